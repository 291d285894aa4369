"""Which Neuron model runner serves: Model Runner V2 (MRv2) or the original MRv1.

Per the seed (features guide, "Model Runner V2", Neuron 2.33 / vLLM Neuron 0.29.0.1.2.0),
which supersedes the reference's older "vllm-neuron has no V2 runner" text:

=============================  ====================================================
``VLLM_USE_V2_MODEL_RUNNER``   behaviour
=============================  ====================================================
unset (default)                MRv2 for supported dense configurations, MRv1 otherwise
``0``                          always MRv1
``1``                          always MRv2, no fallback; unsupported features warn
=============================  ====================================================

With the variable unset, these **model types select MRv1 silently**: MoE / expert
parallelism, sliding-window attention, multimodal, pooling, encoder-decoder, hybrid,
attention-free and diffusion models. For a dense model these **features select MRv1** and log
"Neuron Model Runner V2 does not yet support <features>; using V1.": speculative decoding,
structured-outputs enforcement, LoRA, prompt embeddings, custom logits processors, logprobs
modes other than ``raw_logprobs``/``raw_logits``, decode context-length buckets, component DP,
CPU sampling, ``fp8_packed_kv`` / ``gk_decode``, PP/DCP/PCP > 1, ``enforce_eager``, KV
offloading, EPD encoder-cache transfer, tensor capture and tensor replacement. (The seed says
"for most of them" the line is logged without saying which are silent; we log all of them.)

With ``=1`` the server logs "VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with
unsupported features (<features>); execution may fail." except for MoE / EP models without DP
and sliding-window models, which start on MRv2 without the warning.

MRv2 itself logs :data:`V2_LOG_LINE` at startup (the worker's job, not this module's).

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_npu.settings import parse_switch

__all__ = ["ENV_VAR", "V2_LOG_LINE", "RAW_LOGPROBS_MODES", "RunnerInputs", "RunnerChoice",
           "parse_v2_env", "select_runner", "model_kind_blockers", "dense_feature_blockers"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"
#: Logged by the MRv2 worker at startup; its absence means MRv1.
V2_LOG_LINE = "Using the standalone V2 Neuron model runner."
#: Logprobs modes MRv2 supports.
RAW_LOGPROBS_MODES: frozenset[str] = frozenset({"raw_logprobs", "raw_logits"})



def parse_v2_env(value: str | None) -> bool | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` -> None (unset or blank), False (off) or True (on): a
    switch (:func:`vllm_npu.settings.parse_switch`, ``0 false no off`` / ``1 true yes on``, the
    reference's truthy words).

    Raises:
        SettingError: any other value (a ValueError naming the variable, the value and the
            accepted words).
    """
    return None if value is None or not value.strip() else parse_switch(value, name=ENV_VAR)


@dataclass(frozen=True)
class RunnerInputs:
    """Plain facts the runner choice depends on (the platform fills them from vLLM's config).

    Model kinds (MRv1 without a log line when the variable is unset):
        is_moe: a Mixture-of-Experts model (e.g. gpt-oss).
        expert_parallel: ``--enable-expert-parallel`` or ``ep_degree > 1``.
        sliding_window, multimodal, pooling, encoder_decoder, hybrid, attention_free,
        diffusion: the model type.

    Dense features (MRv1 with the "does not yet support" line):
        speculative_decoding: ``--speculative-config`` set (EAGLE3, P-EAGLE, DFlash).
        structured_outputs: structured-outputs / tool-calling enforcement
            (``enable_structured_outputs``).
        lora, prompt_embeds, custom_logits_processors: as named.
        logprobs_mode: vLLM's ``logprobs_mode``; MRv2 supports ``raw_logprobs``/``raw_logits``.
        decode_context_length_buckets: ``neuron_config.decode_context_length_buckets`` set.
        component_dp: any of ``attention/embedding/mlp/lm_head_dp_size > 1``.
        on_device_sampling: False = CPU sampling (``on_device_sampling_config: null``).
        fp8_packed_kv, gk_decode: the ``neuron_config`` switches.
        pipeline_parallel_size, decode_context_parallel_size, prefill_context_parallel_size:
            degrees; > 1 selects MRv1.
        enforce_eager, kv_offloading, ec_transfer (EPD encoder-cache transfer),
        tensor_capture, tensor_replacement: as named.

    Other:
        data_parallel_size: ``--data-parallel-size`` (MoE/EP with DP > 1 warns under ``=1``).
        env_value: the raw ``VLLM_USE_V2_MODEL_RUNNER`` (None = unset).
    """

    is_moe: bool = False
    expert_parallel: bool = False
    sliding_window: bool = False
    multimodal: bool = False
    pooling: bool = False
    encoder_decoder: bool = False
    hybrid: bool = False
    attention_free: bool = False
    diffusion: bool = False
    speculative_decoding: bool = False
    structured_outputs: bool = False
    lora: bool = False
    prompt_embeds: bool = False
    custom_logits_processors: bool = False
    logprobs_mode: str = "raw_logprobs"
    decode_context_length_buckets: bool = False
    component_dp: bool = False
    on_device_sampling: bool = True
    fp8_packed_kv: bool = False
    gk_decode: bool = False
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    enforce_eager: bool = False
    kv_offloading: bool = False
    ec_transfer: bool = False
    tensor_capture: bool = False
    tensor_replacement: bool = False
    data_parallel_size: int = 1
    env_value: str | None = None


