"""vllm_npu.neuron.memory: KV budget policies, environment, blocks and concurrency
(features guide "Memory management"; neuron.md §3)."""

from __future__ import annotations

import logging

import pytest

from vllm_npu.neuron import memory as M
from vllm_npu.neuron.memory import GIB, KvBudgetError, compute_kv_budget

LOGGER = "vllm.vllm_npu.neuron"




def logs(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_cap_fraction():
    assert M.kv_cap_fraction({}) == 0.30
    assert M.kv_cap_fraction({"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": ""}) == 0.30
    assert M.kv_cap_fraction({"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": "1"}) == 1.0
    assert M.kv_cap_fraction({"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": "0.5"}) == 0.5
    for bad in ("0", "1.5", "-0.1", "abc", "nan"):
        with pytest.raises(KvBudgetError) as info:
            M.kv_cap_fraction({"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": bad})
        assert str(info.value) == \
            f"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION must be in (0, 1]. Got {bad}."
        assert isinstance(info.value, RuntimeError)


def test_cap_fraction_reads_os_environ(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "0.25")
    assert M.kv_cap_fraction() == 0.25


def test_min_budget_and_headroom_env():
    assert M.min_kv_budget_gib({}) == 1.0
    assert M.min_kv_budget_gib({"VLLM_NEURON_MIN_KV_BUDGET_GIB": "0"}) == 0.0
    assert M.min_kv_budget_gib({"VLLM_NEURON_MIN_KV_BUDGET_GIB": "2.5"}) == 2.5
    with pytest.raises(KvBudgetError, match=r"^VLLM_NEURON_MIN_KV_BUDGET_GIB must be >= 0\. "
                                            r"Got -1\.$"):
        M.min_kv_budget_gib({"VLLM_NEURON_MIN_KV_BUDGET_GIB": "-1"})
    assert M.reserved_headroom_gib({}) is None
    assert M.reserved_headroom_gib({"VLLM_NEURON_RESERVED_HEADROOM_GIB": ""}) is None
    assert M.reserved_headroom_gib({"VLLM_NEURON_RESERVED_HEADROOM_GIB": "0"}) == 0.0
    assert M.reserved_headroom_gib({"VLLM_NEURON_RESERVED_HEADROOM_GIB": "4"}) == 4.0
    with pytest.raises(KvBudgetError, match="VLLM_NEURON_RESERVED_HEADROOM_GIB must be >= 0"):
        M.reserved_headroom_gib({"VLLM_NEURON_RESERVED_HEADROOM_GIB": "x"})


def test_default_policy_cap_binds(neuron_caplog):
    b = compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=4 * GIB,
                          gpu_memory_utilization=0.9, env={})
    total = int(24 * GIB * 0.9)
    assert b.mode == "fractional_cap" and not b.headroom_mode
    assert b.total_budget == total and b.user_budget == total - 4 * GIB
    assert b.heuristic_cap == int(total * 0.30) == b.available_bytes
    assert b.effective_gpu_memory_utilization == 0.9 and b.headroom_bytes is None
    assert b.cap_fraction == 0.30 and b.min_kv_budget_gib == 1.0
    assert logs(neuron_caplog, logging.DEBUG) == [
        f"KV cache heuristic: user_budget={total - 4 * GIB} cap={int(total * 0.3)} "
        f"(total_budget={total}, total_hbm={24 * GIB}, bytes_used={4 * GIB}, "
        f"cap_fraction=0.30), effective={int(total * 0.3)}"]


def test_default_policy_weights_bind():
    b = compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=20 * GIB,
                          gpu_memory_utilization=1.0,
                          env={"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": "1"})
    assert b.available_bytes == 4 * GIB and b.available_gib == 4.0


def test_default_policy_weights_exceed_budget():
    b = compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=30 * GIB,
                          gpu_memory_utilization=0.9, env={"VLLM_NEURON_MIN_KV_BUDGET_GIB": "0"})
    assert b.user_budget == 0 and b.available_bytes == 0


def test_minimum_error_default_mode():
    with pytest.raises(KvBudgetError) as info:
        compute_kv_budget(logical_core_hbm_bytes=2 * GIB, model_weight_bytes=0,
                          gpu_memory_utilization=0.9, env={})
    assert str(info.value) == (
        "Computed KV cache budget is below minimum threshold. effective=0.54 GiB, "
        "minimum=1.00 GiB. Increase gpu_memory_utilization or lower "
        "VLLM_NEURON_MIN_KV_BUDGET_GIB.")
    assert isinstance(info.value, RuntimeError)


