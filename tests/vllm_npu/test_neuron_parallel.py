"""vllm_npu.neuron.parallel: EP degree, component DP, vision encoder TP/DP and the other
parallelism rules (features guide; neuron.md §5)."""

from __future__ import annotations


import pytest

from vllm_npu.neuron import parallel as PL
from vllm_npu.neuron.neuron_config import NeuronConfig
from vllm_npu.neuron.parallel import ParallelConfigError, resolve_ep_degree, validate_parallelism


def ep(**kw):
    args = dict(tp=8, dp=1, enable_expert_parallel=False, ep_degree=1)
    args.update(kw)
    return resolve_ep_degree(**args)


def msg(fn, *a, **kw):
    with pytest.raises(ParallelConfigError) as info:
        fn(*a, **kw)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_ep_off():
    assert ep() == 1
    assert msg(ep, ep_degree=2) == "ep_degree=2 requires --enable-expert-parallel to be set."


def test_ep_default_is_full_ep():
    assert ep(enable_expert_parallel=True) == 8          # --tensor-parallel-size
    assert ep(enable_expert_parallel=True, dp=4) == 32   # TP x DP with DP


def test_ep_explicit_dp1():
    assert ep(enable_expert_parallel=True, ep_degree=2) == 2
    assert ep(enable_expert_parallel=True, ep_degree=8) == 8
    assert msg(ep, enable_expert_parallel=True, ep_degree=3) == \
        "world_size (TP*DP=8) must be divisible by ep_degree (3)."
    assert msg(ep, enable_expert_parallel=True, ep_degree=16) == \
        "world_size (TP*DP=8) must be divisible by ep_degree (16)."


def test_ep_with_dp_requires_tp_times_dp():
    assert ep(enable_expert_parallel=True, dp=2, ep_degree=16) == 16
    assert msg(ep, enable_expert_parallel=True, dp=2, ep_degree=8) == (
        "Combining DP with EP requires ep_degree = TP × DP (8 × 2 = 16), got ep_degree=8. "
        "Other combinations are rejected.")


@pytest.mark.parametrize("bad", [0, -1, "2", True])
def test_ep_positive(bad):
    assert msg(ep, ep_degree=bad) == f"ep_degree must be a positive integer, got {bad}"


def test_component_dp():
    ok = {"kv_role": "kv_consumer"}
    PL.validate_component_dp({"attention_dp_size": 1}, dp=1, kv_transfer_config=None)
    PL.validate_component_dp({"attention_dp_size": 2}, dp=2, kv_transfer_config=ok)
    PL.validate_component_dp({"mlp_dp_size": 2}, dp=2, kv_transfer_config={"kv_role": "kv_both"})
    active = {"attention_dp_size": 2, "embedding_dp_size": 1, "mlp_dp_size": 4}
    assert msg(PL.validate_component_dp, active, dp=2, kv_transfer_config=None) == (
        "Component DP (attention_dp_size=2, mlp_dp_size=4) requires disaggregated inference "
        "(--kv-transfer-config). Single-node serving without DI is not supported with "
        "component DP.")
    assert msg(PL.validate_component_dp, active, dp=2,
               kv_transfer_config={"kv_role": "kv_producer"}) == (
        "Component DP (attention_dp_size=2, mlp_dp_size=4) is only supported on the decode "
        "server (kv_role='kv_consumer' or 'kv_both'), got kv_role='kv_producer'. The prefill "
        "server should not set component DP sizes > 1.")
    assert msg(PL.validate_component_dp, active, dp=1, kv_transfer_config=ok) == (
        "Component DP (attention_dp_size=2, mlp_dp_size=4) requires --data-parallel-size >= 2. "
        "Component DP shards modules across DP replicas and needs multiple DP ranks to function.")
    assert PL.COMPONENT_DP_DENSE_LOG == (
        "Component DP enabled — setting num_experts=1 to preserve data_parallel_size for "
        "cross-DP process groups")


