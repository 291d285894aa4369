"""IME2 linear-layer scenarios (the ``ime2-qemu`` and ``ime2-hw`` columns; issue 5).

* ``layer_matches_q4x32``: ``vllm_npu.ime2.linear.PackedQ4Weight.from_float(W).apply(x)`` (the
  plugin's layer on this machine's kernel build) quantizes W to the bits of
  ``npusim.q4x32.quantize_q4_0``, equals ``npusim.q4x32`` at level ``hardware`` bit for bit and is
  within NMSE 5e-4 of level ``exact`` (figure ``nmse_vs_exact``).
* ``packs_once``: ``pack_count()`` does not grow over repeated ``apply`` calls.
* ``riscv64_kernel_matches_layer``: the riscv64 kernel on the same quantized weights equals the
  layer's output bit for bit on the ``rvv`` path and the ``ime2`` path at VLEN 1024; on
  ``ime2-qemu`` under ``qemu-riscv64-static``, on ``ime2-hw`` natively (a path this CPU cannot
  run is skipped with the kernel's reason).
* ``fence_*``: the K3 core fence (:mod:`vllm_npu.ime2.fence`) against a fake ``/proc`` tree and
  a fake worker pool: no-op off a K3; on a K3 load, then fresh GEMM workers, each worker's thread
  id written to ``set_ai_thread``, then worker i pinned to A100 core 8 + i, while the calling
  thread's affinity stays the X100 cores; clear errors for a missing or refused
  ``set_ai_thread`` (the workers stopped); and what the fence decides about this machine.
"""

from __future__ import annotations

import errno
import logging
import platform
from pathlib import Path

import numpy as np
import pytest

#: llama.cpp test-backend-ops' NMSE bound for mul_mat.
MUL_MAT_NMSE = 5e-4

#: (M, K, N): a 4-row group plus a remainder row with N tail columns and K % 256 != 0; the tiny
#: models' fused qkv (K 128, N 128+64+64) and gate_up (K 128, N 2*256) at decode and prefill M.
LAYER_SHAPES = [(5, 288, 70), (1, 128, 256), (4, 128, 512)]
#: Shapes for the riscv64 runs (QEMU emulates the IME2 instructions one by one: keep them small).
RISCV_SHAPES = [(5, 288, 70), (4, 128, 512)]


def _layer_module():
    try:
        from vllm_npu.ime2 import kernel, linear

        kernel.load_library()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"the host IME2 kernel library is not usable: {type(exc).__name__}: {exc}")
    return linear


def _operands(shape, seed):
    m, k, n = shape
    rng = np.random.default_rng([seed, m, k, n])
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)


def _bits_differing(a: np.ndarray, b: np.ndarray) -> int:
    both_nan = np.isnan(a) & np.isnan(b)
    return int(np.count_nonzero((a.view(np.uint32) != b.view(np.uint32)) & ~both_nan))


@pytest.mark.scenario(devices=("ime2",))
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_matches_q4x32(target, record, shape):
    linear = _layer_module()
    import npusim.q4x32 as q

    x, w = _operands(shape, 51)
    layer = linear.PackedQ4Weight.from_float(w, name="scenario.proj")
    qweight, scales = q.quantize_q4_0(w)
    assert np.array_equal(layer.qweight, qweight), "the plugin's Q4_0 codes differ from npusim.q4x32.quantize_q4_0"
    assert np.array_equal(layer.scales.view(np.uint32), scales.view(np.uint32)), "Q4_0 scales differ"

    y = layer.apply(x)
    assert y.dtype == np.float32 and y.shape == (shape[0], shape[2])
    hardware = q.ime2_hp_gemm(x, qweight, scales, level="hardware")
    mismatched = _bits_differing(y, hardware)
    record.figure("bits_differing_from_hardware", mismatched, "elements")
    assert mismatched == 0, f"{mismatched} of {y.size} elements differ from npusim.q4x32 hardware"

    err = q.nmse(q.ime2_hp_gemm(x, qweight, scales, level="exact"), y)
    record.figure("nmse_vs_exact", err)
    assert err <= MUL_MAT_NMSE