def test_headroom_mode():
    env = {"VLLM_NEURON_RESERVED_HEADROOM_GIB": "4", "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": "0.1"}
    b = compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=10 * GIB,
                          gpu_memory_utilization=0.5, env=env)
    assert b.mode == "headroom" and b.headroom_mode
    assert b.available_bytes == 10 * GIB  # 24 - 10 - 4: GMU 1.0, cap bypassed
    assert b.effective_gpu_memory_utilization == 1.0 and b.gpu_memory_utilization == 0.5
    assert b.heuristic_cap is None and b.headroom_bytes == 4 * GIB


def test_headroom_zero_is_explicit():
    b = compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=10 * GIB,
                          gpu_memory_utilization=0.9,
                          env={"VLLM_NEURON_RESERVED_HEADROOM_GIB": "0"})
    assert b.mode == "headroom" and b.available_bytes == 14 * GIB


def test_minimum_error_headroom_mode_hint():
    with pytest.raises(KvBudgetError) as info:
        compute_kv_budget(logical_core_hbm_bytes=24 * GIB, model_weight_bytes=20 * GIB,
                          gpu_memory_utilization=0.9,
                          env={"VLLM_NEURON_RESERVED_HEADROOM_GIB": "3.5"})
    assert str(info.value) == (
        "Computed KV cache budget is below minimum threshold. effective=0.50 GiB, "
        "minimum=1.00 GiB. Increase gpu_memory_utilization or lower "
        "VLLM_NEURON_MIN_KV_BUDGET_GIB. In headroom mode, decrease "
        "VLLM_NEURON_RESERVED_HEADROOM_GIB instead; do not increase it for this error.")


def test_cpu_budget(neuron_caplog):
    b = M.compute_cpu_kv_budget(host_available_bytes=64 * GIB, local_world_size=4,
                                gpu_memory_utilization=0.5, env={})
    assert b.mode == "cpu" and b.available_bytes == int(int(16 * GIB * 0.5) * 0.3)
    assert logs(neuron_caplog, logging.INFO) == [
        "Host memory: 64.00 GiB available, 4 local worker(s), 16.00 GiB fair-share per worker"]
    # no minimum check in CPU mode
    small = M.compute_cpu_kv_budget(host_available_bytes=GIB, local_world_size=2,
                                    gpu_memory_utilization=0.5, env={})
    assert small.available_bytes < GIB
    h = M.compute_cpu_kv_budget(host_available_bytes=64 * GIB, local_world_size=4,
                                gpu_memory_utilization=0.5,
                                env={"VLLM_NEURON_RESERVED_HEADROOM_GIB": "2"})
    assert h.mode == "cpu_headroom" and h.available_bytes == 14 * GIB
    with pytest.raises(ValueError):
        M.compute_cpu_kv_budget(host_available_bytes=GIB, local_world_size=0,
                                gpu_memory_utilization=0.5, env={})


def test_page_bytes_and_blocks(neuron_caplog):
    pb = M.page_bytes(num_layers=32, block_size=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert pb == 2 * 32 * 32 * 8 * 128 * 2
    assert M.num_blocks(10 * pb + 5, pb) == 10
    assert M.num_blocks(-5, pb) == 0
    assert M.num_blocks(10 * pb, pb, 4096) == 4096
    assert logs(neuron_caplog, logging.INFO) == [
        "Overriding num_gpu_blocks=10 with num_gpu_blocks_override=4096"]
    with pytest.raises(ValueError):
        M.num_blocks(10, 0)
    with pytest.raises(ValueError):
        M.num_blocks(10, 1, 0)


def test_max_kv_concurrency(neuron_caplog):
    assert M.max_kv_concurrency(4096, 4096, 32) == 32       # 128 blocks per sequence
    assert M.max_kv_concurrency(100, 4000, 32) == 0          # ceil(4000/32) = 125
    assert M.max_kv_concurrency(4096, 4096, 32, max_num_seqs=8) == 8
    assert logs(neuron_caplog, logging.WARNING) == []
    assert M.max_kv_concurrency(1000, 4096, 32, max_num_seqs=16) == 7
    assert logs(neuron_caplog, logging.WARNING) == [
        "max_num_seqs (16) exceeds worst-case KV cache capacity (7 concurrent requests at "
        "max_model_len=4096, 1000 blocks of 32 tokens). Effective concurrency will be capped "
        "at 7."]
    with pytest.raises(ValueError):
        M.max_kv_concurrency(10, 100, 0)
