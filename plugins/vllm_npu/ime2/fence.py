"""The SpacemiT K3 core fence: the IME2 GEMM's worker threads, and only they, run on the A100 cores.

The K3 has 8 X100 cores (0-7, VLEN 256, the default affinity) and 8 A100 cores (8-15, VLEN 1024,
with the IME2 matrix instructions, not in the default affinity). vLLM's native code (norms, RoPE,
attention, torch) is built for VLEN 256; the IME2 kernel needs VLEN 1024. The seed (004) imports
``vllm._C`` on cores 0-7, writes ``os.getpid()`` to ``/proc/set_ai_thread``, moves the calling
thread to 8-15 (``os.sched_setaffinity(0, ...)`` moves only the calling thread on Linux) and calls
the op from there.

**What the vendor kernel does with ``/proc/set_ai_thread``** (SpacemiT's K3 kernel,
``drivers/soc/spacemit/hmp.c``: ``proc_set_thread_type`` / ``hmp_set_ai_thread``; public copy in
the ``esmil/linux`` tree, commit d02c4f00):

- Each write is one decimal number, looked up as a single task with ``find_vpid`` +
  ``PIDTYPE_PID``: a *thread* id (0 names the writing thread). A process id therefore names only
  the thread-group leader, the main thread; the process's other threads are not touched.
- That thread is marked an AI thread and moved at once to the A100 cores (``set_cpus_allowed_ptr``
  with the AI mask). Afterwards ``sched_setaffinity`` accepts for it only subsets of the A100
  cores, and for an unmarked thread only subsets of the X100 cores (EINVAL otherwise, which is why
  ``taskset -c 8`` fails before the write). There is no way back.
- Threads and processes the marked thread creates afterwards are marked too.
- The kernel warns ("vector has been enabled already") when the thread has used the vector unit
  before: a thread should be registered before it executes any vector instruction.

**Which id is written, and why not the seed's pid.** The kernel wants thread ids. The seed's
``os.getpid()`` is right in the seed's script only because the writer is the main thread (whose
thread id is the pid) and is the thread that then calls the op. In vLLM that thread also runs
every VLEN-256 op between the GEMMs (norms, RoPE, attention), and every thread it starts later
would inherit the mark. Registering it, or writing the pid (the main thread), puts that code on
VLEN-1024 cores: the hazard seed 004 warns about (VLEN-256 vector spills overflow their stack
slots at VLEN 1024; shared reference ``ime2.md`` section 7). So this fence writes the thread ids
of the kernel's GEMM worker threads, one write per worker, and never the pid or the caller's id.

**What the fence does** (:func:`enter_ai_cores`; :func:`enter_ai_cores_once` is the
once-per-process wrapper the ``ime2_q4`` quantization method calls):

1. :func:`detect_k3`. Off a K3: nothing but one log line (the pool stays unpinned).
2. Before the kernel library loads: the calling thread's affinity must not include an A100 core
   (:func:`check_load_affinity`, :class:`LoadOnAiCoresError`). Loading VLEN-256 code while pinned
   to 8-15 aborts (seed 004), and on the vendor kernel such a thread is already marked (e.g. by a
   launcher running ``echo $$ > /proc/set_ai_thread``), so its GEMM workers would be too.
3. ``load_library()`` on the X100 cores.
4. The kernel's worker pool (``kernels/ime2/src/threads.c``) is restarted with one fresh worker
   per A100 core: created by the calling thread, so unmarked, on the X100 cores, idle, having run
   nothing of the library but its scalar wait loop (so no vector instruction of ours).
5. Each worker's thread id is written to ``/proc/set_ai_thread``; the kernel moves it.
6. Worker i is pinned to the i-th A100 core, ascending (8 + i on the SM10): one worker per core,
   :func:`ai_worker_cpus`. From then on each ``npu_ime2_gemm_mt`` call, and the GEMM of the whole
   op (``npu_ime2_hp_gemm_on``), splits the N tiles into at most eight slices, slice i on worker i
   (:func:`plan_slices` is the same split); the calling thread hands them out and sleeps until
   they are done.
7. Checks: each worker's affinity read back (``sched_getaffinity`` of its thread id) is exactly
   its core (:func:`check_split`), and the calling thread's affinity is unchanged.

A failure after step 4 shuts the pool down (no half-fenced worker stays) and raises.

**Which threads end up on the A100 cores:** exactly the pool's workers, one per A100 core. They
run only the kernel's GEMM slices: the IME2 path (built for VLEN 1024) and VLEN-agnostic C and RVV.
The calling thread, vLLM's model runner, never leaves the X100 cores, and the threads it starts
(torch's OpenMP pool, ...) are not marked, so no VLEN-256 code runs on an A100 core. The kernel
paths must therefore be checked on the workers (:func:`worker_path_status`), not on the caller.

**Fork and exit.** A forked child has no workers: the C pool resets itself in the child
(``pthread_atfork``) and this module forgets :func:`enter_ai_cores_once`'s result there
(``os.register_at_fork``), so the child's first ``ime2_q4`` load fences its own new workers.
At exit (or ``dlclose``) the library joins its idle workers.

K3 detection (:func:`detect_k3`), read under the injectable proc root (``/proc`` by default):

1. ``<root>/cpuinfo`` must be readable and list at least one riscv64 hart (an ``isa`` line whose
   value starts with ``rv64``). Otherwise: not a K3 (x86-64 hosts, macOS without ``/proc``...).
2. A SpacemiT K3 marker must be present: a ``uarch`` line naming ``spacemit,x100`` or
   ``spacemit,a100`` (RISC-V Linux prints the cpu node's devicetree ``compatible`` there, and the
   upstream K3 devicetree's cores are ``spacemit,x100``), or ``spacemit,k3`` in
   ``<root>/device-tree/compatible`` (the board's root compatible list), or the vendor kernel's
   ``<root>/set_ai_thread`` itself (which only SpacemiT's AI-core kernels provide).
3. A K3 found by (2) from ``uarch`` or the devicetree without ``<root>/set_ai_thread`` is an
   error (:class:`SetAiThreadMissingError`), not a silent no-op: the IME2 path cannot run then.

Sources for the facts: seed 004 (the recipe, the core numbers, eight A100 cores one per slice);
SpacemiT's K3 kernel ``drivers/soc/spacemit/hmp.c`` (above); opensolvers.github.io
``boards/SM10.md`` (X100 0-7 VLEN 256, A100 8-15 VLEN 1024 with IME2, A100 not in the default
affinity); the public ``k3_ai`` utility's README (the id is written as decimal text; moving a
running process across the two VLENs is unsafe); Linux ``Documentation/arch/riscv/uabi.rst``
(the ``isa``/``hart isa`` lines) and the upstream K3 devicetree (``spacemit,x100`` cores).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

__all__ = [
    "AffinityError",
    "CoreLayout",
    "CpuListError",
    "FenceError",
    "FenceResult",
    "K3Detection",
    "K3_LAYOUT",
    "KernelWorkerPool",
    "LoadOnAiCoresError",
    "MAX_POOL_CPU",
    "MAX_WORKERS",
    "PoolInfo",
    "PoolStartError",
    "PoolState",
    "PoolWorkerInfo",
    "SetAiThreadMissingError",
    "SetAiThreadPermissionError",
    "SetAiThreadWriteError",
    "Slice",
    "SplitError",
    "WorkerPool",
    "WorkerState",
    "ai_worker_cpus",
    "check_load_affinity",
    "check_split",
    "configure_pool",
    "detect_k3",
    "enter_ai_cores",
    "enter_ai_cores_once",
    "plan_slices",
    "pool_state",
    "pool_workers",
    "reset_once_for_tests",
    "unconfigure_pool",
    "validate_cpus",
    "worker_path_status",
]

LOGGER = logging.getLogger(__name__)

#: ``uarch`` values (devicetree cpu compatibles) of the K3's two core types.
K3_UARCH_MARKERS = ("spacemit,x100", "spacemit,a100")
#: The K3's root devicetree compatible.
K3_DT_MARKER = "spacemit,k3"
#: Highest CPU number a worker can be pinned to (``NPU_IME2_POOL_MAX_CPU``: a Linux cpu_set_t).
MAX_POOL_CPU = 1023
#: Most workers a pool (and a GEMM) uses (``NPU_IME2_MAX_THREADS``).
MAX_WORKERS = 256
#: Columns per B tile: the unit the N split works in.
TILE_N = 32


@dataclass(frozen=True)
class CoreLayout:
    """Where the fence looks and which cores it uses.

    Attributes:
        proc_root: the procfs root (``/proc``); tests point it at a fake tree.
        x100_cores: the cores the native code is loaded on and the caller stays on (VLEN 256).
        a100_cores: the cores the GEMM workers are pinned to, one worker each (VLEN 1024, IME2).
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


