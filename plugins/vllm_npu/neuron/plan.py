"""The Neuron plan: everything the platform decides before an engine starts, in one pure
function, :func:`build`, shared by the platform (:mod:`vllm_npu.neuron.platform`) and
``npu-harness neuron plan``.

A plan holds the compile targets (one NEFF each), the bucket lists, the KV budget and block
count with the formula's inputs, the model runner (V1/V2) with its reason, the sampling and
async decisions, and every validation error the configuration hits, each as the exception the
platform raises (its type and the vendor's message). Each rule is checked on its own, so one
start-up shows all of them; the platform raises the first. Standard library only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_npu.neuron import buckets as bk
from vllm_npu.neuron import memory, parallel, quantization, runner, sampling
from vllm_npu.neuron.neuron_config import NeuronConfig
from vllm_npu.settings import env_switch

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: Model types the simulator's NEFFs compute (the golden decoder's).
COMPUTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
UNBUILT_MODEL = ("{what} models are validated by the Neuron plugin but not executed on its NEFFs yet "
                 "(issue 11): the NEFF compute is the golden decoder (llama, qwen2, qwen3, dense, text)")
TP_UNBUILT = ("tensor/data/pipeline parallelism is validated by the Neuron plugin but not run "
              "(tensor_parallel_size={tp}, data_parallel_size={dp}, pipeline_parallel_size={pp}): one "
              "logical NeuronCore serves the model (issue 11)")


@dataclass(frozen=True)
class PlanInputs:
    """What :func:`build` reads, as plain values (taken from a ``VllmConfig`` by the platform).

    Sizes are tokens, sequences or bytes as named; ``environ`` is the process environment.
    """

    model_dir: str
    model_name: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    is_moe: bool
    sliding_window: bool
    multimodal: bool
    pooling: bool
    encoder_decoder: bool
    hf_quantization_config: Mapping[str, Any] | None
    model_weight_bytes: int
    dtype_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    block_size: int
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_dtype: str
    tensor_parallel_size: int
    data_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    enable_expert_parallel: bool
    kv_transfer_config: Mapping[str, Any] | None
    speculative_method: str | None
    structured_outputs_enforced: bool
    enforce_eager: bool
    async_scheduling: bool
    enable_lora: bool
    enable_prompt_embeds: bool
    logprobs_mode: str
    custom_logits_processors: bool
    scheduling_policy: str
    executor_backend: str | None
    cli_quantization: str | None
    additional_config: Mapping[str, Any] | None
    platform_target: str
    logical_core_hbm_bytes: int
    target: str
    environ: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    """The result of :func:`build` (see the module docstring). ``errors`` holds the exceptions
    in check order; :meth:`to_dict` is the JSON the planning tool prints and the worker reads."""

    data: dict[str, Any]
    errors: list[BaseException]

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def to_dict(self) -> dict[str, Any]:
        return {**self.data, "errors": [f"{type(e).__name__}: {e}" for e in self.errors]}


def _check(errors: list[BaseException], fn: Callable[[], Any], default: Any = None) -> Any:
    try:
        return fn()
    except (ValueError, RuntimeError, AssertionError, NotImplementedError, TypeError) as exc:
        errors.append(exc)
        return default


def build(i: PlanInputs) -> Plan:
    """Resolve the plan of ``i`` (module docstring); never raises for a bad configuration
    (the errors are in :attr:`Plan.errors`)."""
    errors: list[BaseException] = []
    env = dict(i.environ)
    data: dict[str, Any] = {"target": i.target, "platform_target": i.platform_target, "model_dir": i.model_dir,
                            "model_name": i.model_name, "model_weight_bytes": i.model_weight_bytes,
                            "max_model_len": i.max_model_len, "block_size": i.block_size,
                            "geometry": {"num_layers": i.num_layers, "num_kv_heads": i.num_kv_heads,
                                         "head_dim": i.head_dim},
                            # --enable-prompt-embeds: the prefill NEFFs take inputs_embeds
                            "prompt_embeds": bool(i.enable_prompt_embeds)}
    ncfg = _check(errors, lambda: NeuronConfig.from_additional_config(i.additional_config))
    if ncfg is None:
        return Plan(data, errors)

    # sampling and async
    ods = ncfg.on_device_sampling
    odsc = ncfg.on_device_sampling_config
    data["on_device_sampling"] = ods
    data["max_top_k"] = int(odsc.max_top_k) if odsc is not None else 256
    data["deterministic"] = bool(odsc.deterministic) if odsc is not None else False
    async_on = _check(errors, lambda: sampling.check_async(
        async_scheduling=i.async_scheduling, ods_enabled=ods, structured_outputs=i.structured_outputs_enforced,
        speculative=i.speculative_method is not None), default=False)
    data["async_scheduling"] = bool(async_on)

    # buckets
    plan = _check(errors, lambda: bk.resolve_buckets(
        max_num_batched_tokens=i.max_num_batched_tokens, max_model_len=i.max_model_len,
        max_num_seqs=i.max_num_seqs, block_size=i.block_size, neuron_config=ncfg,
        enable_prefix_caching=i.enable_prefix_caching))
    if plan is not None:
        targets = plan.compile_targets()
        data.update({
            "num_batched_tokens_buckets": list(plan.num_batched_tokens_buckets),
            "kv_segment_size_buckets": list(plan.kv_segment_size_buckets) if plan.kv_segment_size_buckets else None,
            "kv_segment": int(plan.kv_segment_size_buckets[0]) if plan.kv_segment_size_buckets else 0,
            "segmented_prefill": plan.segmented,
            "num_seqs_buckets": list(plan.num_seqs_buckets),
            "decode_context_length_buckets": (list(plan.decode_context_length_buckets)
                                              if plan.decode_context_length_buckets else None),
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "compile_targets": targets,
            "compile_target_names": [plan.target_name(t) for t in targets],
            "prefill_names": sorted({f"prefill_s{b}" for b in plan.num_batched_tokens_buckets}),
            "decode_names": [f"decode_b{b}" for b in plan.num_seqs_buckets],
        })

    # parallelism
    ep = _check(errors, lambda: parallel.validate_parallelism(
        tp=i.tensor_parallel_size, dp=i.data_parallel_size, enable_expert_parallel=i.enable_expert_parallel,
        neuron_config=ncfg, kv_transfer_config=i.kv_transfer_config, scheduler_policy=i.scheduling_policy,
        distributed_executor_backend=i.executor_backend, env=env))
    data["ep_degree"] = ep

    # quantization
    kv_dtype = _check(errors, lambda: quantization.resolve_kv_cache_dtype(
        i.kv_cache_dtype, segmented_prefill=bool(data.get("segmented_prefill")), fp8_packed_kv=ncfg.fp8_packed_kv),
        default="auto")
    data["kv_dtype"] = "fp8_e4m3" if kv_dtype not in (None, "auto") else "auto"
    data["fp8_clamp_max"] = quantization.fp8_clamp_max(i.platform_target)
    _check(errors, lambda: quantization.validate_mxfp4(i.platform_target, i.model_type, ncfg.quantization))
    _check(errors, lambda: quantization.validate_checkpoint_quantization(i.hf_quantization_config,
                                                                         i.cli_quantization))

    # the runner
    choice = _check(errors, lambda: runner.select_runner(runner.RunnerInputs(
        env_value=env.get("VLLM_USE_V2_MODEL_RUNNER"), is_moe=i.is_moe,
        expert_parallel=i.enable_expert_parallel or (ep or 1) > 1, data_parallel_size=i.data_parallel_size,
        sliding_window=i.sliding_window, multimodal=i.multimodal, pooling=i.pooling,
        encoder_decoder=i.encoder_decoder, speculative_decoding=i.speculative_method is not None,
        structured_outputs=i.structured_outputs_enforced, lora=i.enable_lora,
        prompt_embeds=i.enable_prompt_embeds, custom_logits_processors=i.custom_logits_processors,
        logprobs_mode=i.logprobs_mode,
        decode_context_length_buckets=ncfg.decode_context_length_buckets is not None,
        component_dp=bool(ncfg.component_dp), on_device_sampling=ods, fp8_packed_kv=ncfg.fp8_packed_kv,
        gk_decode=ncfg.gk_decode, pipeline_parallel_size=i.pipeline_parallel_size,
        decode_context_parallel_size=i.decode_context_parallel_size, enforce_eager=i.enforce_eager,
        kv_offloading=i.kv_transfer_config is not None and "offload" in str(i.kv_transfer_config).lower())))
    if choice is not None:
        data["runner"] = asdict(choice)

    # memory: the budget formula on the simulated core
    budget = _check(errors, lambda: memory.compute_kv_budget(
        logical_core_hbm_bytes=i.logical_core_hbm_bytes, model_weight_bytes=i.model_weight_bytes,
        gpu_memory_utilization=i.gpu_memory_utilization, env=env))
    page = memory.page_bytes(i.num_layers, i.block_size, i.num_kv_heads, i.head_dim,
                             1 if data["kv_dtype"] != "auto" else i.dtype_bytes)
    data["page_bytes"] = page
    if budget is not None:
        data["kv_budget"] = asdict(budget)
        blocks = memory.num_blocks(budget.available_bytes, page, i.num_gpu_blocks_override)
        data["num_blocks"] = blocks
        data["max_kv_concurrency"] = memory.max_kv_concurrency(blocks, i.max_model_len, i.block_size,
                                                              i.max_num_seqs)

    # what the NEFFs compute here
    if i.model_type not in COMPUTED_MODEL_TYPES or i.is_moe or i.multimodal or i.pooling or i.encoder_decoder:
        what = ("Mixture-of-Experts" if i.is_moe else "multimodal" if i.multimodal else "pooling" if i.pooling
                else "encoder-decoder" if i.encoder_decoder else f"{i.model_type!r}")
        errors.append(NotImplementedError(UNBUILT_MODEL.format(what=what)))
    if i.tensor_parallel_size * i.data_parallel_size * i.pipeline_parallel_size > 1:
        errors.append(NotImplementedError(TP_UNBUILT.format(
            tp=i.tensor_parallel_size, dp=i.data_parallel_size, pp=i.pipeline_parallel_size)))
    if i.speculative_method is not None:
        errors.append(NotImplementedError(
            f"speculative decoding ({i.speculative_method}) is not built in the Neuron plugin (issue 11)"))
    return Plan(data, errors)


def plan_only(environ: Mapping[str, str] = os.environ) -> bool:
    """``NPU_HARNESS_NEURON_PLAN_ONLY=1`` (set by ``npu-harness neuron plan``): the platform
    records the plan with its errors instead of raising the first."""
    return env_switch("NPU_HARNESS_NEURON_PLAN_ONLY", default=False, environ=environ)
