"""Golden numpy reference decoder for Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X checkpoints
(numpy only).

Public API::

    from npusim.llm import (ModelConfig, load_config, Decoder, KVCache,
                            KVCacheOverflowError, UnsupportedModelError, CheckpointError,
                            UnsupportedLinearError, LINEAR_KINDS, FusedQ4Linear,
                            load_safetensors, save_safetensors, RopeConfig)
    from npusim.llm import (VlmReference, Qwen2VisionTower, Qwen3VisionTower, patchify,
                            rope_index, mrope_cos_sin)          # Qwen2-VL / Qwen3-VL (issue 14 §1)
"""

from __future__ import annotations

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .decoder import Decoder, expected_tensor_shapes
from .errors import CheckpointError, KVCacheOverflowError, UnsupportedModelError
from .kvcache import KVCache
from .qlinear import LINEAR_KINDS, FusedQ4Linear, UnsupportedLinearError
from .rope import SUPPORTED_ROPE_TYPES, RopeConfig, apply_rope
from .mrope import mrope_cos_sin, rope_index
from .safetensors import load_safetensors, read_safetensors_header, save_safetensors
from .vision import Qwen2VisionTower, Qwen3VisionTower
from .vision_inputs import patchify
from .vlm_reference import VlmReference

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "LINEAR_KINDS",
    "CheckpointError",
    "Decoder",
    "FusedQ4Linear",
    "KVCache",
    "KVCacheOverflowError",
    "ModelConfig",
    "Qwen2VisionTower",
    "Qwen3VisionTower",
    "RopeConfig",
    "UnsupportedLinearError",
    "UnsupportedModelError",
    "VlmReference",
    "apply_rope",
    "expected_tensor_shapes",
    "load_config",
    "load_safetensors",
    "mrope_cos_sin",
    "patchify",
    "read_safetensors_header",
    "rope_index",
    "save_safetensors",
]