# ---------------------------------------------------------------------------------------------
# errors


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
    """Any other failure to write a worker's thread id to ``<root>/set_ai_thread``."""


class AffinityError(FenceError):
    """Pinning a worker to its core failed, or an affinity read back is not the one planned."""


class LoadOnAiCoresError(FenceError):
    """The calling thread may already run on an A100 core when the kernel library would load.

    Attributes:
        affinity: the calling thread's CPUs found.
    """

    def __init__(self, message: str, affinity: frozenset[int]) -> None:
        super().__init__(message)
        self.affinity = affinity


class PoolStartError(FenceError):
    """The kernel could not start the worker threads asked for (``pthread_create`` failed)."""


class CpuListError(FenceError, ValueError):
    """A CPU list for the worker pool breaks a rule (empty, too long, not an integer, out of
    0..``MAX_POOL_CPU``, or a repeat)."""


class SplitError(FenceError, ValueError):
    """A bad N or thread count for :func:`plan_slices`."""


# ---------------------------------------------------------------------------------------------
# K3 detection


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


# ---------------------------------------------------------------------------------------------
# planning: which worker pins to which CPU, and how the N tiles split (pure functions)


@dataclass(frozen=True)
class Slice:
    """One slice of a GEMM's N split: worker ``index`` on ``cpu`` computes columns
    ``[col_start, col_stop)``, i.e. B tiles ``[tile_start, tile_stop)`` (32 columns each; only the
    last slice can end in a partial tile)."""

    index: int
    cpu: int
    tile_start: int
    tile_stop: int
    col_start: int
    col_stop: int

    @property
    def tiles(self) -> int:
        return self.tile_stop - self.tile_start

    @property
    def cols(self) -> int:
        return self.col_stop - self.col_start


