"""The C ABI of kernels/ime2 called directly through ctypes: guard regions around every output
buffer, too-small buffers, every error status, and the Python exceptions and messages."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

import npusim.q4x32 as q
from vllm_npu.ime2 import kernel
from vllm_npu.ime2.kernel import Status

GUARD = 4096
FILL = 0xA5


class Guarded:
    """An output buffer of ``size`` bytes with GUARD bytes of 0xA5 before and after it."""

    def __init__(self, size: int, fill: int = FILL) -> None:
        self.size = size
        self.raw = np.full(GUARD + size + GUARD, FILL, dtype=np.uint8)
        self.raw[GUARD:GUARD + size] = fill

    @property
    def ptr(self) -> int:
        return self.raw.ctypes.data + GUARD

    @property
    def body(self) -> np.ndarray:
        return self.raw[GUARD:GUARD + self.size]

    def guards_intact(self) -> bool:
        return bool((self.raw[:GUARD] == FILL).all() and (self.raw[GUARD + self.size:] == FILL).all())


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return kernel.load_library()


def inputs(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    qw, sc = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qw, sc


def ptr(x: np.ndarray) -> int:
    return x.ctypes.data


SHAPES = [(1, 32, 1), (5, 288, 33), (4, 256, 64), (9, 96, 70), (3, 544, 31)]


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_outputs_fill_exactly_their_buffers(lib, m, k, n):
    a, qw, sc = inputs(m, k, n, seed=m + k + n)
    a_size, b_size = q.a_packed_size(m, k), q.b_packed_size(n, k)

    bo = Guarded(b_size)
    assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc), n, k, bo.ptr, b_size) == Status.OK
    assert bo.guards_intact() and bo.body.tobytes() == q.pack_b(qw, sc)

    ao = Guarded(a_size)
    assert lib.npu_ime2_quantize_a(ptr(a), m, k, ao.ptr, a_size) == Status.OK
    assert ao.guards_intact() and ao.body.tobytes() == q.pack_a(q.quantize_a(a))

    hw = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    for path in ["auto", *kernel.usable_paths()]:  # every path this CPU runs, each in its own guarded buffer
        co = Guarded(m * n * 4)
        assert lib.npu_ime2_gemm(ao.ptr, a_size, bo.ptr, b_size, m, k, n, co.ptr, m * n * 4,
                                 kernel.PATHS[path]) == Status.OK, path
        assert co.guards_intact() and np.array_equal(co.body.view(np.float32).reshape(m, n), hw, equal_nan=True), path

    co2 = Guarded(m * n * 4)
    assert lib.npu_ime2_hp_gemm(ptr(a), ptr(qw), ptr(sc), m, k, n, co2.ptr, m * n * 4) == Status.OK
    assert co2.guards_intact() and np.array_equal(co2.body.view(np.float32).reshape(m, n), hw, equal_nan=True)


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_too_small_buffers_return_the_status_and_write_nothing(lib, m, k, n):
    a, qw, sc = inputs(m, k, n)
    a_size, b_size, c_size = q.a_packed_size(m, k), q.b_packed_size(n, k), m * n * 4
    for short in (1, 2, 4, a_size // 2 or 1):
        out = Guarded(max(a_size - short, 0), fill=0x5A)
        assert lib.npu_ime2_quantize_a(ptr(a), m, k, out.ptr, out.size) == Status.BUFFER_TOO_SMALL
        assert out.guards_intact() and (out.body == 0x5A).all()
    for short in (1, 576, b_size // 2):
        out = Guarded(b_size - short, fill=0x5A)
        assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc), n, k, out.ptr, out.size) == Status.BUFFER_TOO_SMALL
        assert out.guards_intact() and (out.body == 0x5A).all()
    ap, bp = np.frombuffer(q.pack_a(q.quantize_a(a)), np.uint8), np.frombuffer(q.pack_b(qw, sc), np.uint8)
    for short in (1, 4, c_size // 2):
        out = Guarded(c_size - short, fill=0x5A)
        assert lib.npu_ime2_hp_gemm(ptr(a), ptr(qw), ptr(sc), m, k, n, out.ptr, out.size) == Status.BUFFER_TOO_SMALL
        assert out.guards_intact() and (out.body == 0x5A).all()
        assert lib.npu_ime2_gemm(ptr(ap), a_size, ptr(bp), b_size, m, k, n, out.ptr, out.size, 0) == \
            Status.BUFFER_TOO_SMALL
        assert out.guards_intact() and (out.body == 0x5A).all()


def test_every_error_status_writes_nothing(lib):
    m, k, n = 5, 96, 40
    a, qw, sc = inputs(m, k, n)
    c = Guarded(m * n * 4, fill=0x5A)
    b = Guarded(q.b_packed_size(n, k), fill=0x5A)
    big = Guarded(1 << 16, fill=0x5A)

    def call(**kw):
        args = dict(a=ptr(a), qw=ptr(qw), sc=ptr(sc), m=m, k=k, n=n, c=c.ptr, cb=c.size)
        args.update(kw)
        return lib.npu_ime2_hp_gemm(args["a"], args["qw"], args["sc"], args["m"], args["k"], args["n"],
                                    args["c"], args["cb"])

    assert call(k=100) == Status.BAD_K
    assert call(k=0) == Status.BAD_K
    assert call(k=-32) == Status.BAD_K
    assert call(m=-1) == Status.BAD_SHAPE
    assert call(n=-1) == Status.BAD_SHAPE
    assert call(m=1 << 40, n=1 << 40) == Status.BAD_SHAPE
    for name in ("a", "qw", "sc", "c"):
        assert call(**{name: None}) == Status.NULL_POINTER
    a_bad = a.copy()
    for bad in (np.nan, np.inf, -np.inf):
        a_bad[2, 17] = bad
        assert call(a=ptr(a_bad)) == Status.NON_FINITE
        sc_bad = sc.copy()
        sc_bad[3, 1] = bad
        assert call(sc=ptr(sc_bad)) == Status.NON_FINITE
        assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc_bad), n, k, b.ptr, b.size) == Status.NON_FINITE
        assert lib.npu_ime2_quantize_a(ptr(a_bad), m, k, big.ptr, big.size) == Status.NON_FINITE
    assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc), 0, k, b.ptr, b.size) == Status.BAD_SHAPE
    assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc), n, 33, b.ptr, b.size) == Status.BAD_K
    assert lib.npu_ime2_pack_b(None, ptr(sc), n, k, b.ptr, b.size) == Status.NULL_POINTER
    assert lib.npu_ime2_pack_b(ptr(qw), ptr(sc), n, k, None, b.size) == Status.NULL_POINTER
    assert lib.npu_ime2_quantize_a(None, m, k, big.ptr, big.size) == Status.NULL_POINTER
    assert lib.npu_ime2_quantize_a(ptr(a), -1, k, big.ptr, big.size) == Status.BAD_SHAPE
    assert lib.npu_ime2_quantize_a(ptr(a), m, 31, big.ptr, big.size) == Status.BAD_K
    ap = np.frombuffer(q.pack_a(q.quantize_a(a)), np.uint8)
    bp = np.frombuffer(q.pack_b(qw, sc), np.uint8)
    g = lib.npu_ime2_gemm
    assert g(ptr(ap), ap.size, ptr(bp), bp.size, m, k, n, c.ptr, c.size, 2) == Status.BAD_PATH  # RVV: riscv64 builds only
    assert g(ptr(ap), ap.size, ptr(bp), bp.size, m, k, n, c.ptr, c.size, 3) == Status.BAD_PATH  # IME2: riscv64 builds only
    assert g(ptr(ap), ap.size, ptr(bp), bp.size, m, k, n, c.ptr, c.size, 99) == Status.BAD_PATH
    assert g(ptr(ap), ap.size - 1, ptr(bp), bp.size, m, k, n, c.ptr, c.size, 0) == Status.BAD_SHAPE
    assert g(ptr(ap), ap.size, ptr(bp), bp.size - 1, m, k, n, c.ptr, c.size, 0) == Status.BAD_SHAPE
    assert g(None, ap.size, ptr(bp), bp.size, m, k, n, c.ptr, c.size, 0) == Status.NULL_POINTER
    assert g(ptr(ap), ap.size, ptr(bp), bp.size, m, 512, n, c.ptr, c.size, 0) == Status.BAD_SHAPE  # inputs too small
    size = ctypes.c_size_t(7)
    assert lib.npu_ime2_b_packed_size(n, k, None) == Status.NULL_POINTER
    assert lib.npu_ime2_a_packed_size(-1, k, ctypes.byref(size)) == Status.BAD_SHAPE and size.value == 7
    for guarded in (c, b, big):
        assert guarded.guards_intact() and (guarded.body == 0x5A).all()


def test_status_strings(lib):
    for code in range(9):
        text = kernel.status_string(code)
        assert text and text != "unknown status code"
    assert kernel.status_string(1234) == "unknown status code"
    assert "multiple of 32" in kernel.status_string(Status.BAD_K)
    assert lib.npu_ime2_abi_version() == kernel.ABI_VERSION == 5


# ---------------------------------------------------------------------------------------------
# Python exceptions and messages


def test_python_errors_name_the_value_and_the_rule():
    m, k, n = 3, 64, 20
    a, qw, sc = inputs(m, k, n)
    f = kernel.ime2_hp_gemm_cpu
    with pytest.raises(kernel.KDimensionError, match=r"K=48 \(from A of shape \(3, 48\)\) must be a positive multiple of 32"):
        f(np.zeros((3, 48), np.float32), qw, sc)
    with pytest.raises(kernel.ShapeMismatchError, match=r"A has K=96 .* but the weights have K=64"):
        f(np.zeros((3, 96), np.float32), qw, sc)
    with pytest.raises(kernel.ShapeMismatchError, match=r"scales has shape \(20, 3\) but qweight"):
        f(a, qw, np.zeros((20, 3), np.float32))
    with pytest.raises(kernel.ShapeMismatchError, match=r"A must be 2-D \[M, K\], got shape \(64,\)"):
        f(a[0], qw, sc)
    with pytest.raises(kernel.ShapeMismatchError, match=r"qweight must have shape \[N, K/32, 16\]"):
        f(a, qw[..., :8], sc)
    with pytest.raises(kernel.DTypeError, match="A must have dtype float32, got float64"):
        f(a.astype(np.float64), qw, sc)
    with pytest.raises(kernel.DTypeError, match="qweight must have dtype uint8, got int8"):
        f(a, qw.view(np.int8), sc)
    with pytest.raises(kernel.DTypeError, match="scales must have dtype float32, got float16"):
        f(a, qw, sc.astype(np.float16))
    a_nan = a.copy()
    a_nan[1, 5] = np.nan
    with pytest.raises(kernel.NonFiniteError, match=r"A must be finite: A\[1, 5\] = nan \(1 non-finite value in total\)"):
        f(a_nan, qw, sc)
    sc_inf = sc.copy()
    sc_inf[4, 0] = -np.inf
    with pytest.raises(kernel.NonFiniteError, match=r"scales must be finite: scales\[4, 0\] = -inf"):
        f(a, qw, sc_inf)
    with pytest.raises(kernel.NonFiniteError, match=r"scales\[4, 0\] = -inf"):
        kernel.pack_b(qw, sc_inf)
    with pytest.raises(kernel.NonFiniteError, match=r"A\[1, 5\] = nan"):
        kernel.quantize_a(a_nan)
    with pytest.raises(kernel.KDimensionError, match="K=33"):
        kernel.quantize_a(np.zeros((1, 33), np.float32))
    for exc in (kernel.KDimensionError, kernel.ShapeMismatchError, kernel.NonFiniteError, kernel.DTypeError,
                kernel.BufferTooSmallError, kernel.NullPointerError, kernel.WrongVlenError, kernel.PathError):
        assert issubclass(exc, kernel.Ime2Error) and issubclass(exc, ValueError)


def test_c_status_maps_to_exception_with_the_c_message():
    ap = kernel.quantize_a(np.ones((2, 64), np.float32))
    with pytest.raises(kernel.ShapeMismatchError, match=r"gemm\(M=2, K=64, N=5, path='auto'\): bad shape .*status 2"):
        kernel.gemm_packed(ap, b"\0" * 10, 2, 64, 5)
    with pytest.raises(kernel.KDimensionError, match=r"b_packed_size\(N=3, K=40\): K must be a positive multiple of 32"):
        kernel.b_packed_size(3, 40)


def test_missing_library_names_the_path_and_the_build_command(monkeypatch, tmp_path):
    missing = tmp_path / "_build" / "libnpu_ime2.so"
    monkeypatch.setattr(kernel, "LIBRARY_PATH", missing)
    monkeypatch.setattr(kernel, "_LIB", None)
    with pytest.raises(kernel.KernelUnavailableError) as info:
        kernel.ime2_hp_gemm_cpu(np.ones((1, 32), np.float32), np.zeros((1, 1, 16), np.uint8),
                                np.ones((1, 1), np.float32))
    assert str(missing) in str(info.value)
    assert "make -C kernels/ime2 OUT=plugins/vllm_npu/ime2/_build" in str(info.value)


def test_library_is_found_relative_to_the_package():
    import vllm_npu.ime2

    assert kernel.LIBRARY_PATH.parent.parent == __import__("pathlib").Path(vllm_npu.ime2.__file__).parent
    assert kernel.LIBRARY_PATH.name == "libnpu_ime2.so" and kernel.LIBRARY_PATH.parent.name == "_build"


# ---------------------------------------------------------------------------------------------
# package boundaries


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_importing_the_package_is_cheap_and_never_imports_the_simulator():
    out = _run(
        "import sys, vllm_npu, vllm_npu.ime2\n"
        "print(sorted(m for m in ('torch', 'npusim', 'vllm_npu.ime2.kernel') if m in sys.modules))\n"
        "import numpy as np\n"
        "from vllm_npu.ime2 import ime2_hp_gemm_cpu\n"
        "c = ime2_hp_gemm_cpu(np.ones((2, 64), np.float32), np.full((3, 2, 16), 0x99, np.uint8),\n"
        "                     np.ones((3, 2), np.float32))\n"
        "print(c.shape, sorted(m for m in ('torch', 'npusim') if m in sys.modules))\n"
    )
    assert out.splitlines() == ["[]", "(2, 3) []"]


def test_register_is_the_general_plugin_function():
    import vllm_npu.ime2

    assert callable(vllm_npu.ime2.register)  # issue 5; exercised with vLLM in test_ime2_vllm.py
    with pytest.raises(AttributeError):
        vllm_npu.ime2.no_such_name  # noqa: B018
    assert vllm_npu.ime2.ime2_hp_gemm_cpu is kernel.ime2_hp_gemm_cpu
    assert vllm_npu.ime2.register_torch_op is kernel.register_torch_op
