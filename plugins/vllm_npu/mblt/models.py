"""Model-registry hooks for Mobilint MXQ artifacts (vLLM general plugin ``mblt_models``).

An MXQ artifact's ``config.json`` names a Mobilint model type (``mobilint-llama``...) and
architecture (``MobilintLlamaForCausalLM``...). vLLM parses the config with transformers and
checks the architecture against its model registry before the platform's worker runs, so
both have to be known in every vLLM process:

- :func:`register` adds a transformers config class per Mobilint model type
  (:mod:`vllm_npu.mblt.hf_configs`), and registers each text architecture with
  vLLM's ``ModelRegistry`` as :class:`MobilintForCausalLM`, each multimodal one
  (:data:`MULTIMODAL_MODEL_TYPES`: Qwen3-ASR, Qwen2-VL, Qwen3-VL) as its own class (for ASR
  :class:`vllm_npu.mblt.asr_model.MobilintQwen3ASRForConditionalGeneration`, which carries vLLM's
  Qwen3-ASR processor and transcription hooks; for the VLMs the classes of
  :mod:`vllm_npu.mblt.vlm_model`, with their processors and M-RoPE positions).
- :class:`MobilintForCausalLM` is a placeholder that satisfies vLLM's model interface
  checks. The MBLT worker never builds it: the model runs inside the MXQ, through the
  runtime API. Building it raises :class:`MobilintModelNotBuildable`.
- :func:`refuse_unsupported_release`: a Mobilint multimodal release of a model type the plugin
  does not serve (say ``mobilint-qwen2_5_vl``) is refused before vLLM parses its config, with
  :class:`MobilintUnsupportedModelType` naming the type and the served ones (otherwise vLLM would
  stop on an unknown model type or architecture, which says nothing of why).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("vllm.vllm_npu.mblt")

#: Mobilint model type -> (architecture, config class name in :mod:`vllm_npu.mblt.hf_configs`).
TEXT_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "mobilint-llama": ("MobilintLlamaForCausalLM", "MobilintLlamaConfig"),
    "mobilint-qwen2": ("MobilintQwen2ForCausalLM", "MobilintQwen2Config"),
    "mobilint-qwen3": ("MobilintQwen3ForCausalLM", "MobilintQwen3Config"),
    "mobilint-exaone4": ("MobilintExaone4ForCausalLM", "MobilintExaone4Config"),
    "mobilint-qwen3_moe": ("MobilintQwen3MoEForCausalLM", "MobilintQwen3MoEConfig"),
    "mobilint-llama-eagle3": ("MobilintLlamaEagle3ForCausalLM", "MobilintLlamaEagle3Config"),
    "mobilint-qwen2-eagle3": ("MobilintQwen2Eagle3ForCausalLM", "MobilintQwen2Eagle3Config"),
    "mobilint-qwen3-eagle3": ("MobilintQwen3Eagle3ForCausalLM", "MobilintQwen3Eagle3Config"),
}

#: Mobilint multimodal model type -> (architecture, config class name, ``module:Class`` of its
#: vLLM registry class).
MULTIMODAL_MODEL_TYPES: dict[str, tuple[str, str, str]] = {
    "mobilint-qwen3_asr": ("MobilintQwen3ASRForConditionalGeneration", "MobilintQwen3ASRConfig",
                           "vllm_npu.mblt.asr_model:MobilintQwen3ASRForConditionalGeneration"),
    "mobilint-qwen2_vl": ("MobilintQwen2VLForConditionalGeneration", "MobilintQwen2VLConfig",
                          "vllm_npu.mblt.vlm_model:MobilintQwen2VLForConditionalGeneration"),
    "mobilint-qwen3_vl": ("MobilintQwen3VLForConditionalGeneration", "MobilintQwen3VLConfig",
                          "vllm_npu.mblt.vlm_model:MobilintQwen3VLForConditionalGeneration"),
}

_REGISTERED = False

#: Sub-config keys that mark a multimodal release (``thinker_config``: Qwen3-ASR).
MULTIMODAL_SUBCONFIGS: tuple[str, ...] = ("vision_config", "video_config", "image_config", "audio_config",
                                          "thinker_config")


class MobilintUnsupportedModelType(ValueError):
    """The model directory is a Mobilint multimodal release of a model type this plugin does not serve."""


def refuse_unsupported_release(model: str | os.PathLike | None) -> None:
    """Refuse a local model directory whose ``config.json`` is a Mobilint multimodal release
    (a ``mobilint-*`` model type with a vision, video, image, audio or thinker sub-config) of a
    type outside :data:`MULTIMODAL_MODEL_TYPES`, before any inference.

    Anything else passes untouched, for vLLM to judge: a Hub id (not a local directory), a
    directory without a readable ``config.json``, a text release, any other model type.

    Raises:
        MobilintUnsupportedModelType: the message names the directory, its model type and the
            multimodal types the plugin serves.
    """
    if model is None:
        return
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        model_type = str(config.get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return
    if (not model_type.startswith("mobilint") or model_type in MULTIMODAL_MODEL_TYPES
            or model_type in TEXT_MODEL_TYPES
            or not any(isinstance(config.get(k), dict) for k in MULTIMODAL_SUBCONFIGS)):
        return
    raise MobilintUnsupportedModelType(
        f"{model}: model_type {model_type!r} is a multimodal release the MBLT plugin does not serve; "
        f"its multimodal releases are {', '.join(MULTIMODAL_MODEL_TYPES)} (Qwen3-ASR, Qwen2-VL, Qwen3-VL)")


class MobilintModelNotBuildable(RuntimeError):
    """vLLM tried to build the placeholder model: it runs only under the MBLT worker."""


def _record_user_scheduler_args() -> None:
    """On an ``mblt-*`` target, record the user's scheduler arguments before vLLM defaults
    them (:mod:`vllm_npu.mblt.engine_args`)."""
    from vllm_npu.targets import platform_for

    if platform_for("mblt", "x") is None:
        return
    try:
        from vllm_npu.mblt import engine_args

        engine_args.install()
    except Exception as exc:  # noqa: BLE001 - a general plugin must never raise
        logger.warning("MBLT: could not record the user's scheduler arguments: %s", exc)


def register() -> None:
    """vLLM general-plugin entry point (group ``vllm.general_plugins``, name ``mblt_models``).

    Idempotent and never raises: vLLM aborts start-up when a general plugin raises, and
    this runs in every vLLM process whatever the platform. A failure is logged.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    _record_user_scheduler_args()
    try:
        from transformers import AutoConfig
        from vllm import ModelRegistry

        from vllm_npu.mblt import hf_configs

        for model_type, (arch, config_name) in TEXT_MODEL_TYPES.items():
            try:
                AutoConfig.register(model_type, getattr(hf_configs, config_name))
            except ValueError:
                pass  # already registered in this process
            if arch not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(arch, "vllm_npu.mblt.models:MobilintForCausalLM")
        for model_type, (arch, config_name, cls_path) in MULTIMODAL_MODEL_TYPES.items():
            try:
                AutoConfig.register(model_type, getattr(hf_configs, config_name))
            except ValueError:
                pass
            if arch not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(arch, cls_path)
        _REGISTERED = True
    except Exception as exc:  # noqa: BLE001 - a general plugin must not stop vLLM
        logger.warning("vllm_npu.mblt: could not register the Mobilint model types: %s", exc)


def _placeholder_base() -> type:
    import torch.nn as nn

    return nn.Module


class MobilintForCausalLM(_placeholder_base()):  # type: ignore[misc]
    """Registry placeholder for Mobilint text LLM architectures (see the module docstring).

    Raises:
        MobilintModelNotBuildable: always, when constructed.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:  # noqa: ARG002
        raise MobilintModelNotBuildable(
            "Mobilint MXQ models run only under the MBLT worker: start vLLM with "
            "NPU_HARNESS_TARGET=mblt-sim or mblt-hw"
        )

    def embed_input_ids(self, input_ids):  # pragma: no cover - never built
        raise MobilintModelNotBuildable("placeholder")

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):  # pragma: no cover
        raise MobilintModelNotBuildable("placeholder")

    def compute_logits(self, hidden_states):  # pragma: no cover
        raise MobilintModelNotBuildable("placeholder")
