"""The vlenb rule of the IME2 kernel's Python binding and of ``ime2_q4`` (issue 15, section 1).

The seed: "The op reads vlenb and returns an error unless it is 128." On the K3 build (a library
with the IME2 path compiled in) ``auto`` is the IME2 path: where vlenb != 128 the whole op,
:func:`kernel.gemm_packed` and the ``ime2_q4`` layers raise :class:`kernel.WrongVlenError` naming
the vlenb read and the CPUs; the RVV/portable fallback is an explicit opt-in
(``NPU_IME2_ALLOW_FALLBACK``, :func:`kernel.set_allow_fallback`, ``ime2_hp_gemm_cpu(...,
allow_fallback=)``), logged.

This host is x86-64, whose build has no IME2 path: there the rule does not apply, which is
checked on the real library. The K3 build's Python side is checked on the real library with its
riscv64-only answers replaced (:class:`FakeK3Library`: vlenb 32, the IME2 path built but not
usable, AUTO = IME2 without the opt-in); the C side of the rule runs under QEMU in
``test_ime2_qemu.py``, ``test_ime2_qemu_ime2.py`` and ``test_ime2_board_library.py``. A failed core
fence on a K3 is an error of ``ime2_q4`` (:func:`quant.pass_core_fence`), checked on fake /proc trees.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_npu.ime2 import fence, kernel

ENV = kernel.ALLOW_FALLBACK_ENV
IME2, PORTABLE = kernel.PATHS["ime2"], kernel.PATHS["portable"]


def operands(m: int = 3, k: int = 64, n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    qweight, scales = kernel.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qweight, scales


class FakeK3Library:
    """The real library, answering as the K3 build does (dispatch.c's rule) at a given vlenb
    (default 32, an X100 core): the IME2 path is built and runs only at vlenb 128; AUTO is IME2
    unless the fallback is allowed and vlenb != 128 (then the portable path, this host's
    stand-in for RVV). Everything else is the real C code."""

    def __init__(self, real: Any, vlenb: int = 32) -> None:
        self._real = real
        self._vlenb = vlenb
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def npu_ime2_vlenb(self) -> int:
        return self._vlenb

    def npu_ime2_path_status(self, path: int) -> int:
        if path == IME2:
            return kernel.Status.OK if self._vlenb == kernel.IME2_VLENB else kernel.Status.WRONG_VLEN
        if path == 0:
            return self.npu_ime2_path_status(self.npu_ime2_auto_path_with(self._real.npu_ime2_allow_fallback()))
        return kernel.Status.BAD_PATH if path == kernel.PATHS["x86"] else self._real.npu_ime2_path_status(path)

    def npu_ime2_auto_path_with(self, allow: int) -> int:
        return PORTABLE if allow and self._vlenb != kernel.IME2_VLENB else IME2

    def npu_ime2_hp_gemm_on(self, *args: Any) -> int:
        self.calls.append("hp_gemm_on")
        status = self.npu_ime2_path_status(args[-1])
        return status if status != kernel.Status.OK else self._real.npu_ime2_hp_gemm_on(*args)

    def npu_ime2_gemm_mt(self, *args: Any) -> int:
        self.calls.append("gemm_mt")
        status = self.npu_ime2_path_status(args[-2])
        return status if status != kernel.Status.OK else self._real.npu_ime2_gemm_mt(*args)


@pytest.fixture
def fresh_setting(monkeypatch):
    """No fallback override, no environment value, no remembered warning (restored after)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(kernel, "_FALLBACK_OVERRIDE", None)
    monkeypatch.setattr(kernel, "_FALLBACK_LOGGED", set())
    monkeypatch.setattr(kernel, "_GEMM_FALLBACK_NOTED", False)
    real = kernel.load_library()
    monkeypatch.setattr(kernel, "_PUSHED", None)
    yield real
    real.npu_ime2_set_allow_fallback(0)
    kernel._PUSHED = False


@pytest.fixture
def k3(fresh_setting, monkeypatch) -> FakeK3Library:
    fake = FakeK3Library(fresh_setting)
    monkeypatch.setattr(kernel, "_LIB", fake)
    monkeypatch.setattr(kernel, "_IME2_BUILT", None)
    return fake


@pytest.fixture
def warnings_seen():
    """Records of ``kernel.logger`` (vLLM's logging config may stop propagation to the root)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    kernel.logger.addHandler(handler)
    try:
        yield records
    finally:
        kernel.logger.removeHandler(handler)


def this_threads_cpus() -> str:
    return kernel._cpu_list(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------------------
# the C ABI additions (real library)


def test_c_setting_round_trips_and_x86_auto_ignores_it(fresh_setting):
    lib = fresh_setting
    assert lib.npu_ime2_allow_fallback() == 0  # the default: refuse
    lib.npu_ime2_set_allow_fallback(7)
    assert lib.npu_ime2_allow_fallback() == 1
    assert lib.npu_ime2_auto_path_with(0) == lib.npu_ime2_auto_path_with(1) == lib.npu_ime2_auto_path()
    lib.npu_ime2_set_allow_fallback(0)
    assert lib.npu_ime2_allow_fallback() == 0
    assert lib.npu_ime2_path_status(0) == kernel.Status.OK  # AUTO's status is its path's


def test_x86_build_has_no_ime2_path_so_the_rule_does_not_apply(fresh_setting):
    assert kernel.vlenb() == 0 and not kernel.ime2_built()
    assert kernel.auto_path() == kernel.auto_path(allow_fallback=True) == kernel.auto_path(allow_fallback=False)
    assert kernel.auto_path() in ("x86", "portable")
    a, qweight, scales = operands()
    want = kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=True)
    np.testing.assert_array_equal(kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=False), want)


def test_python_setting_reaches_the_c_library(fresh_setting, monkeypatch):
    kernel.set_allow_fallback(True)
    assert kernel.allow_fallback_setting() and fresh_setting.npu_ime2_allow_fallback() == 1
    kernel.set_allow_fallback(None)  # back to the environment: unset = off
    assert not kernel.allow_fallback_setting() and fresh_setting.npu_ime2_allow_fallback() == 0
    monkeypatch.setenv(ENV, "yes")
    assert kernel.allow_fallback_setting()
    a, qweight, scales = operands()
    kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), 3, 64, 40)  # auto: pushes it
    assert fresh_setting.npu_ime2_allow_fallback() == 1
    kernel.set_allow_fallback(False)  # the explicit setting wins over the environment
    assert not kernel.allow_fallback_setting() and fresh_setting.npu_ime2_allow_fallback() == 0


@pytest.mark.parametrize("raw", ["2", "maybe", "enabled"])
def test_malformed_environment_value_is_named(fresh_setting, monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(kernel.FallbackSettingError, match=rf"{ENV}='{raw}' is not a switch: expected 1, true, yes, on \(on\) or 0, false"):
        kernel.allow_fallback_setting()
    kernel.set_allow_fallback(None)  # never raises; the C side reads "off"
    assert fresh_setting.npu_ime2_allow_fallback() == 0


def test_cpu_list_collapses_runs():
    assert kernel._cpu_list(range(8)) == "[0..7]"
    assert kernel._cpu_list({9, 0, 1, 2, 3, 5, 8, 10, 11, 12, 13, 14, 15}) == "[0..3, 5, 8..15]"
    assert kernel._cpu_list([4]) == "[4]"


# ---------------------------------------------------------------------------------------------
# the K3 build's Python side (FakeK3Library)


def test_k3_build_refuses_by_default_naming_vlenb_and_cpus(k3):
    a, qweight, scales = operands()
    assert kernel.ime2_built() and kernel.auto_path() == "ime2" and kernel.vlenb() == 32
    with pytest.raises(kernel.WrongVlenError) as info:
        kernel.ime2_hp_gemm_cpu(a, qweight, scales)
    msg = str(info.value)
    assert msg.startswith("ime2_hp_gemm_cpu(M=3, K=64, N=40): IME2 needs vlenb == 128 (VLEN 1024")
    assert f"this thread read vlenb 32 (VLEN 256) on CPUs {this_threads_cpus()}" in msg
    assert f"{ENV}=1" in msg and "set_allow_fallback(True)" in msg
    assert info.value.vlenb == 32 and info.value.cpus == frozenset(os.sched_getaffinity(0))
    assert info.value.status == kernel.Status.WRONG_VLEN
    gemm_context = r"gemm\(M=3, K=64, N=40, path='auto', threads=2\): .*vlenb 32"
    with pytest.raises(kernel.WrongVlenError, match=gemm_context) as info:
        kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), 3, 64, 40, threads=2)
    assert f"on CPUs {this_threads_cpus()}" in str(info.value)  # no pinned pool: the caller checked
    with pytest.raises(kernel.WrongVlenError, match="after the fence.*vlenb 32"):
        kernel.check_gemm_path(context="after the fence")
    with pytest.raises(kernel.WrongVlenError, match="M=0"):  # an empty C too, as in C
        kernel.ime2_hp_gemm_cpu(a[:0], qweight, scales)


def test_k3_build_gemm_error_names_the_pinned_worker(k3, monkeypatch):
    """After the core fence the GEMM's slices (and its path check) run on the pool's pinned
    workers: the error names worker 0's vlenb and CPU, then this thread's."""
    worker = fence.WorkerState(index=0, tid=4242, cpu=8, affinity=frozenset({8}), last_cpu=8, last_vlenb=32,
                               slices=1)
    monkeypatch.setattr(fence, "pool_state", lambda: fence.PoolState(size=1, configured=1, created=1))
    monkeypatch.setattr(fence, "pool_workers", lambda: (worker,))
    a, qweight, scales = operands()
    with pytest.raises(kernel.WrongVlenError) as info:
        kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), 3, 64, 40)
    assert ("the GEMM's worker 0 (thread 4242, pinned to CPUs [8]) read vlenb 32 (VLEN 256) on CPU 8; "
            f"this thread read vlenb 32 (VLEN 256) on CPUs {this_threads_cpus()}") in str(info.value)
    assert info.value.vlenb == 32 and info.value.cpus == frozenset({8})


class FencedK3Library(FakeK3Library):
    """The K3 build after the core fence: the calling thread reads vlenb 32 (an X100 core), the
    configured pool's workers ``worker_vlenb``. As dispatch.c and threads.c do, the whole op and
    ``npu_ime2_gemm_mt`` check the path where the GEMM runs (the workers), then compute (on the
    portable path, this host's stand-in for IME2)."""

    def __init__(self, real: Any, worker_vlenb: int) -> None:
        super().__init__(real, vlenb=32)
        self.worker_vlenb = worker_vlenb

    def _on_workers(self, path: int) -> int:
        caller, self._vlenb = self._vlenb, self.worker_vlenb
        try:
            return self.npu_ime2_path_status(path)
        finally:
            self._vlenb = caller

    def npu_ime2_hp_gemm_on(self, *args: Any) -> int:
        self.calls.append("hp_gemm_on")
        status = self._on_workers(args[-1])
        return status if status != kernel.Status.OK else self._real.npu_ime2_hp_gemm_on(*args[:-1], PORTABLE)

    def npu_ime2_gemm_mt(self, *args: Any) -> int:
        self.calls.append("gemm_mt")
        status = self._on_workers(args[-2])
        return status if status != kernel.Status.OK else self._real.npu_ime2_gemm_mt(*args[:-2], PORTABLE, args[-1])


@pytest.fixture
def fenced(fresh_setting, monkeypatch):
    """A factory: the K3 build after the fence, eight workers pinned to 8..15 reading ``worker_vlenb``."""

    def make(worker_vlenb: int) -> FencedK3Library:
        fake = FencedK3Library(fresh_setting, worker_vlenb)
        workers = tuple(fence.WorkerState(i, 4200 + i, 8 + i, frozenset({8 + i}), 8 + i, worker_vlenb, 1)
                        for i in range(8))
        monkeypatch.setattr(kernel, "_LIB", fake)
        monkeypatch.setattr(kernel, "_IME2_BUILT", None)
        monkeypatch.setattr(fence, "pool_state", lambda: fence.PoolState(size=8, configured=8, created=8))
        monkeypatch.setattr(fence, "pool_workers", lambda: workers)
        return fake

    return make


def test_k3_build_whole_op_after_the_fence_runs_where_the_workers_are(fenced, warnings_seen):
    """After the fence the calling thread is on an X100 core (vlenb 32) but the whole op's GEMM
    runs on the pinned A100 workers (vlenb 128): it runs IME2 there, by default and without a
    fallback warning, also for an empty C; the opt-in changes nothing."""
    a, qweight, scales = operands()
    want = kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=None)  # x86 library: the real op
    fake = fenced(128)
    assert kernel.pool_configured() == 8 and kernel.vlenb() == 32 and kernel.auto_path() == "ime2"
    for allow in (None, True, False):
        np.testing.assert_array_equal(kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=allow), want)
    assert kernel.ime2_hp_gemm_cpu(a[:0], qweight, scales).shape == (0, 40)
    assert "hp_gemm_on" in fake.calls and warnings_seen == []


