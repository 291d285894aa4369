"""ctypes binding of the host build of the IME2 Q4_0x32 kernel (``kernels/ime2``, issue 3).

The library is ``_build/libnpu_ime2.so`` next to this file, built by the set-up
(``bash ci/setup.sh``) or by hand with
``make -C kernels/ime2 OUT=plugins/vllm_npu/ime2/_build`` from the repository root.

Only numpy is imported at module level; torch is imported when a tensor is passed or the custom
op is registered. This module talks to the kernel's C ABI only (never to the simulator).

Public API:

* :func:`ime2_hp_gemm_cpu` ``(A, qweight, scales) -> C``: ``C[M, N] = A @ dequant(W)^T`` on numpy
  arrays or torch tensors (returns the same kind). ``A`` float32 ``[M, K]``, ``qweight`` uint8
  ``[N, K/32, 16]``, ``scales`` float32 ``[N, K/32]``, K a positive multiple of 32.
* :func:`pack_b`, :func:`quantize_a`: the packed B tiles / quantized A rows as ``bytes``.
* :func:`gemm_packed`: the GEMM on already packed operands (``path`` selects the C path).
* :func:`register_torch_op`: defines ``torch.ops.npu_harness.ime2_hp_gemm_cpu`` (idempotent).
* Exceptions: :class:`Ime2Error` (a ``ValueError``) and one subclass per status code.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BUILD_COMMAND",
    "LIBRARY_PATH",
    "PATHS",
    "BufferTooSmallError",
    "DTypeError",
    "Ime2Error",
    "KDimensionError",
    "KernelUnavailableError",
    "NoMemoryError",
    "NonFiniteError",
    "NullPointerError",
    "PathError",
    "ShapeMismatchError",
    "Status",
    "WrongVlenError",
    "a_packed_size",
    "auto_path",
    "b_packed_size",
    "gemm_packed",
    "ime2_hp_gemm_cpu",
    "load_library",
    "pack_b",
    "path_status",
    "quantize_a",
    "quantize_a_array",
    "quantize_q4_0",
    "register_torch_op",
    "status_string",
    "usable_paths",
]

#: Where the host build is expected (relative to this package).
LIBRARY_PATH = Path(__file__).resolve().parent / "_build" / "libnpu_ime2.so"
#: How to build it from the repository root.
BUILD_COMMAND = "make -C kernels/ime2 OUT=plugins/vllm_npu/ime2/_build  (or: bash ci/setup.sh)"

QK = 32
#: The C ABI version this binding speaks (NPU_IME2_ABI_VERSION).
ABI_VERSION = 4


class Status:
    """The C ABI's ``npu_ime2_status`` codes (``kernels/ime2/include/npu_ime2.h``)."""

    OK = 0
    BAD_K = 1
    BAD_SHAPE = 2
    NULL_POINTER = 3
    NON_FINITE = 4
    BUFFER_TOO_SMALL = 5
    WRONG_VLEN = 6
    BAD_PATH = 7
    NO_MEMORY = 8


#: The C ABI's ``npu_ime2_path`` values.
PATHS = {"auto": 0, "portable": 1, "rvv": 2, "ime2": 3, "x86": 4}
_PATH_NAMES = {v: k for k, v in PATHS.items()}


class Ime2Error(ValueError):
    """Base class of the kernel's errors; ``status`` is the C status code (None: Python check)."""

    status: int | None = None


class KDimensionError(Ime2Error):
    """K is not a positive multiple of 32 (``NPU_IME2_ERR_BAD_K``)."""

    status = Status.BAD_K


class ShapeMismatchError(Ime2Error):
    """Shapes disagree or are out of range (``NPU_IME2_ERR_BAD_SHAPE``)."""

    status = Status.BAD_SHAPE


class NullPointerError(Ime2Error):
    """A required pointer was NULL (``NPU_IME2_ERR_NULL_POINTER``)."""

    status = Status.NULL_POINTER


