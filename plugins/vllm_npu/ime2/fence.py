"""The SpacemiT K3 core fence: load native code on the X100 cores, then move to the A100 cores.

The K3 has 8 X100 cores (0-7, VLEN 256, the default affinity) and 8 A100 cores (8-15, VLEN 1024,
with the IME2 matrix instructions, not in the default affinity). Code whose vector spills were
compiled for VLEN 256 aborts when it is *loaded* on an A100 core, and a process cannot safely be
moved once it has made VLEN-dependent decisions. The seed's recipe (004) is therefore: import the
native code on cores 0-7, then write the process id to ``/proc/set_ai_thread`` (the SpacemiT
kernel's interface that lets a task run on the AI cores) and ``sched_setaffinity`` to 8-15.

:func:`enter_ai_cores` does exactly that, in that order; :func:`enter_ai_cores_once` is the
once-per-process wrapper the ``ime2_q4`` quantization method calls when it processes weights. On
any host that is not a K3 both are a no-op that logs one line.

K3 detection (:func:`detect_k3`), read under the injectable proc root (``/proc`` by default):

1. ``<root>/cpuinfo`` must be readable and list at least one riscv64 hart (an ``isa`` line whose
   value starts with ``rv64``). Otherwise: not a K3 (x86-64 hosts, macOS without ``/proc``...).
2. A SpacemiT K3 marker must be present: a ``uarch`` line naming ``spacemit,x100`` or
   ``spacemit,a100`` (RISC-V Linux prints the cpu node's devicetree ``compatible`` there, and the
   upstream K3 devicetree's cores are ``spacemit,x100``), or ``spacemit,k3`` in
   ``<root>/device-tree/compatible`` (the board's root compatible list), or the vendor kernel's
   ``<root>/set_ai_thread`` itself (which only SpacemiT's AI-core kernels provide).
3. A K3 found by (2) from ``uarch`` or the devicetree without ``<root>/set_ai_thread`` is an
   error (:class:`SetAiThreadMissingError`), not a silent no-op: staying on the X100 cores would
   run the IME2 path where it cannot run.

Sources for the facts: seed 004 (the recipe and the core numbers); opensolvers.github.io
``boards/SM10.md`` (X100 0-7 VLEN 256, A100 8-15 VLEN 1024 with IME2, A100 not in the default
affinity); the public ``k3_ai`` utility's README (the pid is written as decimal text to
``/proc/set_ai_thread``; moving a running process across the two VLENs is unsafe); Linux
``Documentation/arch/riscv/uabi.rst`` (the ``isa``/``hart isa`` lines) and the upstream K3
devicetree (``spacemit,x100`` cores).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "AffinityError",
    "CoreLayout",
    "FenceError",
    "FenceResult",
    "K3Detection",
    "K3_LAYOUT",
    "SetAiThreadMissingError",
    "SetAiThreadPermissionError",
    "SetAiThreadWriteError",
    "detect_k3",
    "enter_ai_cores",
    "enter_ai_cores_once",
    "reset_once_for_tests",
]

LOGGER = logging.getLogger(__name__)

#: ``uarch`` values (devicetree cpu compatibles) of the K3's two core types.
K3_UARCH_MARKERS = ("spacemit,x100", "spacemit,a100")
#: The K3's root devicetree compatible.
K3_DT_MARKER = "spacemit,k3"


@dataclass(frozen=True)
class CoreLayout:
    """Where the fence looks and which cores it moves between.

    Attributes:
        proc_root: the procfs root (``/proc``); tests point it at a fake tree.
        x100_cores: the cores the native code is loaded on (VLEN 256).
        a100_cores: the cores the process moves to (VLEN 1024, IME2).
    """

    proc_root: Path = Path("/proc")
    x100_cores: frozenset[int] = field(default_factory=lambda: frozenset(range(0, 8)))
    a100_cores: frozenset[int] = field(default_factory=lambda: frozenset(range(8, 16)))

    def __post_init__(self) -> None:
        object.__setattr__(self, "proc_root", Path(self.proc_root))
        object.__setattr__(self, "x100_cores", frozenset(int(c) for c in self.x100_cores))
        object.__setattr__(self, "a100_cores", frozenset(int(c) for c in self.a100_cores))
        if not self.a100_cores:
            raise ValueError("CoreLayout.a100_cores must name at least one core")
        if self.x100_cores & self.a100_cores:
            raise ValueError(
                f"CoreLayout: the X100 cores {sorted(self.x100_cores)} and the A100 cores "
                f"{sorted(self.a100_cores)} overlap"
            )

    @property
    def cpuinfo(self) -> Path:
        return self.proc_root / "cpuinfo"

    @property
    def set_ai_thread(self) -> Path:
        return self.proc_root / "set_ai_thread"

    @property
    def dt_compatible(self) -> Path:
        return self.proc_root / "device-tree" / "compatible"


#: The Banana Pi SM10's K3: X100 cores 0-7, A100 cores 8-15, ``/proc``.
K3_LAYOUT = CoreLayout()


class FenceError(RuntimeError):
    """Base class of the fence's errors; ``path`` is the file involved (None if none)."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class SetAiThreadMissingError(FenceError):
    """The host is a K3 but ``<root>/set_ai_thread`` does not exist."""