def test_encoder_tp_dp():
    r = PL.resolve_encoder_tp_dp
    assert r(8, None, None) == (1, 8)
    assert r(8, 2, None) == (2, 4)
    assert r(8, None, 2) == (4, 2)
    assert r(8, 1, 8) == (1, 8)
    assert msg(r, 8, 3, None) == "world_size (8) must be divisible by vision tp_size (3)"
    assert msg(r, 8, None, 3) == "world_size (8) must be divisible by vision dp_size (3)"
    assert msg(r, 8, 2, 2) == "vision tp_size (2) * dp_size (2) = 4 must equal world_size (8)"
    assert msg(r, 8, 0, None) == "vision tp_size must be a positive integer, got 0"
    assert msg(r, 8, None, -1) == "vision dp_size must be a positive integer, got -1"




def test_executor_backend(neuron_caplog):
    caplog = neuron_caplog
    r = PL.resolve_executor_backend
    assert r(None, world_size=1, env={}) == "uni"
    assert r(None, world_size=8, env={}) == "mp"
    assert r("uni", world_size=8, env={"NEURON_RT_VISIBLE_CORES": "0-3"}) == "uni"
    assert r("ray", world_size=8, env={}) == "mp"
    assert [rec.getMessage() for rec in caplog.records] == [
        "Neuron supports the 'mp' and 'uni' distributed executor backends; got 'ray', using 'mp'."]
    with pytest.raises(RuntimeError) as info:
        r("mp", world_size=2, env={"NEURON_RT_VISIBLE_CORES": "0-1"})
    assert str(info.value) == (
        "NEURON_RT_VISIBLE_CORES cannot be used with multi-processing execution on vLLM. Set "
        "NEURON_VISIBLE_DEVICES to control device visibility.")


def test_multinode_and_policy():
    PL.validate_multinode(1, "127.0.0.1")
    PL.validate_multinode(2, "10.0.0.1")
    for addr in ("127.0.0.1", "localhost", "::1"):
        assert "loopback" in msg(PL.validate_multinode, 2, addr)
    PL.validate_scheduler_policy("fcfs")
    assert msg(PL.validate_scheduler_policy, "priority") == \
        "The Neuron scheduler supports only scheduling policy 'fcfs', got 'priority'."


def test_validate_parallelism():
    nc = NeuronConfig.from_additional_config({"neuron_config": {"ep_degree": 2}})
    assert validate_parallelism(tp=8, dp=1, enable_expert_parallel=True, neuron_config=nc,
                                env={}) == 2
    assert validate_parallelism(tp=8, dp=1, enable_expert_parallel=False,
                                neuron_config=NeuronConfig(), env={}) == 1
    with pytest.raises(ParallelConfigError, match="requires --enable-expert-parallel"):
        validate_parallelism(tp=8, dp=1, enable_expert_parallel=False, neuron_config=nc, env={})
    cdp = NeuronConfig.from_additional_config({"neuron_config": {"attention_dp_size": 2}})
    with pytest.raises(ParallelConfigError, match="requires disaggregated inference"):
        validate_parallelism(tp=8, dp=2, enable_expert_parallel=False, neuron_config=cdp, env={})
    assert validate_parallelism(tp=8, dp=2, enable_expert_parallel=False, neuron_config=cdp,
                                kv_transfer_config={"kv_role": "kv_both"}, env={}) == 1
    with pytest.raises(ParallelConfigError, match="fcfs"):
        validate_parallelism(tp=8, dp=1, enable_expert_parallel=False, neuron_config=nc,
                             scheduler_policy="priority", env={})
    with pytest.raises(RuntimeError, match="NEURON_RT_VISIBLE_CORES"):
        validate_parallelism(tp=8, dp=1, enable_expert_parallel=False,
                             neuron_config=NeuronConfig(),
                             env={"NEURON_RT_VISIBLE_CORES": "0"})
