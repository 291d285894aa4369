"""vLLM's model classes for Mobilint Qwen2-VL / Qwen3-VL releases (issue 14 §1), as the API
server and the engine see them: the registry classes, their multimodal processors and M-RoPE.

vLLM 0.32 has Qwen2-VL and Qwen3-VL processors, but their modules import transformers' torch
image processor, which needs torchvision, absent here (docs/mblt-vlm-release.md §6). So the
processors are written here on vLLM's multimodal API, with transformers'
``Qwen2VLImageProcessorPil`` for the images (Qwen3-VL's image processor is the same with patch
16 and mean/std 0.5, both read from the release's ``preprocessor_config.json``) and numpy for the
video frames.

What a processor produces (the worker reads these fields of each item):

- ``pixel_values`` float32 ``[sum t*h*w, 3*temporal_patch*patch^2]`` (flat: one item's rows are
  ``t*h*w`` of them, in the HF processor's patch order) and ``image_grid_thw`` int64 ``[3]`` per
  image (in patches, before the merge);
- ``pixel_values_videos`` / ``video_grid_thw`` likewise per video (``t`` in temporal patches),
  plus ``timestamps`` (Qwen3-VL: seconds of each frame group);
- the prompt: each image's ``<|image_pad|>`` becomes ``t*h*w/merge^2`` of them; a Qwen3-VL
  video's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes, per frame group,
  ``<X.X seconds><|vision_start|>`` + ``h*w/merge^2`` ``<|video_pad|>`` + ``<|vision_end|>`` (only
  the pads are embeddings: ``is_embed``); a Qwen2-VL video's pad ``t*h*w/merge^2`` pads.

The seed's rules, at the processor (a :class:`VlmRequestError`, a ``ValueError``: vLLM answers
HTTP 400), with the vendor's wording where it has one (docs/mblt-vlm-release.md §4.2, §4.4):

- **Static vision** (Qwen2-VL, or Qwen3-VL without ``is_dynamic``/``dynamic_vision``): at most
  one image per prompt, no video; the image is resized to the fixed 224x224 frame before the
  image processor (Qwen2-VL: grid (1,16,16); Qwen3-VL: the stock ``shortest_edge`` 65536 then
  scales 224x224 to 256x256, grid (1,16,16), the compiled frame: checked on every image);
  ``size`` / ``min_pixels`` / ``max_pixels`` / ``do_resize=False`` overrides are refused.
- **Dynamic Qwen2-VL**: held to one image and no video (vllm-mblt's worker rule); the image keeps
  its aspect (upstream resize, overrides honoured).
- **Dynamic Qwen3-VL**: several images and videos; at most :data:`MAX_VISION_TOKENS` pre-merge
  patches per encoder call (an image, a video frame group): the stored and per-call
  ``size``/``max_pixels`` are clamped to ``4096*patch^2`` (video: times ``temporal_patch_size``,
  a frame group), ``size.shortest_edge``/``min_pixels`` to a floor whose aligned resize still
  fits; ``do_resize=False`` is refused.
- ``patch_size`` / ``temporal_patch_size`` / ``merge_size`` overrides other than the release's
  are refused everywhere (they are compiled into the vision MXQ).

Also: :func:`vlm_family` (which family a config is; anything else raises
:class:`UnsupportedVlmModelType`), :func:`is_dynamic_vision`, :func:`mrope_input_positions`
(vLLM's ``SupportsMRoPE`` hook, usable without a model instance).

The classes are never built: the MBLT worker runs the release's MXQs. Building one raises
:class:`vllm_npu.mblt.models.MobilintModelNotBuildable`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdateDetails,
)

from vllm_npu.mblt.models import MobilintForCausalLM, MobilintModelNotBuildable
from vllm_npu.mblt.vlm_positions import rope_index

__all__ = [
    "MAX_VISION_TOKENS",
    "QWEN2_VL_MODEL_TYPE",
    "QWEN3_VL_MODEL_TYPE",
    "STATIC_FRAME",
    "STATIC_GRID",
    "VLM_MODEL_TYPES",
    "MobilintQwen2VLForConditionalGeneration",
    "MobilintQwen3VLForConditionalGeneration",
    "UnsupportedVlmModelType",
    "VlmRequestError",
    "is_dynamic_vision",
    "mrope_input_positions",
    "vlm_family",
]

logger = logging.getLogger("vllm.vllm_npu.mblt")

QWEN2_VL_MODEL_TYPE = "mobilint-qwen2_vl"
QWEN3_VL_MODEL_TYPE = "mobilint-qwen3_vl"
#: Mobilint VLM model type -> family.
VLM_MODEL_TYPES: dict[str, str] = {QWEN2_VL_MODEL_TYPE: "qwen2_vl", QWEN3_VL_MODEL_TYPE: "qwen3_vl"}
#: Pre-merge patches one dynamic Qwen3-VL vision-encoder call takes at most (an image, or a video
#: frame group): the vendor's ``QWEN3_VL_MAX_VISION_TOKENS``.
MAX_VISION_TOKENS = 4096
#: Pixel side every static-vision image is resized to first (the vendor's processors).
STATIC_FRAME = 224
#: The patch grid ``(t, h, w)`` a static vision MXQ is compiled for (both families: 224/14 for
#: Qwen2-VL, 256/16 for Qwen3-VL).
STATIC_GRID = (1, 16, 16)
#: Aspect ratio beyond which the upstream resize refuses an image (used for the clamp's floor).
_MAX_ASPECT = 200
_STRUCTURAL_KWARGS = ("patch_size", "temporal_patch_size", "merge_size")
_RESIZE_KWARGS = ("size", "min_pixels", "max_pixels")
#: Upstream Qwen3-VL video processor defaults (when a release ships no video_preprocessor_config).
_QWEN3_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
#: Largest side of a dummy (warm-up) image, pixels.
_DUMMY_SIDE_CAP = 1024
#: Frames per second assumed for a video without metadata (as upstream Qwen3-VL does).
_DEFAULT_FPS = 24.0


class UnsupportedVlmModelType(ValueError):
    """A multimodal config that is neither Mobilint Qwen2-VL nor Qwen3-VL."""


class VlmRequestError(ValueError):
    """A request a Mobilint VLM release cannot serve (the front end answers HTTP 400)."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def vlm_family(hf_config: Any) -> str:
    """``"qwen2_vl"`` or ``"qwen3_vl"`` for a Mobilint VLM config (a transformers config or the
    ``config.json`` dict).

    Raises:
        UnsupportedVlmModelType: any other model type, named in the message.
    """
    model_type = _get(hf_config, "model_type")
    family = VLM_MODEL_TYPES.get(model_type)
    if family is None:
        raise UnsupportedVlmModelType(
            f"model_type {model_type!r} is not a multimodal model the MBLT plugin serves: the vision-language "
            f"releases are {', '.join(VLM_MODEL_TYPES)}")
    return family


