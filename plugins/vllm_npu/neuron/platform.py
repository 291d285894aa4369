"""The Neuron vLLM platform: the plan (buckets, runner, memory, parallelism, sampling,
quantization), the Neuron scheduler, then the NEFF worker.

Activated by the ``vllm.platform_plugins`` entry point ``neuron`` when ``NPU_HARNESS_TARGET``
is ``neuron-sim`` or ``neuron-hw``. What every NPU platform shares (vLLM's CPU kernels chosen
for this CPU, the worker hook, eager and synchronous steps) is in
:class:`vllm_npu._platform.NpuPlatform`. :meth:`NeuronPlatform.configure` reads the
``VllmConfig`` into :class:`vllm_npu.neuron.plan.PlanInputs`, builds the plan
(:func:`vllm_npu.neuron.plan.build`), raises its first error, and otherwise:

* ``block_size`` 32 unless the user gave one (``update_block_size_for_backend`` of vllm-neuron);
* chunked prefill on, ``max_num_batched_tokens`` = M, the scheduler class
  :class:`vllm_npu.neuron.scheduler.NeuronScheduler` (one prefill per step, never mixed, padded);
* the plan in ``additional_config["npu_harness_neuron_plan"]`` for the scheduler and worker;
* the runner decision (``VLLM_USE_V2_MODEL_RUNNER`` read by :mod:`vllm_npu.neuron.runner`) in
  the plan, which every engine and worker process of the server reads (the seed: resolved
  once per server). The variable is then removed from the environment: vLLM's own
  ``VllmConfig.use_v2_model_runner`` is the CUDA runner's choice and, on a build without
  Triton, rejects ``VLLM_USE_V2_MODEL_RUNNER=1`` ("Model Runner V2 requires Triton."). So here
  the plan's ``runner`` and the worker's ``Using the standalone V2 Neuron model runner.`` line
  are authoritative, not that property (a documented difference from the seed).

Async scheduling: the plan records whether it is on (vLLM's default, ``--no-async-scheduling``,
and the seed's rules: it needs on-device sampling); vLLM's own async pipeline stays off (steps
run synchronously, as on every NPU platform here) and the worker counts the steps the async
flow would overlap or break (:meth:`vllm_npu.neuron.worker.NeuronWorker._async_flow`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vllm_npu.vllm_version import require_supported_vllm

require_supported_vllm("neuron")  # before any vLLM import: another vLLM is refused by name

from vllm_npu._platform import NpuPlatform

logger = logging.getLogger("vllm.vllm_npu.neuron")

WORKER_CLS = "vllm_npu.neuron.worker.NeuronWorker"
SCHEDULER_CLS = "vllm_npu.neuron.scheduler.NeuronScheduler"
DEFAULT_BLOCK_SIZE = 32
#: The variable the plan fixes for every process of the server.
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _weight_bytes(model_dir: str) -> int:
    d = Path(model_dir)
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) if d.is_dir() else 0


def plan_inputs(vllm_config: Any, async_scheduling: bool, environ: dict[str, str], enforce_eager: bool = False) -> Any:
    """:class:`vllm_npu.neuron.plan.PlanInputs` of ``vllm_config`` on this host's device."""
    from vllm_npu.neuron.plan import PlanInputs
    from vllm_npu.neuron.runtime import load_runtime

    target = environ.get("NPU_HARNESS_TARGET", "neuron-sim")
    dev = load_runtime(target).device_info()
    mc, sched, cache, par = (vllm_config.model_config, vllm_config.scheduler_config,
                             vllm_config.cache_config, vllm_config.parallel_config)
    hf = mc.hf_config
    text = getattr(hf, "text_config", None) or hf
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    sliding = bool(getattr(text, "sliding_window", None)) and bool(getattr(text, "use_sliding_window", True))
    spec = vllm_config.speculative_config
    quant = getattr(hf, "quantization_config", None)
    return PlanInputs(
        model_dir=str(mc.model), model_name=str(mc.served_model_name or mc.model),
        model_type=str(getattr(hf, "model_type", "")),
        num_layers=int(text.num_hidden_layers), num_kv_heads=int(getattr(text, "num_key_value_heads", heads) or heads),
        head_dim=head_dim, is_moe=experts > 1, sliding_window=sliding,
        multimodal=bool(getattr(mc, "is_multimodal_model", False)),
        pooling=getattr(mc, "runner_type", "generate") == "pooling",
        encoder_decoder=bool(getattr(mc, "is_encoder_decoder", False)),
        hf_quantization_config=dict(quant) if isinstance(quant, dict) else (quant.to_dict() if quant is not None
                                                                            and hasattr(quant, "to_dict") else None),
        model_weight_bytes=_weight_bytes(str(mc.model)), dtype_bytes=int(mc.dtype.itemsize),
        max_model_len=int(mc.max_model_len), max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens) if sched.max_num_batched_tokens else None,
        block_size=int(cache.block_size) if cache.user_specified_block_size else DEFAULT_BLOCK_SIZE,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        gpu_memory_utilization=float(cache.gpu_memory_utilization), kv_cache_dtype=str(cache.cache_dtype),
        tensor_parallel_size=int(par.tensor_parallel_size), data_parallel_size=int(par.data_parallel_size),
        pipeline_parallel_size=int(par.pipeline_parallel_size),
        decode_context_parallel_size=int(getattr(par, "decode_context_parallel_size", 1) or 1),
        enable_expert_parallel=bool(par.enable_expert_parallel),
        kv_transfer_config=(vllm_config.kv_transfer_config.model_dump() if getattr(vllm_config, "kv_transfer_config", None)
                            is not None and hasattr(vllm_config.kv_transfer_config, "model_dump")
                            else (vars(vllm_config.kv_transfer_config) if getattr(vllm_config, "kv_transfer_config", None)
                                  is not None else None)),
        speculative_method=(getattr(spec, "method", None) or "unknown") if spec is not None else None,
        structured_outputs_enforced=False, enforce_eager=bool(enforce_eager),
        async_scheduling=bool(async_scheduling), enable_lora=vllm_config.lora_config is not None,
        enable_prompt_embeds=bool(getattr(mc, "enable_prompt_embeds", False)),
        logprobs_mode=str(getattr(mc, "logprobs_mode", "raw_logprobs")),
        custom_logits_processors=bool(getattr(mc, "logits_processors", None)),
        scheduling_policy=str(getattr(sched, "policy", "fcfs")),
        executor_backend=par.distributed_executor_backend if isinstance(par.distributed_executor_backend, str) else None,
        cli_quantization=mc.quantization if mc.quantization and not quant else None,
        additional_config=vllm_config.additional_config, platform_target=dev.target,
        logical_core_hbm_bytes=int(dev.hbm_bytes_per_logical_core), target=target, environ=dict(environ))


