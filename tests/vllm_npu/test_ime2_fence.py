"""The K3 core fence (vllm_npu.ime2.fence) against fake /proc trees in tmp_path.

The fence registers and pins the IME2 GEMM's worker threads only (one per A100 core); the calling
thread stays on the X100 cores. Unit tests inject a fake pool; the last test drives the kernel's
real pool in a child process, with fake core sets that exist on this host.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vllm_npu.ime2 import fence

X86_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some x86 CPU\nflags\t\t: fpu sse2\n"
X100 = frozenset(range(8))
A100 = tuple(range(8, 16))


def k3_cpuinfo(uarch: str | None = "spacemit,x100") -> str:
    blocks = []
    for cpu in range(16):
        isa = "rv64imafdcvh_zicbop_zvfh" if cpu < 8 else "rv64imafdcv_zicbop_zvfh"
        lines = [f"processor\t: {cpu}", f"hart\t\t: {cpu}", f"isa\t\t: {isa}", "mmu\t\t: sv39"]
        if uarch:
            lines.append(f"uarch\t\t: {uarch if cpu < 8 else uarch.replace('x100', 'a100')}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def make_tree(root: Path, cpuinfo: str, *, set_ai_thread: bool = True, dt: str | None = None) -> fence.CoreLayout:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpuinfo").write_text(cpuinfo)
    if set_ai_thread:
        (root / "set_ai_thread").write_text("")
    if dt is not None:
        (root / "device-tree").mkdir()
        (root / "device-tree" / "compatible").write_bytes(dt.encode())
    return fence.CoreLayout(proc_root=root)


class Recorder:
    """A file opened for one write: records what was written, then writes it to the real file."""

    def __init__(self, calls: Calls, path: Path) -> None:
        self.calls, self.path, self.text = calls, path, ""

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.calls.events.append(("write", self.text))
        self.path.write_text(self.text)

    def write(self, text: str) -> int:
        self.text += text
        return len(text)


class FakePool:
    """A worker pool whose workers are thread ids 50000 + i; pins read back as asked unless told."""

    def __init__(self, calls: Calls, *, pin_error: Exception | None = None,
                 readback: dict[int, frozenset[int]] | None = None) -> None:
        self.calls, self.pin_error, self.readback = calls, pin_error, readback or {}
        self.tids: tuple[int, ...] = ()
        self.configured = 0

    def restart(self, n: int) -> tuple[int, ...]:
        self.calls.events.append(("restart", n))
        self.tids = tuple(50000 + i for i in range(n))
        return self.tids

    def pin(self, cpus):
        self.calls.events.append(("pin", tuple(cpus)))
        if self.pin_error is not None:
            raise self.pin_error
        self.configured = len(cpus)
        return tuple(fence.WorkerState(i, tid, cpu, self.readback.get(i, frozenset({cpu})), None, None, 0)
                     for i, (tid, cpu) in enumerate(zip(self.tids, cpus)))

    def shutdown(self) -> None:
        self.calls.events.append(("shutdown",))
        self.tids, self.configured = (), 0

    def state(self) -> fence.PoolState:
        """The counters, as ``fence.pool_state()`` reports the kernel's (size, configured, created)."""
        return fence.PoolState(len(self.tids), self.configured, len(self.tids))


class Calls:
    """Records the order of the injected steps."""

    def __init__(self, affinity: frozenset[int] = X100, **pool_kw) -> None:
        self.events: list[tuple] = []
        self.affinity = [affinity]
        self.pool = FakePool(self, **pool_kw)

    def load(self) -> object:
        self.events.append(("load",))
        return object()

    def pool_factory(self, lib: object) -> FakePool:
        return self.pool

    def getaffinity(self) -> frozenset[int]:
        return self.affinity[0] if len(self.affinity) == 1 else self.affinity.pop(0)

    def opener(self, path: Path):
        self.events.append(("open", path))
        return Recorder(self, path)

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]

    def writes(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "write"]


def run(layout: fence.CoreLayout, calls: Calls, **kw) -> fence.FenceResult:
    return fence.enter_ai_cores(layout, load_library=calls.load, pool_factory=calls.pool_factory,
                                opener=kw.pop("opener", calls.opener), getaffinity=calls.getaffinity, **kw)