@dataclass(frozen=True)
class RunnerChoice:
    """The resolved runner.

    Attributes:
        use_v2: Model Runner V2 (True) or V1.
        reason: why, in a few words.
        features: the model kinds / features that selected MRv1 (or, when forced with ``=1``,
            the unsupported ones MRv2 runs anyway); empty when none.
        logged: the selection-time log line emitted (info for the V1 fallback, warning for the
            forced V2), None when the choice was silent.
    """

    use_v2: bool
    reason: str
    features: tuple[str, ...]
    logged: str | None


def model_kind_blockers(inputs: RunnerInputs) -> tuple[str, ...]:
    """The model kinds of ``inputs`` that are not eligible for MRv2, in the seed's order."""
    kinds = [
        (inputs.is_moe, "Mixture-of-Experts"), (inputs.expert_parallel, "expert parallelism"),
        (inputs.sliding_window, "sliding-window attention"), (inputs.multimodal, "multimodal"),
        (inputs.pooling, "pooling"), (inputs.encoder_decoder, "encoder-decoder"),
        (inputs.hybrid, "hybrid"), (inputs.attention_free, "attention-free"),
        (inputs.diffusion, "diffusion"),
    ]
    return tuple(name for on, name in kinds if on)


def dense_feature_blockers(inputs: RunnerInputs) -> tuple[str, ...]:
    """The features of ``inputs`` MRv2 does not yet support, in the seed's order."""
    feats = [
        (inputs.speculative_decoding, "speculative decoding"),
        (inputs.structured_outputs, "structured outputs (enable_structured_outputs)"),
        (inputs.lora, "LoRA"), (inputs.prompt_embeds, "prompt embeddings"),
        (inputs.custom_logits_processors, "custom logits processors"),
        (inputs.logprobs_mode not in RAW_LOGPROBS_MODES,
         f"logprobs_mode={inputs.logprobs_mode}"),
        (inputs.decode_context_length_buckets, "decode_context_length_buckets"),
        (inputs.component_dp, "component data parallelism"),
        (not inputs.on_device_sampling, "CPU sampling"),
        (inputs.fp8_packed_kv, "fp8_packed_kv"), (inputs.gk_decode, "gk_decode"),
        (inputs.pipeline_parallel_size > 1, "pipeline parallelism"),
        (inputs.decode_context_parallel_size > 1, "decode context parallelism"),
        (inputs.prefill_context_parallel_size > 1, "prefill context parallelism"),
        (inputs.enforce_eager, "enforce_eager"), (inputs.kv_offloading, "KV cache offloading"),
        (inputs.ec_transfer, "EPD encoder-cache transfer"),
        (inputs.tensor_capture, "tensor capture"),
        (inputs.tensor_replacement, "tensor replacement"),
    ]
    return tuple(name for on, name in feats if on)


def _forced_warning_features(inputs: RunnerInputs) -> tuple[str, ...]:
    """Unsupported features that warn under ``=1``: all but MoE/EP without DP and sliding
    window."""
    kinds = [k for k in model_kind_blockers(inputs) if k != "sliding-window attention"]
    if inputs.data_parallel_size <= 1:
        kinds = [k for k in kinds if k not in ("Mixture-of-Experts", "expert parallelism")]
    else:
        kinds = [f"{k} with data parallelism" if k in ("Mixture-of-Experts", "expert parallelism")
                 else k for k in kinds]
    return (*kinds, *dense_feature_blockers(inputs))


def select_runner(inputs: RunnerInputs) -> RunnerChoice:
    """Resolve the runner once per server (the seed's tables); logs the selection-time line.

    Raises:
        ValueError: an invalid ``VLLM_USE_V2_MODEL_RUNNER`` (see :func:`parse_v2_env`).
    """
    forced = parse_v2_env(inputs.env_value)
    if forced is False:
        return RunnerChoice(False, f"{ENV_VAR}=0", (), None)
    if forced is True:
        unsupported = _forced_warning_features(inputs)
        if not unsupported:
            return RunnerChoice(True, f"{ENV_VAR}=1", model_kind_blockers(inputs), None)
        msg = (f"{ENV_VAR}=1 forces Neuron Model Runner V2 with unsupported features "
               f"({', '.join(unsupported)}); execution may fail.")
        logger.warning(msg)
        return RunnerChoice(True, f"{ENV_VAR}=1", unsupported, msg)
    kinds = model_kind_blockers(inputs)
    if kinds:
        return RunnerChoice(False, "model type not eligible for Model Runner V2", kinds, None)
    feats = dense_feature_blockers(inputs)
    if feats:
        msg = f"Neuron Model Runner V2 does not yet support {', '.join(feats)}; using V1."
        logger.info(msg)
        return RunnerChoice(False, "unsupported features", feats, msg)
    return RunnerChoice(True, "supported dense configuration", (), None)
