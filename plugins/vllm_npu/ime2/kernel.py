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

The vlenb rule (ABI 5; ``kernels/ime2/include/npu_ime2.h``, "AUTO and the vlenb rule"). It
applies to the K3 build only, a library with the IME2 path compiled in (:func:`ime2_built`: a
riscv64 build with ``src/gemm_ime2.c``). There ``auto`` (the whole op, :func:`gemm_packed`'s
default, the ``ime2_q4`` linear layers) is the IME2 path: where ``vlenb != 128`` (not an A100
core) it raises :class:`WrongVlenError`, naming the vlenb read (:func:`vlenb`) and the CPUs,
before any work. :func:`gemm_packed` computes on the kernel's worker threads (pinned to the A100
cores by the core fence, ``vllm_npu.ime2.fence``), so the C library resolves ``auto`` on each
worker's core (:func:`check_gemm_path` checks it ahead). The whole op (:func:`ime2_hp_gemm_cpu`)
quantizes A and packs B in the calling thread; its GEMM runs there too while the worker pool is
unconfigured (so that is where it checks), and on the pinned workers, one slice each, once the
fence configured the pool (:func:`pool_configured`; then it checks there). The RVV/portable
fallback is an explicit opt-in: ``NPU_IME2_ALLOW_FALLBACK=1`` in the environment or
:func:`set_allow_fallback` for the process (both reach the C library's
``npu_ime2_set_allow_fallback``), or ``ime2_hp_gemm_cpu(..., allow_fallback=True)`` per call; its
use is logged (one warning per vlenb and path). Other builds (x86-64 hosts, riscv64 without the IME2 path) ignore the setting:
``auto`` is the first usable of RVV, X86, portable. Explicit paths never fall back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from vllm_npu.settings import env_switch

__all__ = [
    "ALLOW_FALLBACK_ENV",
    "BUILD_COMMAND",
    "IME2_VLENB",
    "LIBRARY_PATH",
    "PATHS",
    "BufferTooSmallError",
    "DTypeError",
    "FallbackSettingError",
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
    "allow_fallback_setting",
    "auto_path",
    "b_packed_size",
    "check_gemm_path",
    "gemm_auto_path",
    "gemm_packed",
    "ime2_built",
    "ime2_hp_gemm_cpu",
    "load_library",
    "pack_b",
    "path_status",
    "pool_configured",
    "quantize_a",
    "quantize_a_array",
    "quantize_q4_0",
    "register_torch_op",
    "set_allow_fallback",
    "status_string",
    "usable_paths",
    "vlenb",
]

#: Where the host build is expected (relative to this package).
LIBRARY_PATH = Path(__file__).resolve().parent / "_build" / "libnpu_ime2.so"
#: How to build it from the repository root.
BUILD_COMMAND = "make -C kernels/ime2 OUT=plugins/vllm_npu/ime2/_build  (or: bash ci/setup.sh)"

QK = 32
#: The C ABI version this binding speaks (NPU_IME2_ABI_VERSION).
ABI_VERSION = 5
#: vlenb (bytes per vector register) the IME2 path needs: VLEN 1024, the K3's A100 cores.
IME2_VLENB = 128
#: Environment variable opting in to the RVV/portable fallback of ``auto`` on the K3 build
#: (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``; unset or empty: off).
ALLOW_FALLBACK_ENV = "NPU_IME2_ALLOW_FALLBACK"
# Packed B of N = 32, K = 32: one tile of one superblock (8 blocks of 576 bytes).
_B_ONE_TILE = 8 * 576

# A child of vLLM's "vllm" logger, so the fallback warning shows up with vLLM's logging set-up.
logger = logging.getLogger("vllm.vllm_npu.ime2.kernel")


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
    """The IME2 path needs VLEN 1024 (``NPU_IME2_ERR_WRONG_VLEN``): the IME2 path, or ``auto`` on
    the K3 build without the fallback opt-in, ran where ``vlenb != 128``.

    Attributes:
        vlenb: the vlenb read where the check ran (bytes; 0 without RVV): the calling thread,
            or worker 0 of the GEMM's pinned worker pool; None if not read.
        cpus: the CPUs that thread may run on (``os.sched_getaffinity``), None if unknown.
    """

    status = Status.WRONG_VLEN

    def __init__(self, message: str, *, vlenb: int | None = None, cpus: frozenset[int] | None = None) -> None:
        super().__init__(message)
        self.vlenb = vlenb
        self.cpus = cpus