class SetAiThreadPermissionError(FenceError):
    """Opening or writing ``<root>/set_ai_thread`` was refused (EACCES / EPERM)."""


class SetAiThreadWriteError(FenceError):
    """Any other failure to write the thread id to ``<root>/set_ai_thread``."""


class AffinityError(FenceError):
    """``sched_setaffinity`` to the A100 cores failed."""


@dataclass(frozen=True)
class K3Detection:
    """The outcome of :func:`detect_k3`.

    Attributes:
        is_k3: the host is a SpacemiT K3 (by the module's rule).
        reason: one line saying why (names the file and the marker found or missing).
        has_set_ai_thread: ``<root>/set_ai_thread`` exists.
    """

    is_k3: bool
    reason: str
    has_set_ai_thread: bool


@dataclass(frozen=True)
class FenceResult:
    """What :func:`enter_ai_cores` did.

    Attributes:
        moved: the thread was registered and moved to the A100 cores.
        message: the one line that was logged.
        tid: the thread id written to ``set_ai_thread`` (None when not moved).
        cores: the affinity set (empty when not moved).
    """

    moved: bool
    message: str
    tid: int | None = None
    cores: frozenset[int] = frozenset()


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _cpuinfo_fields(text: str, key: str) -> list[str]:
    values = []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() == key:
            values.append(value.strip().lower())
    return values


def detect_k3(layout: CoreLayout = K3_LAYOUT) -> K3Detection:
    """Decide whether this host is a SpacemiT K3 (rule in the module docstring).

    Never raises: an unreadable ``cpuinfo`` means "not a K3".
    """
    has_sat = layout.set_ai_thread.exists()
    cpuinfo = _read_text(layout.cpuinfo)
    if cpuinfo is None:
        return K3Detection(False, f"{layout.cpuinfo} is not readable", has_sat)
    isas = _cpuinfo_fields(cpuinfo, "isa")
    if not any(isa.startswith("rv64") for isa in isas):
        return K3Detection(False, f"{layout.cpuinfo} lists no riscv64 hart (no 'isa: rv64...' line)", has_sat)
    uarchs = _cpuinfo_fields(cpuinfo, "uarch")
    found = sorted({m for m in K3_UARCH_MARKERS for u in uarchs if m in u})
    if found:
        return K3Detection(True, f"{layout.cpuinfo} names {', '.join(found)}", has_sat)
    dt = _read_text(layout.dt_compatible)
    if dt is not None and K3_DT_MARKER in [c.strip().lower() for c in dt.split("\0")]:
        return K3Detection(True, f"{layout.dt_compatible} lists {K3_DT_MARKER}", has_sat)
    if has_sat:
        return K3Detection(True, f"riscv64 with the SpacemiT AI-core interface {layout.set_ai_thread}", has_sat)
    return K3Detection(
        False,
        f"riscv64 but no K3 marker (uarch {'/'.join(K3_UARCH_MARKERS)} in {layout.cpuinfo}, "
        f"{K3_DT_MARKER} in {layout.dt_compatible}, or {layout.set_ai_thread})",
        has_sat,
    )


def _default_opener(path: Path) -> TextIO:
    return open(path, "w", encoding="ascii")  # noqa: SIM115 - closed by the caller's with


def _default_load_library() -> Any:
    from vllm_npu.ime2.kernel import load_library

    return load_library()


