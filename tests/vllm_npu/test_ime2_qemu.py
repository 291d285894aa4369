"""The riscv64 build of kernels/ime2 under qemu-riscv64-static (issue 3, section 3; portable path).

The static riscv64 driver (``kernels/ime2/driver/driver.c``, built by the set-up into
the user cache, ``npu-harness ime2 build-driver``) runs the real kernel sources under QEMU user mode at
VLEN 128..1024. Its output must equal the host build of the same sources and
``npusim.q4x32.ime2_hp_gemm(level="hardware")`` bit for bit; the driver's 4 KiB guard regions
around C and the packed operands must come back untouched; errors come back as statuses, never
as crashes. The RVV path (``src/gemm_rvv.c``, VLEN-agnostic intrinsics) runs the same matrix and
must agree bit for bit too; the IME2 path is tested in ``test_ime2_qemu_ime2.py``. Below VLEN
1024 the whole op and AUTO return WRONG_VLEN (this build holds the IME2 path) unless the driver
runs with ``--allow-fallback``.
"""

from __future__ import annotations

import itertools
import struct
import subprocess

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import qemu_ime2
from vllm_npu.ime2 import ime2_hp_gemm_cpu

_missing = qemu_ime2.missing_reason()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

SHAPES = list(itertools.product((1, 4, 5), (32, 288), (7, 64)))  # (M, K, N)


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, m, k, n])
    a = rng.standard_normal((m, k)).astype(np.float32)
    qweight, scales = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qweight, scales


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("vlen", qemu_ime2.VLENS)
def test_portable_path_is_bit_exact_at_every_vlen(vlen):
    for m, k, n in SHAPES:
        a, qweight, scales = operands(m, k, n)
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="portable")
        assert res.status == 0, res.text
        assert res.guards_ok
        assert res.vlenb == qemu_ime2.vlenb(vlen) == vlen // 8
        host = np.asarray(ime2_hp_gemm_cpu(a, qweight, scales))
        sim = q.ime2_hp_gemm(a, qweight, scales, level="hardware")
        assert res.c.shape == (m, n) and res.c.dtype == np.float32
        np.testing.assert_array_equal(bits(res.c), bits(host), err_msg=f"vs host at {(m, k, n)}")
        np.testing.assert_array_equal(bits(res.c), bits(sim), err_msg=f"vs npusim at {(m, k, n)}")


BELOW_1024 = [v for v in qemu_ime2.VLENS if v != 1024]


def test_whole_op_and_auto_path_match_the_host_at_vlen_1024():
    # Two full 32-column tiles plus a 6-column tail; K = 544: two superblocks, the second padded.
    a, qweight, scales = operands(6, 544, 70, seed=1)
    host = bits(ime2_hp_gemm_cpu(a, qweight, scales))
    for path in ("hp_gemm", "auto"):
        np.testing.assert_array_equal(bits(qemu_ime2.run_driver(a, qweight, scales, vlen=1024, path=path)), host)


@pytest.mark.parametrize("vlen", BELOW_1024)
def test_whole_op_and_auto_path_refuse_below_vlen_1024_by_default(vlen):
    """The seed: "The op reads vlenb and returns an error unless it is 128." The riscv64 build
    holds the IME2 path (the K3 build), so AUTO and the whole op do not fall back silently."""
    a, qweight, scales = operands(6, 544, 70, seed=1)
    for path in ("hp_gemm", "auto"):
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path)
        assert (res.status, res.c, res.guards_ok) == (6, None, True), (path, res.text)
        assert res.vlenb == vlen // 8 and "VLEN 1024" in res.text
        with pytest.raises(qemu_ime2.KernelStatusError, match="WRONG_VLEN"):
            qemu_ime2.run_driver(a, qweight, scales, vlen=vlen, path=path)


@pytest.mark.parametrize("vlen", BELOW_1024)
def test_whole_op_and_auto_path_fall_back_only_when_opted_in(vlen):
    """--allow-fallback (npu_ime2_set_allow_fallback(1)): AUTO runs RVV below VLEN 1024, bit for
    bit the host's result; explicit paths are unaffected by the flag."""
    a, qweight, scales = operands(6, 544, 70, seed=1)
    host = bits(ime2_hp_gemm_cpu(a, qweight, scales))
    for path in ("hp_gemm", "auto"):
        c = qemu_ime2.run_driver(a, qweight, scales, vlen=vlen, path=path, allow_fallback=True)
        np.testing.assert_array_equal(bits(c), host, err_msg=path)
    res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="ime2", allow_fallback=True)
    assert res.status == 6 and res.c is None  # an explicit IME2 path never falls back


@pytest.mark.parametrize("path", ["hp_gemm", "auto"])
def test_empty_c_still_obeys_the_vlenb_rule(path):
    """M = 0: nothing to compute, but AUTO on this (K3) build is still refused below VLEN 1024."""
    a, qweight, scales = operands(0, 64, 7)
    res = qemu_ime2.run(a, qweight, scales, vlen=256, path=path)
    assert (res.status, res.guards_ok) == (6, True), res.text
    assert qemu_ime2.run_driver(a, qweight, scales, vlen=256, path=path, allow_fallback=True).shape == (0, 7)
    assert qemu_ime2.run_driver(a, qweight, scales, vlen=1024, path=path).shape == (0, 7)


