"""Tiny random-weight Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X checkpoints with a locally
trained tokenizer.

``build(arch, out_dir, seed=0, **config_overrides)`` writes a complete Hugging Face model
directory without network access; see :mod:`npusim.tinymodel.build`.
``build_eagle3(out_dir, base_arch="llama", seed=0)`` adds a one-block EAGLE-3 draft fitted to a
4-layer base (:mod:`npusim.tinymodel.eagle3`).
``build_qwen2_vl(out_dir, seed=0)`` / ``build_qwen3_vl(out_dir, seed=0)`` write tiny Qwen2-VL /
Qwen3-VL checkpoints; ``test_image(name)`` / ``test_video(name)`` their synthetic test pictures
(:mod:`npusim.tinymodel.vlm`).
"""

from __future__ import annotations

from .build import (ARCHES, CHAT_TEMPLATE, SPECIAL_TOKENS, build, exaone4_layer_types, make_config, make_weights,
                    train_tokenizer)
from .eagle3 import build_eagle3
from .vlm import build_qwen2_vl, build_qwen3_vl, test_image, test_video

__all__ = ["ARCHES", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build", "build_eagle3", "build_qwen2_vl", "build_qwen3_vl", "exaone4_layer_types", "make_config", "make_weights",
           "test_image", "test_video", "train_tokenizer"]