def is_dynamic_vision(hf_config: Any) -> bool:
    """Whether a release's vision is dynamic, as its config says: Qwen2-VL ``dynamic_vision``;
    Qwen3-VL ``is_dynamic`` or its legacy alias ``dynamic_vision`` (either true). A flag on
    ``vision_config`` counts too (transformers-mblt copies it there).

    Raises:
        UnsupportedVlmModelType: not a Mobilint VLM config.
    """
    family = vlm_family(hf_config)
    keys = ("dynamic_vision",) if family == "qwen2_vl" else ("is_dynamic", "dynamic_vision")
    vision = _get(hf_config, "vision_config") or {}
    return any(bool(_get(hf_config, k, False)) or bool(_get(vision, k, False)) for k in keys)


def mrope_input_positions(hf_config: Any, input_tokens: Sequence[int],
                          mm_features: Sequence[Any]) -> tuple[torch.Tensor, int]:
    """M-RoPE positions (int64 ``[3, T]``) and decode delta of a prompt whose placeholders the
    processor expanded: :func:`vllm_npu.mblt.vlm_positions.rope_index` with the grids of
    ``mm_features`` (vLLM's ``MultiModalFeatureSpec``: ``modality``, ``mm_position.offset``,
    ``data["image_grid_thw"|"video_grid_thw"].data``) in prompt order. Generated token ``i``
    sits at ``i + delta``.

    Raises:
        UnsupportedVlmModelType: not a Mobilint VLM config.
        ValueError: a feature without its grid (``data`` None), or grids that do not match the
            prompt's pad runs (:class:`vllm_npu.mblt.vlm_positions.MropeInputError`).
    """
    family = vlm_family(hf_config)
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    for feat in sorted(mm_features, key=lambda f: f.mm_position.offset):
        modality = "video" if feat.modality.startswith("video") else "image"
        data = feat.data
        key = f"{modality}_grid_thw"
        if data is None or key not in data:
            raise ValueError(f"{modality} feature at token {feat.mm_position.offset} carries no {key}")
        thw = data[key].data
        grids[modality].append(tuple(int(x) for x in torch.as_tensor(thw).reshape(-1).tolist()))
    vision = _get(hf_config, "vision_config")
    positions, delta = rope_index(
        list(input_tokens), image_grid_thw=grids["image"], video_grid_thw=grids["video"],
        image_token_id=int(_get(hf_config, "image_token_id")), video_token_id=int(_get(hf_config, "video_token_id")),
        vision_start_token_id=_get(hf_config, "vision_start_token_id"),
        spatial_merge_size=int(_get(vision, "spatial_merge_size", 2)), family=family)
    return torch.from_numpy(positions), delta


