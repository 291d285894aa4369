"""Tiny Qwen2-VL / Qwen3-VL checkpoints (transformers 5.19 layout) and synthetic test pictures.

``build_qwen2_vl(out_dir, seed=0)`` / ``build_qwen3_vl(out_dir, seed=0)`` write what
``Qwen2VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration.save_pretrained`` and
their processors write, scaled down (sizes: /work/vlm/CONTRACT.md, "Fixed names and numbers"):

- ``config.json``: ``model_type`` ``qwen2_vl`` / ``qwen3_vl`` with ``text_config`` and
  ``vision_config``, ``image_token_id`` 1026, ``video_token_id`` 1027, ``vision_start_token_id``
  1024, ``vision_end_token_id`` 1025, untied LM head;
- ``model.safetensors`` (float32; ``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``);
- the tiny BPE of :func:`npusim.tinymodel.build.train_tokenizer` plus :data:`VLM_SPECIAL_TOKENS`
  (ids 1024-1027, special): ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template
  and the image/video/vision tokens named), ``special_tokens_map.json``;
- ``chat_template.jinja``: :data:`CHAT_TEMPLATE` (ours: ChatML; an ``{"type": "image"}`` part
  renders as ``<|vision_start|><|image_pad|><|vision_end|>``, a video part with ``<|video_pad|>``);
- ``preprocessor_config.json`` (``Qwen2VLImageProcessor``: Qwen2-VL patch 14 with the OpenAI CLIP
  mean/std, min/max pixels 3136 / 12845056; Qwen3-VL patch 16, mean/std 0.5, size
  {shortest_edge 65536, longest_edge 16777216}); Qwen3-VL also ``video_preprocessor_config.json``
  (``Qwen3VLVideoProcessor``);
- ``generation_config.json`` (greedy; eos ``<|im_end|>``, ``<|endoftext|>``).

Weights are random (:func:`npusim.tinymodel.build.make_weights` for the text model; the tower's
projections ``N(0, 1/fan_in)``, LayerNorm weights ``1 + N(0, 0.05^2)``, biases ``N(0, 0.05^2)``,
Qwen3-VL's position table ``N(0, 0.5^2)``), so vision embeddings are about as large as token
embeddings. Nothing is fitted: generated text is arbitrary but deterministic.

Test pictures: :data:`IMAGES` / :func:`test_image` and :data:`VIDEOS` / :func:`test_video` are
deterministic synthetic uint8 pictures whose sides are multiples of 28 and/or 32, so the
processors' resizing leaves them unchanged (which families each fits is listed in
:data:`IMAGES`).

Every file is a pure function of ``seed``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..llm.config import ModelConfig
from ..llm.safetensors import save_safetensors
from ..llm.vision import vision_tensor_shapes
from ..llm.vlm_reference import VlmReference, vlm_text_config
from .build import EOS_TOKEN, IM_END, IM_START, SPECIAL_TOKENS, TRANSFORMERS_VERSION, make_weights, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "IMAGES", "IMAGE_PAD", "ImageSpec", "PREPROCESSORS", "VIDEOS", "VIDEO_PAD", "VISION_END",
           "VISION_START", "VLM_SPECIAL_TOKENS", "build_qwen2_vl", "build_qwen3_vl", "fits", "make_vlm_config",
           "test_image", "test_video", "vlm_tokenizer"]

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
#: Added special tokens, in id order after the BPE vocabulary (1024 .. 1027).
VLM_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

#: ChatML; content is a string or a list of parts ``{"type": "text", "text": ...}``,
#: ``{"type": "image", ...}`` / ``{"type": "video", ...}`` (or any part with an "image"/"video" key).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

#: Per family: the processor facts (``patchify`` keywords and the resize limits in pixels).
PREPROCESSORS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": OPENAI_CLIP_MEAN,
                 "image_std": OPENAI_CLIP_STD, "min_pixels": 3136, "max_pixels": 12845056},
    "qwen3_vl": {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "min_pixels": 65536, "max_pixels": 16777216},
}

_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_act": "quick_gelu", "hidden_size": 128, "in_channels": 3,
                 "initializer_range": 0.02, "mlp_ratio": 2, "model_type": "qwen2_vl_vision", "num_heads": 2,
                 "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen3_vl": {"deepstack_visual_indexes": [0, 1, 2], "depth": 3, "hidden_act": "gelu_pytorch_tanh",
                 "hidden_size": 32, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 64,
                 "model_type": "qwen3_vl_vision", "num_heads": 2, "num_position_embeddings": 256,
                 "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}

_TEXT_COMMON: dict[str, Any] = {
    "attention_dropout": 0.0, "dtype": "float32", "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "use_cache": True,
}
_TEXT: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2_vl_text",
                 "num_hidden_layers": 2, "rope_scaling": {"mrope_section": [4, 6, 6], "rope_type": "default",
                                                          "type": "mrope"},
                 "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False,
                 "layer_types": ["full_attention"] * 2},
    "qwen3_vl": {"attention_bias": False, "head_dim": 32, "max_position_embeddings": 262144,
                 "model_type": "qwen3_vl_text", "num_hidden_layers": 3,
                 "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
                 "rope_theta": 5000000.0},
}
_ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
_VISION_SEED_OFFSET = 6007


@dataclass(frozen=True)
class ImageSpec:
    """A synthetic picture: ``height x width`` pixels drawn by ``pattern`` (see :func:`test_image`)."""

    height: int
    width: int
    pattern: str


#: Test images. Sides that are multiples of 28 fit Qwen2-VL, multiples of 32 fit Qwen3-VL
#: (224 and 448 fit both): ``sunset`` 224x224 (Qwen2-VL's static frame, grid 16x16; Qwen3-VL
#: 14x14), ``checker`` 256x256 (Qwen3-VL's static frame), ``stripes`` 192x320 (Qwen3-VL,
#: non-square 12x20), ``rings`` 448x224 (both; Qwen2-VL 32x16), ``dots`` 224x224 (both).
IMAGES: dict[str, ImageSpec] = {
    "sunset": ImageSpec(224, 224, "sunset"),
    "dots": ImageSpec(224, 224, "dots"),
    "checker": ImageSpec(256, 256, "checker"),
    "stripes": ImageSpec(192, 320, "stripes"),
    "rings": ImageSpec(448, 224, "rings"),
}
#: Test videos: name -> (frames, height, width); ``square`` is a square crossing a gradient
#: (224x224 fits both families).
VIDEOS: dict[str, tuple[int, int, int]] = {"square": (4, 224, 224)}


def fits(name: str, family: str) -> bool:
    """Whether image ``name`` passes ``family``'s processor unresized (sides multiples of patch*merge, pixels in range)."""
    spec, pp = IMAGES[name], PREPROCESSORS[family]
    f = pp["patch_size"] * pp["merge_size"]
    return (spec.height % f == 0 and spec.width % f == 0
            and pp["min_pixels"] <= spec.height * spec.width <= pp["max_pixels"])