class NonFiniteError(Ime2Error):
    """NaN or Inf in ``A`` or ``scales`` (``NPU_IME2_ERR_NON_FINITE``)."""

    status = Status.NON_FINITE


class BufferTooSmallError(Ime2Error):
    """An output buffer is smaller than required (``NPU_IME2_ERR_BUFFER_TOO_SMALL``)."""

    status = Status.BUFFER_TOO_SMALL


class WrongVlenError(Ime2Error):
    """The IME2 path needs VLEN 1024 (``NPU_IME2_ERR_WRONG_VLEN``)."""

    status = Status.WRONG_VLEN


class PathError(Ime2Error):
    """Unknown GEMM path or one not built into the library (``NPU_IME2_ERR_BAD_PATH``)."""

    status = Status.BAD_PATH


class NoMemoryError(Ime2Error, MemoryError):
    """The kernel could not allocate its workspace (``NPU_IME2_ERR_NO_MEMORY``)."""

    status = Status.NO_MEMORY


class DTypeError(Ime2Error):
    """An input has the wrong dtype (checked in Python before the C call)."""


class KernelUnavailableError(RuntimeError):
    """The shared library is not built (or cannot be loaded)."""


_ERRORS: dict[int, type[Ime2Error]] = {
    cls.status: cls  # type: ignore[misc]
    for cls in (KDimensionError, ShapeMismatchError, NullPointerError, NonFiniteError, BufferTooSmallError,
                WrongVlenError, PathError, NoMemoryError)
}

_LIB: ctypes.CDLL | None = None
_LOCK = threading.RLock()
_i64 = ctypes.c_int64
_sz = ctypes.c_size_t
_vp = ctypes.c_void_p


def load_library() -> ctypes.CDLL:
    """Load (once) and return the kernel library.

    Raises:
        KernelUnavailableError: the library is missing or fails to load; the message names the
            path and the build command.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if not LIBRARY_PATH.is_file():
            raise KernelUnavailableError(
                f"the IME2 kernel library {LIBRARY_PATH} is not built; build it with: {BUILD_COMMAND}"
            )
        try:
            lib = ctypes.CDLL(str(LIBRARY_PATH))
        except OSError as exc:
            raise KernelUnavailableError(
                f"cannot load the IME2 kernel library {LIBRARY_PATH} ({exc}); rebuild it with: {BUILD_COMMAND}"
            ) from exc
        lib.npu_ime2_abi_version.argtypes = []
        lib.npu_ime2_abi_version.restype = ctypes.c_int
        if lib.npu_ime2_abi_version() != ABI_VERSION:
            raise KernelUnavailableError(
                f"the IME2 kernel library {LIBRARY_PATH} has ABI version {lib.npu_ime2_abi_version()}, "
                f"this binding needs {ABI_VERSION}; rebuild it with: {BUILD_COMMAND}"
            )
        lib.npu_ime2_path_status.argtypes = [ctypes.c_int]
        lib.npu_ime2_path_status.restype = ctypes.c_int
        lib.npu_ime2_auto_path.argtypes = []
        lib.npu_ime2_auto_path.restype = ctypes.c_int
        lib.npu_ime2_x86_variant.argtypes = []
        lib.npu_ime2_x86_variant.restype = ctypes.c_char_p
        lib.npu_ime2_status_string.argtypes = [ctypes.c_int]
        lib.npu_ime2_status_string.restype = ctypes.c_char_p
        for name in ("npu_ime2_b_packed_size", "npu_ime2_a_packed_size"):
            fn = getattr(lib, name)
            fn.argtypes = [_i64, _i64, ctypes.POINTER(_sz)]
            fn.restype = ctypes.c_int
        lib.npu_ime2_pack_b.argtypes = [_vp, _vp, _i64, _i64, _vp, _sz]
        lib.npu_ime2_pack_b.restype = ctypes.c_int
        lib.npu_ime2_quantize_a.argtypes = [_vp, _i64, _i64, _vp, _sz]
        lib.npu_ime2_quantize_a.restype = ctypes.c_int
        lib.npu_ime2_gemm.argtypes = [_vp, _sz, _vp, _sz, _i64, _i64, _i64, _vp, _sz, ctypes.c_int]
        lib.npu_ime2_gemm.restype = ctypes.c_int
        lib.npu_ime2_gemm_mt.argtypes = [_vp, _sz, _vp, _sz, _i64, _i64, _i64, _vp, _sz, ctypes.c_int, ctypes.c_int]
        lib.npu_ime2_gemm_mt.restype = ctypes.c_int
        lib.npu_ime2_quantize_q4_0.argtypes = [_vp, _i64, _i64, _vp, _sz, _vp, _sz]
        lib.npu_ime2_quantize_q4_0.restype = ctypes.c_int
        lib.npu_ime2_hp_gemm.argtypes = [_vp, _vp, _vp, _i64, _i64, _i64, _vp, _sz]
        lib.npu_ime2_hp_gemm.restype = ctypes.c_int
        _LIB = lib
        return lib


def status_string(status: int) -> str:
    """The C library's description of a status code."""
    return load_library().npu_ime2_status_string(int(status)).decode()


