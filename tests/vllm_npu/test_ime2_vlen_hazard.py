"""The ``vs1r.v`` hazard class of the seed, kept caught (issue 3; shared reference ime2.md section 7).

The seed's kernel was built for one VLEN (``zvl256b`` + ``-mrvv-vector-bits=zvl``): the compiler
then sizes vector spill slots for 256-bit registers, but a whole-register store (``vs1r.v`` ..
``vs8r.v``) always writes the machine's full register, so on a VLEN 1024 core it overruns its
slot and walks over the frame. This file builds the real RVV kernel (``src/gemm_rvv.c``) twice
into pytest's tmp_path with the Makefile's riscv64 rules:

* the deliberately wrong build, ``RV_RVV_FLAGS='-march=rv64gcv_zvfh_zvl256b -mrvv-vector-bits=zvl'``;
* the real build, the Makefile's default ``RV_RVV_FLAGS`` (no zvl flag),

and shows that the wrong one is wrong in exactly that way (its disassembly has whole-register
spills and never reads ``vlenb``; it is bit-exact at VLEN 256 and breaks at VLEN 1024 through the
rvv path), while the real one sizes its spill slots from ``vlenb`` and is bit-exact at VLEN 128 ..
1024 on the same inputs. If the real build's flags ever gain a zvl flag or
``-mrvv-vector-bits``, ``test_real_rvv_flags_pin_no_vlen`` fails; if the kernel stops spilling or
the toolchain changes so that the hazard no longer shows, the wrong-build tests fail and tell.

Tools (all from ``ci/apt-packages.txt``): make, clang-19 + lld-19, the riscv64 cross libc,
``riscv64-linux-gnu-objdump`` (binutils-riscv64-linux-gnu, a dependency of
gcc-riscv64-linux-gnu), qemu-user-static.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import qemu_ime2
from vllm_npu.ime2 import ime2_hp_gemm_cpu

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "ime2"
WRONG_RVV_FLAGS = "-march=rv64gcv_zvfh_zvl256b -mrvv-vector-bits=zvl"
OBJDUMP = "riscv64-linux-gnu-objdump"
TOOLS = ("make", "clang-19", OBJDUMP, qemu_ime2.QEMU)

_missing = [t for t in TOOLS if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"missing {', '.join(_missing)} (bash ci/setup.sh installs them)")

#: (M, K, N): a 4-row group (the most register pressure) and a single row, both with a tail tile.
SHAPES = [(4, 288, 70), (1, 96, 40)]


def _make_env() -> dict[str, str]:
    """The environment without overrides of the riscv64 build variables (what ci/setup.sh sees)."""
    drop = {"RV_RVV_FLAGS", "RV_CFLAGS", "RV_CC", "RV_IME2_FLAGS", "MAKEFLAGS", "MFLAGS"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _make(out: Path, *extra: str, dry_run: bool = False) -> str:
    cmd = ["make", "-C", str(KERNEL), "riscv64", f"OUT={out}", *extra]
    cmd[1:1] = ["-n", "-B"] if dry_run else ["-s"]
    proc = subprocess.run(cmd, env=_make_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _rvv_compile_line(out: Path, *extra: str) -> str:
    lines = [ln for ln in _make(out, *extra, dry_run=True).splitlines() if " -c " in ln and "src/gemm_rvv.c" in ln]
    assert len(lines) == 1, "the Makefile has no (or more than one) compile rule for src/gemm_rvv.c"
    return lines[0]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """{"real": OUT of the default build, "wrong": OUT of the zvl256b/-mrvv-vector-bits=zvl build}."""
    base = tmp_path_factory.mktemp("vlen_hazard")
    outs = {"real": base / "real", "wrong": base / "wrong"}
    _make(outs["real"])
    _make(outs["wrong"], f"RV_RVV_FLAGS={WRONG_RVV_FLAGS}")
    return outs


# --- disassembly: whole-register spills, and whether their slots are sized from vlenb ---

def _decode_functions(obj: Path) -> dict[str, list[int]]:
    """{function: [32-bit instruction words]} of an object file (compressed ones left out).

    The words are decoded here rather than trusting mnemonics: binutils 2.40 may print vector
    instructions it does not know as ``.4byte``."""
    text = subprocess.run([OBJDUMP, "-d", str(obj)], capture_output=True, text=True, check=True, timeout=120).stdout
    funcs: dict[str, list[int]] = {}
    cur = None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if head:
            if not head.group(1).startswith(".L"):  # .Lpcrel_hi* labels stay inside their function
                cur = head.group(1)
                funcs[cur] = []
            continue
        insn = re.match(r"^\s*[0-9a-f]+:\s+([0-9a-f]{8})\s", line)
        if insn and cur is not None:
            funcs[cur].append(int(insn.group(1), 16))
    return funcs


def whole_register_store_nf(w: int) -> int:
    """nf (1, 2, 4, 8) when ``w`` is ``vs<nf>r.v`` (STORE-FP opcode 0x27, width 000, mop 00, vm 1,
    sumop 01000), else 0."""
    if w & 0x7F != 0x27 or (w >> 12) & 7 != 0 or (w >> 26) & 3 != 0 or not (w >> 25) & 1 or (w >> 20) & 0x1F != 8:
        return 0
    return ((w >> 29) & 7) + 1


def is_whole_register_load(w: int) -> bool:
    """``vl<nf>re<eew>.v``: LOAD-FP opcode 0x07, width 000/101/110/111, mop 00, vm 1, lumop 01000."""
    return (w & 0x7F == 0x07 and (w >> 12) & 7 in (0, 5, 6, 7) and (w >> 26) & 3 == 0 and bool((w >> 25) & 1)
            and (w >> 20) & 0x1F == 8)


def reads_vlenb(w: int) -> bool:
    """``csrr rd, vlenb`` = csrrs rd, 0xc22, x0."""
    return w & 0xFFFFF07F == 0xC2202073


def spill_report(obj: Path) -> dict[str, tuple[int, int, bool]]:
    """{function: (whole-register stores, whole-register loads, reads vlenb)} of functions that spill."""
    out = {}
    for name, words in _decode_functions(obj).items():
        stores = sum(1 for w in words if whole_register_store_nf(w))
        loads = sum(1 for w in words if is_whole_register_load(w))
        if stores or loads:
            out[name] = (stores, loads, any(reads_vlenb(w) for w in words))
    return out


def test_decoders_on_known_encodings():
    # vs8r.v v8,(a2) = 0xe2860427 (ime2.md section 7); vs4r.v v8,(a0) = 0x62850427; vs1r.v v8,(a0)
    assert whole_register_store_nf(0xE2860427) == 8 and whole_register_store_nf(0x62850427) == 4
    assert whole_register_store_nf(0x02850427) == 1
    assert whole_register_store_nf(0x00853027) == 0  # fsd fs0,0(a0): same opcode, width 011
    assert is_whole_register_load(0x22857407)  # vl2re64.v v8,(a0)
    assert not is_whole_register_load(0x02057407)  # vle64.v v8,(a0): lumop 00000
    assert reads_vlenb(0xC2202573)  # csrr a0,vlenb
    assert not reads_vlenb(0xC2002573)  # csrr a0,vl


def test_real_rvv_flags_pin_no_vlen(tmp_path):
    """The Makefile's own compile command for src/gemm_rvv.c (make -n, no overrides): RVV 1.0 with
    zvfh, no zvl flag, no -mrvv-vector-bits; and nothing else in the driver pins a VLEN either."""
    line = _rvv_compile_line(tmp_path)
    assert "-march=rv64gcv" in line and "zvfh" in line
    assert "zvl" not in line and "-mrvv-vector-bits" not in line, line
    for other in _make(tmp_path, dry_run=True).splitlines():
        if " -c " in other and any(f"{d}/{f}.c" in other for d in ("src", "driver")
                                   for f in ("pack", "gemm_portable", "dispatch", "driver")):
            assert "zvl" not in other and "-mrvv-vector-bits" not in other, other
    # the override used by the wrong build reaches exactly this rule
    wrong = _rvv_compile_line(tmp_path, f"RV_RVV_FLAGS={WRONG_RVV_FLAGS}")
    assert "zvl256b" in wrong and "-mrvv-vector-bits=zvl" in wrong


def test_wrong_build_spills_into_fixed_size_slots(builds):
    real = spill_report(builds["real"] / "obj-riscv64" / "gemm_rvv.o")
    wrong = spill_report(builds["wrong"] / "obj-riscv64" / "gemm_rvv.o")
    # the 4-row group keeps more than 32 registers' worth of vectors live: both builds spill
    assert any(stores for stores, _, _ in wrong.values()), wrong
    assert any(stores for stores, _, _ in real.values()), real
    # wrong build: slot offsets are constants for 256-bit registers (no vlenb read anywhere)
    assert not any(vl for _, _, vl in wrong.values()), wrong
    # real build: every spilling function scales its slots by vlenb at run time
    assert all(vl for _, _, vl in real.values()), real


# --- runs under QEMU through the rvv path ---

def _inputs():
    for m, k, n in SHAPES:
        rng = np.random.default_rng([11, m, k, n])
        a = rng.standard_normal((m, k)).astype(np.float32)
        qweight, scales = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
        want = np.asarray(ime2_hp_gemm_cpu(a, qweight, scales)).view(np.uint32)
        sim = np.asarray(q.ime2_hp_gemm(a, qweight, scales, level="hardware"), dtype=np.float32).view(np.uint32)
        np.testing.assert_array_equal(want, sim)
        yield (m, k, n), a, qweight, scales, want


def _outcome(driver: Path, monkeypatch, a, qweight, scales, want, vlen: int) -> str:
    """"exact", or how the run went wrong: "signal N" / "rc N: <stderr>", "guards", "status S", "wrong C"."""
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, str(driver))
    try:
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="rvv", timeout=120)
    except qemu_ime2.GuardCorruption:
        return "guards"
    except qemu_ime2.QemuDriverTimeout:
        raise
    except qemu_ime2.QemuDriverError as exc:
        rc = re.search(r"exited with (-?\d+): (.*)", str(exc), re.S)
        if rc and int(rc.group(1)) < 0:
            return f"signal {-int(rc.group(1))}"
        return f"rc {rc.group(1)}: {rc.group(2)[:80]}" if rc else str(exc)
    if res.status != 0:
        return f"status {res.status}"
    return "exact" if np.array_equal(res.c.view(np.uint32), want) else "wrong C"


def test_wrong_build_is_exact_at_vlen_256_and_breaks_at_vlen_1024(builds, monkeypatch):
    """The hazard is VLEN-specific: right where the build's VLEN assumption holds, broken above it
    (observed with clang-19 / QEMU 7.2: SIGSEGV, the spills overwrite the saved return address
    above the slots; glibc's "stack smashing detected" (rc 134), a touched guard region or a
    wrong C would count as broken too)."""
    driver = builds["wrong"] / qemu_ime2.DRIVER_NAME
    for shape, a, qweight, scales, want in _inputs():
        assert _outcome(driver, monkeypatch, a, qweight, scales, want, 256) == "exact", shape
        broken = _outcome(driver, monkeypatch, a, qweight, scales, want, 1024)
        assert broken != "exact", f"{shape}: the zvl256b build survived VLEN 1024"
        assert broken.startswith(("signal", "rc 134", "guards", "wrong C")), f"{shape}: {broken}"


def test_real_build_is_exact_at_every_vlen(builds, monkeypatch):
    driver = builds["real"] / qemu_ime2.DRIVER_NAME
    for shape, a, qweight, scales, want in _inputs():
        for vlen in qemu_ime2.VLENS:
            assert _outcome(driver, monkeypatch, a, qweight, scales, want, vlen) == "exact", (shape, vlen)