def _draw(pattern: str, h: int, w: int, phase: float = 0.0) -> np.ndarray:
    y, x = np.meshgrid(np.linspace(0.0, 1.0, h), np.linspace(0.0, 1.0, w), indexing="ij")
    if pattern == "sunset":
        r, g, b = 0.9 - 0.4 * y, 0.3 + 0.5 * y * (1 - x), 0.2 + 0.7 * y
        disc = (x - 0.5) ** 2 + (y - 0.45) ** 2 < 0.04
        r, g, b = np.where(disc, 1.0, r), np.where(disc, 0.85, g), np.where(disc, 0.2, b)
    elif pattern == "dots":
        d = np.sin(2 * np.pi * 6 * x) * np.sin(2 * np.pi * 6 * y)
        r, g, b = 0.5 + 0.5 * d, 0.5 - 0.4 * d * x, 0.3 + 0.6 * y
    elif pattern == "checker":
        c = ((np.floor(x * 8) + np.floor(y * 8)) % 2)
        r, g, b = 0.1 + 0.8 * c, 0.2 + 0.6 * x, 0.9 - 0.8 * c * y
    elif pattern == "stripes":
        s = 0.5 + 0.5 * np.sin(2 * np.pi * (5 * x + 2 * y))
        r, g, b = s, 1.0 - s * y, 0.4 + 0.5 * x
    elif pattern == "rings":
        rr = np.sqrt((x - 0.4) ** 2 + (y - 0.6) ** 2)
        s = 0.5 + 0.5 * np.cos(2 * np.pi * 7 * rr)
        r, g, b = 0.2 + 0.7 * s, 0.6 * (1 - rr), 0.8 * s * x
    elif pattern == "square":
        r, g, b = 0.2 + 0.6 * x, 0.3 + 0.4 * y, 0.5 + 0.0 * x
        sq = (np.abs(x - (0.2 + phase)) < 0.12) & (np.abs(y - 0.5) < 0.12)
        r, g, b = np.where(sq, 0.95, r), np.where(sq, 0.1, g), np.where(sq, 0.1, b)
    else:  # pragma: no cover - IMAGES only names the patterns above
        raise KeyError(pattern)
    rgb = np.stack([r, g, b], axis=-1)
    return np.clip(np.round(rgb * 255.0), 0, 255).astype(np.uint8)