def test_k3_build_whole_op_after_the_fence_names_worker_0(fenced, warnings_seen):
    """Pinned workers that read vlenb 32: the whole op's error names worker 0's vlenb and CPU
    (where the GEMM runs), then this thread's; the opt-in falls back, and the warning says where."""
    a, qweight, scales = operands()
    fenced(32)
    with pytest.raises(kernel.WrongVlenError) as info:
        kernel.ime2_hp_gemm_cpu(a, qweight, scales)
    assert "the GEMM's worker 0 (thread 4200, pinned to CPUs [8]) read vlenb 32 (VLEN 256) on CPU 8" in str(info.value)
    assert info.value.cpus == frozenset({8})
    with pytest.raises(kernel.WrongVlenError, match="M=0.*worker 0"):
        kernel.ime2_hp_gemm_cpu(a[:0], qweight, scales)
    kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=True)
    assert len(warnings_seen) == 1 and "the GEMM's worker 0 (thread 4200" in warnings_seen[0].getMessage()


def test_k3_build_explicit_paths_do_not_need_the_opt_in(k3):
    a, qweight, scales = operands()
    a_p, b_p = kernel.quantize_a(a), kernel.pack_b(qweight, scales)
    got = kernel.gemm_packed(a_p, b_p, 3, 64, 40, path="portable")
    kernel.set_allow_fallback(True)
    np.testing.assert_array_equal(got, kernel.gemm_packed(a_p, b_p, 3, 64, 40, path="portable"))
    with pytest.raises(kernel.WrongVlenError, match=r"path='ime2'.*vlenb 32"):  # IME2 never falls back
        kernel.gemm_packed(a_p, b_p, 3, 64, 40, path="ime2")