def test_driver_rejects_an_unknown_option():
    cmd = [qemu_ime2.qemu_path(), "-cpu", "rv64,v=true,Zfh=true,vlen=128,vext_spec=v1.0",
           str(qemu_ime2.driver_path()), "--allow-fallbak"]
    bad = subprocess.run(cmd, input=b"", capture_output=True, timeout=60, check=False)
    assert bad.returncode == 2 and b"usage: npu_ime2_driver [--allow-fallback]" in bad.stderr


def test_vlenb_is_what_qemu_was_asked_for():
    a, qweight, scales = operands(1, 32, 1)
    assert [qemu_ime2.run(a, qweight, scales, vlen=v).vlenb for v in qemu_ime2.VLENS] == [16, 32, 64, 128]
    with pytest.raises(ValueError, match="vlen must be one of"):
        qemu_ime2.vlenb(2048)


@pytest.mark.parametrize("path", ["x86"])  # a host-only path: not in the riscv64 build
def test_unbuilt_paths_return_bad_path(path):
    a, qweight, scales = operands(4, 32, 7)
    for vlen in (128, 1024):
        with pytest.raises(qemu_ime2.KernelStatusError, match="BAD_PATH") as info:
            qemu_ime2.run_driver(a, qweight, scales, vlen=vlen, path=path)
        assert info.value.status == 7 and info.value.name == "BAD_PATH"
        assert "not built into this library" in info.value.text


@pytest.mark.parametrize("path", ["portable", "hp_gemm"])
def test_bad_k_is_a_status_not_a_crash(path):
    a, qweight, scales = operands(2, 64, 7)
    with pytest.raises(qemu_ime2.KernelStatusError, match="BAD_K") as info:
        qemu_ime2.run_driver(a[:, :40], qweight, scales, vlen=256, path=path)
    assert info.value.status == 1 and "multiple of 32" in info.value.text


def test_non_finite_input_is_a_status():
    a, qweight, scales = operands(1, 32, 7)
    a[0, 3] = np.nan
    res = qemu_ime2.run(a, qweight, scales, vlen=128, path="hp_gemm")
    assert (res.status, res.c, res.guards_ok) == (4, None, True)


def test_empty_m_returns_an_empty_result():
    a, qweight, scales = operands(0, 64, 7)
    c = qemu_ime2.run_driver(a, qweight, scales, vlen=512)
    assert c.shape == (0, 7)


def test_request_round_trip_and_malformed_request():
    a, qweight, scales = operands(1, 32, 2)
    req = qemu_ime2.encode_request(a, qweight, scales, 1)
    assert req[:8] == b"NPUIME2Q" and len(req) == 72 + 32 * 4 + 2 * 16 + 2 * 4
    assert struct.unpack_from("<qqq", req, 16) == (1, 32, 2)
    cmd = [qemu_ime2.qemu_path(), "-cpu", "rv64,v=true,Zfh=true,vlen=128,vext_spec=v1.0",
           str(qemu_ime2.driver_path())]
    bad = subprocess.run(cmd, input=b"XXXXXXXX" + req[8:], capture_output=True, timeout=60, check=False)
    assert bad.returncode == 2 and b"bad request magic" in bad.stderr and bad.stdout == b""
    short = subprocess.run(cmd, input=req[:-3], capture_output=True, timeout=60, check=False)
    assert short.returncode == 2 and b"short request body" in short.stderr


def test_guard_corruption_and_errors_are_reported(monkeypatch):
    """The runner turns the driver's guard report (exit 3, guards_ok 0) into GuardCorruption."""
    a, qweight, scales = operands(1, 32, 2)
    good = qemu_ime2.run(a, qweight, scales, vlen=128)
    text = b"ok"
    resp = struct.pack("<8siiiIqqQ", b"NPUIME2R", 0, 16, 0, len(text), 1, 2, 8) + text + good.c.tobytes()

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 3, resp, b"npu_ime2_driver: guard region of C touched: 0 bytes "
                                                        b"before, 4 bytes after")

    monkeypatch.setattr(qemu_ime2.subprocess, "run", fake_run)
    with pytest.raises(qemu_ime2.GuardCorruption, match="guard region of C touched"):
        qemu_ime2.run_driver(a, qweight, scales, vlen=128)

    def crash(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, -11, b"", b"segfault")

    monkeypatch.setattr(qemu_ime2.subprocess, "run", crash)
    with pytest.raises(qemu_ime2.QemuDriverError, match="exited with -11: segfault"):
        qemu_ime2.run_driver(a, qweight, scales, vlen=128)

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(qemu_ime2.subprocess, "run", hang)
    with pytest.raises(qemu_ime2.QemuDriverTimeout, match="timed out after 0.5 s"):
        qemu_ime2.run_driver(a, qweight, scales, vlen=128, timeout=0.5)