def path_status(path: str) -> int:
    """The C library's ``npu_ime2_path_status`` for a path name (``Status.OK`` when it runs here).

    Raises:
        PathError: ``path`` is not one of ``PATHS``.
    """
    if path not in PATHS:
        raise PathError(f"path={path!r} is not one of {', '.join(map(repr, PATHS))}")
    return int(load_library().npu_ime2_path_status(PATHS[path]))


def usable_paths() -> list[str]:
    """The concrete path names (``auto`` excluded) this library can run on this CPU."""
    return [p for p in PATHS if p != "auto" and path_status(p) == Status.OK]


def auto_path() -> str:
    """The concrete path ``auto`` runs on this CPU (``npu_ime2_auto_path``)."""
    return _PATH_NAMES[int(load_library().npu_ime2_auto_path())]


def x86_variant() -> str:
    """The X86 path's variant on this CPU now (``npu_ime2_x86_variant``): ``avx512-vnni-fp16``,
    ``avx2-f16c`` (also when ``NPU_IME2_X86_ISA=avx2`` forces it), or ``none`` (not an x86-64
    build, or no AVX2/F16C: ``auto`` then runs another path)."""
    return load_library().npu_ime2_x86_variant().decode()


def _raise_for(status: int, context: str) -> None:
    if status == Status.OK:
        return
    cls = _ERRORS.get(status, Ime2Error)
    raise cls(f"{context}: {status_string(status)} (status {status})")


# ---------------------------------------------------------------------------------------------
# Python-side validation (specific messages naming the offending value and the rule)


def _check_k(k: int, where: str) -> None:
    if k <= 0 or k % QK:
        raise KDimensionError(
            f"K={k} (from {where}) must be a positive multiple of {QK}, the Q4_0 block length "
            f"(K % 32 = {k % QK}); K need not be a multiple of 256"
        )


def _check_dtype(name: str, x: np.ndarray, dtype: type) -> None:
    if x.dtype != np.dtype(dtype):
        raise DTypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {x.dtype}")


def _check_ndim(name: str, x: np.ndarray, ndim: int, layout: str) -> None:
    if x.ndim != ndim:
        raise ShapeMismatchError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _check_finite(name: str, x: np.ndarray) -> None:
    if x.size == 0:
        return
    finite = np.isfinite(x)
    if not finite.all():
        idx = tuple(int(i) for i in np.argwhere(~finite)[0])
        count = int((~finite).sum())
        raise NonFiniteError(
            f"{name} must be finite: {name}[{', '.join(map(str, idx))}] = {float(x[idx])} "
            f"({count} non-finite value{'s' if count != 1 else ''} in total)"
        )


