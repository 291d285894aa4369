"""The K3 core fence (vllm_npu.ime2.fence) against fake /proc trees in tmp_path."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from vllm_npu.ime2 import fence

X86_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some x86 CPU\nflags\t\t: fpu sse2\n"


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


class Calls:
    """Records the order of the injected steps."""

    def __init__(self, affinity_error: OSError | None = None) -> None:
        self.events: list[tuple] = []
        self.affinity_error = affinity_error

    def load(self) -> object:
        self.events.append(("load",))
        return object()

    def setaffinity(self, pid: int, cores) -> None:
        self.events.append(("affinity", pid, frozenset(cores)))
        if self.affinity_error is not None:
            raise self.affinity_error

    def opener(self, path: Path):
        self.events.append(("open", path))
        return open(path, "w", encoding="ascii")


def run(layout: fence.CoreLayout, calls: Calls, **kw) -> fence.FenceResult:
    return fence.enter_ai_cores(layout, load_library=calls.load, setaffinity=calls.setaffinity,
                                opener=kw.pop("opener", calls.opener), **kw)


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
    assert res.moved is False and res.tid is None and res.cores == frozenset()
    assert calls.events == []  # nothing loaded, written or moved
    lines = [r.getMessage() for r in caplog.records if r.name == fence.LOGGER.name]
    assert lines == [res.message]
    assert "not a SpacemiT K3" in res.message and "\n" not in res.message


def test_k3_happy_path_loads_before_moving(tmp_path, caplog):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()
    logger = logging.getLogger("test.fence.happy")
    with caplog.at_level(logging.INFO, logger=logger.name):
        res = run(layout, calls, logger=logger, tid=4242)
    assert res.moved and res.tid == 4242 and res.cores == frozenset(range(8, 16))
    assert layout.set_ai_thread.read_text() == "4242"
    assert [e[0] for e in calls.events] == ["load", "open", "affinity"]
    assert calls.events[2] == ("affinity", 0, frozenset(range(8, 16)))
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [res.message]


def test_default_tid_is_the_calling_thread(tmp_path):
    import os
    import threading

    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    res = run(layout, Calls())
    assert res.tid == threading.get_native_id() == os.getpid()  # pytest runs tests on the main thread
    assert layout.set_ai_thread.read_text() == str(os.getpid())


def test_custom_core_sets_are_used(tmp_path):
    root = tmp_path / "proc"
    make_tree(root, k3_cpuinfo())
    layout = fence.CoreLayout(proc_root=root, x100_cores={0, 1}, a100_cores={2, 3})
    calls = Calls()
    run(layout, calls, tid=7)
    assert calls.events[-1] == ("affinity", 0, frozenset({2, 3}))


def test_k3_without_set_ai_thread_is_an_error(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo(), set_ai_thread=False)
    calls = Calls()
    with pytest.raises(fence.SetAiThreadMissingError) as info:
        run(layout, calls, tid=1)
    assert str(layout.set_ai_thread) in str(info.value) and "does not exist" in str(info.value)
    assert info.value.path == layout.set_ai_thread
    assert calls.events == []  # no half-done fence: nothing loaded or moved


def test_permission_denied_is_a_clear_error(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()

    def denied(path: Path):
        calls.events.append(("open", path))
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with pytest.raises(fence.SetAiThreadPermissionError) as info:
        run(layout, calls, opener=denied, tid=99)
    msg = str(info.value)
    assert str(layout.set_ai_thread) in msg and "EACCES" in msg and "99" in msg
    assert "allowed to write" in msg  # says what to do
    assert isinstance(info.value, fence.FenceError)
    assert [e[0] for e in calls.events] == ["load", "open"]  # never moved


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="running as root: file modes do not deny root (the injected opener test covers it)")
def test_permission_denied_by_file_mode(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    layout.set_ai_thread.chmod(0o444)
    with pytest.raises(fence.SetAiThreadPermissionError, match="EACCES"):
        run(layout, Calls(), opener=fence._default_opener, tid=5)


def test_directory_in_place_of_the_file(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo(), set_ai_thread=False)
    layout.set_ai_thread.mkdir()
    with pytest.raises(fence.SetAiThreadWriteError) as info:
        run(layout, Calls(), opener=fence._default_opener, tid=5)
    assert "EISDIR" in str(info.value) and str(layout.set_ai_thread) in str(info.value)


def test_affinity_failure_is_a_clear_error(tmp_path):
    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls(affinity_error=OSError(errno.EINVAL, "Invalid argument"))
    with pytest.raises(fence.AffinityError) as info:
        run(layout, calls, tid=3)
    msg = str(info.value)
    assert "EINVAL" in msg and "[8, 9, 10, 11, 12, 13, 14, 15]" in msg and "online" in msg
    assert [e[0] for e in calls.events] == ["load", "open", "affinity"]


def test_kernel_load_failure_propagates_before_any_move(tmp_path):
    from vllm_npu.ime2.kernel import KernelUnavailableError

    layout = make_tree(tmp_path / "proc", k3_cpuinfo())
    calls = Calls()

    def missing():
        raise KernelUnavailableError("the IME2 kernel library is not built")

    with pytest.raises(KernelUnavailableError):
        fence.enter_ai_cores(layout, load_library=missing, setaffinity=calls.setaffinity, opener=calls.opener)
    assert calls.events == [] and layout.set_ai_thread.read_text() == ""


def test_once_wrapper_runs_once_and_retries_after_failure(tmp_path):
    fence.reset_once_for_tests()
    try:
        layout = make_tree(tmp_path / "proc", k3_cpuinfo())
        bad = Calls(affinity_error=OSError(errno.EPERM, "Operation not permitted"))
        with pytest.raises(fence.AffinityError):
            fence.enter_ai_cores_once(layout=layout, load_library=bad.load, setaffinity=bad.setaffinity,
                                      opener=bad.opener, tid=1)
        good = Calls()
        first = fence.enter_ai_cores_once(layout=layout, load_library=good.load, setaffinity=good.setaffinity,
                                          opener=good.opener, tid=1)
        second = fence.enter_ai_cores_once(layout=layout, load_library=good.load, setaffinity=good.setaffinity,
                                           opener=good.opener, tid=1)
        assert first.moved and second is first
        assert [e[0] for e in good.events] == ["load", "open", "affinity"]  # not repeated
    finally:
        fence.reset_once_for_tests()


def test_once_wrapper_on_this_host_is_a_noop(caplog):
    """This machine (x86-64 CI or a laptop) is not a K3: the real /proc gives a no-op + one line."""
    fence.reset_once_for_tests()
    try:
        if fence.detect_k3().is_k3:
            pytest.skip("running on a K3: the real fence would move this process")
        with caplog.at_level(logging.INFO, logger=fence.LOGGER.name):
            res = fence.enter_ai_cores_once()
        assert not res.moved
        assert [r.getMessage() for r in caplog.records if r.name == fence.LOGGER.name] == [res.message]
    finally:
        fence.reset_once_for_tests()
