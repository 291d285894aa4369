"""transformers config classes of Mobilint artifacts (``model_type: mobilint-<family>``).

Each is the family's own config class under the Mobilint model type, defined at module level
so vLLM can pickle it into the engine processes it spawns. Registered with transformers'
``AutoConfig`` by :func:`vllm_npu.mblt.models.register`.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    Exaone4Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3VLConfig,
)
from vllm.transformers_utils.configs.qwen3_asr import Qwen3ASRConfig


class MobilintLlamaConfig(LlamaConfig):
    """``LlamaConfig`` of a Mobilint MXQ artifact (``model_type`` ``mobilint-llama``): Llama and
    the Llama-compatible HyperCLOVAX releases (their extra config keys are kept as attributes;
    the MXQ computes with them, the host only embeds)."""

    model_type = "mobilint-llama"


class MobilintQwen2Config(Qwen2Config):
    """``Qwen2Config`` of a Mobilint MXQ artifact (``model_type`` ``mobilint-qwen2``)."""

    model_type = "mobilint-qwen2"


class MobilintQwen3Config(Qwen3Config):
    """``Qwen3Config`` of a Mobilint MXQ artifact (``model_type`` ``mobilint-qwen3``)."""

    model_type = "mobilint-qwen3"


class MobilintExaone4Config(Exaone4Config):
    """``Exaone4Config`` of a Mobilint MXQ artifact (``model_type`` ``mobilint-exaone4``)."""

    model_type = "mobilint-exaone4"


class MobilintQwen3MoEConfig(Qwen3MoeConfig):
    """``Qwen3MoeConfig`` of a Mobilint Mixture-of-Experts release (``model_type``
    ``mobilint-qwen3_moe``); the role keys (``shared_*``, ``expert_*``, ``lm_head_*``,
    ``moe_mxq_pack_index``...) are kept as attributes for :mod:`vllm_npu.mblt.moe_backend`."""

    model_type = "mobilint-qwen3_moe"


class MobilintLlamaEagle3Config(LlamaConfig):
    """``LlamaConfig`` of a Mobilint EAGLE-3 release on a Llama base (``model_type``
    ``mobilint-llama-eagle3``); ``draft_config`` (a LlamaConfig dict), the ``base_``/``draft_``/``fc_``
    role keys and the tree keys are kept as attributes for :mod:`vllm_npu.mblt.eagle3_backend`."""

    model_type = "mobilint-llama-eagle3"


class MobilintQwen2Eagle3Config(Qwen2Config):
    """``Qwen2Config`` of a Mobilint EAGLE-3 release on a Qwen2 base (``mobilint-qwen2-eagle3``)."""

    model_type = "mobilint-qwen2-eagle3"


class MobilintQwen3Eagle3Config(Qwen3Config):
    """``Qwen3Config`` of a Mobilint EAGLE-3 release on a Qwen3 base (``mobilint-qwen3-eagle3``)."""

    model_type = "mobilint-qwen3-eagle3"


class MobilintQwen3ASRConfig(Qwen3ASRConfig):
    """vLLM's ``Qwen3ASRConfig`` of a Mobilint speech-to-text release (``model_type``
    ``mobilint-qwen3_asr``): vLLM's Qwen3-ASR processor reads its ``thinker_config``; the
    ``mxq_path`` and layout keys of ``thinker_config.audio_config`` / ``text_config`` and the
    top-level ``encoder_*`` / ``decoder_*`` keys are kept as attributes for
    :mod:`vllm_npu.mblt.asr`."""

    model_type = "mobilint-qwen3_asr"

    def __init__(self, thinker_config: Any = None, **kwargs: Any) -> None:
        # Spelled out: transformers 5 gives a config subclass without its own __init__ a generated
        # one, which would keep thinker_config a dict instead of vLLM's Qwen3ASRThinkerConfig.
        super().__init__(thinker_config=thinker_config, **kwargs)


class MobilintQwen2VLConfig(Qwen2VLConfig):
    """transformers' ``Qwen2VLConfig`` of a Mobilint Qwen2-VL release (``model_type``
    ``mobilint-qwen2_vl``, architecture ``MobilintQwen2VLForConditionalGeneration``).

    The release nests its backend keys in the sub-configs (``vision_config.mxq_path``,
    ``text_config.mxq_path``, ``dev_no``, ``core_mode``, ``max_batch_size``...): they are kept as
    attributes of ``vision_config`` / ``text_config``, as are the top-level ``dynamic_vision``
    flag (static vs dynamic vision, read by :func:`vllm_npu.mblt.vlm_model.is_dynamic_vision`) and
    any ``vision_*`` / ``text_*`` override. vLLM reads the text model's shape (``hidden_size``,
    ``num_attention_heads``, ``vocab_size``, ``max_position_embeddings``, the M-RoPE
    ``rope_scaling``) from ``text_config`` through ``get_text_config()``; the token ids
    (``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``)
    are the upstream fields."""

    model_type = "mobilint-qwen2_vl"


class MobilintQwen3VLConfig(Qwen3VLConfig):
    """transformers' ``Qwen3VLConfig`` of a Mobilint Qwen3-VL release (``model_type``
    ``mobilint-qwen3_vl``, architecture ``MobilintQwen3VLForConditionalGeneration``).

    As :class:`MobilintQwen2VLConfig`, plus: static vs dynamic vision is the top-level
    ``is_dynamic`` (``dynamic_vision`` its legacy alias; either true means dynamic),
    ``vision_config.vision_output_order`` and ``deepstack_visual_indexes`` are kept for the
    worker."""

    model_type = "mobilint-qwen3_vl"