def test_layout_defaults_and_validation(tmp_path):
    lay = fence.CoreLayout()
    assert lay.proc_root == Path("/proc")
    assert lay.x100_cores == frozenset(range(8)) and lay.a100_cores == frozenset(range(8, 16))
    with pytest.raises(ValueError, match="overlap"):
        fence.CoreLayout(x100_cores=range(0, 9), a100_cores=range(8, 16))
    with pytest.raises(ValueError, match="at least one"):
        fence.CoreLayout(a100_cores=())
    with pytest.raises(AttributeError):
        lay.proc_root = tmp_path  # frozen


@pytest.mark.parametrize(
    "cpuinfo, set_ai, dt, expected",
    [
        (X86_CPUINFO, False, None, False),
        (X86_CPUINFO, True, None, False),  # not riscv64: set_ai_thread alone does not make a K3
        (k3_cpuinfo(uarch="sifive,u74-mc"), False, None, False),  # another riscv64 board
        (k3_cpuinfo(), True, None, True),
        (k3_cpuinfo(), False, None, True),  # a K3 without the interface (an error at enter time)
        (k3_cpuinfo(uarch=None), False, "bananapi,sm10\0spacemit,k3\0", True),
        (k3_cpuinfo(uarch=None), False, "spacemit,k1\0", False),
        (k3_cpuinfo(uarch=None), True, None, True),
    ],
)
def test_detect_k3_rule(tmp_path, cpuinfo, set_ai, dt, expected):
    layout = make_tree(tmp_path / "proc", cpuinfo, set_ai_thread=set_ai, dt=dt)
    got = fence.detect_k3(layout)
    assert got.is_k3 is expected, got.reason
    assert got.has_set_ai_thread is set_ai
    assert str(layout.proc_root) in got.reason


def test_detect_without_cpuinfo_is_not_k3(tmp_path):
    got = fence.detect_k3(fence.CoreLayout(proc_root=tmp_path / "nothing"))
    assert not got.is_k3 and "not readable" in got.reason


def test_non_k3_is_a_noop_with_one_log_line(tmp_path, caplog):
    layout = make_tree(tmp_path / "proc", X86_CPUINFO, set_ai_thread=False)
    calls = Calls()
    with caplog.at_level(logging.INFO, logger=fence.LOGGER.name):
        res = run(layout, calls)
    assert res.moved is False and res.registered == () and res.workers == () and res.cores == frozenset()
    assert calls.events == []  # nothing loaded, started, written or pinned
    lines = [r.getMessage() for r in caplog.records if r.name == fence.LOGGER.name]
    assert lines == [res.message]
    assert "not a SpacemiT K3" in res.message and "\n" not in res.message


def test_k3_fences_only_the_worker_threads(tmp_path, caplog):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()
    logger = logging.getLogger("test.fence.happy")
    with caplog.at_level(logging.INFO, logger=logger.name):
        res = run(layout, calls, logger=logger)
    # load on the X100 cores, fresh workers, one registration per worker, then one worker per core
    assert calls.kinds() == ["load", "restart"] + ["open", "write"] * 8 + ["pin"]
    assert calls.events[1] == ("restart", 8) and calls.events[-1] == ("pin", A100)
    assert res.moved and res.registered == calls.pool.tids and res.cores == frozenset(A100)
    assert [(w.index, w.tid, w.cpu, w.affinity) for w in res.workers] == [
        (i, 50000 + i, 8 + i, frozenset({8 + i})) for i in range(8)]
    assert res.caller_affinity == X100  # the calling thread stays on the X100 cores
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [res.message]
    assert "the calling thread stays on [0, 1, 2, 3, 4, 5, 6, 7]" in res.message


def test_what_is_written_is_each_worker_thread_id_never_the_pid(tmp_path):
    """The vendor kernel reads one thread id per write (find_vpid + PIDTYPE_PID): the workers'
    ids, each alone; not the pid (the main thread) and not the calling thread's id."""
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()
    res = run(layout, calls)
    assert calls.writes() == [str(t) for t in res.registered] == [str(50000 + i) for i in range(8)]
    assert str(os.getpid()) not in calls.writes() and str(threading.get_native_id()) not in calls.writes()
    assert all(path == layout.set_ai_thread for kind, *rest in calls.events if kind == "open" for path in rest)
    assert layout.set_ai_thread.read_text() == "50007"  # the last write