class FallbackSettingError(Ime2Error):
    """``NPU_IME2_ALLOW_FALLBACK`` holds a value that is neither on nor off."""


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
        lib.npu_ime2_auto_path_with.argtypes = [ctypes.c_int]
        lib.npu_ime2_auto_path_with.restype = ctypes.c_int
        lib.npu_ime2_set_allow_fallback.argtypes = [ctypes.c_int]
        lib.npu_ime2_set_allow_fallback.restype = None
        lib.npu_ime2_allow_fallback.argtypes = []
        lib.npu_ime2_allow_fallback.restype = ctypes.c_int
        lib.npu_ime2_vlenb.argtypes = []
        lib.npu_ime2_vlenb.restype = ctypes.c_int
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
        lib.npu_ime2_hp_gemm_on.argtypes = [_vp, _vp, _vp, _i64, _i64, _i64, _vp, _sz, ctypes.c_int]
        lib.npu_ime2_hp_gemm_on.restype = ctypes.c_int
        # The C library's opt-in follows the process setting (gemm_packed's AUTO reads it there).
        _push(lib, _setting_or_off())
        # thread pinning (issue 15): npu_ime2_gemm_mt's worker pool, driven by vllm_npu.ime2.fence
        # (structs: fence.PoolInfo / fence.PoolWorkerInfo, passed by address); errno-style returns.
        if hasattr(lib, "npu_ime2_pool_configure"):
            lib.npu_ime2_pool_start.argtypes = [ctypes.c_int]
            lib.npu_ime2_pool_start.restype = ctypes.c_int
            lib.npu_ime2_pool_configure.argtypes = [_vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            lib.npu_ime2_pool_configure.restype = ctypes.c_int
            lib.npu_ime2_pool_shutdown.argtypes = []
            lib.npu_ime2_pool_shutdown.restype = None
            lib.npu_ime2_pool_get_info.argtypes = [_vp]
            lib.npu_ime2_pool_get_info.restype = ctypes.c_int
            lib.npu_ime2_pool_get_worker.argtypes = [ctypes.c_int, _vp]
            lib.npu_ime2_pool_get_worker.restype = ctypes.c_int
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


def auto_path(*, allow_fallback: bool | None = None) -> str:
    """The concrete path ``auto`` runs in the calling thread (``npu_ime2_auto_path_with``): the
    whole op's path while the worker pool is unconfigured (:func:`ime2_hp_gemm_cpu` then computes
    in the calling thread).

    ``allow_fallback``: None = the process setting (:func:`allow_fallback_setting`). On the K3 build
    without the opt-in this is always ``"ime2"``, whether or not it can run here (a call then
    raises :class:`WrongVlenError`); see the module docstring. Where :func:`gemm_packed`'s slices
    run (the kernel's worker threads once the core fence pinned them) see :func:`gemm_auto_path`.

    Raises:
        FallbackSettingError: ``NPU_IME2_ALLOW_FALLBACK`` is malformed (when it is consulted).
    """
    use = allow_fallback_setting() if allow_fallback is None else bool(allow_fallback)
    return _PATH_NAMES[int(load_library().npu_ime2_auto_path_with(int(use)))]


def ime2_built() -> bool:
    """Whether this library is the K3 build: the IME2 path is compiled in (riscv64 with
    ``src/gemm_ime2.c``), whatever vlenb this thread reads. The vlenb rule applies only then."""
    global _IME2_BUILT
    if _IME2_BUILT is None:
        _IME2_BUILT = path_status("ime2") != Status.BAD_PATH
    return _IME2_BUILT


def vlenb() -> int:
    """vlenb (bytes per vector register, VLEN / 8) read by ``csrr vlenb`` on the hart this thread
    runs on now (``npu_ime2_vlenb``); 0 in a build without RVV (x86-64 hosts)."""
    return int(load_library().npu_ime2_vlenb())


# ---------------------------------------------------------------------------------------------
# the fallback opt-in

_FALLBACK_OVERRIDE: bool | None = None
_PUSHED: bool | None = None  # the value last given to npu_ime2_set_allow_fallback
_IME2_BUILT: bool | None = None
_FALLBACK_LOGGED: set[tuple[int, str]] = set()


def _fallback_from_env() -> bool:
    """``NPU_IME2_ALLOW_FALLBACK`` as a switch (:func:`vllm_npu.settings.env_switch`; unset or
    blank: False, refuse the fallback).

    Raises:
        FallbackSettingError: the value is neither on nor off (named, with the accepted words).
    """
    return env_switch(ALLOW_FALLBACK_ENV, default=False, error=FallbackSettingError)


def allow_fallback_setting() -> bool:
    """The process setting of the fallback opt-in: the last :func:`set_allow_fallback` value,
    else ``NPU_IME2_ALLOW_FALLBACK`` (read at each call).

    Raises:
        FallbackSettingError: the environment variable is malformed.
    """
    return _FALLBACK_OVERRIDE if _FALLBACK_OVERRIDE is not None else _fallback_from_env()


def _setting_or_off() -> bool:
    """:func:`allow_fallback_setting`, a malformed environment value read as off (it raises where
    it is used: at the next ``auto`` call)."""
    try:
        return allow_fallback_setting()
    except FallbackSettingError:
        return False


def _push(lib: Any, allow: bool) -> None:
    """Make the C library's process-wide opt-in ``allow`` (one ctypes call when it changes)."""
    global _PUSHED
    if _PUSHED is not allow:
        lib.npu_ime2_set_allow_fallback(int(allow))
        _PUSHED = allow


def _sync_setting() -> bool:
    """The process setting, pushed to the C library (what AUTO reads where the GEMM runs).

    Raises:
        FallbackSettingError: the environment variable is malformed.
    """
    allow = allow_fallback_setting()
    _push(load_library(), allow)
    return allow


def set_allow_fallback(allow: bool | None) -> None:
    """Set the process-wide fallback opt-in (also the C library's, ``npu_ime2_set_allow_fallback``);
    None goes back to ``NPU_IME2_ALLOW_FALLBACK``. Ignored by builds without the IME2 path.

    Raises:
        FallbackSettingError: never for ``allow`` itself; a malformed environment value raises at
            the next ``auto`` call instead.
    """
    global _FALLBACK_OVERRIDE
    with _LOCK:
        _FALLBACK_OVERRIDE = None if allow is None else bool(allow)
        if _LIB is not None:
            _push(_LIB, _setting_or_off())


# ---------------------------------------------------------------------------------------------
# where the kernel runs: vlenb and CPUs, for the errors and the fallback warning


def _cpu_list(cpus: Iterable[int]) -> str:
    """``[0..7]``, ``[0..3, 5, 8..15]``: sorted CPU numbers with runs collapsed."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}..{ordered[j]}")
        i = j + 1
    return f"[{', '.join(parts)}]"


def _affinity() -> frozenset[int] | None:
    """The CPUs the calling thread may run on, or None where the OS does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _vlen_phrase(vb: int) -> str:
    return f"vlenb {vb} ({f'VLEN {vb * 8}' if vb else 'no RVV'})"


class _Where:
    """Where a path check ran: the vlenb read there, the CPUs, and a phrase naming both."""

    def __init__(self, vb: int, cpus: frozenset[int] | None, phrase: str) -> None:
        self.vlenb, self.cpus, self.phrase = vb, cpus, phrase


def _here() -> _Where:
    """The calling thread: its vlenb now and ``os.sched_getaffinity(0)``."""
    vb, cpus = vlenb(), _affinity()
    place = f"on CPUs {_cpu_list(cpus)}" if cpus is not None else "on unknown CPUs (no os.sched_getaffinity)"
    return _Where(vb, cpus, f"this thread read {_vlen_phrase(vb)} {place} (os.sched_getaffinity(0))")


def _gemm_where() -> _Where:
    """Where :func:`gemm_packed` checked its path: worker 0 of the kernel's pinned worker pool
    (after the core fence, ``vllm_npu.ime2.fence``), else the calling thread."""
    here = _here()
    try:
        from vllm_npu.ime2 import fence

        workers = fence.pool_workers() if fence.pool_state().configured else ()
    except Exception:  # noqa: BLE001 - a library without the pool API: the caller checked
        workers = ()
    if not workers or workers[0].last_vlenb is None:
        return here
    w = workers[0]
    cpus = w.affinity or (frozenset({w.cpu}) if w.cpu is not None else None)
    place = f"CPU {w.last_cpu}" if w.last_cpu is not None else "an unknown CPU"
    return _Where(w.last_vlenb, cpus,
                  f"the GEMM's worker 0 (thread {w.tid}, pinned to CPUs {_cpu_list(cpus or ())}) read "
                  f"{_vlen_phrase(w.last_vlenb)} on {place}; {here.phrase}")


def _wrong_vlen(context: str, where: _Where | None = None) -> WrongVlenError:
    """The error of the vlenb rule, naming the vlenb read and the CPUs it was read on."""
    where = where or _here()
    return WrongVlenError(
        f"{context}: IME2 needs vlenb == {IME2_VLENB} (VLEN 1024, the K3's A100 cores 8..15); {where.phrase}. "
        f"Run it on the A100 cores (the core fence, vllm_npu.ime2.fence.enter_ai_cores, pins the GEMM's "
        f"worker threads there), or opt in to the RVV/portable fallback with {ALLOW_FALLBACK_ENV}=1 or "
        f"kernel.set_allow_fallback(True) (ime2_hp_gemm_cpu: also allow_fallback=True)",
        vlenb=where.vlenb, cpus=where.cpus,
    )


def _log_fallback(where: _Where, path: str) -> None:
    """One warning per (vlenb, path) and process when ``auto`` fell back from IME2."""
    key = (where.vlenb, path)
    with _LOCK:
        if key in _FALLBACK_LOGGED:
            return
        _FALLBACK_LOGGED.add(key)
    logger.warning("IME2 fallback (opted in: %s=1 or set_allow_fallback(True)): %s, not vlenb %d, so auto "
                   "runs the %s path instead of ime2 (same results, without the matrix unit)",
                   ALLOW_FALLBACK_ENV, where.phrase, IME2_VLENB, path)


def _gemm_status(code: int) -> int:
    """``npu_ime2_gemm_mt``'s status for path ``code`` on an empty C: checked where the GEMM's
    slices run (a configured worker pool's worker 0 on its core, else this thread)."""
    a = np.zeros(1, dtype=np.uint8)
    b = np.zeros(_B_ONE_TILE, dtype=np.uint8)
    c = np.zeros(1, dtype=np.float32)
    return int(load_library().npu_ime2_gemm_mt(_ptr(a), 0, _ptr(b), b.nbytes, 0, QK, QK, _ptr(c), 0, code, 1))


def gemm_auto_path() -> str:
    """The concrete path ``auto`` runs where :func:`gemm_packed`'s slices run (the kernel's
    pinned worker threads after the core fence, else this thread), under the process setting.

    Raises:
        FallbackSettingError: ``NPU_IME2_ALLOW_FALLBACK`` is malformed.
    """
    return _gemm_path(_sync_setting())


def _gemm_path(allow: bool) -> str:
    """The concrete path ``auto`` with the fallback opt-in ``allow`` runs where the GEMM's slices
    run: ``ime2`` on the K3 build unless ``allow`` and the IME2 path cannot run there; else what
    :func:`auto_path` answers (RVV / X86 / portable run on any core alike)."""
    if ime2_built() and (not allow or _gemm_status(PATHS["ime2"]) == Status.OK):
        return "ime2"
    return auto_path(allow_fallback=allow)


def pool_configured() -> int:
    """The kernel's pinned GEMM workers (``npu_ime2_pool_get_info``: ``configured``), 0 when the
    worker pool is unconfigured (every host but a K3 after the core fence) or the library has no
    pool API. While it is non-zero the whole op runs its GEMM on those workers.

    Raises:
        KernelUnavailableError: the library is not built.
    """
    lib = load_library()
    if not hasattr(lib, "npu_ime2_pool_get_info"):
        return 0
    from vllm_npu.ime2 import fence

    return fence.pool_state().configured


def check_gemm_path(context: str = "check_gemm_path") -> str:
    """Check, before any work, that :func:`gemm_packed` with ``path="auto"`` can run where its
    slices run, and return that path (:func:`gemm_auto_path`); logs the fallback when it is used.

    Args:
        context: names the caller at the start of an error message.

    Raises:
        WrongVlenError: the K3 build where vlenb != 128 and the fallback is not opted in (names
            the vlenb and the CPUs: the pinned worker's, and this thread's).
        PathError: the path cannot run on this CPU. FallbackSettingError: bad environment value.
    """
    path = gemm_auto_path()
    _raise_for(_gemm_status(PATHS["auto"]), f"{context} (path {path!r})", _gemm_where)
    if path != "ime2" and ime2_built():
        _log_fallback(_gemm_where(), path)
    return path


_GEMM_FALLBACK_NOTED = False


def _note_gemm_fallback() -> None:
    """Once per process (the K3 build, the opt-in set): log the fallback if the GEMM's slices
    run where vlenb != 128 (an empty-C probe of the IME2 path, where they run)."""
    global _GEMM_FALLBACK_NOTED
    _GEMM_FALLBACK_NOTED = True
    if _gemm_status(PATHS["ime2"]) != Status.OK:
        _log_fallback(_gemm_where(), auto_path(allow_fallback=True))


def _resolve_here(allow: bool | None) -> int:
    """The path code ``auto`` runs in the calling thread (the whole op, unconfigured pool),
    logging a fallback.

    Raises:
        FallbackSettingError: bad environment value.
    """
    use = allow_fallback_setting() if allow is None else bool(allow)
    code = int(load_library().npu_ime2_auto_path_with(int(use)))
    if use and code != PATHS["ime2"] and ime2_built():
        _log_fallback(_here(), _PATH_NAMES[code])
    return code


def _resolve_on_workers(allow: bool | None) -> int:
    """The path code ``auto`` runs on the configured pool's workers (the whole op's GEMM after the
    core fence), under the per-call ``allow`` or else the process setting, logging a fallback.

    Raises:
        FallbackSettingError: bad environment value.
    """
    path = _gemm_path(allow_fallback_setting() if allow is None else bool(allow))
    if path != "ime2" and ime2_built():
        _log_fallback(_gemm_where(), path)
    return PATHS[path]


def x86_variant() -> str:
    """The X86 path's variant on this CPU now (``npu_ime2_x86_variant``): ``avx512-vnni-fp16``,
    ``avx512-vnni-f16c`` (AVX-512 VNNI without AVX512-FP16, e.g. AMD Zen 4; also when
    ``NPU_IME2_X86_ISA=avx512-vnni`` caps it), ``avx2-f16c`` (also when ``NPU_IME2_X86_ISA=avx2``
    forces it), or ``none`` (not an x86-64
    build, or no AVX2/F16C: ``auto`` then runs another path)."""
    return load_library().npu_ime2_x86_variant().decode()


def _raise_for(status: int, context: str, where: Callable[[], _Where] = _here) -> None:
    """Raise the error class of a nonzero status; ``where`` says where a WRONG_VLEN was read."""
    if status == Status.OK:
        return
    if status == Status.WRONG_VLEN:
        raise _wrong_vlen(context, where())
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

    ``out``: an optional C-contiguous float32 ``[M, N]`` array to write into. ``auto`` is
    resolved by the C library where each slice runs (the kernel's worker threads, pinned to the
    A100 cores after the core fence), under the process setting of the fallback opt-in
    (:func:`set_allow_fallback`, ``NPU_IME2_ALLOW_FALLBACK``); :func:`check_gemm_path` checks it
    ahead and logs a fallback.

    Raises:
        PathError: ``path`` is not one of ``PATHS`` or is not built into the library.
        WrongVlenError: the IME2 path (explicit, or ``auto`` on the K3 build without the
            fallback opt-in) where vlenb != 128; names the vlenb and the CPUs.
        KDimensionError, ShapeMismatchError: bad shapes, buffers too small for them, bad threads.
        FallbackSettingError: ``NPU_IME2_ALLOW_FALLBACK`` is malformed (``auto`` only).
    """
    if path not in PATHS:
        raise PathError(f"path={path!r} is not one of {', '.join(map(repr, PATHS))}")
    if path == "auto" and _sync_setting() and not _GEMM_FALLBACK_NOTED and ime2_built():
        _note_gemm_fallback()
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
    _raise_for(st, f"gemm(M={m}, K={k}, N={n}, path={path!r}{extra})", _gemm_where)
    return c


def _gemm_numpy(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray, allow: bool | None) -> np.ndarray:
    a = np.ascontiguousarray(a)
    _activations(a, None)  # A's own errors first
    qweight, scales, n, k = _weights(qweight, scales)
    a = _activations(a, k)
    _check_finite("A", a)
    m = a.shape[0]
    c = np.empty((m, n), dtype=np.float32)
    context = f"ime2_hp_gemm_cpu(M={m}, K={k}, N={n})"
    lib = load_library()
    # The GEMM runs on the pinned workers once the core fence configured the pool (C decides the
    # same way, npu_ime2_hp_gemm_on), else here: the path is resolved and checked where it runs.
    pooled = pool_configured() > 0
    code = _resolve_on_workers(allow) if pooled else _resolve_here(allow)
    where = _gemm_where if pooled else _here
    if m == 0 or n == 0:  # the vlenb rule holds for an empty C too, as in C
        _raise_for(_gemm_status(code) if pooled else lib.npu_ime2_path_status(code), context, where)
        return c
    st = lib.npu_ime2_hp_gemm_on(_ptr(a), _ptr(qweight), _ptr(scales), m, k, n, _ptr(c), c.nbytes, code)
    _raise_for(st, context, where)
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


def ime2_hp_gemm_cpu(a: Any, qweight: Any, scales: Any, *, allow_fallback: bool | None = None) -> Any:
    """``C[M, N] = A @ dequant(qweight, scales)^T`` with the IME2 HP kernel's arithmetic (host C),
    on the ``auto`` path (the whole op, ``npu_ime2_hp_gemm_on``).

    A is quantized and B packed in the calling thread. The GEMM runs in the calling thread while
    the kernel's worker pool is unconfigured, and on its pinned workers (one slice per worker,
    ``npu_ime2_gemm_mt``) once it is configured (:func:`pool_configured`: after the core fence on
    a K3, the A100 cores); ``auto`` is resolved and checked where the GEMM runs. The result is the
    same bit for bit.

    Args:
        a: float32 ``[M, K]`` (numpy array or torch tensor), finite.
        qweight: uint8 ``[N, K/32, 16]`` Q4_0 codes, unsigned 0..15 with zero point 8. Nibble
            order (this project's choice; the seed does not state the fork's): byte ``b`` of
            block ``qweight[n, j]`` holds K element ``32j + 2b`` in bits 3:0 and ``32j + 2b + 1``
            in bits 7:4 (adjacent pairs, low nibble first, as ONNX Runtime's MatMulNBits and the
            IME Int4 register layout), not ggml's ``block_q4_0`` order (byte ``b`` = elements
            ``b`` and ``b + 16``; convert with ``npusim.q4x32.qweight_from_ggml``). The board
            scenario ``ime2_board.fork_op[qweight_nibbles]`` tells the two apart on the fork's
            ``torch.ops._C.ime2_hp_gemm_cpu`` where it is installed.
        scales: float32 ``[N, K/32]``, finite.
        allow_fallback: on the K3 build, run RVV/portable where vlenb != 128 instead of raising
            :class:`WrongVlenError` (logged once); None = the process setting
            (:func:`allow_fallback_setting`: :func:`set_allow_fallback` or ``NPU_IME2_ALLOW_FALLBACK``).
            Ignored by builds without the IME2 path (x86-64 hosts).

    Returns:
        float32 ``[M, N]``: a torch tensor if ``a`` is a tensor, else a numpy array.

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs (all
        ``ValueError``); WrongVlenError: the K3 build where the GEMM runs on a hart with
        vlenb != 128 (this thread, or worker 0 of a configured pool) without the fallback opt-in
        (names the vlenb read and the CPUs; also for M == 0 or N == 0);
        FallbackSettingError: ``NPU_IME2_ALLOW_FALLBACK`` is malformed;
        KernelUnavailableError: the library is not built.
    """
    if _is_tensor(a):
        import torch

        out = _gemm_numpy(_to_numpy(a, "A"), _to_numpy(qweight, "qweight"), _to_numpy(scales, "scales"),
                          allow_fallback)
        return torch.from_numpy(out).to(a.device)
    return _gemm_numpy(np.asarray(a), np.asarray(_to_numpy(qweight, "qweight")),
                       np.asarray(_to_numpy(scales, "scales")), allow_fallback)


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