#: Structured outputs (and ``tool_choice`` ``required`` / named, which vLLM turns into them)
#: with CPU sampling, refused as the AWS Neuron guide describes the device (seed 002, "Tool
#: calling", Note).
CPU_SAMPLING_GRAMMAR_REFUSAL = (
    "structured outputs (response_format, structured_outputs, and tool_choice \"required\" or a named tool) "
    "need on-device sampling on Neuron: with CPU sampling the logit_mask is not applied and the model may "
    "produce tokens that violate the grammar (the AWS Neuron guide). Leave on_device_sampling_config on.")


class NeuronPlatform(NpuPlatform):
    """Out-of-tree platform for AWS Trainium (Trn2/Trn3) NeuronCores (module docstring)."""

    worker_cls = WORKER_CLS
    npu_name = "neuron"
    device_control_env_var: str = "NEURON_VISIBLE_DEVICES"

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """The shared step, then ``PROMETHEUS_MULTIPROC_DIR`` unless the user set it
        (:func:`vllm_npu.neuron.metrics.ensure_multiproc_dir`): vLLM calls this in the process
        that builds the engine's configuration (the API server, or ``vllm.LLM``'s), before it
        creates its metrics and starts the engine core, which inherits the variable. Here and
        not at platform resolution, so that the directory belongs to the process that serves
        (one made while a process resolves its platform would be shared by whatever forks
        from that process, as the harness's prefork zygotes do)."""
        super().pre_register_and_update(parser)
        from vllm_npu.neuron.metrics import ensure_multiproc_dir

        ensure_multiproc_dir()

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """Capture the async-scheduling setting vLLM resolved, then the shared steps (which
        turn vLLM's async pipeline off) and :meth:`configure`."""
        cls._async_requested = bool(vllm_config.scheduler_config.async_scheduling)
        mc = vllm_config.model_config
        cls._eager_requested = bool(mc.enforce_eager) if mc is not None else False
        super().check_and_update_config(vllm_config)

    @classmethod
    def configure(cls, vllm_config: Any) -> None:
        """Build the plan and apply it (module docstring).

        Raises:
            the plan's first error: the vendor's ``ValueError``/``RuntimeError`` texts for
            buckets, memory, parallelism, quantization, sampling and runner settings;
            ``NotImplementedError`` (issue 11) for what is validated but not executed.
        """
        from vllm_npu.neuron import plan as planmod
        from vllm_npu.neuron.worker import PLAN_KEY

        extra = vllm_config.additional_config
        if isinstance(extra, dict) and isinstance(extra.get(PLAN_KEY), dict):
            return  # configured already (the API server's config, passed to the engine process)
        inputs = plan_inputs(vllm_config, getattr(cls, "_async_requested", True), dict(os.environ),
                             getattr(cls, "_eager_requested", False))
        plan = planmod.build(inputs)
        raw = os.environ.pop(V2_ENV, None)  # read into the plan; vLLM's own check would need Triton
        if planmod.plan_only():
            extra = dict(extra) if isinstance(extra, dict) else {}
            vllm_config.additional_config = {**extra, PLAN_KEY: plan.to_dict()}
            return
        plan.raise_first()
        data = plan.to_dict()
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        cache.block_size = int(data["block_size"])
        sched.enable_chunked_prefill = True
        sched.max_num_batched_tokens = int(data["max_num_batched_tokens"])
        if getattr(sched, "max_num_scheduled_tokens", None) is not None:
            sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, sched.max_num_batched_tokens)
        sched.scheduler_cls = SCHEDULER_CLS
        use_v2 = bool(data["runner"]["use_v2"])
        if raw is not None:
            logger.info("%s=%s is resolved by the Neuron plugin (Model Runner %s) and removed from the "
                        "environment: vLLM's own runner selection needs Triton, which the Neuron runtime "
                        "does not use", V2_ENV, raw, "V2" if use_v2 else "V1")
        if data["runner"].get("logged"):
            logger.warning("%s", data["runner"]["logged"])
        extra = dict(extra) if isinstance(extra, dict) else {}
        vllm_config.additional_config = {**extra, PLAN_KEY: data}
        cls._ods = bool(data["on_device_sampling"])
        cls._async_on = bool(data["async_scheduling"])
        logger.info("Neuron platform: %s (%s), %d NEFFs %s, block_size %d, Model Runner %s (%s), %s sampling, "
                    "async scheduling %s", data["target"], data["platform_target"], len(data["compile_targets"]),
                    data["compile_target_names"], data["block_size"], "V2" if use_v2 else "V1",
                    data["runner"]["reason"], "on-device" if data["on_device_sampling"] else "CPU",
                    "on" if data["async_scheduling"] else "off")

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Refuse what the NEFFs do not do (vLLM answers HTTP 400 naming the parameter).

        Raises:
            NeuronRequestError: pooling requests, prompt logprobs of a prompt sent as
                embeddings (the embeddings themselves are served: the prefill NEFFs take
                ``inputs_embeds``), and with on-device sampling every parameter beyond temperature, top_k and top_p
                (:func:`vllm_npu.neuron.sampling.ods_refusals`: structured outputs are served,
                under the guide's on-device bitmask, without async scheduling); with CPU sampling what the
                host sampler cannot honour (:func:`vllm_npu._platform.refuse_unsampled`), and
                structured outputs and grammar-constrained tool calls
                (:data:`CPU_SAMPLING_GRAMMAR_REFUSAL`: the guide says the board applies no
                grammar mask with CPU sampling).
        """
        from vllm.sampling_params import SamplingParams

        from vllm_npu._platform import refuse_unsampled
        from vllm_npu.neuron.errors import NeuronRequestError

        ods = getattr(cls, "_ods", True)  # set by configure in this process
        if not ods:
            refuse_unsampled(processed_inputs, params, worker="Neuron worker (CPU sampling)", error=NeuronRequestError,
                             serves_prompt_embeds=True)
            if getattr(params, "structured_outputs", None) is not None:
                # The AWS Neuron guide (seed 002, "Tool calling", Note): "tool_choice="required" and
                # named tool choice require on-device sampling. With CPU sampling, the logit_mask is
                # not applied and the model may produce tokens that violate the grammar FSM." Serving
                # it here under vLLM's host bitmask would pass where the board breaks the grammar.
                raise NeuronRequestError(CPU_SAMPLING_GRAMMAR_REFUSAL, parameter="response_format")
            return
        if not isinstance(params, SamplingParams):
            raise NeuronRequestError("the Neuron worker serves text generation only (no pooling requests)")
        if isinstance(processed_inputs, dict) and processed_inputs.get("prompt_embeds") is not None:
            from vllm_npu._platform import refuse_embeds_logprobs

            refuse_embeds_logprobs(params, NeuronRequestError)  # the prefill NEFFs take the embeddings
        from vllm_npu.neuron.sampling import ods_refusals

        fields = {name: getattr(params, name, None) for name in (
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
            "allowed_token_ids", "bad_words", "logits_processors", "min_tokens", "n",
            "structured_outputs")}
        refused = ods_refusals(fields, async_scheduling=getattr(cls, "_async_on", False))
        if getattr(params, "prompt_logprob_token_ids", None) is not None:
            refused.append(("prompt_logprob_token_ids", "prompt_logprob_token_ids is not supported"))
        if getattr(params, "thinking_token_budget", None) not in (None, -1):
            refused.append(("thinking_token_budget", f"thinking_token_budget={params.thinking_token_budget} is not "
                                                     "supported (no reasoning-budget logits processor runs)"))
        if refused:
            raise NeuronRequestError(" ".join(text if text.endswith(".") else text + "." for _p, text in refused),
                                     parameter=refused[0][0])

    @classmethod
    def log_warnings(cls) -> None:
        logger.info("Neuron platform active (NPU_HARNESS_TARGET=%s)", os.environ.get("NPU_HARNESS_TARGET", ""))