def _cpu_number(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise CpuListError(f"{name}={value!r} is not a CPU number (an integer 0..{MAX_POOL_CPU}, not a bool)")
    try:
        cpu = operator.index(value)
    except TypeError:
        raise CpuListError(f"{name}={value!r} is not a CPU number (an integer 0..{MAX_POOL_CPU})") from None
    if not 0 <= cpu <= MAX_POOL_CPU:
        raise CpuListError(f"{name}={cpu} is outside 0..{MAX_POOL_CPU}, the CPU numbers a Linux cpu_set_t holds")
    return cpu


def validate_cpus(cpus: Iterable[int], what: str = "cpus") -> tuple[int, ...]:
    """The CPU list of a worker pool, checked: worker i is pinned to ``cpus[i]``.

    Rules: 1..``MAX_WORKERS`` entries, each an integer CPU number 0..``MAX_POOL_CPU``, no repeats
    (one worker per CPU). Order is kept.

    Raises:
        CpuListError: a rule is broken; the message names the offending entry and the rule.
    """
    if isinstance(cpus, (str, bytes)):
        raise CpuListError(f"{what}={cpus!r} must be a sequence of CPU numbers, not a string")
    try:
        items = list(cpus)
    except TypeError:
        raise CpuListError(f"{what}={cpus!r} must be a sequence of CPU numbers") from None
    if not items:
        raise CpuListError(f"{what} is empty: the pool needs at least one CPU (one worker per CPU)")
    if len(items) > MAX_WORKERS:
        raise CpuListError(f"{what} names {len(items)} CPUs; a pool has at most {MAX_WORKERS} workers, one per CPU")
    seen: dict[int, int] = {}
    for i, value in enumerate(items):
        cpu = _cpu_number(value, f"{what}[{i}]")
        if cpu in seen:
            raise CpuListError(f"{what}[{i}]={cpu} repeats {what}[{seen[cpu]}]: one worker per CPU")
        seen[cpu] = i
    return tuple(seen)


def ai_worker_cpus(layout: CoreLayout = K3_LAYOUT) -> tuple[int, ...]:
    """The CPUs the fenced workers are pinned to: one worker per A100 core, ascending (worker i on
    the i-th A100 core: ``(8, 9, ..., 15)`` on the SM10).

    Raises:
        CpuListError: ``layout.a100_cores`` breaks :func:`validate_cpus`'s rules.
    """
    return validate_cpus(sorted(layout.a100_cores), what="CoreLayout.a100_cores")


def _positive(value: Any, name: str, rule: str, limit: int | None = None) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise SplitError(f"{name}={value!r} must be an integer ({rule})") from None
    if isinstance(value, bool) or number < 1 or (limit is not None and number > limit):
        raise SplitError(f"{name}={value!r} breaks the rule: {rule}")
    return number


def plan_slices(n: int, cpus: Sequence[int], threads: int | None = None) -> tuple[Slice, ...]:
    """The N split ``npu_ime2_gemm_mt`` makes on a pool configured with ``cpus`` (threads.c).

    ``tiles = ceil(N / 32)``, ``T = min(threads, len(cpus), tiles)``; slice i (worker i, on
    ``cpus[i]``) gets tiles ``[i * tiles // T, (i + 1) * tiles // T)``. With the eight A100 cores
    and ``N >= 256`` that is eight slices, one per core 8..15.

    Args:
        n: output columns N (>= 1).
        cpus: the pool's CPUs, worker i on ``cpus[i]`` (:func:`validate_cpus` rules).
        threads: the GEMM's ``threads`` argument (1..256; None: ``len(cpus)``).

    Raises:
        SplitError: ``n`` < 1, or ``threads`` outside 1..256.
        CpuListError: a bad CPU list.
    """
    cpus = validate_cpus(cpus)
    n = _positive(n, "n", "N, the GEMM's output columns, must be >= 1")
    t = len(cpus) if threads is None else _positive(threads, "threads", f"1 <= threads <= {MAX_WORKERS}", MAX_WORKERS)
    tiles = -(-n // TILE_N)
    t = min(t, len(cpus), tiles)
    slices = []
    for i in range(t):
        t0, t1 = tiles * i // t, tiles * (i + 1) // t
        slices.append(Slice(i, cpus[i], t0, t1, t0 * TILE_N, min(t1 * TILE_N, n)))
    return tuple(slices)


def check_load_affinity(affinity: Iterable[int], layout: CoreLayout = K3_LAYOUT) -> frozenset[int]:
    """The calling thread's CPUs, checked to hold no A100 core (the rule of step 2, module docstring).

    On the vendor kernel an unmarked thread's CPUs are always within the X100 cores and a marked
    thread's within the A100 cores, so "includes an A100 core" is "pinned to 8-15 only" there;
    other kernels are held to the same rule.

    Raises:
        LoadOnAiCoresError: ``affinity`` includes an A100 core; names the affinity and the rule.
    """
    cpus = frozenset(int(c) for c in affinity)
    on_ai = cpus & layout.a100_cores
    if not on_ai:
        return cpus
    if cpus <= layout.a100_cores:
        found = f"is pinned to A100 cores only (affinity {sorted(cpus)})"
    else:
        found = f"may run on the A100 cores {sorted(on_ai)} (affinity {sorted(cpus)})"
    raise LoadOnAiCoresError(
        f"ime2 core fence: the calling thread {found}, but the IME2 kernel library must be loaded on the "
        f"X100 cores {sorted(layout.x100_cores)} only: loading VLEN-256 code while pinned to the A100 cores "
        f"{sorted(layout.a100_cores)} aborts (seed 004), and a thread already registered in "
        f"{layout.set_ai_thread} would pass that to every thread it starts. Start the process on the default "
        "affinity (do not launch it with `echo $$ > /proc/set_ai_thread` or `taskset -c 8-15`): the fence "
        "itself puts only the GEMM's worker threads on the A100 cores", cpus)


# ---------------------------------------------------------------------------------------------
# the kernel's worker pool


class PoolInfo(ctypes.Structure):
    """``npu_ime2_pool_info`` (npu_ime2.h, "thread pinning (issue 15)")."""

    _fields_ = [("size", ctypes.c_int32), ("configured", ctypes.c_int32), ("created", ctypes.c_int64)]


class PoolWorkerInfo(ctypes.Structure):
    """``npu_ime2_pool_worker_info``."""

    _fields_ = [("tid", ctypes.c_int64), ("cpu", ctypes.c_int32), ("last_cpu", ctypes.c_int32),
                ("last_vlenb", ctypes.c_int32), ("reserved", ctypes.c_int32), ("slices", ctypes.c_int64)]


@dataclass(frozen=True)
class PoolState:
    """The pool's counters.

    Attributes:
        size: workers alive.
        configured: 0, or the number of pinned workers every GEMM runs on.
        created: worker threads created in this process (since it started, or since fork).
    """

    size: int
    configured: int
    created: int


@dataclass(frozen=True)
class WorkerState:
    """One worker of the pool.

    Attributes:
        index: its slice number (worker i computes slice i).
        tid: its kernel thread id (what is written to ``/proc/set_ai_thread``).
        cpu: the CPU it is pinned to (None: not pinned).
        affinity: its CPUs read back from the kernel (``sched_getaffinity(tid)``; empty if unreadable).
        last_cpu: the CPU its last slice ended on (None before the first).
        last_vlenb: the vlenb it read after its last slice (bytes; 0 without RVV; None before).
        slices: slices it has run.
    """

    index: int
    tid: int
    cpu: int | None
    affinity: frozenset[int]
    last_cpu: int | None
    last_vlenb: int | None
    slices: int


class WorkerPool(Protocol):
    """What :func:`enter_ai_cores` needs from a worker pool (tests inject fakes)."""

    def restart(self, n: int) -> tuple[int, ...]:
        """Stop every worker, start ``n`` fresh idle unpinned ones; their thread ids, in order."""

    def pin(self, cpus: Sequence[int]) -> tuple[WorkerState, ...]:
        """Pin worker i to ``cpus[i]`` (GEMMs then run on those workers only); the workers' states."""

    def shutdown(self) -> None:
        """Stop every worker (the pool becomes empty and unconfigured)."""


def _errname(code: int) -> str:
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


def _thread_affinity(tid: int) -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except (AttributeError, OSError):
        return frozenset()


class KernelWorkerPool:
    """The kernel library's worker pool (``npu_ime2_pool_*``), as :class:`WorkerPool`.

    Args:
        lib: the loaded kernel library (default: ``kernel.load_library()``).
        affinity_of: reads a thread's CPUs by thread id (default ``os.sched_getaffinity``).

    Raises:
        KernelUnavailableError: the library is not built, or predates the pool API (rebuild it).
    """

    def __init__(self, lib: Any | None = None, *,
                 affinity_of: Callable[[int], frozenset[int]] = _thread_affinity) -> None:
        from vllm_npu.ime2 import kernel

        self._lib = kernel.load_library() if lib is None else lib
        self._affinity_of = affinity_of
        if not hasattr(self._lib, "npu_ime2_pool_configure"):
            raise kernel.KernelUnavailableError(
                f"the IME2 kernel library {kernel.LIBRARY_PATH} has no worker pool (npu_ime2_pool_configure); "
                f"rebuild it with: {kernel.BUILD_COMMAND}")

    def state(self) -> PoolState:
        """The pool's counters (size, configured workers, threads created)."""
        info = PoolInfo()
        self._lib.npu_ime2_pool_get_info(ctypes.addressof(info))
        return PoolState(int(info.size), int(info.configured), int(info.created))

    def workers(self) -> tuple[WorkerState, ...]:
        """Every live worker, in slice order, its affinity read back from the kernel."""
        out = []
        for i in range(self.state().size):
            info = PoolWorkerInfo()
            if self._lib.npu_ime2_pool_get_worker(i, ctypes.addressof(info)) != 0:
                break  # stopped meanwhile
            tid = int(info.tid)
            out.append(WorkerState(i, tid, None if info.cpu < 0 else int(info.cpu),
                                   self._affinity_of(tid) if tid > 0 else frozenset(),
                                   None if info.last_cpu < 0 else int(info.last_cpu),
                                   None if info.last_vlenb < 0 else int(info.last_vlenb), int(info.slices)))
        return tuple(out)

    def start(self, n: int) -> tuple[int, ...]:
        """Make sure at least ``n`` (1..256) workers exist; the thread ids of workers 0..n-1.

        Raises:
            SplitError: ``n`` outside 1..256. PoolStartError: a thread could not be created.
        """
        n = _positive(n, "n", f"a pool has 1..{MAX_WORKERS} workers", MAX_WORKERS)
        err = int(self._lib.npu_ime2_pool_start(n))
        if err:
            raise PoolStartError(f"cannot start {n} GEMM worker threads: pthread_create failed with {_errname(err)}; "
                                 f"{self.state().size} are running (check ulimit -u and the memory limit)")
        return tuple(w.tid for w in self.workers()[:n])

    def restart(self, n: int) -> tuple[int, ...]:
        """:meth:`shutdown`, then :meth:`start` ``n`` fresh workers (never used, unpinned).

        Raises:
            SplitError, PoolStartError: as :meth:`start`.
        """
        self.shutdown()
        return self.start(n)

    def pin(self, cpus: Sequence[int]) -> tuple[WorkerState, ...]:
        """Pin worker i to ``cpus[i]`` (creating workers as needed); every later GEMM runs on
        workers ``0..len(cpus)-1`` only. On a K3 an A100 core accepts only a registered worker.

        Raises:
            CpuListError: a bad CPU list (:func:`validate_cpus`).
            PoolStartError: a thread could not be created.
            AffinityError: the kernel refused a pin (offline CPU, not allowed to the thread).
        """
        cpus = validate_cpus(cpus)
        arr = (ctypes.c_int * len(cpus))(*cpus)
        bad = ctypes.c_int(-1)
        err = int(self._lib.npu_ime2_pool_configure(ctypes.addressof(arr), len(cpus), ctypes.byref(bad)))
        if err:
            self._raise_pin_error(err, int(bad.value), cpus)
        return self.workers()[: len(cpus)]

    def _raise_pin_error(self, err: int, index: int, cpus: tuple[int, ...]) -> None:
        if err in (errno.EAGAIN, errno.ENOMEM) or index >= len(cpus):
            raise PoolStartError(f"cannot start {len(cpus)} GEMM worker threads to pin to CPUs {list(cpus)}: "
                                 f"{_errname(err)}")
        if index < 0:
            raise CpuListError(f"npu_ime2_pool_configure refused the CPU list {list(cpus)}: {_errname(err)}")
        workers = self.workers()
        tid = workers[index].tid if index < len(workers) else "?"
        raise AffinityError(
            f"cannot pin GEMM worker {index} (thread {tid}) to CPU {cpus[index]}: pthread_setaffinity_np failed with "
            f"{_errname(err)}; the CPU must be online (/sys/devices/system/cpu/online), inside the cgroup's cpuset, "
            "and allowed to the thread (on a K3 an A100 core only after the thread id was written to "
            "/proc/set_ai_thread)")

    def unpin(self) -> None:
        """Unconfigure: the workers are stopped; later GEMMs start fresh unpinned ones."""
        self._lib.npu_ime2_pool_configure(None, 0, None)

    def shutdown(self) -> None:
        """Stop and join every worker."""
        self._lib.npu_ime2_pool_shutdown()


def check_split(workers: Sequence[WorkerState], cpus: Sequence[int]) -> tuple[WorkerState, ...]:
    """Worker i must be pinned to ``cpus[i]`` with exactly that CPU read back: one worker per core.

    Raises:
        AffinityError: a worker is missing, pinned elsewhere, or its read-back affinity differs.
    """
    cpus = validate_cpus(cpus)
    if len(workers) < len(cpus):
        raise AffinityError(f"the pool has {len(workers)} workers, {len(cpus)} planned (one per CPU of {list(cpus)})")
    for w, cpu in zip(workers, cpus):
        if w.cpu != cpu or w.affinity != frozenset({cpu}):
            raise AffinityError(
                f"GEMM worker {w.index} (thread {w.tid}) should run on CPU {cpu} only, but is pinned to {w.cpu} with "
                f"affinity {sorted(w.affinity)} read back; the split needs one worker per core of {list(cpus)}")
    return tuple(workers[: len(cpus)])


def pool_state() -> PoolState:
    """The kernel pool's counters (loads the library).

    Raises:
        KernelUnavailableError: the library is missing or predates the pool API.
    """
    return KernelWorkerPool().state()


def pool_workers() -> tuple[WorkerState, ...]:
    """The kernel pool's workers with their affinities read back (loads the library).

    Raises:
        KernelUnavailableError: the library is missing or predates the pool API.
    """
    return KernelWorkerPool().workers()


def configure_pool(cpus: Iterable[int]) -> tuple[WorkerState, ...]:
    """Pin the GEMM workers one per CPU on any host (worker i on ``cpus[i]``), checked by
    :func:`check_split`. On a K3 use :func:`enter_ai_cores` instead: A100 cores take only
    registered workers.

    Raises:
        CpuListError: a bad CPU list. PoolStartError: threads could not be created.
        AffinityError: a pin was refused or does not read back. KernelUnavailableError: no library.
    """
    cpus = validate_cpus(cpus)
    return check_split(KernelWorkerPool().pin(cpus), cpus)


def unconfigure_pool() -> None:
    """Back to an unconfigured pool (workers stopped; later GEMMs start unpinned ones).

    Raises:
        KernelUnavailableError: the library is missing or predates the pool API.
    """
    KernelWorkerPool().unpin()


def worker_path_status(path: int, lib: Any | None = None) -> tuple[int, WorkerState | None]:
    """Whether the C path ``path`` (a ``kernel.PATHS`` value) can run where the GEMM runs: the
    status of ``npu_ime2_gemm_mt`` on an empty C, which a configured pool has worker 0 check on
    its own core (an unconfigured pool: the calling thread), and worker 0's state after it.

    Raises:
        KernelUnavailableError: the library is missing or predates the pool API.
    """
    pool = KernelWorkerPool(lib)
    a = (ctypes.c_uint8 * 1)()
    b = (ctypes.c_uint8 * 4608)()
    c = (ctypes.c_float * 1)()
    st = int(pool._lib.npu_ime2_gemm_mt(ctypes.addressof(a), 0, ctypes.addressof(b), len(b), 0, 32, 32,
                                        ctypes.addressof(c), 0, int(path), 1))
    workers = pool.workers() if pool.state().configured else ()
    return st, (workers[0] if workers else None)


# ---------------------------------------------------------------------------------------------
# the fence


@dataclass(frozen=True)
class FenceResult:
    """What :func:`enter_ai_cores` did.

    Attributes:
        moved: the GEMM's worker threads were registered and pinned to the A100 cores.
        message: the one line that was logged.
        registered: the ids written to ``set_ai_thread``, in order: the workers' thread ids
            (never the pid, never the calling thread's id).
        workers: the pinned workers, worker i on the i-th A100 core (empty when not moved).
        cores: the A100 cores the workers are pinned to (empty when not moved).
        caller_affinity: the calling thread's CPUs, the same before and after the fence.
    """

    moved: bool
    message: str
    registered: tuple[int, ...] = ()
    workers: tuple[WorkerState, ...] = ()
    cores: frozenset[int] = frozenset()
    caller_affinity: frozenset[int] = frozenset()

    def plan(self, n: int, threads: int | None = None) -> tuple[Slice, ...]:
        """The split of an N-column GEMM over the fenced workers (:func:`plan_slices`).

        Raises:
            SplitError: bad ``n``/``threads``, or the fence did not move (no workers to split over).
        """
        if not self.workers:
            raise SplitError(f"no fenced workers to split N={n} over: {self.message}")
        return plan_slices(n, [w.cpu for w in self.workers], threads)


def _default_opener(path: Path) -> TextIO:
    return open(path, "w", encoding="ascii")  # noqa: SIM115 - closed by the caller's with


def _default_load_library() -> Any:
    from vllm_npu.ime2.kernel import load_library

    return load_library()


def _default_pool(lib: Any) -> WorkerPool:
    return KernelWorkerPool(lib)


def _calling_thread_affinity() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def _register(layout: CoreLayout, tid: int, opener: Callable[[Path], TextIO]) -> None:
    """Write one worker's thread id to ``set_ai_thread`` (one id per write, as the kernel parses it)."""
    path = layout.set_ai_thread
    what = f"GEMM worker thread {tid}"
    try:
        with opener(path) as handle:
            handle.write(str(tid))
    except FileNotFoundError as exc:
        raise SetAiThreadMissingError(
            f"{path} disappeared while registering {what} ({exc.strerror}); the running kernel must provide "
            "SpacemiT's AI-core interface", path) from exc
    except PermissionError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise SetAiThreadPermissionError(
            f"cannot write {what} to {path}: {code} ({exc.strerror or exc}); run the server as a user allowed to "
            f"write {path} (root, or grant write access to it at boot)", path) from exc
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise SetAiThreadWriteError(
            f"cannot write {what} to {path}: {code} ({exc.strerror or exc}); check that {path} is SpacemiT's "
            "set_ai_thread interface (a writable file) and that the thread exists", path) from exc


def _check_caller_stayed(before: frozenset[int], after: Iterable[int]) -> None:
    now = frozenset(after)
    if now != before:
        raise AffinityError(f"the calling thread's CPUs changed during the fence, from {sorted(before)} to "
                            f"{sorted(now)}; it must stay where it was (only the GEMM workers move)")


def _fence_workers(layout: CoreLayout, pool: WorkerPool, cpus: tuple[int, ...],
                   opener: Callable[[Path], TextIO]) -> tuple[tuple[int, ...], tuple[WorkerState, ...]]:
    """Steps 4-6 and the split check; the pool is shut down on any failure."""
    try:
        tids = tuple(pool.restart(len(cpus)))
        if len(tids) != len(cpus):
            raise PoolStartError(f"the pool started {len(tids)} workers, {len(cpus)} asked for")
        for tid in tids:
            _register(layout, tid, opener)
        return tids, check_split(pool.pin(cpus), cpus)
    except BaseException:
        pool.shutdown()
        raise


def enter_ai_cores(
    layout: CoreLayout = K3_LAYOUT,
    *,
    logger: logging.Logger | None = None,
    load_library: Callable[[], Any] = _default_load_library,
    pool_factory: Callable[[Any], WorkerPool] = _default_pool,
    opener: Callable[[Path], TextIO] = _default_opener,
    getaffinity: Callable[[], Iterable[int]] = _calling_thread_affinity,
) -> FenceResult:
    """Fence the IME2 GEMM's worker threads onto the A100 cores, one per core; the caller stays.

    On a K3 (:func:`detect_k3`), in this order (module docstring): the calling thread's affinity
    is checked to hold no A100 core, ``load_library()`` runs (still on the X100 cores), the pool
    is restarted with one fresh worker per A100 core (:func:`ai_worker_cpus`), each worker's
    thread id is written to ``<root>/set_ai_thread``, worker i is pinned to the i-th A100 core,
    and the pins are read back. Off a K3: nothing but the log line. One line is logged at INFO.

    Args:
        layout: proc root and core sets.
        logger: where the line goes (default: this module's logger).
        load_library: loads the kernel (default ``kernel.load_library``); its result goes to
            ``pool_factory``.
        pool_factory: the worker pool for a loaded library (default :class:`KernelWorkerPool`).
        opener: opens ``set_ai_thread`` for one write (default ``open(path, "w")``).
        getaffinity: the calling thread's CPUs (default ``os.sched_getaffinity(0)``).

    Raises:
        SetAiThreadMissingError: a K3 without ``<root>/set_ai_thread``.
        LoadOnAiCoresError: the calling thread may run on an A100 core (before anything loads).
        KernelUnavailableError: the kernel library is not built (from ``load_library``) or has
            no worker pool.
        PoolStartError: the worker threads could not be created.
        SetAiThreadPermissionError: writing a thread id was refused (EACCES/EPERM).
        SetAiThreadWriteError: writing it failed otherwise (e.g. a directory there, EINVAL, ESRCH).
        AffinityError: a pin failed or reads back wrong, or the caller's CPUs changed.
        CpuListError: ``layout.a100_cores`` holds a CPU number a pool cannot pin to.
    """
    log = logger or LOGGER
    found = detect_k3(layout)
    if not found.is_k3:
        message = f"ime2 core fence: not a SpacemiT K3 ({found.reason}); GEMM workers stay unpinned"
        log.info(message)
        return FenceResult(False, message)
    if not found.has_set_ai_thread:
        raise SetAiThreadMissingError(
            f"this host is a SpacemiT K3 ({found.reason}) but {layout.set_ai_thread} does not exist: the "
            "kernel lacks SpacemiT's AI-core interface, so no thread can run on the A100 cores "
            f"{sorted(layout.a100_cores)}; boot the vendor kernel that provides it", layout.set_ai_thread)
    caller = check_load_affinity(getaffinity(), layout)
    cpus = ai_worker_cpus(layout)
    pool = pool_factory(load_library())
    tids, workers = _fence_workers(layout, pool, cpus, opener)
    try:
        _check_caller_stayed(caller, getaffinity())
    except AffinityError:
        pool.shutdown()
        raise
    message = (f"ime2 core fence: {found.reason}; kernel loaded on the X100 cores, {len(tids)} GEMM worker "
               f"threads {list(tids)} registered in {layout.set_ai_thread} and pinned one per A100 core "
               f"{list(cpus)}; the calling thread stays on {sorted(caller)}")
    log.info(message)
    return FenceResult(True, message, tids, workers, frozenset(cpus), caller)


_ONCE_LOCK = threading.Lock()
_ONCE_RESULT: FenceResult | None = None


def enter_ai_cores_once(logger: logging.Logger | None = None, **kwargs: Any) -> FenceResult:
    """:func:`enter_ai_cores` the first time it succeeds in this process; later calls return that
    result. A failure is not remembered: the error propagates and the next call tries again. A
    forked child starts afresh (its pool has no workers).

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


def _forget_in_child() -> None:
    """After fork, in the child: the parent's fence result names workers the child does not have."""
    global _ONCE_LOCK, _ONCE_RESULT
    _ONCE_LOCK = threading.Lock()  # another thread may have held it at the fork
    _ONCE_RESULT = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