def test_driver_is_built_without_a_zvl_flag():
    """The driver's RISC-V arch attribute must not pin VLEN > 128 (a zvl flag makes compiled
    vector code VLEN-specific; shared reference ime2.md section 7). The IME2 kernel object alone
    is built with zvl1024b, which the linker merges into the ELF attribute; its objects are then
    checked one by one in test_ime2_qemu_ime2.py."""
    elf = qemu_ime2.driver_path().read_bytes()
    assert elf[:4] == b"\x7fELF" and b"rv64i" in elf and b"_v1p0" in elf
    if (qemu_ime2.driver_path().parent / "obj-riscv64" / "gemm_ime2.o").is_file():
        return
    for flag in (b"zvl256b", b"zvl512b", b"zvl1024b"):
        assert flag not in elf


# --- the VLEN x {portable, rvv} matrix (issue 3: "Matrix: VLEN 128, 256, 512, 1024 x paths") ---

#: (M, K, N): M = 1 (m1), 4 (one group), 5 (a group + a single row); K = 32, 96 (one padded
#: superblock), 288 (two, the second padded); N = 7 (tail only), 70 (two full tiles + a tail).
MATRIX_SHAPES = list(itertools.product((1, 4, 5), (32, 96, 288), (7, 70)))
VECTOR_PATHS = ("portable", "rvv")


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-identical, except that NaN payloads/signs may differ (NaN positions must match)."""
    assert got.shape == want.shape and got.dtype == np.float32, what
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"NaN positions, {what}")
    np.testing.assert_array_equal(np.where(nan, 0, bits(got)), np.where(nan, 0, bits(want)), err_msg=what)


def expected(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(host build, npusim hardware level); they must agree with each other first."""
    host = np.asarray(ime2_hp_gemm_cpu(a, qweight, scales))
    sim = np.asarray(q.ime2_hp_gemm(a, qweight, scales, level="hardware"), dtype=np.float32)
    assert_same_bits(host, sim, "host vs npusim")
    return host, sim


@pytest.fixture(scope="module")
def matrix_cases():
    cases = []
    for m, k, n in MATRIX_SHAPES:
        a, qweight, scales = operands(m, k, n, seed=3)
        cases.append(((m, k, n), a, qweight, scales, expected(a, qweight, scales)[0]))
    return cases


def test_rvv_path_is_built_into_the_driver():
    a, qweight, scales = operands(1, 32, 7)
    res = qemu_ime2.run(a, qweight, scales, vlen=128, path="rvv")
    assert res.status == 0, res.text


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("vlen", qemu_ime2.VLENS)
def test_vlen_path_matrix_is_bit_exact(vlen, path, matrix_cases):
    for shape, a, qweight, scales, want in matrix_cases:
        res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path)
        assert res.status == 0, res.text
        assert res.guards_ok and res.vlenb == vlen // 8
        assert_same_bits(res.c, want, f"{path} at VLEN {vlen}, (M, K, N) = {shape}")


def adversarial_operands(kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs that push the fp16 steps to their limits, M = 5, K = 288, N = 70.

    ``overflow``: all-positive activations with an outlier, codes 15 (large uncentered dots) and scales
    up to 30, so fp16(dot * sc) and the fp16 sums overflow to inf (and inf - inf gives NaN).
    ``tiny``: column scales 1e-9 .. 1e-4 (fp16 subnormals and values that round to 0) and one
    activation row scaled by 1e-6 (a subnormal scale_avg).
    """
    m, k, n = 5, 288, 70
    rng = np.random.default_rng([7, len(kind)])
    qweight = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    if kind == "overflow":
        a = np.abs(rng.standard_normal((m, k))).astype(np.float32)
        a[:, 5] = 200.0  # an outlier: a large rel_j for sub-block 0
        qweight[: n // 2] = 0xFF
        scales = np.exp(rng.uniform(np.log(1e-2), np.log(30.0), (n, k // 32))).astype(np.float32)
    else:
        a = rng.standard_normal((m, k)).astype(np.float32)
        a[4] *= 1e-6
        scales = np.exp(rng.uniform(np.log(1e-9), np.log(1e-4), (n, k // 32))).astype(np.float32)
    return a, qweight, scales


@pytest.mark.parametrize("kind", ["overflow", "tiny"])
def test_adversarial_inputs_at_every_vlen(kind):
    a, qweight, scales = adversarial_operands(kind)
    want, _ = expected(a, qweight, scales)
    if kind == "overflow":  # the inputs really reach inf, and some outputs stay finite
        assert np.isinf(want).any() and np.isfinite(want).any()
    else:  # fp16 subnormal column scales (6e-8 .. 6.1e-5) and scales that round to fp16 zero
        assert ((scales >= 6e-8) & (scales < 6.1e-5)).any() and (scales < 2.9e-8).any()
        assert np.isfinite(want).all() and (want != 0).any()
    for vlen in qemu_ime2.VLENS:
        for path in VECTOR_PATHS:
            res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path)
            assert res.status == 0 and res.guards_ok, res.text
            assert_same_bits(res.c, want, f"{kind}: {path} at VLEN {vlen}")
