"""npusim.mxq.machine: configuration (env and configure), devices, cores, memory, clock, pace, faults."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import npusim.mxq as qb

C0, C1 = qb.Cluster.Cluster0, qb.Cluster.Cluster1


def _x(n: int) -> np.ndarray:
    return np.random.default_rng(n).normal(0, 1, (1, n, 128)).astype(np.float32)


def _launch(path, mc=None, acc=None):
    m = qb.Model(str(path), mc)
    m.launch(acc or qb.Accelerator())
    return m


# ---------------------------------------------------------------- configuration

def test_env_is_read_lazily_and_reread_when_it_changes(mxq_machine, monkeypatch):
    assert qb.get_available_devices() == ["aries"] and qb.get_available_device_numbers() == [0]
    monkeypatch.setenv("NPUSIM_MXQ", '{"devices": 3}')
    assert qb.get_available_device_numbers() == [0, 1, 2] and qb.get_available_device_numbers("aries-rb") == [0, 1, 2]
    assert qb.get_available_device_numbers("regulus") == []
    monkeypatch.setenv("NPUSIM_MXQ", '{"no_device": true}')
    assert qb.get_available_devices() == [] and qb.get_available_device_numbers() == []
    mxq_machine.configure(no_device=False)  # configure overrides the environment
    assert qb.get_available_device_numbers() == [0]


@pytest.mark.parametrize(
    ("env", "message"),
    [('{"devcies": 1}', "NPUSIM_MXQ: unknown keys ['devcies']; known: bad_alloc_at_launch, device_memory_mib"),
     ('{"pace": 1}', "NPUSIM_MXQ: pace=1 must be true or false"),
     ('{"devices": -1}', "NPUSIM_MXQ: devices=-1 must be an integer >= 0"),
     ('{"infer_fixed_us": -5}', "NPUSIM_MXQ: infer_fixed_us=-5 must be a number >= 0"),
     ('{"infer_fail_status": "Oops"}', "NPUSIM_MXQ: infer_fail_status='Oops' must be one of"),
     ('[1]', "NPUSIM_MXQ='[1]' must be a JSON object, got list"),
     ('{bad', "NPUSIM_MXQ='{bad' is not valid JSON")],
)
def test_bad_env_names_the_field_and_rule(mxq_machine, monkeypatch, env, message):
    monkeypatch.setenv("NPUSIM_MXQ", env)
    with pytest.raises(ValueError) as exc:
        mxq_machine.settings()
    assert message in str(exc.value)


def test_configure_rejects_bad_values(mxq_machine):
    with pytest.raises(ValueError, match=r"bad_alloc_at_launch=0 must be null or an integer >= 1"):
        mxq_machine.configure(bad_alloc_at_launch=0)
    with pytest.raises(ValueError, match=r"npusim.mxq.machine.configure: unknown keys \['speed'\]"):
        mxq_machine.configure(speed=2)


# ---------------------------------------------------------------- devices

def test_accelerator_device_errors(mxq_machine, glog):
    mxq_machine.configure(devices=2)
    # auto and the base name resolve to the concrete device, as the real core does
    assert qb.Accelerator(1).get_device_name() == "aries-rb"
    assert qb.Accelerator("aries", 1).get_device_name() == "aries-rb"
    assert qb.Accelerator("aries-rb", 1).get_device_name() == "aries-rb"
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Accelerator(2)
    assert exc.value.status == "Acc_DeviceNotFound"
    assert glog() == ["No NPU device found in the system.", "Accelerator not created."]
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Accelerator("aries-rb", 2)
    assert exc.value.status == "Driver_NotInitialized"
    assert glog() == ["ARIES device #2 not found.", "Accelerator not created."]
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Accelerator("regulus", 0)
    assert exc.value.status == "Driver_NotInitialized"
    assert glog() == ["REGULUS device #0 not found.", "Accelerator not created."]
    mxq_machine.configure(no_device=True)
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Accelerator()
    assert str(exc.value).startswith("Acc_DeviceNotFound occurred.\n")
    with pytest.raises(ValueError, match="unknown device name 'tpu'"):
        qb.Accelerator("tpu")


# ---------------------------------------------------------------- cores

def test_single_core_models_fill_the_card_then_fail(mxq_machine, mxq_artifact, glog):
    path = mxq_artifact()
    models = [_launch(path) for _ in range(8)]
    assert sorted(c for m in models for c in m.get_target_cores()) == sorted(
        qb.CoreId(cl, co) for cl in (C0, C1) for co in (qb.Core.Core0, qb.Core.Core1, qb.Core.Core2, qb.Core.Core3))
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        _launch(path)
    assert exc.value.status == "Driver_FailedToClaimCores"
    assert glog() == ["Core allocation failed - available cores : 0 vs requested cores : 1"]
    models[3].dispose()
    _launch(path)  # the freed core is reused


def test_explicit_cores_are_shared_by_memory_flexible_models(mxq_machine, mxq_artifact, glog):
    """Two memory-flexible models named the same core both launch (the board time-shares it, as
    transformers-mblt's multi-slot backend and the MoE release layout need); the core is free
    again only when both are disposed."""
    core = qb.CoreId(C1, qb.Core.Core2)
    mc = qb.ModelConfig()
    mc.set_single_core_mode(None, [core])
    a = _launch(mxq_artifact(), mc)
    b = _launch(mxq_artifact(), mc)
    assert a.get_target_cores() == [core] and b.get_target_cores() == [core] and a.is_target(core)
    dev = mxq_machine.device(0)
    assert len(dev.free_cores()) == 7
    a.dispose()
    assert len(dev.free_cores()) == 7  # b still holds it
    b.dispose()
    assert len(dev.free_cores()) == 8


def test_memory_fixed_mxq_never_shares_a_core(mxq_machine, mxq_artifact, glog):
    core = qb.CoreId(C1, qb.Core.Core2)
    mc = qb.ModelConfig()
    mc.set_single_core_mode(None, [core])
    fixed = mxq_artifact(memory_flexible=False)
    a = _launch(mxq_artifact(), mc)
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:  # a fixed newcomer on a taken core
        _launch(fixed, mc)
    assert exc.value.status == "Acc_CoreAlreadyInUse"
    want = ("core [20003] memory area is already in use. Recommend to use latest compiler to utilize memory "
            "flexible. Or use other core please.")
    assert glog() == [want]
    a.dispose()
    _launch(fixed, mc)
    with pytest.raises(qb.QbRuntimeError) as exc:  # a flexible newcomer on a fixed holder's core
        _launch(mxq_artifact(), mc)
    assert exc.value.status == "Acc_CoreAlreadyInUse" and glog() == [want]


def test_runtime_picked_cores_are_free_ones(mxq_machine, mxq_artifact, glog):
    """Without explicit cores the runtime takes free cores only, never a held one."""
    mc = qb.ModelConfig()
    mc.set_single_core_mode(None, list(mxq_machine.ALL_CORES))
    _launch(mxq_artifact(), mc)
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        _launch(mxq_artifact())
    assert exc.value.status == "Driver_FailedToClaimCores"
    assert glog() == ["Core allocation failed - available cores : 0 vs requested cores : 1"]


def test_cluster_and_global8_modes(mxq_machine, mxq_artifact, glog):
    mc = qb.ModelConfig()
    mc.set_multi_core_mode([C1])
    multi = _launch(mxq_artifact(core_mode="auto"), mc)
    assert multi.get_core_mode() == qb.CoreMode.Multi
    assert {c.cluster for c in multi.get_target_cores()} == {C1} and len(multi.get_target_cores()) == 4
    g8 = qb.Model(str(mxq_artifact(core_mode="global8")))
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        g8.launch(qb.Accelerator())
    assert glog() == ["Core allocation failed - available cores : 4 vs requested cores : 8"]
    multi.dispose()
    g8.launch(qb.Accelerator())
    assert g8.get_core_mode() == qb.CoreMode.Global8 and len(g8.get_target_cores()) == 8


def test_core_mode_must_match_the_artifact(mxq_machine, mxq_artifact, glog):
    mc = qb.ModelConfig()
    mc.set_global8_core_mode()
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Model(str(mxq_artifact()), mc)  # compiled for single only
    assert exc.value.status == "Model_MXQAndModelConfigNotMatch"
    assert glog() == ["The MXQ is compiled for core mode(s) [CoreMode.Single] (batch 1), but the ModelConfig asks for CoreMode.Global8."]
    mc.set_multi_core_mode([C0])
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Model(str(mxq_artifact(max_batch_size=2, core_mode="auto")), mc)
    assert exc.value.status == "Model_MXQAndModelConfigNotMatch"
    qb.Model(str(mxq_artifact(max_batch_size=2, core_mode="auto")), qb.ModelConfig())  # one compiled mode: Auto takes it


def test_auto_core_mode_on_a_several_mode_mxq_is_refused_naming_the_modes(mxq_machine, mxq_artifact, glog):
    """qbruntime refuses CoreMode.Auto when the MXQ holds several core modes (issue 20 §2.4;
    the simulator once took the first silently)."""
    path = str(mxq_artifact(core_mode="auto"))  # K=1, compiled for all four modes
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Model(path, qb.ModelConfig())
    assert exc.value.status == "Model_MXQAndModelConfigNotMatch"
    assert glog() == ["The MXQ is compiled for several core modes [CoreMode.Single, CoreMode.Multi, CoreMode.Global4, "
                      "CoreMode.Global8]: CoreMode.Auto cannot pick one; set one of them in the ModelConfig."]
    mc = qb.ModelConfig()
    mc.set_global4_core_mode([C0, C1])
    assert qb.Model(path, mc).get_core_mode() == qb.CoreMode.Global4


# ---------------------------------------------------------------- memory

def test_bad_alloc_when_device_memory_is_exhausted(mxq_machine, mxq_artifact, glog):
    small, batch = qb.Model(str(mxq_artifact())), qb.Model(str(mxq_artifact(max_batch_size=3)))
    kv = sum(i.size for i in small.get_cache_infos())
    assert batch.upload_bytes() - small.upload_bytes() == 2 * kv
    mxq_machine.configure(device_memory_mib=(small.upload_bytes() + batch.upload_bytes() - 1) / 2**20)
    small.launch(qb.Accelerator())
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        batch.launch(qb.Accelerator())
    assert exc.value.status == "BadAlloc" and "badalloc" in str(exc.value).lower()
    [detail] = glog()
    assert detail.startswith("Failed to allocate NPU memory for model upload. ")
    assert f"requested {batch.upload_bytes()} bytes" in detail
    assert not hasattr(batch, "_acc")  # a failed launch sets nothing, as in qbruntime
    small.dispose()
    batch.launch(qb.Accelerator())  # memory and cores were returned


# ---------------------------------------------------------------- faults

def test_bad_alloc_at_nth_launch(mxq_machine, mxq_artifact, glog):
    mxq_machine.configure(bad_alloc_at_launch=2)
    _launch(mxq_artifact())
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        _launch(mxq_artifact())
    assert exc.value.status == "BadAlloc"
    assert glog() == ["Failed to allocate NPU memory for model upload. (injected fault: bad_alloc_at_launch=2)"]
    _launch(mxq_artifact())


def test_infer_fail_after_n_then_recovers_with_kv_untouched(mxq_machine, mxq_artifact, glog):
    mxq_machine.configure(infer_fail_after=2, infer_fail_times=2, infer_fail_status="Model_CacheOverflow")
    m = _launch(mxq_artifact())
    m.infer([_x(3)], None, 0)
    m.infer([_x(2)], None, 3)
    before = m.dump_cache_memory(0)
    glog()
    for _ in range(2):
        with pytest.raises(qb.QbRuntimeError) as exc:
            m.infer([_x(4)], None, 5)
        assert exc.value.status == "Model_CacheOverflow"
        assert glog() == ["Injected fault: infer failed (infer_fail_after=2, infer_fail_times=2)."]
    assert m.dump_cache_memory(0) == before
    m.infer([_x(4)], None, 5)


# ---------------------------------------------------------------- clock and pace

def test_clock_advances_by_the_configured_costs(mxq_machine, mxq_artifact):
    mxq_machine.configure(infer_fixed_us=1000, infer_us_per_token=10, io_fixed_us=7, dump_us_per_kib=3, load_us_per_kib=5)
    a, b = _launch(mxq_artifact()), _launch(mxq_artifact())
    assert a.device_clock_us() == 0
    a.infer([_x(6)], None, 0)
    assert a.device_clock_us() == 2 * 7 + 1000 + 10 * 6
    b.infer([_x(1)], None, 0)  # same card, same clock
    t = 2 * 7 + 1000 + 10 * 6 + 2 * 7 + 1000 + 10
    assert a.device_clock_us() == b.device_clock_us() == t
    blobs = a.dump_cache_memory(0)
    kib = sum(map(len, blobs)) / 1024
    assert a.device_clock_us() == pytest.approx(t + 7 + 3 * kib)
    a.load_cache_memory(blobs, 0)
    assert a.device_clock_us() == pytest.approx(t + 7 + 3 * kib + 7 + 5 * kib)


def test_infer_costs_per_kind_replace_the_global_costs(mxq_machine, mxq_artifact, monkeypatch):
    mxq_machine.configure(infer_fixed_us=1000, infer_us_per_token=10, io_fixed_us=0,
                          infer_costs={"decoder": {"fixed_us": 300, "us_per_token": 2}, "eagle3_base": {"fixed_us": 1, "us_per_token": 1}})
    m = _launch(mxq_artifact())
    m.infer([_x(6)], None, 0)
    assert m.device_clock_us() == 300 + 2 * 6
    mxq_machine.configure(infer_costs={"eagle3_base": {"fixed_us": 1, "us_per_token": 1}})  # not this kind's
    m.infer([_x(1)], None, 0)
    assert m.device_clock_us() == 312 + 1000 + 10
    for bad, rule in (({"decoder": {"fixed_us": 1}}, "infer_costs['decoder']"), ([1], "must be an object")):
        with pytest.raises(ValueError, match=re.escape(rule)):
            mxq_machine.configure(infer_costs=bad)
    monkeypatch.setenv("NPUSIM_MXQ", '{"infer_costs": {"decoder": {"fixed_us": -1, "us_per_token": 0}}}')
    with pytest.raises(ValueError, match=r"NPUSIM_MXQ: infer_costs\['decoder'\]=.*must be"):
        mxq_machine.settings()


def test_pace_sleeps_for_the_simulated_cost(mxq_machine, mxq_artifact):
    m = _launch(mxq_artifact())
    mxq_machine.configure(infer_fixed_us=150_000)
    t0 = time.perf_counter()
    m.infer([_x(1)], None, 0)
    unpaced = time.perf_counter() - t0
    mxq_machine.configure(pace=True)
    t0 = time.perf_counter()
    m.infer([_x(1)], None, 0)
    paced = time.perf_counter() - t0
    assert unpaced < 0.15 <= paced