def test_default_threads_is_the_fenced_pool_not_the_callers_cores(tmp_path, monkeypatch):
    """vLLM may bind its worker to seven X100 cores; after the fence every GEMM runs on the eight
    pinned workers, so the layers split N into eight slices (linear.default_threads), not seven.
    NPU_HARNESS_IME2_THREADS still overrides; a failed fence leaves the caller's count."""
    from vllm_npu.ime2 import linear

    monkeypatch.delenv(linear.THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(1, 8)))  # seven X100 cores
    calls = Calls(frozenset(range(1, 8)))
    assert linear.default_threads(pool_state=calls.pool.state) == 7  # unconfigured: the caller's cores
    res = run(make_tree(tmp_path / "proc", k3_cpuinfo()), calls)
    assert res.moved and calls.pool.state().configured == 8
    assert linear.default_threads(pool_state=calls.pool.state) == 8 == len(res.plan(5632))
    monkeypatch.setenv(linear.THREADS_ENV, "3")
    assert linear.default_threads(pool_state=calls.pool.state) == 3
    monkeypatch.delenv(linear.THREADS_ENV)
    bad = Calls(frozenset(range(1, 8)), pin_error=fence.AffinityError("EINVAL"))
    with pytest.raises(fence.AffinityError):
        run(make_tree(tmp_path / "proc2", k3_cpuinfo()), bad)
    assert linear.default_threads(pool_state=bad.pool.state) == 7  # the pool was shut down


def test_the_split_is_eight_slices_one_per_a100_core(tmp_path):
    res = run(make_tree(tmp_path / "proc", k3_cpuinfo()), Calls())
    plan = res.plan(5632)  # TinyLlama's feed-forward N: 176 tiles
    assert [s.cpu for s in plan] == list(A100) and [s.index for s in plan] == list(range(8))
    assert [s.tiles for s in plan] == [22] * 8
    assert [(s.col_start, s.col_stop) for s in plan] == [(704 * i, 704 * (i + 1)) for i in range(8)]
    assert [s.cpu for s in res.plan(5632, threads=4)] == [8, 9, 10, 11]
    with pytest.raises(fence.SplitError, match="no fenced workers"):
        fence.FenceResult(False, "not a K3").plan(5632)


@pytest.mark.parametrize("affinity, says", [
    (frozenset(range(8, 16)), "is pinned to A100 cores only (affinity [8, 9, 10, 11, 12, 13, 14, 15])"),
    (frozenset({12}), "is pinned to A100 cores only (affinity [12])"),
    (frozenset(range(16)), "may run on the A100 cores [8, 9, 10, 11, 12, 13, 14, 15] (affinity [0, 1,"),
])
def test_refuses_when_the_caller_is_already_on_a100_cores(tmp_path, affinity, says):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls(affinity)
    with pytest.raises(fence.LoadOnAiCoresError) as info:
        run(layout, calls)
    msg = str(info.value)
    assert says in msg and info.value.affinity == affinity
    assert "X100 cores [0, 1, 2, 3, 4, 5, 6, 7] only" in msg and "aborts (seed 004)" in msg
    assert calls.events == []  # refused before the kernel library loads


@pytest.mark.parametrize("affinity", [X100, frozenset({3}), frozenset({0, 7})])
def test_x100_affinities_pass_the_load_check(affinity):
    assert fence.check_load_affinity(affinity) == affinity


def test_custom_core_sets_are_used(tmp_path):
    root = tmp_path / "proc"
    make_tree(root, k3_cpuinfo())
    layout = fence.CoreLayout(proc_root=root, x100_cores={0, 1}, a100_cores={3, 2})
    calls = Calls(frozenset({0, 1}))
    res = run(layout, calls)
    assert calls.events[1] == ("restart", 2) and calls.events[-1] == ("pin", (2, 3))
    assert [w.cpu for w in res.workers] == [2, 3]


def test_k3_without_set_ai_thread_is_an_error(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo(), set_ai_thread=False)
    calls = Calls()
    with pytest.raises(fence.SetAiThreadMissingError) as info:
        run(layout, calls)
    assert str(layout.set_ai_thread) in str(info.value) and "does not exist" in str(info.value)
    assert info.value.path == layout.set_ai_thread
    assert calls.events == []  # no half-done fence: nothing loaded or started