def _weights(qweight: Any, scales: Any) -> tuple[np.ndarray, np.ndarray, int, int]:
    qweight = np.ascontiguousarray(qweight)
    scales = np.ascontiguousarray(scales)
    _check_dtype("qweight", qweight, np.uint8)
    _check_ndim("qweight", qweight, 3, "[N, K/32, 16]")
    if qweight.shape[2] != QK // 2:
        raise ShapeMismatchError(
            f"qweight must have shape [N, K/32, 16] (16 bytes = 32 nibbles per block), got {tuple(qweight.shape)}"
        )
    _check_dtype("scales", scales, np.float32)
    _check_ndim("scales", scales, 2, "[N, K/32]")
    if scales.shape != qweight.shape[:2]:
        raise ShapeMismatchError(
            f"scales has shape {tuple(scales.shape)} but qweight {tuple(qweight.shape)} needs scales "
            f"[N, K/32] = {tuple(qweight.shape[:2])}"
        )
    n, k = qweight.shape[0], qweight.shape[1] * QK
    _check_k(k, f"qweight of shape {tuple(qweight.shape)}")
    _check_finite("scales", scales)
    return qweight, scales, n, k


def _activations(a: Any, k_w: int | None) -> np.ndarray:
    a = np.ascontiguousarray(a)
    _check_dtype("A", a, np.float32)
    _check_ndim("A", a, 2, "[M, K]")
    _check_k(a.shape[1], f"A of shape {tuple(a.shape)}")
    if k_w is not None and a.shape[1] != k_w:
        raise ShapeMismatchError(
            f"A has K={a.shape[1]} (shape {tuple(a.shape)}) but the weights have K={k_w} "
            f"(qweight [N, K/32, 16] with K/32={k_w // QK}); they must agree"
        )
    return a


def _ptr(x: np.ndarray) -> int:
    return x.ctypes.data


# ---------------------------------------------------------------------------------------------
# sizes, packing, GEMM


def b_packed_size(n: int, k: int) -> int:
    """Bytes of packed B, ``ceil(N/32) * ceil(K/256) * 4608`` (from the C library)."""
    out = _sz()
    _raise_for(load_library().npu_ime2_b_packed_size(int(n), int(k), ctypes.byref(out)),
               f"b_packed_size(N={n}, K={k})")
    return int(out.value)


def a_packed_size(m: int, k: int) -> int:
    """Bytes of quantized A, ``M * ceil(K/256) * 290`` (from the C library)."""
    out = _sz()
    _raise_for(load_library().npu_ime2_a_packed_size(int(m), int(k), ctypes.byref(out)),
               f"a_packed_size(M={m}, K={k})")
    return int(out.value)


def pack_b(qweight: Any, scales: Any) -> bytes:
    """Pack ``qweight [N, K/32, 16]`` uint8 and ``scales [N, K/32]`` float32 into B tiles.

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs.
    """
    qweight, scales, n, k = _weights(_to_numpy(qweight, "qweight"), _to_numpy(scales, "scales"))
    if n < 1:
        raise ShapeMismatchError(f"N={n} must be >= 1 to pack B (qweight of shape {tuple(qweight.shape)})")
    size = b_packed_size(n, k)
    out = np.empty(size, dtype=np.uint8)
    st = load_library().npu_ime2_pack_b(_ptr(qweight), _ptr(scales), n, k, _ptr(out), size)
    _raise_for(st, f"pack_b(N={n}, K={k})")
    return out.tobytes()


def quantize_a(a: Any) -> bytes:
    """Quantize ``A [M, K]`` float32 to the kernel's rows (4-row groups, then single rows).

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs.
    """
    return quantize_a_array(a).tobytes()


def quantize_a_array(a: Any) -> np.ndarray:
    """:func:`quantize_a` into a fresh uint8 array (no bytes copy; what the linear layers use).

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs.
    """
    a = _activations(_to_numpy(a, "A"), None)
    m, k = a.shape
    size = a_packed_size(m, k)
    out = np.empty(max(size, 1), dtype=np.uint8)
    st = load_library().npu_ime2_quantize_a(_ptr(a), m, k, _ptr(out), size)
    if st == Status.NON_FINITE:
        _check_finite("A", a)  # the C check is the only pass on the hot path; this names the value
    _raise_for(st, f"quantize_a(M={m}, K={k})")
    return out[:size]