# ------------------------------------------------------------------------------------------------
# Resize arithmetic (the upstream Qwen resize rules, written here)

def _aligned_floor(limit: int, factor: int) -> int:
    """The largest ``min_pixels`` whose upscale, rounded up to ``factor`` on both sides, stays
    within ``limit`` pixels for any aspect ratio the resize accepts (at most 200:1).

    With area ``M`` and ratio ``r``, the rounded sides are at most ``sqrt(M r) + F`` and
    ``sqrt(M/r) + F``, so the area is at most ``M + F sqrt(M) (sqrt(r) + 1/sqrt(r)) + F^2``:
    solved for ``sqrt(M)`` at ``r = 200``."""
    k = factor * (math.sqrt(_MAX_ASPECT) + 1 / math.sqrt(_MAX_ASPECT))
    disc = k * k + 4 * (limit - factor * factor)
    if disc < 0:
        return 0
    root = (-k + math.sqrt(disc)) / 2
    return max(0, int(root * root))


def _video_resize(frames: int, height: int, width: int, *, temporal: int, factor: int, min_pixels: int,
                  max_pixels: int) -> tuple[int, int]:
    """Upstream Qwen3-VL's video resize: sides multiples of ``factor``, ``frames*h*w`` within
    ``[min_pixels, max_pixels]``, the aspect kept as nearly as possible.

    Raises:
        VlmRequestError: an aspect ratio above 200.
    """
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise VlmRequestError(f"video frame {height}x{width}: aspect ratio above {_MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = max(temporal, round(frames / temporal) * temporal)
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _patchify_frames(frames: np.ndarray, *, patch: int, temporal: int, merge: int, mean: Sequence[float],
                     std: Sequence[float]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalized frames float32 ``[F, H, W, 3]`` (``F`` a multiple of ``temporal``, ``H``/``W``
    of ``patch*merge``) -> rows ``[t*h*w, 3*temporal*patch^2]`` in the HF processor's order
    (merge blocks of ``merge x merge`` patches contiguous; a row is channel, frame, y, x) and the
    grid ``(t, h, w)``."""
    f, height, width, c = frames.shape
    x = (frames - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    x = x.transpose(0, 3, 1, 2)  # F, C, H, W
    t, gh, gw = f // temporal, height // patch, width // patch
    x = x.reshape(t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * gh * gw, c * temporal * patch * patch), dtype=np.float32), (t, gh, gw)


def _to_pil(image: Any) -> Any:
    """An image item (PIL, ndarray HWC/CHW, tensor) as an RGB PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
        arr = arr.transpose(1, 2, 0)
    if arr.dtype != np.uint8:
        arr = np.clip(arr * 255.0 if arr.max() <= 1.0 else arr, 0, 255).astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return Image.fromarray(arr).convert("RGB")


def _frames_rgb(video: Any) -> np.ndarray:
    """A video item (ndarray/tensor ``[F, H, W, 3]`` or a list of frames) as uint8 ``[F, H, W, 3]``."""
    if isinstance(video, (list, tuple)):
        return np.stack([np.asarray(_to_pil(f)) for f in video])
    arr = video.detach().cpu().numpy() if isinstance(video, torch.Tensor) else np.asarray(video)
    if arr.ndim != 4:
        raise VlmRequestError(f"video of shape {tuple(arr.shape)}: expected frames [F, H, W, 3]")
    return np.stack([np.asarray(_to_pil(f)) for f in arr])


# ------------------------------------------------------------------------------------------------
# kwargs rules

def _scopes(kwargs: Mapping[str, Any], nested: str) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = [kwargs]
    if isinstance(kwargs.get(nested), Mapping):
        out.append(kwargs[nested])
    return out


def _effective(kwargs: Mapping[str, Any], nested: str) -> dict[str, Any]:
    """One modality's kwargs: the flat ones, overridden by its nested ``images_kwargs`` /
    ``videos_kwargs``."""
    flat = {k: v for k, v in kwargs.items() if not k.endswith("_kwargs")}
    if isinstance(kwargs.get(nested), Mapping):
        flat.update(kwargs[nested])
    return flat


def _size_edges(size: Any, field: str) -> dict[str, int]:
    if size is None:
        return {}
    if isinstance(size, Mapping) or hasattr(size, "__dataclass_fields__"):
        edges = {k: _get(size, k) for k in ("shortest_edge", "longest_edge")}
        return {k: int(v) for k, v in edges.items() if v is not None}
    raise VlmRequestError(f"{field}={size!r}: expected a mapping with shortest_edge and/or longest_edge (pixels)")


class _ReleaseVision:
    """The release's vision facts and rules (one per processing info)."""

    def __init__(self, hf_config: Any, image_cfg: Mapping[str, Any], video_cfg: Mapping[str, Any] | None) -> None:
        self.family = vlm_family(hf_config)
        self.dynamic = is_dynamic_vision(hf_config)
        vision = hf_config.vision_config
        self.patch = int(image_cfg.get("patch_size") or vision.patch_size)
        self.temporal = int(image_cfg.get("temporal_patch_size") or vision.temporal_patch_size)
        self.merge = int(image_cfg.get("merge_size") or vision.spatial_merge_size)
        size = _size_edges(image_cfg.get("size"), "size") if image_cfg.get("size") is not None else {}
        if image_cfg.get("min_pixels") is not None:
            size["shortest_edge"] = int(image_cfg["min_pixels"])
        if image_cfg.get("max_pixels") is not None:
            size["longest_edge"] = int(image_cfg["max_pixels"])
        default = ({"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280} if self.family == "qwen2_vl"
                   else {"shortest_edge": 65536, "longest_edge": 16777216})
        self.image_size = {**default, **size}
        self.image_mean = list(image_cfg.get("image_mean") or ([0.5] * 3 if self.family == "qwen3_vl" else
                                                              [0.48145466, 0.4578275, 0.40821073]))
        self.image_std = list(image_cfg.get("image_std") or ([0.5] * 3 if self.family == "qwen3_vl" else
                                                            [0.26862954, 0.26130258, 0.27577711]))
        vcfg = dict(video_cfg or {})
        vsize = _size_edges(vcfg.get("size"), "size") if vcfg.get("size") is not None else {}
        self.video_size = {**_QWEN3_VIDEO_SIZE, **vsize}
        self.video_mean = list(vcfg.get("image_mean") or self.image_mean)
        self.video_std = list(vcfg.get("image_std") or self.image_std)
        self.image_limit = MAX_VISION_TOKENS * self.patch ** 2
        self.video_limit = self.image_limit * self.temporal
        factor = self.patch * self.merge
        if self.capped:  # the stored sizes, clamped once
            self.image_size = self._clamp(self.image_size, self.image_limit, "image", stored=True)
            self.video_size = self._clamp(self.video_size, self.video_limit, "video", stored=True)
        self.factor = factor

    @property
    def capped(self) -> bool:
        """Dynamic Qwen3-VL: the 4096-patch cap applies."""
        return self.family == "qwen3_vl" and self.dynamic

    @property
    def static(self) -> bool:
        """Static vision: Qwen2-VL's or Qwen3-VL's fixed frame."""
        return not self.dynamic

    @property
    def takes_video(self) -> bool:
        return self.capped

    def _clamp(self, size: Mapping[str, int], limit: int, kind: str, *, stored: bool) -> dict[str, int]:
        floor = _aligned_floor(limit, self.patch * self.merge)
        out = dict(size)
        for edge, cap in (("longest_edge", limit), ("shortest_edge", floor)):
            if edge in out and out[edge] > cap:
                logger.info("MBLT Qwen3-VL: %s %s %s %d -> %d (at most %d pre-merge patches per encoder call)",
                            "stored" if stored else "call-time", kind, edge, out[edge], cap, MAX_VISION_TOKENS)
                out[edge] = cap
        return out

    # -- the rules ---------------------------------------------------------------------------

    def check_counts(self, n_images: int, n_videos: int) -> None:
        """The per-prompt item rules.

        Raises:
            VlmRequestError: several images or any video where the release takes one image.
        """
        what = self.family.replace("qwen", "Qwen").replace("_vl", "-VL")
        if n_videos and not self.takes_video:
            if self.family == "qwen3_vl":
                raise VlmRequestError(
                    f"Video input requires a dynamic-vision Qwen3-VL release (3-input vision MXQ with variable "
                    f"visual-token count in the text decoder); got {n_videos} video(s). The release is static "
                    "(is_dynamic=False, dynamic_vision=False). Serve a Qwen3-VL release that ships a dynamic vision "
                    "MXQ, or pass only image inputs.")
            if self.static:
                raise VlmRequestError(f"Video inputs require a dynamic-vision Qwen2-VL release; got {n_videos} "
                                      "video(s) for a static Qwen2-VL release (dynamic_vision=False)")
            raise VlmRequestError(
                f"Mobilint Qwen2/3-VL on NPU does not support video inputs (got {n_videos} video(s)). Only one "
                "initial image is supported; subsequent turns must be text-only.")
        if n_images > 1 and not self.capped:
            if self.family == "qwen3_vl":
                raise VlmRequestError(
                    f"Multi-image input at prompt index 0 ({n_images} images bound to that prompt) requires a "
                    "dynamic-vision Qwen3-VL release (3-input vision MXQ with per-image 2D RoPE in the text "
                    "decoder). The release is static (is_dynamic=False), which supports exactly one image per "
                    "prompt. Serve a Qwen3-VL release that ships a dynamic vision MXQ, or pass a single image "
                    "per prompt.")
            if self.static:
                raise VlmRequestError(f"Only one image input is supported by static Qwen2-VL; got {n_images} images "
                                      "in one prompt")
            raise VlmRequestError(
                f"Mobilint {what} on NPU supports exactly one image in the initial request, but got {n_images} "
                "images. Subsequent turns must be text-only.")

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """The per-request processor-kwargs rules (flat and nested ``images_kwargs`` /
        ``videos_kwargs``).

        Raises:
            VlmRequestError: a structural override, a static resize override, ``do_resize=False``
                on a capped release; the message names the field and value.
        """
        for nested, kind in (("images_kwargs", "image"), ("videos_kwargs", "video")):
            for scope in _scopes(kwargs, nested):
                for field in _STRUCTURAL_KWARGS:
                    value = scope.get(field)
                    base = {"patch_size": self.patch, "temporal_patch_size": self.temporal,
                            "merge_size": self.merge}[field]
                    if value is not None and value != base:
                        raise VlmRequestError(
                            f"{kind} {field}={value!r} cannot override the vision MXQ's compile-time value "
                            f"({base!r}). {field} is a release-level structural parameter baked into the compiled "
                            f"{'Qwen3-VL' if self.family == 'qwen3_vl' else 'Qwen2-VL'} vision MXQ. Remove the "
                            "override, or serve a release compiled with the desired value.")
                if kind == "video" and not self.takes_video:
                    continue
                if self.static:
                    for field in (*_RESIZE_KWARGS, "do_resize"):
                        value = scope.get(field)
                        if value is None or (field == "do_resize" and value is not False):
                            continue
                        what = "Qwen3-VL" if self.family == "qwen3_vl" else "Qwen2-VL"
                        raise VlmRequestError(
                            f"image {field}={value!r} cannot override the static-vision {what} processor's fixed "
                            f"resize. The static release ships a vision MXQ compiled for a fixed "
                            f"{STATIC_GRID[1]}x{STATIC_GRID[2]}-patch frame, and the processor resizes every input "
                            f"to {STATIC_FRAME}x{STATIC_FRAME} first. Any additional resize would shape-mismatch the "
                            f"MXQ. Remove the override, or serve a dynamic-vision {what} release for resize "
                            "control.")
                elif self.capped and scope.get("do_resize") is False:
                    raise VlmRequestError(
                        f"do_resize=False bypasses the {MAX_VISION_TOKENS}-token NPU vision-token ceiling for {kind} "
                        "inputs. Larger inputs hang the NPU (watchdog timeout -> Model_NotAlive) rather than erroring "
                        "cleanly. Remove the do_resize override or pre-resize the input so its resulting patch grid "
                        "fits the ceiling.")

    def call_size(self, kwargs: Mapping[str, Any], kind: str) -> dict[str, int]:
        """The resize bounds of one call (pixels): stored, overridden by ``size`` then
        ``min_pixels``/``max_pixels``, clamped on a capped release."""
        eff = _effective(kwargs, "images_kwargs" if kind == "image" else "videos_kwargs")
        size = dict(self.image_size if kind == "image" else self.video_size)
        size.update(_size_edges(eff.get("size"), f"{kind} size"))
        if eff.get("min_pixels") is not None:
            size["shortest_edge"] = int(eff["min_pixels"])
        if eff.get("max_pixels") is not None:
            size["longest_edge"] = int(eff["max_pixels"])
        if self.capped:
            size = self._clamp(size, self.image_limit if kind == "image" else self.video_limit, kind, stored=False)
        return size


# ------------------------------------------------------------------------------------------------
# vLLM processing

class MobilintVlmProcessingInfo(BaseProcessingInfo):
    """A Mobilint Qwen2-VL / Qwen3-VL release's processing facts: its family, static or
    dynamic vision, the image processor (``Qwen2VLImageProcessorPil`` on the release's
    ``preprocessor_config.json``), the item limits."""

    def get_hf_config(self) -> Any:
        return self.ctx.get_hf_config()

    @property
    def vision(self) -> _ReleaseVision:
        cached = self.__dict__.get("_vision")
        if cached is None:
            cached = _ReleaseVision(self.get_hf_config(), self.ctx.get_hf_image_processor_config() or {},
                                    self._video_config())
            self.__dict__["_vision"] = cached
        return cached

    def _video_config(self) -> dict[str, Any] | None:
        path = Path(str(self.ctx.model_config.model)) / "video_preprocessor_config.json"
        try:
            import json

            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def get_image_processor(self) -> Any:
        """``Qwen2VLImageProcessorPil`` with the release's patch, merge, mean/std and stored
        (clamped) size."""
        cached = self.__dict__.get("_image_processor")
        if cached is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            v = self.vision
            cfg = self.ctx.get_hf_image_processor_config() or {}
            extra = {k: cfg[k] for k in ("do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "resample")
                     if k in cfg}
            cached = Qwen2VLImageProcessorPil(size=dict(v.image_size), patch_size=v.patch,
                                              temporal_patch_size=v.temporal, merge_size=v.merge,
                                              image_mean=v.image_mean, image_std=v.image_std, **extra)
            self.__dict__["_image_processor"] = cached
        return cached

    def get_hf_processor(self, **kwargs: object) -> Any:  # noqa: ARG002
        """No transformers processor: the processor here runs the image processor itself.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("Mobilint VLM releases are processed by vllm_npu.mblt.vlm_model, "
                                  "not a transformers processor")

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        keys = {"size", "min_pixels", "max_pixels", "do_resize", *_STRUCTURAL_KWARGS}
        out = {"text_kwargs": set(), "images_kwargs": set(keys)}
        if self.vision.takes_video:
            out["videos_kwargs"] = keys | {"fps", "num_frames", "do_sample_frames"}
        return out

    def get_data_parser(self) -> MultiModalDataParser:
        """vLLM's parser; a release that takes video keeps each video's metadata (fps, frame
        indices) with its frames, so it survives the processor cache's re-parsing of the items it
        misses (the timestamps depend on it)."""
        return MultiModalDataParser(expected_hidden_size=self._get_expected_hidden_size(),
                                    allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
                                    video_needs_metadata=self.vision.takes_video)

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        if self.vision.takes_video:
            return {"image": None, "video": None}
        return {"image": 1}

    def validate_num_items(self, modality: str, num_items: int) -> None:
        """The release's rules first (their own messages), then vLLM's limits.

        Raises:
            VlmRequestError: :meth:`_ReleaseVision.check_counts`.
        """
        if modality.startswith("video"):
            self.vision.check_counts(0, num_items)
        elif modality.startswith("image"):
            self.vision.check_counts(num_items, 0)
        super().validate_num_items(modality, num_items)

    def token_ids(self) -> dict[str, int]:
        cfg = self.get_hf_config()
        return {"image": int(cfg.image_token_id), "video": int(cfg.video_token_id),
                "start": int(cfg.vision_start_token_id), "end": int(cfg.vision_end_token_id)}

    def max_image_side(self) -> int:
        """The square image side giving the most tokens (a multiple of patch*merge)."""
        v = self.vision
        if v.static:
            return STATIC_FRAME
        f = v.patch * v.merge
        return max(f, int(math.isqrt(v.image_size["longest_edge"]) // f) * f)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        v = self.vision
        if v.static:
            return {"image": STATIC_GRID[1] * STATIC_GRID[2] // v.merge ** 2}
        side = self.max_image_side() // v.patch
        out = {"image": side * side // v.merge ** 2}
        if v.takes_video:
            out["video"] = max(out["image"], seq_len)
        return out


class MobilintVlmDummyInputs(BaseDummyInputsBuilder[MobilintVlmProcessingInfo]):
    """Warm-up inputs: each image the most tokens one can give (static: the fixed frame; dynamic
    Qwen3-VL: 1024x1024, the cap), each video one frame group of that size."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ("<|image_pad|>" * mm_counts.get("image", 0)
                + "<|vision_start|><|video_pad|><|vision_end|>" * mm_counts.get("video", 0))

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any) -> Any:  # noqa: ARG002
        # At most 1024x1024 (the dynamic Qwen3-VL cap): the MBLT worker sizes nothing from these
        # (the token maxima are :meth:`MobilintVlmProcessingInfo.get_mm_max_tokens_per_item`), and
        # a dynamic Qwen2-VL's stock maximum (3584x3584) would cost the warm-up seconds.
        side = min(self.info.max_image_side(), _DUMMY_SIDE_CAP)
        out: dict[str, Any] = {"image": self._get_dummy_images(
            width=side, height=side, num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image") if mm_options else None)}
        if mm_counts.get("video", 0):
            frames = self.info.vision.temporal
            videos = self._get_dummy_videos(
                width=side, height=side, num_frames=frames, num_videos=mm_counts["video"],
                overrides=mm_options.get("video") if mm_options else None)
            meta = {"fps": float(_DEFAULT_FPS), "frames_indices": list(range(frames)), "total_num_frames": frames,
                    "duration": frames / _DEFAULT_FPS, "do_sample_frames": False}
            out["video"] = [(v, dict(meta)) for v in videos]  # videos carry their metadata (get_data_parser)
        return out


def _fields(hf_inputs: Mapping[str, torch.Tensor]) -> dict[str, MultiModalFieldConfig]:
    image_grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.int64))
    video_grid = hf_inputs.get("video_grid_thw", torch.empty((0, 3), dtype=torch.int64))
    return {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", image_grid.prod(-1)),
        "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        "pixel_values_videos": MultiModalFieldConfig.flat_from_sizes("video", video_grid.prod(-1)),
        "video_grid_thw": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
        "timestamps": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
    }


def _timestamps(metadata: Mapping[str, Any] | None, n_frames: int, temporal: int) -> list[float]:
    """Seconds of each frame group: the mean of its first and last frame's time (frames padded
    to a multiple of ``temporal`` by repeating the last), from the video's ``fps`` and
    ``frames_indices`` (defaults: 24 fps, frames 0..F-1)."""
    meta = metadata or {}
    fps = float(meta.get("fps") or _DEFAULT_FPS)
    idx = list(meta.get("frames_indices") if meta.get("frames_indices") is not None else range(n_frames))
    idx = [int(i) for i in idx][:n_frames] or [0]
    while len(idx) % temporal:
        idx.append(idx[-1])
    return [(idx[i] / fps + idx[i + temporal - 1] / fps) / 2 for i in range(0, len(idx), temporal)]


class MobilintVlmMultiModalProcessor(BaseMultiModalProcessor[MobilintVlmProcessingInfo]):
    """Images and videos -> :func:`_fields` and the placeholder expansion of the module
    docstring, the release's rules checked before anything runs (:meth:`apply`)."""

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        """vLLM's processing, after the release's rules on the prompt's items and kwargs.

        Raises:
            VlmRequestError: a rule of :class:`_ReleaseVision` (HTTP 400).
        """
        counts = inputs.mm_data_items.get_all_counts()
        v = self.info.vision
        v.check_counts(counts.get("image", 0), counts.get("video", 0))
        v.check_kwargs(self.info.ctx.get_merged_mm_kwargs(inputs.hf_processor_mm_kwargs))
        return super().apply(inputs, timing_ctx)

    def _get_hf_mm_inputs(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        hf = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        if "videos" in hf.hf_data and "video" in mm_items:
            items = mm_items["video"]
            meta = items.metadata if isinstance(items.metadata, list) else [items.metadata] * len(items)
            videos = []
            for i in range(len(items)):
                item = items.get(i)
                videos.append(item if isinstance(item, tuple) else (item, meta[i] if i < len(meta) else None))
            hf.hf_data["videos"] = videos
        return hf

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        v = self.info.vision
        kwargs = self.info.ctx.get_merged_mm_kwargs(hf_kwargs)
        v.check_kwargs(kwargs)
        out = BatchFeature()
        images = list(hf_data.get("images") or [])
        if images:
            out.update(self._images(images, kwargs))
        videos = list(hf_data.get("videos") or [])
        if videos:
            out.update(self._videos(videos, kwargs))
        return out

    def _images(self, images: list[Any], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        from PIL import Image

        v = self.info.vision
        ip = self.info.get_image_processor()
        pil = [_to_pil(im) for im in images]
        if v.static:
            pil = [im.resize((STATIC_FRAME, STATIC_FRAME), Image.BICUBIC) for im in pil]
            res = ip(images=pil, return_tensors="pt")
        else:
            eff = _effective(kwargs, "images_kwargs")
            do_resize = eff.get("do_resize")
            res = ip(images=pil, size=v.call_size(kwargs, "image"), return_tensors="pt",
                     **({} if do_resize is None else {"do_resize": bool(do_resize)}))
        grids = res["image_grid_thw"].to(torch.int64)
        for i, g in enumerate(grids.tolist()):
            if v.static and tuple(g) != STATIC_GRID:
                raise VlmRequestError(
                    f"image {i}: the static vision MXQ was compiled for a {STATIC_GRID} patch grid; the processor "
                    f"produced {tuple(g)} (check the release's preprocessor_config.json size/min_pixels)")
            if v.capped and g[0] * g[1] * g[2] > MAX_VISION_TOKENS:
                raise VlmRequestError(
                    f"image {i}: preprocessing produced {g} ({g[0] * g[1] * g[2]} pre-merge vision tokens for one "
                    f"encoder call), exceeding the NPU encoder limit of {MAX_VISION_TOKENS}. Keep resizing enabled "
                    "and reduce the input resolution.")
        return {"pixel_values": res["pixel_values"].to(torch.float32), "image_grid_thw": grids}

    def _videos(self, videos: list[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        from PIL import Image

        v = self.info.vision
        size = v.call_size(kwargs, "video")
        rows, grids, stamps = [], [], []
        for i, (video, meta) in enumerate(videos):
            frames = _frames_rgb(video)
            n = len(frames)
            if n == 0:
                raise VlmRequestError(f"video {i} has no frames")
            if n % v.temporal:
                frames = np.concatenate([frames, np.repeat(frames[-1:], v.temporal - n % v.temporal, axis=0)])
            h, w = _video_resize(len(frames), frames.shape[1], frames.shape[2], temporal=v.temporal,
                                 factor=v.patch * v.merge, min_pixels=size["shortest_edge"],
                                 max_pixels=size["longest_edge"])
            resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in frames])
            pv, grid = _patchify_frames(resized.astype(np.float32) / 255.0, patch=v.patch, temporal=v.temporal,
                                        merge=v.merge, mean=v.video_mean, std=v.video_std)
            if grid[1] * grid[2] > MAX_VISION_TOKENS:
                raise VlmRequestError(
                    "Qwen3-VL dynamic video preprocessing produced a per-frame spatial grid above the "
                    f"{MAX_VISION_TOKENS}-token vision MXQ limit: [{grid[1] * grid[2]}] (video {i}). Reduce the "
                    "video spatial resolution.")
            rows.append(torch.from_numpy(pv))
            grids.append(grid)
            stamps.append(torch.tensor(_timestamps(meta, n, v.temporal), dtype=torch.float64))
        return {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
                "timestamps": stamps}

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object],  # noqa: ARG002
                              ) -> Mapping[str, MultiModalFieldConfig]:
        return _fields(hf_inputs)

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],  # noqa: ARG002
                            out_mm_kwargs: Any) -> Sequence[PromptReplacement]:
        v = self.info.vision
        ids = self.info.token_ids()
        merge2 = v.merge ** 2
        tokenizer = self.info.get_tokenizer()

        def grid(modality: str, item_idx: int) -> list[int]:
            return [int(x) for x in out_mm_kwargs[modality][item_idx][f"{modality}_grid_thw"].data.tolist()]

        def image(item_idx: int) -> list[int]:
            t, h, w = grid("image", item_idx)
            return [ids["image"]] * (t * h * w // merge2)

        def video_qwen2(item_idx: int) -> list[int]:
            t, h, w = grid("video", item_idx)
            return [ids["video"]] * (t * h * w // merge2)

        def video_qwen3(item_idx: int) -> PromptUpdateDetails:
            t, h, w = grid("video", item_idx)
            stamps = out_mm_kwargs["video"][item_idx]["timestamps"].data
            seq: list[int] = []
            for k in range(t):
                seq += list(tokenizer.encode(f"<{float(stamps[k]):.1f} seconds>", add_special_tokens=False))
                seq += [ids["start"], *([ids["video"]] * (h * w // merge2)), ids["end"]]
            return PromptUpdateDetails.select_token_id(seq, ids["video"])

        updates = [PromptReplacement(modality="image", target=[ids["image"]], replacement=image)]
        if v.family == "qwen3_vl":
            updates.append(PromptReplacement(modality="video", target=[ids["start"], ids["video"], ids["end"]],
                                             replacement=video_qwen3))
        else:
            updates.append(PromptReplacement(modality="video", target=[ids["video"]], replacement=video_qwen2))
        return updates


# ------------------------------------------------------------------------------------------------
# Registry classes

class _MobilintVlmBase(MobilintForCausalLM, SupportsMultiModal, SupportsMRoPE):
    """Shared hooks of the two registry classes (never built).

    Raises:
        MobilintModelNotBuildable: when constructed.
    """

    config: Any

    def embed_multimodal(self, **kwargs: object) -> Any:  # pragma: no cover - never built
        raise MobilintModelNotBuildable("placeholder")

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:  # noqa: ARG003
        """A chat message's image part becomes ``<|vision_start|><|image_pad|><|vision_end|>``,
        a video part the same with ``<|video_pad|>``.

        Raises:
            ValueError: any other modality.
        """
        if modality.startswith("image"):
            return "<|vision_start|><|image_pad|><|vision_end|>"
        if modality.startswith("video"):
            return "<|vision_start|><|video_pad|><|vision_end|>"
        raise ValueError(f"modality {modality!r}: Mobilint Qwen2-VL/Qwen3-VL take images and videos only")

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        """vLLM's ``SupportsMRoPE`` hook: :func:`mrope_input_positions` of ``self.config``.
        Without a model instance call it as ``Cls.get_mrope_input_positions(
        SimpleNamespace(config=hf_config), ids, features)`` or call :func:`mrope_input_positions`."""
        return mrope_input_positions(self.config, input_tokens, mm_features)


_register = MULTIMODAL_REGISTRY.register_processor(MobilintVlmMultiModalProcessor, info=MobilintVlmProcessingInfo,
                                                   dummy_inputs=MobilintVlmDummyInputs)


@_register
class MobilintQwen2VLForConditionalGeneration(_MobilintVlmBase):
    """Registry class of Mobilint Qwen2-VL releases (``mobilint-qwen2_vl``; see the module docstring)."""


@_register
class MobilintQwen3VLForConditionalGeneration(_MobilintVlmBase):
    """Registry class of Mobilint Qwen3-VL releases (``mobilint-qwen3_vl``; see the module docstring)."""
