"""The IME2 path (vmadot*.hp via .insn, VLEN 1024) under QEMU, and its SIGILL emulator (issue 3).

Upstream QEMU does not know the IME2 instructions, so the riscv64 driver installs a SIGILL
handler (``kernels/ime2/driver/ime2_emu.c``) that emulates ``vmadot{u,us,su,}.hp`` (int4) with
the semantics of ``npusim.q4x32.execute_hp``. Checked here:

* the emulator, one instruction at a time (``npu_ime2_emu_probe``), against ``execute_hp`` on
  random register files: all four signedness forms, both scale registers, every imm3, aliasing
  registers, fp16 overflow; each rounding option selected through its environment variable;
  anything it does not emulate still dies with SIGILL;
* the IME2 GEMM path at VLEN 1024 bit for bit against the host build's portable path and
  ``npusim.q4x32`` hardware level, guards intact, the expected number of .hp instructions run;
* below VLEN 1024 the path returns WRONG_VLEN (no crash, no .hp executed, guards intact);
* the whole op (AUTO) at VLEN 1024 runs the IME2 path and equals the model; below VLEN 1024 it
  returns WRONG_VLEN too, unless the driver runs with ``--allow-fallback`` (then RVV);
* build flags: only the IME2 kernel object carries zvl1024b.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import qemu_ime2
from vllm_npu.ime2 import kernel

_missing = qemu_ime2.missing_reason()
if _missing is None and not qemu_ime2.probe_path().is_file():
    _missing = f"the emulator probe {qemu_ime2.probe_path()} is not built: {qemu_ime2.BUILD_COMMAND}"
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

COUNT = {qemu_ime2.EMU_ENV["count"]: "1"}
SIGNEDNESS = ("u", "us", "su", "ss")


# ---------------------------------------------------------------------------------------------
# helpers


def f16_nan(x: np.ndarray) -> np.ndarray:
    """NaN test on fp16 bit patterns (uint16)."""
    return ((x & 0x7C00) == 0x7C00) & ((x & 0x03FF) != 0)


def assert_same_registers(got: np.ndarray, want: np.ndarray, words: list[int]) -> int:
    """Register files equal byte for byte, except that in vd any NaN equals any NaN (payloads are
    not modelled). Returns how many vd values compared as NaN."""
    assert got.shape == want.shape
    nans = 0
    for i, w in enumerate(words):
        vd = q.decode_hp(w).vd
        g, e = got[i].copy(), want[i].copy()
        g16, e16 = g[vd].view("<u2"), e[vd].view("<u2")
        both = f16_nan(g16) & f16_nan(e16)
        nans += int(both.sum())
        g16[both] = e16[both]
        bad = np.argwhere(g != e)
        assert bad.size == 0, (f"case {i}: {q.format_hp(q.decode_hp(w))}: registers/bytes {bad[:8].tolist()} "
                               f"differ from execute_hp")
    return nans


def random_fp16(rng: np.random.Generator, size: int, lo: float, hi: float) -> np.ndarray:
    """fp16 values +/- 2**u, u uniform in [lo, hi] (bits as uint8 pairs)."""
    mag = np.exp2(rng.uniform(lo, hi, size))
    v = (np.where(rng.random(size) < 0.5, -mag, mag)).astype(np.float16)
    return v.view(np.uint8)


def instruction_cases(seed: int) -> tuple[list[int], np.ndarray]:
    """Every (signedness, vscale, imm3) twice: once on fully random register bytes (NaN/inf
    included), once with finite fp16 accumulators and scales, some large enough to overflow;
    register numbers random (aliasing included), plus explicit aliasing cases."""
    rng = np.random.default_rng(seed)
    words, files = [], []
    for regime, sgn, vscale, imm3 in itertools.product(("bytes", "finite"), SIGNEDNESS, (0, 1), range(8)):
        vd, vs1, vs2 = (int(x) for x in rng.integers(0, 32, 3))
        regs = rng.integers(0, 256, (32, 128), dtype=np.uint8)
        if regime == "finite":
            regs[vd] = random_fp16(rng, 64, -12, 15)
            regs[vscale] = random_fp16(rng, 64, -14, 12)  # 2**12 * 7200 overflows fp16
        words.append(q.encode_hp(vd, vs1, vs2, imm3=imm3, vscale=vscale, signedness=sgn))
        files.append(regs)
    for vd, vs1, vs2, vscale in ((3, 3, 4, 0), (5, 6, 5, 1), (0, 2, 4, 0), (1, 7, 7, 1), (9, 9, 9, 0)):
        regs = rng.integers(0, 256, (32, 128), dtype=np.uint8)
        words.append(q.encode_hp(vd, vs1, vs2, imm3=int(rng.integers(8)), vscale=vscale, signedness="su"))
        files.append(regs)
    return words, np.stack(files)


def model(words: list[int], files: np.ndarray, **mode: str) -> np.ndarray:
    return np.stack([q.execute_hp(w, f, **mode) for w, f in zip(words, files)])


def operands(m: int, k: int, n: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng([seed, m, k, n])
    a = rng.standard_normal((m, k)).astype(np.float32)
    qweight, scales = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qweight, (scales * np.float32(scale)).astype(np.float32)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, msg: str) -> None:
    """Bit-exact float32 comparison; NaN equals NaN (the NaN sign/payload differs between hosts)."""
    g, w = bits(got).copy(), bits(want).copy()
    both = np.isnan(got) & np.isnan(want)
    g[both] = w[both]
    np.testing.assert_array_equal(g, w, err_msg=msg)


def hp_instructions(m: int, k: int, n: int) -> int:
    """.hp instructions the IME2 path issues: 64 per (row group, full tile, superblock)."""
    row_groups = m // 4 + m % 4
    return row_groups * (n // 32) * (-(-k // 256)) * 64


# ---------------------------------------------------------------------------------------------
# the emulator, one instruction at a time


def test_emulator_matches_execute_hp_on_random_registers():
    words, files = instruction_cases(seed=11)
    res = qemu_ime2.run_probe(words, files, env=COUNT)
    assert res.returncode == 0, res.stderr
    assert qemu_ime2.emulated_count(res.stderr) == len(words)
    want = model(words, files)
    nans = assert_same_registers(res.regs, want, words)
    # the test has teeth: vd changed in (nearly) every case, overflow to inf happened, and NaN
    # equivalence covered only a minority of outputs
    changed = sum(not np.array_equal(res.regs[i][q.decode_hp(w).vd], files[i][q.decode_hp(w).vd])
                  for i, w in enumerate(words))
    assert changed >= len(words) - 2
    finite = 64  # cases 0..63: random bytes; 64..127: finite accumulators and scales
    out16 = np.stack([res.regs[i][q.decode_hp(words[i]).vd].view("<u2") for i in range(finite, 2 * finite)])
    in16 = np.stack([files[i][q.decode_hp(words[i]).vd].view("<u2") for i in range(finite, 2 * finite)])
    new_inf = ((out16 & 0x7FFF) == 0x7C00) & ((in16 & 0x7FFF) != 0x7C00)
    assert new_inf.sum() > 0, "no fp16 overflow was exercised"
    assert nans < len(words) * 64 // 4


@pytest.mark.parametrize("option,value", [("rounding", "fused"), ("dot", "exact"), ("overflow", "saturate")])
def test_emulator_options_follow_the_model(option, value):
    words, files = instruction_cases(seed=12)
    res = qemu_ime2.run_probe(words, files, env={qemu_ime2.EMU_ENV[option]: value})
    assert res.returncode == 0, res.stderr
    assert_same_registers(res.regs, model(words, files, **{option: value}), words)
    # and the option matters: the default mode gives a different register file somewhere
    default = model(words, files)
    assert any(not np.array_equal(res.regs[i], default[i]) for i in range(len(words)))


def test_emulator_rejects_an_unknown_option_value():
    words, files = instruction_cases(seed=13)
    res = qemu_ime2.run_probe(words[:1], files[:1], env={qemu_ime2.EMU_ENV["rounding"]: "sideways"})
    assert res.returncode == 2 and "NPU_IME2_EMU_ROUNDING=sideways" in res.stderr


def _r_type(funct7: int, funct3: int, vd: int = 16, vs1: int = 3, vs2: int = 4, opcode: int = 0x2B) -> int:
    return (funct7 << 25) | (vs2 << 20) | (vs1 << 15) | (funct3 << 12) | (vd << 7) | opcode


NOT_EMULATED = {
    "vmadotsu.hp i8": q.encode_hp(16, 3, 4, imm3=4, signedness="su", int4=False),
    "vmadotu.hp i8 v1": q.encode_hp(16, 3, 4, imm3=0, vscale=1, signedness="u", int4=False),
    "vmadot i4 (not .hp)": _r_type(0x61, 3),
    "vmadot.sp i4": _r_type(0b1100100, 3),
    "i4, bits 28:26 = 111": _r_type(0b1101110, 0),
    "data type 00": _r_type(0b1000110, 0),
    "vpack.vv (bit 31 clear)": _r_type(0x33, 1),
    "custom-0 opcode": _r_type(0x66, 0, opcode=0x0B),
}


@pytest.mark.parametrize("name", sorted(NOT_EMULATED))
def test_instructions_it_does_not_emulate_still_die_with_sigill(name):
    word = NOT_EMULATED[name]
    files = np.random.default_rng(14).integers(0, 256, (1, 32, 128), dtype=np.uint8)
    res = qemu_ime2.run_probe([word], files, env=COUNT)
    assert res.returncode == -signal.SIGILL, (name, res.returncode, res.stderr)
    assert res.regs is None


def test_hp_below_vlen_1024_is_not_emulated():
    """The emulator models the VLEN-1024 tile only: at vlenb 64 a .hp word is a real SIGILL."""
    word = q.encode_hp(16, 3, 4, imm3=4, signedness="su")
    files = np.zeros((1, 32, 64), dtype=np.uint8)
    res = qemu_ime2.run_probe([word], files, vlen=512)
    assert res.returncode == -signal.SIGILL, res.stderr
    ok = qemu_ime2.run_probe([word], np.zeros((1, 32, 128), dtype=np.uint8), vlen=1024)
    assert ok.returncode == 0, ok.stderr


# ---------------------------------------------------------------------------------------------
# the IME2 GEMM path

SHAPES = [(m, k, n) for m in (1, 4, 5) for k, n in ((32, 70), (96, 32), (288, 64), (512, 39))]


@pytest.mark.parametrize("m,k,n", SHAPES, ids=lambda v: str(v))
def test_ime2_path_is_bit_exact_at_vlen_1024(m, k, n):
    a, qweight, scales = operands(m, k, n)
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
    assert res.status == 0, res.text
    assert res.guards_ok and res.vlenb == 128
    portable = kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), m, k, n, path="portable")
    sim = q.ime2_hp_gemm(a, qweight, scales, level="hardware")
    assert_bits_equal(res.c, portable, f"vs host portable at {(m, k, n)}")
    assert_bits_equal(res.c, sim, f"vs npusim hardware at {(m, k, n)}")


def test_ime2_path_runs_the_expected_hp_instructions(monkeypatch):
    """The matrix unit does the work: 64 .hp per (row group, full tile, superblock), none for the
    scalar-tail columns."""
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    for m, k, n in ((5, 288, 70), (4, 32, 31), (1, 512, 64)):
        a, qweight, scales = operands(m, k, n, seed=5)
        res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
        assert res.status == 0, res.text
        assert qemu_ime2.emulated_count(res.stderr) == hp_instructions(m, k, n), (m, k, n)


def test_ime2_path_fp16_overflow_matches_the_model():
    """Large weight scales overflow the fp16 tile accumulator to inf: positions must agree."""
    a, qweight, scales = operands(4, 256, 64, seed=6, scale=2000.0)
    a[1, :32] *= 50.0
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
    assert res.status == 0, res.text
    sim = q.ime2_hp_gemm(a, qweight, scales, level="hardware")
    assert not np.all(np.isfinite(sim)), "the case must overflow"
    assert_bits_equal(res.c, sim, "overflow case vs npusim")


@pytest.mark.parametrize("vlen", [128, 256, 512])
def test_ime2_path_returns_wrong_vlen_below_1024(vlen, monkeypatch):
    a, qweight, scales = operands(5, 288, 70)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="ime2")
    assert (res.status, res.c, res.guards_ok) == (6, None, True)
    assert res.vlenb == vlen // 8 and "VLEN 1024" in res.text
    assert qemu_ime2.emulated_count(res.stderr) == 0  # no .hp instruction ran
    with pytest.raises(qemu_ime2.KernelStatusError, match="WRONG_VLEN"):
        qemu_ime2.run_driver(a, qweight, scales, vlen=vlen, path="ime2")


@pytest.mark.parametrize("path", ["hp_gemm", "auto"])
def test_whole_op_at_vlen_1024_runs_ime2_and_equals_the_model(path, monkeypatch):
    m, k, n = 6, 544, 70
    a, qweight, scales = operands(m, k, n, seed=1)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path=path)
    assert res.status == 0 and res.guards_ok, res.text
    assert qemu_ime2.emulated_count(res.stderr) == hp_instructions(m, k, n)  # AUTO chose IME2
    assert_bits_equal(res.c, q.ime2_hp_gemm(a, qweight, scales, level="hardware"), path)


@pytest.mark.parametrize("vlen", [128, 256, 512])
def test_whole_op_below_vlen_1024_is_an_error_unless_the_fallback_is_opted_in(vlen, monkeypatch):
    """The seed: the op reads vlenb and returns an error unless it is 128. By default the whole op
    and AUTO return WRONG_VLEN before any work (no .hp, no C, guards intact); with the driver's
    --allow-fallback they run RVV (still no .hp) and equal the model bit for bit."""
    m, k, n = 5, 288, 70
    a, qweight, scales = operands(m, k, n, seed=1)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    want = q.ime2_hp_gemm(a, qweight, scales, level="hardware")
    for path in ("hp_gemm", "auto"):
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path)
        assert (res.status, res.c, res.guards_ok) == (6, None, True), (path, res.text)
        assert res.vlenb == vlen // 8 and qemu_ime2.emulated_count(res.stderr) == 0
        opted = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path, allow_fallback=True)
        assert opted.status == 0 and opted.guards_ok, opted.text
        assert qemu_ime2.emulated_count(opted.stderr) == 0  # the fallback is RVV, not IME2
        assert_bits_equal(opted.c, want, f"{path} with the fallback at VLEN {vlen}")


def test_fallback_opt_in_changes_nothing_at_vlen_1024(monkeypatch):
    """The opt-in only matters where vlenb != 128: at VLEN 1024 AUTO still runs IME2."""
    m, k, n = 4, 256, 32
    a, qweight, scales = operands(m, k, n, seed=2)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="hp_gemm", allow_fallback=True)
    assert res.status == 0 and qemu_ime2.emulated_count(res.stderr) == hp_instructions(m, k, n)
    assert_bits_equal(res.c, q.ime2_hp_gemm(a, qweight, scales, level="hardware"), "opt-in at VLEN 1024")


def test_emulator_is_inert_when_no_ime_instruction_runs(monkeypatch):
    a, qweight, scales = operands(4, 64, 40)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    for vlen in (128, 1024):
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="portable")
        assert res.status == 0 and qemu_ime2.emulated_count(res.stderr) == 0


# ---------------------------------------------------------------------------------------------
# build flags


def _arch_attribute(obj: Path) -> bytes:
    data = obj.read_bytes()
    start = data.find(b"rv64i")
    assert start >= 0, f"{obj.name}: no RISC-V arch attribute"
    return data[start:data.index(b"\0", start)]


def test_only_the_ime2_kernel_object_is_built_with_zvl1024b():
    """The kernel file gets zvl1024b + zvfh; the driver, the other kernel sources and the
    emulator no zvl flag (shared reference ime2.md section 7). The linked ELF's merged attribute
    necessarily lists zvl1024b, so the objects are checked one by one, and the C library (Debian's
    riscv64 libc.a, no V extension at all) by its arch attributes."""
    objdir = qemu_ime2.driver_path().parent / "obj-riscv64"
    objs = {p.name: _arch_attribute(p) for p in objdir.glob("*.o")}
    assert {"gemm_ime2.o", "driver.o", "ime2_emu.o", "pack.o", "gemm_portable.o", "dispatch.o"} <= set(objs)
    assert b"zvl1024b" in objs["gemm_ime2.o"] and b"zvfh" in objs["gemm_ime2.o"]
    for name, arch in objs.items():
        if name != "gemm_ime2.o":
            assert b"zvl" not in arch.replace(b"zvl32b", b"").replace(b"zvl64b", b"").replace(b"zvl128b", b""), \
                f"{name}: {arch!r}"
    libc = Path("/usr/riscv64-linux-gnu/lib/libc.a")
    if libc.is_file():
        assert b"zvl1024b" not in libc.read_bytes()


def test_ime2_gemm_with_the_fused_emulator_equals_the_fused_model(monkeypatch):
    """The emulator's rounding option carries through the whole kernel: with
    NPU_IME2_EMU_ROUNDING=fused the IME2 path equals ime2_hp_gemm(rounding="fused"), which
    differs from the default (unfused) model on this case."""
    m, k, n = 4, 512, 70
    a, qweight, scales = operands(m, k, n, seed=8)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["rounding"], "fused")
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
    assert res.status == 0 and res.guards_ok, res.text
    fused = q.ime2_hp_gemm(a, qweight, scales, level="hardware", rounding="fused")
    unfused = q.ime2_hp_gemm(a, qweight, scales, level="hardware")
    assert not np.array_equal(bits(fused), bits(unfused))
    assert_bits_equal(res.c, fused, "fused emulator vs fused model")


ADVERSARIAL = ("all_positive", "all_negative", "outlier", "zero_rows", "tiny_scales")


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_ime2_path_adversarial_inputs_match_the_model(case):
    """Inputs that stress the nibble planes and the fp16 tile accumulator: uncentered dots
    (all-positive / all-negative activations: hi planes at their extremes), an outlier sub-block,
    all-zero rows (zero scales), fp16-subnormal tile scales."""
    m, k, n = 9, 768, 64  # two 4-row groups + one single row, three superblocks
    a, qweight, scales = operands(m, k, n, seed=9)
    if case == "all_positive":
        a = np.abs(a)
    elif case == "all_negative":
        a = -np.abs(a)
    elif case == "outlier":
        a[:, 40] = 200.0
    elif case == "zero_rows":
        a[[0, 5, 8]] = 0.0
    elif case == "tiny_scales":
        scales = (scales * np.float32(1e-4)).astype(np.float32)
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
    assert res.status == 0 and res.guards_ok, res.text
    portable = kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), m, k, n, path="portable")
    assert_bits_equal(res.c, portable, f"{case}: vs host portable")
    assert_bits_equal(res.c, q.ime2_hp_gemm(a, qweight, scales, level="hardware"), f"{case}: vs npusim")


# ---------------------------------------------------------------------------------------------
# the kernel object, statically (riscv64-linux-gnu-objdump from binutils-riscv64-linux-gnu)

OBJDUMP = "riscv64-linux-gnu-objdump"


def _disassembly() -> dict[str, list[str]]:
    """Instruction lines of gemm_ime2.o per function symbol (mnemonic and operands only)."""
    import re
    import shutil
    import subprocess

    if shutil.which(OBJDUMP) is None:
        pytest.skip(f"{OBJDUMP} not on PATH (Debian binutils-riscv64-linux-gnu)")
    obj = qemu_ime2.driver_path().parent / "obj-riscv64" / "gemm_ime2.o"
    text = subprocess.run([OBJDUMP, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if head:
            if not head.group(1).startswith(".L"):  # local labels stay in their function
                current = head.group(1)
                funcs[current] = []
            continue
        ins = re.match(r"^\s+[0-9a-f]+:\s+([0-9a-f]+)\s+(.*)$", line)
        if ins and current:
            funcs[current].append(f"{ins.group(1)} {ins.group(2).strip()}")
    return funcs


def test_kernel_issues_exactly_the_documented_hp_words():
    """gemm_ime2.o holds the 8 .hp words of one sub-block, in order (hi then lo per 8-column
    group), and they decode as vmadotsu.hp / vmadotu.hp on the documented registers."""
    words = [int(line.split()[0], 16) for body in _disassembly().values() for line in body
             if len(line.split()[0]) == 8 and int(line.split()[0], 16) & 0x7F == 0x2B]
    expected = []
    for g in range(4):
        expected.append(q.encode_hp(16 + g, 8, 12 + g, imm3=4 + g, vscale=0, signedness="su"))
        expected.append(q.encode_hp(16 + g, 9, 12 + g, imm3=g, vscale=0, signedness="u"))
    assert words == expected, [hex(w) for w in words]
    assert q.format_hp(q.decode_hp(words[0])) == "vmadotsu.hp v16, v8, v12, v0, 4, i4"
    assert q.format_hp(q.decode_hp(words[1])) == "vmadotu.hp v16, v9, v12, v0, 0, i4"


def test_entry_points_touch_no_vector_state_before_the_vlenb_check():
    """npu_ime2_ime2_usable and npu_ime2_gemm_ime2 (which check vlenb == 128 and return
    WRONG_VLEN) contain no vector instruction: the zvl1024b work is out of line, after the check."""
    funcs = _disassembly()
    for name in ("npu_ime2_ime2_usable", "npu_ime2_gemm_ime2"):
        body = funcs[name]
        assert any("csrr" in line and "vlenb" in line for line in body), name
        vector = [line for line in body if line.split()[1].startswith("v")]
        assert vector == [], f"{name}: {vector}"