def quantize_q4_0(w: Any) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0-quantize a weight ``W [N, K]`` (float32, finite) in C: ``(qweight [N, K/32, 16] uint8,
    scales [N, K/32] float32)``, the bits of ``npusim.q4x32.quantize_q4_0``.

    Raises:
        DTypeError: ``w`` is not float32. ShapeMismatchError: not 2-D or N < 1.
        KDimensionError: K is not a positive multiple of 32. NonFiniteError: NaN/Inf in ``w``.
    """
    w = _to_numpy(w, "W")
    if not isinstance(w, np.ndarray):
        w = np.asarray(w)
    _check_dtype("W", w, np.float32)
    _check_ndim("W", w, 2, "[N, K]")
    n, k = w.shape
    _check_k(k, f"W of shape {(n, k)}")
    if n < 1:
        raise ShapeMismatchError(f"W of shape {(n, k)} must have N >= 1 rows")
    w = np.ascontiguousarray(w)
    qweight = np.empty((n, k // QK, QK // 2), dtype=np.uint8)
    scales = np.empty((n, k // QK), dtype=np.float32)
    st = load_library().npu_ime2_quantize_q4_0(_ptr(w), n, k, _ptr(qweight), qweight.nbytes, _ptr(scales),
                                               scales.nbytes)
    if st == Status.NON_FINITE:
        _check_finite("W", w)  # names the first non-finite value
    _raise_for(st, f"quantize_q4_0(N={n}, K={k})")
    return qweight, scales


def _u8(x: Any) -> np.ndarray:
    """A read-only uint8 view of bytes / a contiguous uint8 array (never an empty buffer)."""
    if isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.flags.c_contiguous and x.size:
        return x
    buf = np.frombuffer(bytes(x), dtype=np.uint8) if not isinstance(x, np.ndarray) else np.ascontiguousarray(x, np.uint8)
    return buf if buf.size else np.zeros(1, dtype=np.uint8)


def gemm_packed(a_packed: Any, b_packed: Any, m: int, k: int, n: int, *, path: str = "auto",
                threads: int = 1, out: np.ndarray | None = None) -> np.ndarray:
    """``C [M, N]`` float32 from :func:`quantize_a` and :func:`pack_b` output (bytes or uint8
    arrays) on the given C path, the N tiles split over ``threads`` threads (1 .. 256).

    ``out``: an optional C-contiguous float32 ``[M, N]`` array to write into.

    Raises:
        PathError: ``path`` is not one of ``PATHS`` or is not built into the library.
        KDimensionError, ShapeMismatchError: bad shapes, buffers too small for them, bad threads.
    """
    if path not in PATHS:
        raise PathError(f"path={path!r} is not one of {', '.join(map(repr, PATHS))}")
    if not 1 <= int(threads) <= 256:
        raise ShapeMismatchError(f"threads={threads} must be between 1 and 256")
    a_len = a_packed.nbytes if isinstance(a_packed, np.ndarray) else len(a_packed)
    b_len = b_packed.nbytes if isinstance(b_packed, np.ndarray) else len(b_packed)
    a_buf, b_buf = _u8(a_packed), _u8(b_packed)
    shape = (max(int(m), 0), max(int(n), 0))
    if out is None:
        c = np.empty(shape, dtype=np.float32)
    else:
        if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ShapeMismatchError(f"out must be a C-contiguous float32 array of shape {shape}, got "
                                     f"{out.dtype} {tuple(out.shape)}")
        c = out
    c_ptr = c if c.size else np.empty(1, dtype=np.float32)
    st = load_library().npu_ime2_gemm_mt(_ptr(a_buf), a_len, _ptr(b_buf), b_len, int(m), int(k), int(n),
                                         _ptr(c_ptr), c.nbytes, PATHS[path], int(threads))
    extra = f", threads={threads}" if int(threads) != 1 else ""
    _raise_for(st, f"gemm(M={m}, K={k}, N={n}, path={path!r}{extra})")
    return c


def _gemm_numpy(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    _activations(a, None)  # A's own errors first
    qweight, scales, n, k = _weights(qweight, scales)
    a = _activations(a, k)
    _check_finite("A", a)
    m = a.shape[0]
    c = np.empty((m, n), dtype=np.float32)
    if m == 0 or n == 0:
        return c
    st = load_library().npu_ime2_hp_gemm(_ptr(a), _ptr(qweight), _ptr(scales), m, k, n, _ptr(c), c.nbytes)
    _raise_for(st, f"ime2_hp_gemm_cpu(M={m}, K={k}, N={n})")
    return c


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any, name: str = "input") -> Any:
    if _is_tensor(x):
        try:
            return x.detach().cpu().contiguous().numpy()
        except TypeError as exc:  # e.g. bfloat16, which numpy has no dtype for
            raise DTypeError(f"{name} has dtype {x.dtype}, which is not supported here ({exc})") from exc
    return x


def ime2_hp_gemm_cpu(a: Any, qweight: Any, scales: Any) -> Any:
    """``C[M, N] = A @ dequant(qweight, scales)^T`` with the IME2 HP kernel's arithmetic (host C).

    Args:
        a: float32 ``[M, K]`` (numpy array or torch tensor), finite.
        qweight: uint8 ``[N, K/32, 16]`` Q4_0 codes (byte b: element 2b low nibble, 2b+1 high).
        scales: float32 ``[N, K/32]``, finite.

    Returns:
        float32 ``[M, N]``: a torch tensor if ``a`` is a tensor, else a numpy array.

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs (all
        ``ValueError``); KernelUnavailableError: the library is not built.
    """
    if _is_tensor(a):
        import torch

        out = _gemm_numpy(_to_numpy(a, "A"), _to_numpy(qweight, "qweight"), _to_numpy(scales, "scales"))
        return torch.from_numpy(out).to(a.device)
    return _gemm_numpy(np.asarray(a), np.asarray(_to_numpy(qweight, "qweight")),
                       np.asarray(_to_numpy(scales, "scales")))


# ---------------------------------------------------------------------------------------------
# torch custom op

_OP_NAME = "npu_harness::ime2_hp_gemm_cpu"
_OP_SCHEMA = "(Tensor a, Tensor qweight, Tensor scales) -> Tensor"
_REGISTERED = False


def register_torch_op() -> Any:
    """Define ``torch.ops.npu_harness.ime2_hp_gemm_cpu(Tensor a, Tensor qweight, Tensor scales) -> Tensor``.

    A CPU implementation (this module's kernel) and a fake implementation (shapes only, for
    ``torch.compile`` / meta tensors). Idempotent: later calls return the same op.
    """
    global _REGISTERED
    import torch

    with _LOCK:
        if not _REGISTERED:
            try:
                torch.ops.npu_harness.ime2_hp_gemm_cpu  # noqa: B018 - defined elsewhere already?
                _REGISTERED = True
            except (AttributeError, RuntimeError):
                pass
        if not _REGISTERED:

            @torch.library.custom_op(_OP_NAME, mutates_args=(), device_types="cpu", schema=_OP_SCHEMA)
            def _op(a, qweight, scales):  # type: ignore[no-untyped-def]
                return ime2_hp_gemm_cpu(a, qweight, scales)

            @_op.register_fake
            def _fake(a, qweight, scales):  # type: ignore[no-untyped-def]
                torch._check(a.dim() == 2, lambda: f"a must be 2-D [M, K], got {tuple(a.shape)}")
                torch._check(qweight.dim() == 3, lambda: f"qweight must be 3-D [N, K/32, 16], got {tuple(qweight.shape)}")
                return a.new_empty((a.shape[0], qweight.shape[0]), dtype=torch.float32)

            _REGISTERED = True
    return torch.ops.npu_harness.ime2_hp_gemm_cpu