def test_image(name: str) -> np.ndarray:
    """Image ``name`` of :data:`IMAGES`: uint8 ``[H, W, 3]`` (deterministic).

    Raises:
        KeyError: unknown name (names the choices).
    """
    if name not in IMAGES:
        raise KeyError(f"unknown test image {name!r} (choices: {', '.join(IMAGES)})")
    spec = IMAGES[name]
    return _draw(spec.pattern, spec.height, spec.width)


test_image.__test__ = False  # not a pytest test


def test_video(name: str) -> np.ndarray:
    """Video ``name`` of :data:`VIDEOS`: uint8 ``[F, H, W, 3]`` (deterministic; ``F`` even).

    Raises:
        KeyError: unknown name (names the choices).
    """
    if name not in VIDEOS:
        raise KeyError(f"unknown test video {name!r} (choices: {', '.join(VIDEOS)})")
    f, h, w = VIDEOS[name]
    return np.stack([_draw(name, h, w, phase=0.15 * i) for i in range(f)])


test_video.__test__ = False


def vlm_tokenizer():
    """The tiny BPE tokenizer plus :data:`VLM_SPECIAL_TOKENS` (special, ids 1024-1027).

    Raises:
        ImportError: ``tokenizers`` is missing.
    """
    from tokenizers import AddedToken

    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIAL_TOKENS])
    return tok