def _register(layout: CoreLayout, tid: int, opener: Callable[[Path], TextIO]) -> None:
    path = layout.set_ai_thread
    try:
        with opener(path) as handle:
            handle.write(str(tid))
    except FileNotFoundError as exc:
        raise SetAiThreadMissingError(
            f"{path} disappeared while registering thread {tid} ({exc.strerror}); the running kernel "
            "must provide SpacemiT's AI-core interface", path) from exc
    except PermissionError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise SetAiThreadPermissionError(
            f"cannot write thread {tid} to {path}: {code} ({exc.strerror or exc}); run the server as a "
            f"user allowed to write {path} (root, or grant write access to it at boot)", path) from exc
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise SetAiThreadWriteError(
            f"cannot write thread {tid} to {path}: {code} ({exc.strerror or exc}); check that {path} "
            "is SpacemiT's set_ai_thread interface (a writable file) and that the thread exists", path) from exc


def enter_ai_cores(
    layout: CoreLayout = K3_LAYOUT,
    *,
    logger: logging.Logger | None = None,
    load_library: Callable[[], Any] = _default_load_library,
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
    opener: Callable[[Path], TextIO] = _default_opener,
    tid: int | None = None,
) -> FenceResult:
    """Load the kernel on the X100 cores, register the thread, move it to the A100 cores.

    On a K3 (:func:`detect_k3`): ``load_library()`` first (still on the X100 cores), then the
    thread id (default: the calling thread's native id, which is the pid on the main thread)
    is written as decimal text to ``<root>/set_ai_thread``, then ``setaffinity(0, a100_cores)``
    moves the calling thread. Off a K3: nothing but the log line. One line is logged at INFO
    either way. Only the calling thread moves: threads started before the fence (a torch
    OpenMP pool, the kernel's GEMM threads are started per call and inherit the new affinity)
    stay where they were, so call it before starting long-lived worker threads.

    Args:
        layout: proc root and core sets.
        logger: where the line goes (default: this module's logger).
        load_library, setaffinity, opener: injectable for tests (defaults: the kernel's
            ``load_library``, ``os.sched_setaffinity``, ``open(path, "w")``).
        tid: the id to register (default ``threading.get_native_id()``).

    Raises:
        SetAiThreadMissingError: a K3 without ``<root>/set_ai_thread``.
        SetAiThreadPermissionError: writing it was refused (EACCES/EPERM).
        SetAiThreadWriteError: writing it failed otherwise (e.g. a directory there, EINVAL).
        AffinityError: ``setaffinity`` raised ``OSError``.
        KernelUnavailableError: the kernel library is not built (from ``load_library``).
    """
    log = logger or LOGGER
    found = detect_k3(layout)
    if not found.is_k3:
        message = f"ime2 core fence: not a SpacemiT K3 ({found.reason}); staying on the current cores"
        log.info(message)
        return FenceResult(False, message)
    if not found.has_set_ai_thread:
        raise SetAiThreadMissingError(
            f"this host is a SpacemiT K3 ({found.reason}) but {layout.set_ai_thread} does not exist: the "
            "kernel lacks SpacemiT's AI-core interface, so the process cannot move to the A100 cores "
            f"{sorted(layout.a100_cores)}; boot the vendor kernel that provides it", layout.set_ai_thread)
    load_library()
    ident = threading.get_native_id() if tid is None else int(tid)
    _register(layout, ident, opener)
    cores = layout.a100_cores
    try:
        setaffinity(0, set(cores))
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise AffinityError(
            f"sched_setaffinity(0, {sorted(cores)}) failed after registering thread {ident} in "
            f"{layout.set_ai_thread}: {code} ({exc.strerror or exc}); check that the A100 cores are online "
            "(/sys/devices/system/cpu/online) and not excluded by the cgroup's cpuset") from exc
    message = (f"ime2 core fence: {found.reason}; kernel loaded on the X100 cores, thread {ident} registered "
               f"in {layout.set_ai_thread} and moved to the A100 cores {sorted(cores)}")
    log.info(message)
    return FenceResult(True, message, ident, cores)


_ONCE_LOCK = threading.Lock()
_ONCE_RESULT: FenceResult | None = None


def enter_ai_cores_once(logger: logging.Logger | None = None, **kwargs: Any) -> FenceResult:
    """:func:`enter_ai_cores` the first time it succeeds in this process; later calls return that result.

    A failure is not remembered: the error propagates and the next call tries again.

    Raises:
        The errors of :func:`enter_ai_cores`.
    """
    global _ONCE_RESULT
    with _ONCE_LOCK:
        if _ONCE_RESULT is None:
            _ONCE_RESULT = enter_ai_cores(logger=logger, **kwargs)
        return _ONCE_RESULT


def reset_once_for_tests() -> None:
    """Forget :func:`enter_ai_cores_once`'s result (tests only)."""
    global _ONCE_RESULT
    with _ONCE_LOCK:
        _ONCE_RESULT = None