@pytest.mark.scenario(devices=("ime2",))
def test_packs_once(target, record):
    linear = _layer_module()
    x, w = _operands((4, 128, 96), 52)
    before = linear.pack_count()
    layer = linear.PackedQ4Weight.from_float(w, name="scenario.pack_once")
    assert linear.pack_count() == before + 1
    first = layer.apply(x)
    for _ in range(5):
        np.testing.assert_array_equal(layer.apply(x), first)
    record.figure("packs_after_6_applies", linear.pack_count() - before, "packs")
    assert linear.pack_count() == before + 1, "apply() packed the weight again"


@pytest.mark.scenario(devices=("ime2",))
@pytest.mark.parametrize("path", ["rvv", "ime2"])
@pytest.mark.parametrize("shape", RISCV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_riscv64_kernel_matches_layer(target, record, shape, path):
    linear = _layer_module()
    x, w = _operands(shape, 53)
    layer = linear.PackedQ4Weight.from_float(w, name="scenario.riscv64")
    y = layer.apply(x)
    m, k, n = shape
    if target.name == "ime2-qemu":
        from npu_conformance import qemu_ime2

        res = qemu_ime2.run(x, layer.qweight, layer.scales, vlen=1024, path=path, timeout=180)
        assert res.status == 0, res.text
        assert res.guards_ok and res.vlenb == 128
        record.figure("qemu_wall_s", res.seconds, "s")
        c = res.c
    else:
        from vllm_npu.ime2 import kernel

        if path not in kernel.usable_paths():
            status = kernel.path_status(path)
            pytest.skip(f"{target.name}: path {path!r} cannot run on this CPU: {kernel.status_string(status)} "
                        f"(status {status}; the ime2 path needs VLEN 1024, i.e. the A100 cores)")
        c = kernel.gemm_packed(kernel.quantize_a_array(x), layer.packed, m, k, n, path=path)
    mismatched = _bits_differing(c, y)
    record.figure("bits_differing_from_layer", mismatched, "elements")
    assert mismatched == 0, f"{mismatched} of {m * n} elements of the riscv64 {path} path differ from the layer"


# ---- the core fence on a fake /proc tree


def _k3_cpuinfo() -> str:
    return "\n\n".join(
        f"processor\t: {c}\nhart\t\t: {c}\nisa\t\t: rv64imafdcv{'h' if c < 8 else ''}_zvfh\n"
        f"uarch\t\t: spacemit,{'x100' if c < 8 else 'a100'}"
        for c in range(16)
    ) + "\n"


def _tree(root: Path, *, k3: bool, set_ai_thread: bool):
    from vllm_npu.ime2 import fence

    root.mkdir(parents=True)
    (root / "cpuinfo").write_text(_k3_cpuinfo() if k3 else "processor\t: 0\nmodel name\t: x86-64 host\n")
    if set_ai_thread:
        (root / "set_ai_thread").write_text("")
    return fence.CoreLayout(proc_root=root)


#: The calling thread's CPUs the fake K3 reports: the X100 cores, where it must stay.
_X100 = frozenset(range(8))
#: The A100 cores, one GEMM worker each (worker i on core 8 + i).
_A100 = tuple(range(8, 16))


class _Steps:
    """The fence's injected steps, recorded in order: load the library, restart the pool, one
    ``set_ai_thread`` write per worker (``register``), pin the workers (``pin``), stop them
    (``shutdown``). The fake pool's workers have thread ids 50000 + i."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.written: list[str] = []
        self.tids: tuple[int, ...] = ()
        self.pinned: tuple[int, ...] = ()
        self.caller_reads = 0

    def load(self) -> object:
        self.order.append("load")
        return object()

    def pool_factory(self, lib: object) -> _Steps:
        return self  # the pool API is on this object: restart / pin / shutdown

    def restart(self, n: int) -> tuple[int, ...]:
        self.order.append("restart")
        self.tids = tuple(50000 + i for i in range(n))
        return self.tids

    def pin(self, cpus):
        from vllm_npu.ime2 import fence

        self.order.append("pin")
        self.pinned = tuple(cpus)
        return tuple(fence.WorkerState(i, tid, cpu, frozenset({cpu}), None, None, 0)
                     for i, (tid, cpu) in enumerate(zip(self.tids, cpus)))

    def shutdown(self) -> None:
        self.order.append("shutdown")

    def getaffinity(self) -> frozenset[int]:
        self.caller_reads += 1
        return _X100

    def opener(self, path: Path):
        steps = self

        class _Write:
            def __enter__(self):
                steps.order.append("register")
                return self

            def __exit__(self, *exc) -> None:
                path.write_text(steps.written[-1])

            def write(self, text: str) -> int:
                steps.written.append(text)
                return len(text)

        return _Write()


def _enter(layout, steps: _Steps, **kw):
    from vllm_npu.ime2 import fence

    kw.setdefault("opener", steps.opener)
    return fence.enter_ai_cores(layout, load_library=steps.load, pool_factory=steps.pool_factory,
                                getaffinity=steps.getaffinity, **kw)


@pytest.mark.scenario(devices=("ime2",))
def test_fence_noop_off_k3(target, tmp_path, caplog):
    from vllm_npu.ime2 import fence

    steps = _Steps()
    with caplog.at_level(logging.INFO, logger=fence.LOGGER.name):
        res = _enter(_tree(tmp_path / "proc", k3=False, set_ai_thread=False), steps)
    assert not res.moved and res.workers == () and res.registered == ()
    assert steps.order == [] and steps.caller_reads == 0  # nothing loaded, started, written or pinned
    assert [r.getMessage() for r in caplog.records if r.name == fence.LOGGER.name] == [res.message]


@pytest.mark.scenario(devices=("ime2",))
def test_fence_moves_after_loading_on_k3(target, tmp_path):
    """Load on the X100 cores, fresh workers, each worker's thread id written, one worker per A100
    core; the calling thread's affinity is read before and after and stays the X100 cores."""
    steps = _Steps()
    layout = _tree(tmp_path / "proc", k3=True, set_ai_thread=True)
    res = _enter(layout, steps)
    assert res.moved and steps.order == ["load", "restart"] + ["register"] * 8 + ["pin"]
    assert steps.written == [str(50000 + i) for i in range(8)] == [str(t) for t in res.registered]
    assert layout.set_ai_thread.read_text() == "50007"  # the last worker's id: one id per write
    assert steps.pinned == _A100 and [(w.index, w.cpu) for w in res.workers] == list(enumerate(_A100))
    assert res.cores == frozenset(_A100)
    assert res.caller_affinity == _X100 and steps.caller_reads == 2  # checked before loading and after


@pytest.mark.scenario(devices=("ime2",))
def test_fence_errors(target, tmp_path):
    from vllm_npu.ime2 import fence

    missing = _tree(tmp_path / "a", k3=True, set_ai_thread=False)
    steps = _Steps()
    with pytest.raises(fence.SetAiThreadMissingError, match="does not exist"):
        _enter(missing, steps)
    assert steps.order == []  # refused before the library loads

    def refused(path: Path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    layout = _tree(tmp_path / "b", k3=True, set_ai_thread=True)
    steps = _Steps()
    with pytest.raises(fence.SetAiThreadPermissionError, match="EACCES") as info:
        _enter(layout, steps, opener=refused)
    assert str(layout.set_ai_thread) in str(info.value) and "worker thread 50000" in str(info.value)
    assert steps.order == ["load", "restart", "shutdown"]  # never pinned: no half-fenced worker stays


@pytest.mark.scenario(devices=("ime2",))
def test_fence_on_this_machine(target, record):
    """ime2-hw: the board is a K3 with set_ai_thread; elsewhere a non-riscv64 host is no K3."""
    from vllm_npu.ime2 import fence

    found = fence.detect_k3()
    record.figure("is_k3", int(found.is_k3))
    if target.is_hardware:
        assert found.is_k3 and found.has_set_ai_thread, found.reason
    elif platform.machine() != "riscv64":
        assert not found.is_k3, found.reason
    else:
        pytest.skip(f"{target.name} on a riscv64 host: {found.reason}")