def make_vlm_config(family: str, token_ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` dict of the tiny ``family`` (``qwen2_vl`` / ``qwen3_vl``) model.

    Raises:
        ValueError: unknown family.
    """
    if family not in _VISION:
        raise ValueError(f"unknown VLM family {family!r} (qwen2_vl or qwen3_vl)")
    text = {**copy.deepcopy(_TEXT_COMMON), **copy.deepcopy(_TEXT[family])}
    text.update(vocab_size=int(vocab_size), bos_token_id=token_ids[EOS_TOKEN], eos_token_id=token_ids[IM_END],
                pad_token_id=token_ids[EOS_TOKEN])
    return {
        "architectures": [_ARCHITECTURES[family]],
        "dtype": "float32",
        "image_token_id": token_ids[IMAGE_PAD],
        "model_type": family,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "video_token_id": token_ids[VIDEO_PAD],
        "vision_config": copy.deepcopy(_VISION[family]),
        "vision_end_token_id": token_ids[VISION_END],
        "vision_start_token_id": token_ids[VISION_START],
    }


def _vision_weights(family: str, vision_config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + _VISION_SEED_OFFSET)
    out: dict[str, np.ndarray] = {}
    for name, shape in vision_tensor_shapes(family, vision_config).items():
        if name == "pos_embed.weight":
            w = rng.normal(0.0, 0.5, shape)
        elif name.endswith(".bias"):
            w = rng.normal(0.0, 0.05, shape)
        elif len(shape) == 1:
            w = 1.0 + rng.normal(0.0, 0.05, shape)
        else:
            w = rng.normal(0.0, np.sqrt(1.0 / int(np.prod(shape[1:]))), shape)
        out["model.visual." + name] = w.astype(np.float32)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _preprocessor_config(family: str) -> dict[str, Any]:
    pp = PREPROCESSORS[family]
    size = {"longest_edge": pp["max_pixels"], "shortest_edge": pp["min_pixels"]}
    d: dict[str, Any] = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": pp["image_mean"], "image_processor_type": "Qwen2VLImageProcessor", "image_std": pp["image_std"],
        "merge_size": pp["merge_size"], "patch_size": pp["patch_size"],
        "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen3VLProcessor",
        "resample": 3, "rescale_factor": 1.0 / 255.0, "size": size, "temporal_patch_size": pp["temporal_patch_size"],
    }
    if family == "qwen2_vl":
        d.update(min_pixels=pp["min_pixels"], max_pixels=pp["max_pixels"])
    return d


def _build(family: str, out_dir: str | os.PathLike, seed: int) -> Path:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed!r} must be an integer in [0, 2**32)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    tok = vlm_tokenizer()
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *VLM_SPECIAL_TOKENS)}
    cfg = make_vlm_config(family, ids, tok.get_vocab_size())
    text_cfg = ModelConfig.from_dict(vlm_text_config(family, cfg["text_config"]))
    tensors = {("lm_head.weight" if n == "lm_head.weight" else "model.language_model." + n[len("model."):]): t
               for n, t in make_weights(text_cfg, int(seed)).items()}
    tensors.update(_vision_weights(family, cfg["vision_config"], int(seed)))
    VlmReference(cfg, tensors, source=f"tiny {family}")  # the golden loads it (else CheckpointError)

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[EOS_TOKEN], "do_sample": False, "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
        "pad_token_id": ids[EOS_TOKEN], "transformers_version": TRANSFORMERS_VERSION,
    })
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    special = {"additional_special_tokens": [IM_START, IM_END, *VLM_SPECIAL_TOKENS], "eos_token": IM_END,
               "pad_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {
        **special,
        "add_bos_token": False, "add_eos_token": False, "bos_token": None, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {"image_token": IMAGE_PAD, "video_token": VIDEO_PAD, "vision_bos_token": VISION_START,
                                 "vision_eos_token": VISION_END},
        "model_max_length": 32768,
        "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen3VLProcessor",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(out / "preprocessor_config.json", _preprocessor_config(family))
    if family == "qwen3_vl":
        pp = PREPROCESSORS[family]
        _write_json(out / "video_preprocessor_config.json", {
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "do_sample_frames": True,
            "fps": 2, "image_mean": pp["image_mean"], "image_std": pp["image_std"], "max_frames": 768,
            "merge_size": pp["merge_size"], "min_frames": 4, "patch_size": pp["patch_size"],
            "processor_class": "Qwen3VLProcessor", "resample": 3, "rescale_factor": 1.0 / 255.0,
            "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "temporal_patch_size": pp["temporal_patch_size"],
            "video_processor_type": "Qwen3VLVideoProcessor",
        })
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    return out


def build_qwen2_vl(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny Qwen2-VL checkpoint (module docstring) into ``out_dir``; returns ``Path(out_dir)``.

    Raises:
        ValueError: bad ``seed`` (an integer in [0, 2**32)); ``out_dir`` is an existing file.
        ImportError: ``tokenizers`` is not installed.
    """
    return _build("qwen2_vl", out_dir, seed)


def build_qwen3_vl(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny Qwen3-VL checkpoint (module docstring) into ``out_dir``; returns ``Path(out_dir)``.

    Raises:
        ValueError: bad ``seed`` (an integer in [0, 2**32)); ``out_dir`` is an existing file.
        ImportError: ``tokenizers`` is not installed.
    """
    return _build("qwen3_vl", out_dir, seed)