def test_permission_denied_is_a_clear_error_and_stops_the_workers(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()

    def denied(path: Path):
        calls.events.append(("open", path))
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with pytest.raises(fence.SetAiThreadPermissionError) as info:
        run(layout, calls, opener=denied)
    msg = str(info.value)
    assert str(layout.set_ai_thread) in msg and "EACCES" in msg and "worker thread 50000" in msg
    assert "allowed to write" in msg  # says what to do
    assert isinstance(info.value, fence.FenceError)
    assert calls.kinds() == ["load", "restart", "open", "shutdown"]  # never pinned; no half-fenced worker


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="running as root: file modes do not deny root (the injected opener test covers it)")
def test_permission_denied_by_file_mode(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    layout.set_ai_thread.chmod(0o444)
    with pytest.raises(fence.SetAiThreadPermissionError, match="EACCES"):
        run(layout, Calls(), opener=fence._default_opener)


def test_directory_in_place_of_the_file(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo(), set_ai_thread=False)
    layout.set_ai_thread.mkdir()
    calls = Calls()
    with pytest.raises(fence.SetAiThreadWriteError) as info:
        run(layout, calls, opener=fence._default_opener)
    assert "EISDIR" in str(info.value) and str(layout.set_ai_thread) in str(info.value)
    assert calls.kinds()[-1] == "shutdown"


def test_pin_failure_propagates_and_stops_the_workers(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls(pin_error=fence.AffinityError("cannot pin GEMM worker 3 (thread 50003) to CPU 11: EINVAL"))
    with pytest.raises(fence.AffinityError, match="CPU 11: EINVAL"):
        run(layout, calls)
    assert calls.kinds()[-2:] == ["pin", "shutdown"]


def test_a_pin_that_reads_back_wrong_is_refused(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls(readback={2: frozenset({10, 11})})
    with pytest.raises(fence.AffinityError) as info:
        run(layout, calls)
    assert "GEMM worker 2 (thread 50002) should run on CPU 10 only" in str(info.value)
    assert "affinity [10, 11] read back" in str(info.value) and calls.kinds()[-1] == "shutdown"


def test_the_caller_must_not_move(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()
    calls.affinity = [X100, frozenset(range(8, 16))]  # before / after
    with pytest.raises(fence.AffinityError, match="calling thread's CPUs changed"):
        run(layout, calls)
    assert calls.kinds()[-1] == "shutdown"


def test_kernel_load_failure_propagates_before_any_worker_starts(tmp_path):
    from vllm_npu.ime2.kernel import KernelUnavailableError

    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()

    def missing():
        raise KernelUnavailableError("the IME2 kernel library is not built")

    with pytest.raises(KernelUnavailableError):
        fence.enter_ai_cores(layout, load_library=missing, pool_factory=calls.pool_factory, opener=calls.opener,
                             getaffinity=calls.getaffinity)
    assert calls.events == [] and layout.set_ai_thread.read_text() == ""


def test_once_wrapper_runs_once_and_retries_after_failure(tmp_path):
    fence.reset_once_for_tests()
    try:
        layout = make_tree(tmp_path / "proc", k3_cpuinfo())
        bad = Calls(pin_error=fence.AffinityError("EPERM"))
        kw = {"layout": layout, "getaffinity": bad.getaffinity}
        with pytest.raises(fence.AffinityError):
            fence.enter_ai_cores_once(load_library=bad.load, pool_factory=bad.pool_factory, opener=bad.opener, **kw)
        good = Calls()
        first = fence.enter_ai_cores_once(load_library=good.load, pool_factory=good.pool_factory,
                                          opener=good.opener, **kw)
        second = fence.enter_ai_cores_once(load_library=good.load, pool_factory=good.pool_factory,
                                           opener=good.opener, **kw)
        assert first.moved and second is first
        assert good.kinds().count("restart") == 1 and good.kinds().count("pin") == 1  # not repeated
        fence._forget_in_child()  # what os.register_at_fork runs in a forked child
        third = fence.enter_ai_cores_once(load_library=good.load, pool_factory=good.pool_factory,
                                          opener=good.opener, **kw)
        assert third is not first and good.kinds().count("restart") == 2  # the child fences its own workers
    finally:
        fence.reset_once_for_tests()


def test_once_wrapper_on_this_host_is_a_noop(caplog):
    """This machine (x86-64 CI or a laptop) is not a K3: the real /proc gives a no-op + one line."""
    fence.reset_once_for_tests()
    try:
        if fence.detect_k3().is_k3:
            pytest.skip("running on a K3: the real fence would pin this process's workers")
        with caplog.at_level(logging.INFO, logger=fence.LOGGER.name):
            res = fence.enter_ai_cores_once()
        assert not res.moved
        assert [r.getMessage() for r in caplog.records if r.name == fence.LOGGER.name] == [res.message]
    finally:
        fence.reset_once_for_tests()


REAL_POOL_CHILD = r"""
import json, os, sys, threading
from pathlib import Path
import numpy as np
from vllm_npu.ime2 import fence, kernel

root = Path(sys.argv[1])
host = sorted(os.sched_getaffinity(0))
a100, x100 = host[:2], [1000, 1001]             # fake core sets: the "A100 cores" exist on this host
layout = fence.CoreLayout(proc_root=root, x100_cores=x100, a100_cores=a100)
writes = []

class Rec:
    def __init__(self, path): self.path, self.text = path, ""
    def __enter__(self): return self
    def __exit__(self, *exc): writes.append(self.text); self.path.write_text(self.text)
    def write(self, t): self.text += t; return len(t)

from vllm_npu.ime2 import linear
os.sched_setaffinity(0, {host[0]})               # the caller bound to fewer cores than the pool has
threads_before = linear.default_threads()
before = sorted(os.sched_getaffinity(0))
res = fence.enter_ai_cores(layout, opener=Rec, getaffinity=lambda: frozenset(x100))
after = sorted(os.sched_getaffinity(0))
threads_after = linear.default_threads()
rng = np.random.default_rng(3)
m, k, n = 5, 320, 200
qw, sc = kernel.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
a = kernel.quantize_a_array(rng.standard_normal((m, k)).astype(np.float32))
b = np.frombuffer(kernel.pack_b(qw, sc), np.uint8)
ws0 = {w.index: w.slices for w in fence.pool_workers()}
c = kernel.gemm_packed(a, b, m, k, n, threads=8, path="portable")
ref = np.empty_like(c)
lib = kernel.load_library()
st = lib.npu_ime2_gemm(a.ctypes.data, a.nbytes, b.ctypes.data, b.nbytes, m, k, n, ref.ctypes.data, ref.nbytes, 1)
print(json.dumps({
    "moved": res.moved, "a100": a100, "before": before, "after": after, "writes": writes,
    "registered": list(res.registered), "pid": os.getpid(), "caller_tid": threading.get_native_id(),
    "workers": [[w.tid, w.cpu, sorted(w.affinity), w.last_cpu, w.slices - ws0[w.index]] for w in fence.pool_workers()],
    "state": list(fence.pool_state().__dict__.values()),
    "same": bool(st == 0 and (c.view(np.uint32) == ref.view(np.uint32)).all()),
    "threads": [threads_before, threads_after],
}))
"""


def child_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least two CPUs to stand in for A100 cores")
def test_real_pool_workers_are_fenced_and_the_caller_stays(tmp_path):
    """The kernel's own pool behind the fence, on a fake K3 tree whose 'A100 cores' are two CPUs of
    this host: the ids written are the workers' thread ids, each worker's affinity reads back as its
    one core, the GEMM runs on those workers (one slice each, on their cores) and is bit-identical
    to npu_ime2_gemm, and the calling thread's affinity has not changed."""
    pytest.importorskip("numpy")
    from vllm_npu.ime2 import kernel

    if not kernel.LIBRARY_PATH.is_file():
        pytest.skip(f"the kernel library is not built: {kernel.BUILD_COMMAND}")
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    proc = subprocess.run([sys.executable, "-c", REAL_POOL_CHILD, str(layout.proc_root)], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["moved"] and got["same"]
    assert got["before"] == got["after"]  # the calling thread did not move
    tids = [w[0] for w in got["workers"]]
    assert got["writes"] == [str(t) for t in tids] == [str(t) for t in got["registered"]]
    assert got["pid"] not in tids and got["caller_tid"] not in tids
    for (tid, cpu, affinity, last_cpu, slices), core in zip(got["workers"], got["a100"]):
        assert (cpu, affinity, last_cpu, slices) == (core, [core], core, 1), got["workers"]
    assert got["state"] == [2, 2, 2]  # size, configured, created: fresh workers, created once
    assert got["threads"] == [1, 2]  # default_threads: the caller's one core, then the two workers
