"""Golden numpy reference decoder for Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X checkpoints
(numpy only).

Public API::

    from npusim.llm import (ModelConfig, load_config, Decoder, KVCache,
                            KVCacheOverflowError, UnsupportedModelError, CheckpointError,
                            UnsupportedLinearError, LINEAR_KINDS, FusedQ4Linear,
                            load_safetensors, save_safetensors, RopeConfig)
"""

from __future__ import annotations

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .decoder import Decoder, expected_tensor_shapes
from .errors import CheckpointError, KVCacheOverflowError, UnsupportedModelError
from .kvcache import KVCache
from .qlinear import LINEAR_KINDS, FusedQ4Linear, UnsupportedLinearError
from .rope import SUPPORTED_ROPE_TYPES, RopeConfig, apply_rope
from .safetensors import load_safetensors, read_safetensors_header, save_safetensors

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
    "RopeConfig",
    "UnsupportedLinearError",
    "UnsupportedModelError",
    "apply_rope",
    "expected_tensor_shapes",
    "load_config",
    "load_safetensors",
    "read_safetensors_header",
    "save_safetensors",
]