@pytest.mark.parametrize("how", ["argument", "setting", "environment"])
def test_k3_build_fallback_is_an_opt_in_and_logged_once(k3, monkeypatch, warnings_seen, how):
    a, qweight, scales = operands()
    kwargs = {}
    if how == "argument":
        kwargs = {"allow_fallback": True}
    elif how == "setting":
        kernel.set_allow_fallback(True)
    else:
        monkeypatch.setenv(ENV, "1")
    want = kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), 3, 64, 40, path="portable")
    for _ in range(3):
        np.testing.assert_array_equal(kernel.ime2_hp_gemm_cpu(a, qweight, scales, **kwargs), want)
    if how != "argument":  # the GEMM on packed operands follows the process setting only
        for _ in range(2):
            np.testing.assert_array_equal(
                kernel.gemm_packed(kernel.quantize_a(a), kernel.pack_b(qweight, scales), 3, 64, 40, threads=2), want)
        assert kernel.check_gemm_path() == kernel.gemm_auto_path() == "portable"
    assert kernel.auto_path(**kwargs) == "portable"
    assert len(warnings_seen) == 1, [r.getMessage() for r in warnings_seen]
    line = warnings_seen[0].getMessage()
    assert f"this thread read vlenb 32 (VLEN 256) on CPUs {this_threads_cpus()}" in line
    assert "auto runs the portable path instead of ime2" in line and ENV in line


def test_k3_build_explicit_refusal_beats_the_environment(k3, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    a, qweight, scales = operands()
    with pytest.raises(kernel.WrongVlenError):
        kernel.ime2_hp_gemm_cpu(a, qweight, scales, allow_fallback=False)


def test_k3_build_on_an_a100_core_runs_ime2_without_a_warning(k3, warnings_seen):
    k3._vlenb = 128
    assert kernel.check_gemm_path() == kernel.auto_path(allow_fallback=True) == "ime2"
    kernel.set_allow_fallback(True)
    assert kernel.gemm_auto_path() == "ime2"
    assert warnings_seen == []


# ---------------------------------------------------------------------------------------------
# ime2_q4: the fence is an error on a K3, the path is checked before packing


X86_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2\n"
K3_CPUINFO = "\n\n".join(
    f"processor\t: {c}\nisa\t\t: rv64imafdcv_zvfh\nuarch\t\t: spacemit,{'x100' if c < 8 else 'a100'}" for c in range(16)
) + "\n"


def fake_proc(root: Path, cpuinfo: str, *, set_ai_thread: bool) -> fence.CoreLayout:
    root.mkdir(parents=True)
    (root / "cpuinfo").write_text(cpuinfo)
    if set_ai_thread:
        (root / "set_ai_thread").mkdir()  # a directory: opening it for writing fails
    return fence.CoreLayout(proc_root=root)


@pytest.fixture
def quant():
    module = pytest.importorskip("vllm_npu.ime2.quant")
    fence.reset_once_for_tests()
    yield module
    fence.reset_once_for_tests()


def test_failed_fence_on_a_k3_is_an_error(quant, tmp_path):
    layout = fake_proc(tmp_path / "proc", K3_CPUINFO, set_ai_thread=False)
    with pytest.raises(quant.CoreFenceError, match=r"--quantization ime2_q4: the SpacemiT K3 core fence failed.*"
                                                    r"A100 cores \[8, 9, .*set_ai_thread does not exist") as info:
        quant.pass_core_fence(layout)
    assert isinstance(info.value.__cause__, fence.SetAiThreadMissingError)
    assert isinstance(info.value, fence.FenceError)  # callers catching the fence's errors still do


def test_failed_fence_write_on_a_k3_is_an_error(quant, tmp_path):
    layout = fake_proc(tmp_path / "proc", K3_CPUINFO, set_ai_thread=True)
    with pytest.raises(quant.CoreFenceError) as info:
        quant.pass_core_fence(layout)
    assert isinstance(info.value.__cause__, fence.SetAiThreadWriteError)


def test_fence_that_does_not_move_on_a_k3_is_an_error(quant, tmp_path, monkeypatch):
    layout = fake_proc(tmp_path / "proc", K3_CPUINFO, set_ai_thread=False)
    monkeypatch.setattr(fence, "enter_ai_cores_once",
                        lambda **kw: fence.FenceResult(False, "ime2 core fence: stayed"))
    with pytest.raises(quant.CoreFenceError,
                       match=r"is a SpacemiT K3 .* did not move the threads of the GEMM to the A100 cores .*stayed"):
        quant.pass_core_fence(layout)


def test_fence_off_a_k3_stays_a_logged_no_op(quant, tmp_path):
    layout = fake_proc(tmp_path / "proc", X86_CPUINFO, set_ai_thread=False)
    res = quant.pass_core_fence(layout)
    assert not res.moved and "not a SpacemiT K3" in res.message


def test_ime2_q4_checks_the_kernel_path_before_packing(quant, k3, monkeypatch):
    with pytest.raises(kernel.WrongVlenError, match=r"--quantization ime2_q4, after the core fence .*vlenb 32"):
        quant.check_kernel_path()
    monkeypatch.setenv(ENV, "1")
    assert quant.check_kernel_path() == "portable"


def test_ime2_q4_path_check_on_this_host(quant, fresh_setting):
    assert quant.check_kernel_path() == kernel.auto_path()
