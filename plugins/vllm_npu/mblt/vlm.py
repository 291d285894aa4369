"""A Mobilint Qwen2-VL / Qwen3-VL release on the runtime API: its layout, its vision MXQ and the
host's part of every MXQ call (issue 14 §1; facts in ``docs/mblt-vlm-release.md``).

A release ships two MXQs (``vision_config.mxq_path``, ``text_config.mxq_path``). The vision MXQ
(no KV) turns one image, or one video frame (Qwen3-VL), into merged vision tokens of the text
width; the text MXQ is a text-LLM decoder fed input embeddings, plus, by layout, packed RoPE rows
and Qwen3-VL's DeepStack rows. What each MXQ takes is read off its input count and last-axis
widths (``get_model_variant_handle(0).get_model_input_shape()``), as transformers-mblt does:

* Qwen2-VL vision (fact sheet §2a): 1 input = static (a re-laid-out 224x224 frame,
  :func:`static_relayout`); 2 inputs = ``[folded, rope]``; 3 = ``[folded, cos, sin]`` (the
  folded slot found by width, cos/sin in their order after it).
* Qwen3-VL vision (§2c): 1 input = static ``folded`` ``(1, N, fold)`` (N fixed) or ``legacy``
  ``(1024, 64, 6)`` (told apart by width); 3 inputs = ``rope``, ``pos``, ``folded`` in any order
  (found by width). Four same-shaped outputs, reordered by ``vision_output_order`` into the
  merged embeddings and L DeepStack tensors.
* Text (§2b, §2d): Qwen2-VL 1 input (static) or 2 ``[embeds, rope]``; Qwen3-VL 2 ``[embeds,
  deepstack (L,T,H)]``, 3 ``[embeds, deepstack, rope]`` (batch builds: ``[embeds, rope,
  deepstack]``), 4 ``[embeds, ds0, ds1, ds2]``, 5 ``[embeds, ds0, ds1, ds2, rope]``.

The host computes, in numpy: the static relayout; the vision 2-D RoPE rows (cos/sin or the packed
"rotate" form, :func:`pack_rotate`); Qwen3-VL's bilinear position embedding
(:func:`pos_embed_interpolate`, from the release's ``model.visual.pos_embed.weight``); the text
M-RoPE rows for RoPE-input text MXQs (:func:`text_rope_rows`); the dense DeepStack input of a
token window (:func:`deepstack_window`).

Serving rules (the seed's, vllm-mblt's texts): a Qwen2-VL release (static or dynamic) or a static
Qwen3-VL one takes exactly one image and no video per request, and later turns of a session keep
the image at the same token position (:class:`SessionImagePositions`); a dynamic Qwen3-VL takes
images and videos, each encoder call at most :data:`MAX_VISION_PATCHES` pre-merge patches.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_npu.mblt.errors import MbltBackendError
from vllm_npu.mblt.placement import make_slot_config, resolve_targets

__all__ = [
    "DEFAULT_VISION_OUTPUT_ORDER", "MAX_VISION_PATCHES", "POS_EMBED_TENSOR", "TEXT_EMBED_TENSOR",
    "VISION_OUTPUT_ORDER_ENV", "VLM_MODEL_TYPES", "SessionImagePositions", "TextLayout", "VisionEncoder",
    "VisionItem", "VisionLayout", "VlmInputError", "VlmLayoutError", "VlmRelease", "VlmRuleError",
    "check_vision_patches", "deepstack_window", "feature_items", "image_signature", "is_vlm_release",
    "pack_rotate", "pos_embed_interpolate", "static_relayout", "text_layout", "text_rope_rows",
    "vision_layout", "vision_rope_cos_sin", "vlm_family",
]

logger = logging.getLogger("vllm.vllm_npu.mblt")

#: Mobilint model type -> family.
VLM_MODEL_TYPES: dict[str, str] = {"mobilint-qwen2_vl": "qwen2_vl", "mobilint-qwen3_vl": "qwen3_vl"}
#: Pre-merge patches one vision-encoder call takes at most (vllm-mblt's ``QWEN3_VL_MAX_VISION_TOKENS``).
MAX_VISION_PATCHES = 4096
#: (merger, deepstack0, deepstack1, deepstack2) output indices of the shipped Qwen3-VL vision MXQs.
DEFAULT_VISION_OUTPUT_ORDER: tuple[int, int, int, int] = (0, 2, 3, 1)
#: Process-wide override of ``vision_config.vision_output_order`` (e.g. ``"3,0,1,2"``).
VISION_OUTPUT_ORDER_ENV = "MBLT_VISION_OUTPUT_ORDER"
#: Host tensors of a release.
TEXT_EMBED_TENSOR = "model.language_model.embed_tokens.weight"
POS_EMBED_TENSOR = "model.visual.pos_embed.weight"
#: Vision RoPE base (upstream's vision rotary embedding).
VISION_ROPE_THETA = 10000.0

# The seed's texts (vllm-mblt 0.8.0's worker), fact sheet §4.2-4.4.
STATIC_VIDEO_REFUSAL = ("Mobilint Qwen2/3-VL on NPU does not support video inputs. Only one initial image is "
                        "supported; subsequent turns must be text-only.")
STATIC_IMAGE_COUNT_REFUSAL = ("Mobilint Qwen2/3-VL on NPU supports exactly one image in the initial request, but "
                              "got {n} image features. Subsequent turns must be text-only.")
STATIC_MODALITY_REFUSAL = "Unsupported multimodal modality for Mobilint Qwen2/3-VL on NPU: {m}"
DYNAMIC_MODALITY_REFUSAL = "Unsupported multimodal modalities for Mobilint Qwen3-VL dynamic vision on NPU: {ms}"
FIXED_POSITION_REFUSAL = ("Mobilint Qwen2/3-VL on NPU requires a fixed image-token position. session_id={s}, "
                          "expected={e}, got={g}.")
PATCH_CAP_REFUSAL = ("Qwen3-VL {kind} preprocessing produced {grids} pre-merge vision tokens ({n} total for one "
                     "encoder call), exceeding the NPU encoder limit of {cap}. Keep resizing enabled and reduce the "
                     "input resolution or sampled video frames.")


class VlmLayoutError(MbltBackendError):
    """A vision or text MXQ whose inputs or outputs match no layout of its family (the message
    names the shapes and what was expected)."""


class VlmInputError(ValueError):
    """A multimodal item the vision MXQ cannot take (the message names the shape and the rule)."""


class VlmRuleError(VlmInputError):
    """A request breaking a serving rule of the release (one image on static releases, a fixed
    image position per session, image/video only, the per-call patch cap); the seed's text."""


def vlm_family(artifact: Mapping[str, object]) -> str | None:
    """``"qwen2_vl"`` / ``"qwen3_vl"`` for a parsed VLM release ``config.json``, else None."""
    return VLM_MODEL_TYPES.get(str(artifact.get("model_type")))


def is_vlm_release(artifact: Mapping[str, object]) -> bool:
    """Whether a parsed ``config.json`` is a Mobilint Qwen2-VL or Qwen3-VL release."""
    return vlm_family(artifact) is not None


def _ceil64(n: int) -> int:
    return ((int(n) + 63) // 64) * 64


# ------------------------------------------------------------------------------------------------
# host parts: RoPE rows, position embedding, relayout, DeepStack


def pack_rotate(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The packed "rotate" RoPE rows of ``cos``/``sin`` ``[..., d]`` (``d`` even, each the concat
    of a half with itself): ``[..., 2 * ceil64(d)]`` float32 with, for ``k < d / 2``, slot ``2k`` =
    ``cos[k]``, ``2k + 1`` = ``-sin[k]``, ``ceil64(d) + 2k`` = ``sin[d/2 + k]``,
    ``ceil64(d) + 2k + 1`` = ``cos[d/2 + k]``; the padding slots are 0.

    Raises:
        ValueError: shapes differ, or ``d`` is odd.
    """
    cos, sin = np.asarray(cos, np.float32), np.asarray(sin, np.float32)
    if cos.shape != sin.shape or cos.ndim < 1 or cos.shape[-1] % 2:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must have the same shape with an even last axis")
    d = cos.shape[-1]
    half, tgt = d // 2, _ceil64(d)
    out = np.zeros((*cos.shape[:-1], 2 * tgt), np.float32)
    out[..., 0:d:2] = cos[..., :half]
    out[..., 1:d:2] = -sin[..., :half]
    out[..., tgt:tgt + d:2] = sin[..., half:]
    out[..., tgt + 1:tgt + d:2] = cos[..., half:]
    return out


def _grid_rows(grid_thw: Sequence[Sequence[int]] | np.ndarray) -> list[tuple[int, int, int]]:
    arr = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if (arr < 1).any():
        raise VlmInputError(f"grid_thw {arr.tolist()} must hold positive (t, h, w) triples")
    return [(int(t), int(h), int(w)) for t, h, w in arr]


def _block_coords(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column (in patches) of each patch in the processor's order: merge windows
    row-major, the ``m x m`` patches of a window row-major inside it."""
    if h % m or w % m:
        raise VlmInputError(f"grid h={h}, w={w}: both must be multiples of spatial_merge_size={m}")
    br, bc, ir, ic = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    return (br * m + ir).ravel(), (bc * m + ic).ravel()


def vision_rope_cos_sin(grid_thw: Sequence[Sequence[int]] | np.ndarray, *, head_dim: int, merge_size: int,
                        theta: float = VISION_ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """The vision tower's 2-D RoPE of every patch of ``grid_thw`` (Qwen2-VL and Qwen3-VL alike):
    frequencies ``1 / theta ** (2j / (head_dim / 2))`` for ``j < head_dim / 4``, angles
    ``row * f`` then ``col * f`` (``[N, head_dim / 2]``), doubled to ``head_dim``; frames repeat.

    Returns:
        ``(cos, sin)`` float32, each ``[sum t*h*w, head_dim]``, patches in the processor's order.

    Raises:
        VlmInputError: a grid not a multiple of ``merge_size``; ``head_dim`` not a multiple of 4.
    """
    if head_dim % 4:
        raise VlmInputError(f"vision head_dim {head_dim} must be a multiple of 4")
    dim = head_dim // 2
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    rows = []
    for t, h, w in _grid_rows(grid_thw):
        r, c = _block_coords(h, w, merge_size)
        ang = np.concatenate([np.outer(r.astype(np.float32), inv), np.outer(c.astype(np.float32), inv)], axis=1)
        rows.append(np.tile(ang, (t, 1)))
    ang = np.concatenate(rows, axis=0).astype(np.float32)
    emb = np.concatenate([ang, ang], axis=1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def pos_embed_interpolate(pos_embed: np.ndarray, grid_thw: Sequence[Sequence[int]] | np.ndarray, *,
                          merge_size: int) -> np.ndarray:
    """Qwen3-VL's learned position embedding ``pos_embed`` ``[n*n, C]`` (an ``n x n`` grid)
    bilinearly resampled to each item's ``h x w`` patches (sample points ``linspace(0, n-1, h)``
    by ``linspace(0, n-1, w)``, corner weights ``(1-dh)(1-dw)``, ``(1-dh)dw``, ``dh(1-dw)``,
    ``dh dw``), repeated over ``t`` and put in the processor's patch order.

    Returns:
        float32 ``[sum t*h*w, C]``.

    Raises:
        VlmInputError: ``pos_embed`` not a square grid's rows; a grid not a multiple of ``merge_size``.
    """
    table = np.asarray(pos_embed, np.float32)
    n = math.isqrt(table.shape[0]) if table.ndim == 2 else 0
    if table.ndim != 2 or n * n != table.shape[0]:
        raise VlmInputError(f"pos_embed of shape {table.shape}: expected [n*n, C] rows of a square grid")
    out = []
    for t, h, w in _grid_rows(grid_thw):
        hi = np.linspace(0, n - 1, h, dtype=np.float32)
        wi = np.linspace(0, n - 1, w, dtype=np.float32)
        hf, wf = hi.astype(np.int64), wi.astype(np.int64)
        hc, wc = np.minimum(hf + 1, n - 1), np.minimum(wf + 1, n - 1)
        dh, dw = (hi - hf)[:, None], (wi - wf)[None, :]
        emb = ((1 - dh) * (1 - dw))[..., None] * table[hf[:, None] * n + wf[None, :]]
        emb = emb + ((1 - dh) * dw)[..., None] * table[hf[:, None] * n + wc[None, :]]
        emb = emb + (dh * (1 - dw))[..., None] * table[hc[:, None] * n + wf[None, :]]
        emb = emb + (dh * dw)[..., None] * table[hc[:, None] * n + wc[None, :]]  # [h, w, C]
        r, c = _block_coords(h, w, merge_size)
        out.append(np.tile(emb[r, c], (t, 1)))
    return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)


def static_relayout(pixel_values: np.ndarray, grid_thw: Sequence[int], *, in_channels: int = 3,
                    temporal_patch_size: int = 2, merge_size: int = 2) -> np.ndarray:
    """One image's processor patches ``[h*w, c*tp*p*p]`` (t = 1) as the static vision MXQ's grid
    ``[(h/m)*(w/m)*p, m*m*p, tp*c]``: axes (window row, window col, pixel row) by (patch row in
    window, patch col in window, pixel col) by (frame, channel). Qwen2-VL's 224x224 frame gives
    ``(896, 56, 6)``; Qwen3-VL's legacy 256x256 frame ``(1024, 64, 6)``.

    Raises:
        VlmInputError: ``t != 1``, or a patch count / width that does not match the grid.
    """
    t, h, w = _grid_rows([grid_thw])[0]
    x = np.asarray(pixel_values, np.float32)
    c, tp, m = int(in_channels), int(temporal_patch_size), int(merge_size)
    p = math.isqrt(x.shape[-1] // (c * tp)) if x.ndim == 2 else 0
    if t != 1 or x.ndim != 2 or x.shape[0] != h * w or x.shape[1] != c * tp * p * p or h % m or w % m:
        raise VlmInputError(f"pixel values {x.shape} with grid {(t, h, w)}: the static vision MXQ takes one "
                            f"image (t=1) of [h*w, {c}*{tp}*p*p] patches, h and w multiples of {m}")
    x = x.reshape(h // m, w // m, m, m, c, tp, p, p)         # (gh2, gw2, mh, mw, c, tp, ph, pw)
    x = x.transpose(0, 1, 6, 2, 3, 7, 5, 4)                  # (gh2, gw2, ph, mh, mw, pw, tp, c)
    return np.ascontiguousarray(x.reshape((h // m) * (w // m) * p, m * m * p, tp * c))


def text_rope_rows(positions: np.ndarray, *, head_dim: int, rope_theta: float, mrope_section: Sequence[int],
                   interleaved: bool) -> np.ndarray:
    """Packed RoPE rows ``[T, 2 * ceil64(head_dim)]`` float32 of M-RoPE ``positions`` ``[3, T]``
    (``[4, T]`` drops row 0; ``[T]`` is used on all three rows) for a RoPE-input text MXQ.

    Frequency ``j`` (``inv = 1 / theta ** (2j / head_dim)``) rotates by row ``r(j)``: chunked
    (Qwen2-VL) the first ``mrope_section[0]`` frequencies by time, the next ``[1]`` by height, the
    next ``[2]`` by width; interleaved (Qwen3-VL) ``j % 3 == 1`` (below ``3 * section[1]``) by
    height, ``j % 3 == 2`` (below ``3 * section[2]``) by width, the rest by time. Then
    :func:`pack_rotate`.

    Raises:
        ValueError: ``mrope_section`` not 3 non-negative ints summing to ``head_dim / 2``; bad positions.
    """
    pos = np.asarray(positions, np.int64)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (3, pos.shape[0]))
    if pos.ndim == 2 and pos.shape[0] == 4:
        pos = pos[1:]
    if pos.ndim != 2 or pos.shape[0] != 3:
        raise ValueError(f"positions must be [3, T] (or [4, T], [T]), got {pos.shape}")
    sec = [int(s) for s in mrope_section]
    half = int(head_dim) // 2
    if len(sec) != 3 or min(sec) < 0 or sum(sec) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must be 3 non-negative ints summing to "
                         f"head_dim/2={half}")
    if interleaved:
        j = np.arange(half)
        rows = np.zeros(half, np.int64)
        rows[(j % 3 == 1) & (j < 3 * sec[1])] = 1
        rows[(j % 3 == 2) & (j < 3 * sec[2])] = 2
    else:
        rows = np.repeat(np.arange(3), sec)
    inv = (np.float32(1) / (np.float32(rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                       / np.float32(head_dim)))).astype(np.float32)
    ang = pos[rows].T.astype(np.float32) * inv  # [T, half]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return pack_rotate(np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1))


def deepstack_window(visual_pos: np.ndarray, deepstack: np.ndarray | None, start: int, length: int,
                     *, layers: int, hidden: int) -> np.ndarray:
    """The dense DeepStack input ``[layers, length, hidden]`` float32 of token positions
    ``[start, start + length)``: zeros, with DeepStack row ``i`` (``deepstack[:, i]``) at
    ``visual_pos[i]`` when inside the window (vllm-mblt's ``_build_deepstack_input_embeds``;
    generated tokens get zeros)."""
    out = np.zeros((layers, length, hidden), np.float32)
    if deepstack is None or visual_pos is None or not len(visual_pos):
        return out
    sel = (visual_pos >= start) & (visual_pos < start + length)
    if sel.any():
        out[:, visual_pos[sel] - start] = deepstack[:, sel]
    return out


# ------------------------------------------------------------------------------------------------
# MXQ layouts


@dataclass(frozen=True)
class VisionLayout:
    """How a vision MXQ is fed.

    Attributes:
        kind: ``"static"`` (Qwen2-VL 1 input), ``"folded"`` / ``"legacy"`` (Qwen3-VL 1 input),
            ``"dynamic"``.
        slots: dynamic only: role (``folded``, ``rope``, ``cos``, ``sin``, ``pos``) -> input index.
        static_patches: the patch count a static MXQ was compiled for (``folded``: ``N``), else None.
        input_shapes: the MXQ's reported input shapes.
    """

    kind: str
    slots: Mapping[str, int] = field(default_factory=dict)
    static_patches: int | None = None
    input_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"


def _vision_dims(vision_config: Mapping[str, Any], family: str) -> tuple[int, int, int, int, int]:
    """``(head_dim, fold, in_channels, temporal_patch_size, patch_size)`` of the vision tower."""
    c = int(vision_config.get("in_channels", vision_config.get("in_chans", 3)))
    tp = int(vision_config.get("temporal_patch_size", 2))
    p = int(vision_config.get("patch_size", 14 if family == "qwen2_vl" else 16))
    width = int(vision_config.get("embed_dim" if family == "qwen2_vl" else "hidden_size",
                                  vision_config.get("hidden_size", 0)))
    heads = int(vision_config.get("num_heads", 1))
    return width // heads, c * tp * p * p, c, tp, p


def vision_layout(family: str, input_shapes: Sequence[Sequence[int]], vision_config: Mapping[str, Any]) -> VisionLayout:
    """The layout of a vision MXQ from its input count and last-axis widths (fact sheet §2a, §2c).

    Raises:
        VlmLayoutError: an input count or widths that match no layout (vllm-mblt's texts).
    """
    shapes = tuple(tuple(int(v) for v in s) for s in input_shapes)
    widths = [s[-1] for s in shapes]
    head_dim, fold, c, tp, _p = _vision_dims(vision_config, family)
    rope_w = 2 * _ceil64(head_dim)
    if family == "qwen2_vl":
        if len(shapes) == 1:
            return VisionLayout("static", input_shapes=shapes)
        if len(shapes) not in (2, 3):
            raise VlmLayoutError(f"Qwen2-VL vision MXQ must expose 1, 2, or 3 inputs; got {len(shapes)}.")
        folded = [i for i, w in enumerate(widths) if w == fold]
        if len(folded) != 1:
            raise VlmLayoutError(f"Qwen2-VL dynamic vision widths {widths} do not uniquely identify folded={fold}.")
        rest = [i for i in range(len(shapes)) if i != folded[0]]
        if len(shapes) == 2:
            if widths[rest[0]] != rope_w:
                raise VlmLayoutError(f"Qwen2-VL dynamic vision widths {widths} do not match rope={rope_w}.")
            return VisionLayout("dynamic", {"folded": folded[0], "rope": rest[0]}, input_shapes=shapes)
        if any(widths[i] != head_dim for i in rest):
            raise VlmLayoutError(f"Qwen2-VL dynamic vision widths {widths} do not match separate cos/sin "
                                 f"width={head_dim}.")
        return VisionLayout("dynamic", {"folded": folded[0], "cos": rest[0], "sin": rest[1]}, input_shapes=shapes)
    if len(shapes) == 1:
        if widths[0] == fold:
            n = shapes[0][-2] if len(shapes[0]) >= 2 and shapes[0][-2] > 0 else None
            return VisionLayout("folded", static_patches=n, input_shapes=shapes)
        if widths[0] == c * tp:
            return VisionLayout("legacy", input_shapes=shapes)
        raise VlmLayoutError(f"Qwen3-VL static vision MXQ input shape {shapes[0]} matches neither the folded layout "
                             f"(1, N, {fold}) nor the legacy layout (1024, 64, {c * tp}) derived from the vision "
                             "config.")
    if len(shapes) != 3:
        raise VlmLayoutError(f"Qwen3-VL vision MXQ must expose 1 (static) or 3 (dynamic rope + pos + folded) "
                             f"inputs; got {len(shapes)}.")
    pos_w = int(vision_config.get("hidden_size", 0))
    expected = {"rope": rope_w, "pos": pos_w, "folded": fold}
    if len(set(expected.values())) != 3:
        raise VlmLayoutError(f"Vision role widths collide for this config (rope={rope_w}, pos={pos_w}, "
                             f"folded={fold}); cannot recover input slot assignment from shapes alone.")
    slots = {}
    for role, width in expected.items():
        hits = [i for i, w in enumerate(widths) if w == width]
        if len(hits) != 1:
            raise VlmLayoutError(f"Dynamic vision MXQ input widths {widths} do not match the expected {role} width "
                                 f"{width} derived from the vision config.")
        slots[role] = hits[0]
    return VisionLayout("dynamic", slots, input_shapes=shapes)


@dataclass(frozen=True)
class TextLayout:
    """How a text MXQ is fed: ``inputs`` names each input in order (``embeds``, ``rope``,
    ``deepstack`` (the bundled ``[L, T, H]``), ``ds0``.. (split ``[1, T, H]`` each)).

    Attributes:
        family: ``qwen2_vl`` / ``qwen3_vl``.
        inputs: the roles in the MXQ's input order.
        batch: a batch-compiled text MXQ (``max_batch_size > 1``).
    """

    family: str
    inputs: tuple[str, ...]
    batch: bool = False

    @property
    def has_rope(self) -> bool:
        """The MXQ takes the host's packed RoPE rows (a "dynamic" text MXQ)."""
        return "rope" in self.inputs

    @property
    def deepstack(self) -> str | None:
        """``"bundled"``, ``"split"`` or None."""
        return "bundled" if "deepstack" in self.inputs else "split" if "ds0" in self.inputs else None

    @property
    def embeds_rank(self) -> int:
        """Rank of the embeddings input: Qwen2-VL ``(1, 1, T, H)``, Qwen3-VL ``(1, T, H)``."""
        return 4 if self.family == "qwen2_vl" else 3


TEXT_BATCH_NO_ROPE_REFUSAL = ("Batched Qwen3-VL text MXQs without a RoPE input are unsupported; use a dynamic text "
                              "MXQ, which has one.")
TEXT_SPLIT_STATIC_BATCH_REFUSAL = ("Qwen3-VL split-static text MXQ (per-layer inputs without rope) is only supported "
                                   "for max_batch_size == 1; batched split-static artifacts are unsupported (max_batch_"
                                   "size={n}). Use a dynamic (RoPE-input) text MXQ for batching.")
TEXT_QWEN2_BATCH_ROPE_REFUSAL = ("Batched Qwen2-VL text MXQs with an external RoPE input are not supported "
                                 "(max_batch_size={n}); a batch Qwen2-VL release is static-text only.")


def text_layout(family: str, input_shapes: Sequence[Sequence[int]], *, max_batch_size: int = 1,
                deepstack_layers: int = 3) -> TextLayout:
    """The layout of a text MXQ from its input count (fact sheet §2b, §2d), with the batch refusals.

    Raises:
        VlmLayoutError: an input count that matches no layout (vllm-mblt's texts).
        vllm_npu.mblt.settings.MbltConfigError: a batched Qwen3-VL text MXQ without a RoPE input
            (split-static included), or a batched Qwen2-VL one with a RoPE input.
    """
    from vllm_npu.mblt.settings import MbltConfigError

    n = len(input_shapes)
    batch = int(max_batch_size) > 1
    if family == "qwen2_vl":
        if n not in (1, 2):
            raise VlmLayoutError(f"Qwen2-VL text MXQ must expose 1 static or 2 dynamic inputs; got {n}")
        if n == 2 and batch:
            raise MbltConfigError(TEXT_QWEN2_BATCH_ROPE_REFUSAL.format(n=max_batch_size))
        return TextLayout(family, ("embeds",) if n == 1 else ("embeds", "rope"), batch)
    split = tuple(f"ds{i}" for i in range(deepstack_layers))
    layouts = {2: ("embeds", "deepstack"),
               3: ("embeds", "rope", "deepstack") if batch else ("embeds", "deepstack", "rope"),
               1 + deepstack_layers: ("embeds", *split),
               2 + deepstack_layers: ("embeds", *split, "rope")}
    if n not in layouts:
        raise VlmLayoutError(f"Qwen3-VL text MXQ input count is not recognized: got {n}. Expected 2 (bundled static), "
                             f"3 (bundled dynamic), {1 + deepstack_layers} (split static) or {2 + deepstack_layers} "
                             "(split dynamic).")
    layout = TextLayout(family, layouts[n], batch)
    if batch and not layout.has_rope:
        if layout.deepstack == "split":
            raise MbltConfigError(TEXT_SPLIT_STATIC_BATCH_REFUSAL.format(n=max_batch_size))
        raise MbltConfigError(TEXT_BATCH_NO_ROPE_REFUSAL)
    return layout


def _input_shapes(model: Any) -> list[tuple[int, ...]]:
    """One shape per tensor input (the variant handle's, as transformers-mblt reads it)."""
    try:
        shapes = model.get_model_variant_handle(0).get_model_input_shape()
    except AttributeError:
        shapes = model.get_model_input_shape()
    return [tuple(int(v) for v in s) for s in shapes]


def probe_input_shapes(runtime: Any, mxq_path: str) -> list[tuple[int, ...]]:
    """The input shapes of an MXQ, read from a constructed, never launched, disposed ``Model``.

    Raises:
        QbRuntimeError: the runtime cannot load the MXQ (unchanged).
    """
    model = runtime.Model(mxq_path)
    try:
        return _input_shapes(model)
    finally:
        model.dispose()


# ------------------------------------------------------------------------------------------------
# the release


def parse_vision_output_order(value: object, origin: str) -> tuple[int, int, int, int]:
    """A ``vision_output_order`` (``"3,0,1,2"`` or a list of four ints).

    Raises:
        VlmLayoutError: not a permutation of 0..3 (``<origin>: expected a permutation of 0..3, got ...``).
    """
    if isinstance(value, str):
        items: Sequence[object] = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise VlmLayoutError(f"{origin}: expected a list of four integers, got {value!r}")
    try:
        order = tuple(int(str(i).strip()) for i in items)
    except (TypeError, ValueError) as exc:
        raise VlmLayoutError(f"{origin}: expected four integers, got {value!r}") from exc
    if sorted(order) != [0, 1, 2, 3]:
        raise VlmLayoutError(f"{origin}: expected a permutation of 0..3, got {order}")
    return order  # type: ignore[return-value]


def resolve_vision_output_order(vision_config: Mapping[str, Any],
                                environ: Mapping[str, str] = os.environ) -> tuple[int, int, int, int]:
    """``$MBLT_VISION_OUTPUT_ORDER``, else ``vision_config.vision_output_order``, else
    :data:`DEFAULT_VISION_OUTPUT_ORDER`.

    Raises:
        VlmLayoutError: a value that is not a permutation of 0..3.
    """
    raw = environ.get(VISION_OUTPUT_ORDER_ENV)
    if raw:
        return parse_vision_output_order(raw, VISION_OUTPUT_ORDER_ENV)
    if vision_config.get("vision_output_order") is not None:
        return parse_vision_output_order(vision_config["vision_output_order"], "config.vision_output_order")
    return DEFAULT_VISION_OUTPUT_ORDER


def _sub(artifact: Mapping[str, Any], name: str) -> dict[str, Any]:
    sub = artifact.get(name)
    return dict(sub) if isinstance(sub, Mapping) else {}


@dataclass(frozen=True)
class VlmRelease:
    """A VLM release's layout: its two MXQs, how each is fed, and the text model's numbers.

    Attributes:
        family: ``qwen2_vl`` / ``qwen3_vl``.
        model_dir: the release directory.
        vision_mxq, text_mxq: the MXQ paths (``vision_mxq_path`` / ``text_mxq_path`` overrides
            first, then ``vision_config.mxq_path`` / ``text_config.mxq_path``; relative to ``model_dir``).
        vision: the vision MXQ's :class:`VisionLayout`.
        text: the text MXQ's :class:`TextLayout`.
        dynamic: the release's vision is dynamic (read off the MXQs, the config's flag reconciled).
        vision_config, text_config: the sub-configs as parsed.
        output_order: Qwen3-VL: (merger, deepstack...) output indices; Qwen2-VL: ``(0,)``.
        deepstack_layers: L (``len(vision_config.deepstack_visual_indexes)``; 0 for Qwen2-VL).
        image_token_id, video_token_id: the placeholder ids.
    """

    family: str
    model_dir: str
    vision_mxq: str
    text_mxq: str
    vision: VisionLayout
    text: TextLayout
    dynamic: bool
    vision_config: Mapping[str, Any]
    text_config: Mapping[str, Any]
    output_order: tuple[int, ...]
    deepstack_layers: int
    image_token_id: int | None = None
    video_token_id: int | None = None

    @staticmethod
    def mxq_paths(model_dir: str, artifact: Mapping[str, Any], extra: Mapping[str, object]) -> tuple[str, str]:
        """``(vision, text)`` MXQ paths: the loader extra config's ``vision_mxq_path`` /
        ``text_mxq_path``, then ``config.json``'s top-level ones, then the sub-configs'.

        Raises:
            MbltBackendError: a role without an MXQ path (the keys looked at named).
        """
        out = []
        for role in ("vision", "text"):
            rel = extra.get(f"{role}_mxq_path") or artifact.get(f"{role}_mxq_path") \
                or _sub(artifact, f"{role}_config").get("mxq_path")
            if not rel:
                raise MbltBackendError(
                    f"{model_dir}/config.json: the VLM release names no {role} MXQ (looked at the loader extra "
                    f"config's {role}_mxq_path, config.json's {role}_mxq_path and {role}_config.mxq_path)")
            out.append(str(Path(model_dir) / str(rel)))
        return out[0], out[1]

    @classmethod
    def resolve(cls, model_dir: str, artifact: Mapping[str, Any], extra: Mapping[str, object],
                vision_shapes: Sequence[Sequence[int]], text_shapes: Sequence[Sequence[int]], *,
                text_max_batch_size: int = 1) -> VlmRelease:
        """The release's layout from its config and its MXQs' input shapes (read with
        :func:`probe_input_shapes`). The config's ``dynamic_vision`` / ``is_dynamic`` flag is a
        hint: the vision MXQ's input count decides (a disagreement is logged), and the text MXQ
        must agree (a RoPE input exactly when the vision is dynamic), as transformers-mblt requires.

        Raises:
            MbltBackendError: no MXQ path for a role; ``VlmLayoutError``: inputs matching no
                layout, or vision and text MXQs that disagree on static/dynamic.
            vllm_npu.mblt.settings.MbltConfigError: the batch refusals of :func:`text_layout`.
        """
        family = vlm_family(artifact)
        if family is None:
            raise VlmLayoutError(f"model_type {artifact.get('model_type')!r} is not a Mobilint Qwen2-VL/Qwen3-VL "
                                 f"release ({', '.join(VLM_MODEL_TYPES)})")
        vision_mxq, text_mxq = cls.mxq_paths(model_dir, artifact, extra)
        vcfg, tcfg = _sub(artifact, "vision_config"), _sub(artifact, "text_config")
        layers = len(vcfg.get("deepstack_visual_indexes") or ()) if family == "qwen3_vl" else 0
        vision = vision_layout(family, vision_shapes, vcfg)
        text = text_layout(family, text_shapes, max_batch_size=text_max_batch_size, deepstack_layers=layers or 3)
        flag = artifact.get("is_dynamic", artifact.get("dynamic_vision")) if family == "qwen3_vl" \
            else artifact.get("dynamic_vision", vcfg.get("dynamic_vision"))
        if flag is not None and bool(flag) != vision.dynamic:
            logger.warning("MBLT %s: the vision MXQ's %d input(s) override config.json's dynamic flag %s",
                           family, len(vision_shapes), flag)
        if vision.dynamic != text.has_rope:
            raise VlmLayoutError(
                f"{family}: the vision MXQ is {'dynamic' if vision.dynamic else 'static'} ({len(vision_shapes)} "
                f"input(s)) but the text MXQ {'has' if text.has_rope else 'has no'} RoPE input ({len(text_shapes)} "
                "input(s)); a release pairs a dynamic vision MXQ with a RoPE-input text MXQ, a static one with a "
                "static text MXQ")
        order: tuple[int, ...] = (0,)
        if family == "qwen3_vl":
            order = resolve_vision_output_order(vcfg)
        ids = {k: artifact.get(k, tcfg.get(k)) for k in ("image_token_id", "video_token_id")}
        return cls(family, model_dir, vision_mxq, text_mxq, vision, text, vision.dynamic, vcfg, tcfg, order, layers,
                   int(ids["image_token_id"]) if ids["image_token_id"] is not None else None,
                   int(ids["video_token_id"]) if ids["video_token_id"] is not None else None)

    # text-side numbers
    @property
    def multi_item(self) -> bool:
        """Several images and videos per request: a dynamic Qwen3-VL only. Every Qwen2-VL (a dynamic
        one too, as vllm-mblt's worker holds it, and the seed's "Qwen2-VL takes exactly one image")
        and a static Qwen3-VL take exactly one image and no video."""
        return self.family == "qwen3_vl" and self.dynamic

    @property
    def head_dim(self) -> int:
        t = self.text_config
        return int(t.get("head_dim") or int(t["hidden_size"]) // int(t["num_attention_heads"]))

    def _rope(self) -> Mapping[str, Any]:
        t = self.text_config
        return t.get("rope_scaling") or t.get("rope_parameters") or {}

    @property
    def mrope_section(self) -> tuple[int, ...]:
        sec = self._rope().get("mrope_section")
        if not sec:
            raise VlmLayoutError(f"{self.model_dir}/config.json: text_config.rope_scaling.mrope_section is required by "
                                 "a RoPE-input text MXQ")
        return tuple(int(s) for s in sec)

    @property
    def rope_theta(self) -> float:
        value = self.text_config.get("rope_theta") or self._rope().get("rope_theta")
        return float(value if value is not None else 10000.0)

    def rope_rows(self, positions: np.ndarray) -> np.ndarray:
        """:func:`text_rope_rows` of ``positions`` ``[3, T]`` for this release's text MXQ."""
        return text_rope_rows(positions, head_dim=self.head_dim, rope_theta=self.rope_theta,
                              mrope_section=self.mrope_section, interleaved=self.family == "qwen3_vl")

    @property
    def merge_size(self) -> int:
        return int(self.vision_config.get("spatial_merge_size", 2))


def text_extras(release: VlmRelease, *, rope: np.ndarray | None,
                deepstack: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """The text MXQ's inputs after the embeddings, in its order, for one row of ``T`` tokens:
    ``rope`` ``[T, P]`` -> ``(1, T, P)``; ``deepstack`` ``[L, T, H]`` bundled as is, split as
    ``L`` inputs ``(1, T, H)``. The token axis is -2 in each (a batch call concatenates there).

    Raises:
        VlmInputError: a role the layout needs and the caller did not give.
    """
    out = []
    for role in release.text.inputs[1:]:
        if role == "rope":
            if rope is None:
                raise VlmInputError("the text MXQ takes RoPE rows and none were given")
            out.append(np.ascontiguousarray(rope[None], np.float32))
        elif role == "deepstack":
            if deepstack is None:
                raise VlmInputError("the text MXQ takes DeepStack rows and none were given")
            out.append(np.ascontiguousarray(deepstack, np.float32))
        else:  # dsI
            if deepstack is None:
                raise VlmInputError("the text MXQ takes DeepStack rows and none were given")
            out.append(np.ascontiguousarray(deepstack[int(role[2:])][None], np.float32))
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# the vision encoder


def check_vision_patches(kind: str, grids: Sequence[Sequence[int]], cap: int = MAX_VISION_PATCHES) -> None:
    """The per-call cap of a dynamic Qwen3-VL vision MXQ: one call per image and per video frame
    takes ``h * w`` pre-merge patches (``t * h * w`` for an image, ``t`` = 1).

    Raises:
        VlmRuleError: a call above ``cap`` (vllm-mblt's text, with the grids and the call's count).
    """
    for t, h, w in _grid_rows(grids):
        per_call = h * w if kind == "video" else t * h * w
        if per_call > cap:
            raise VlmRuleError(PATCH_CAP_REFUSAL.format(kind=kind, grids=[[t, h, w]], n=per_call, cap=cap))


def _fit(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``x`` reshaped to the MXQ's fixed input ``shape`` when the element counts agree (a leading
    1 added or dropped), else as it is."""
    if all(int(v) > 0 for v in shape) and int(np.prod(shape)) == x.size and tuple(shape) != x.shape:
        return x.reshape(tuple(int(v) for v in shape))
    return x


class VisionEncoder:
    """The launched vision MXQ and the host's part of each call; build with :meth:`create`.

    Attributes:
        release: the :class:`VlmRelease`.
        out_hidden: width of one merged vision token (the text hidden size), known after a call.
    """

    def __init__(self, release: VlmRelease, model: Any, accelerator: Any = None,
                 pos_embed: np.ndarray | None = None) -> None:
        """Internal: use :meth:`create` (tests pass a stand-in ``model``).

        Raises:
            VlmLayoutError: a dynamic Qwen3-VL release without its ``pos_embed`` table.
        """
        self.release = release
        self.model = model
        self.accelerator = accelerator
        self.pos_embed = pos_embed
        if release.family == "qwen3_vl" and release.vision.dynamic and pos_embed is None:
            raise VlmLayoutError(f"{release.model_dir}: a dynamic Qwen3-VL release needs {POS_EMBED_TENSOR!r} for the "
                                 "vision position embedding, and none was found in its safetensors")
        vcfg = release.vision_config
        self.head_dim, self.fold, self.in_channels, self.temporal_patch_size, self.patch_size = \
            _vision_dims(vcfg, release.family)
        self.merge_size = release.merge_size
        rp = vcfg.get("rope_parameters") or {}
        self.theta = float(rp.get("rope_theta", vcfg.get("rope_theta", VISION_ROPE_THETA)))

    @classmethod
    def create(cls, runtime: Any, release: VlmRelease, *, dev_no: int, core_mode: str,
               target_cores: Sequence[str] | None, target_clusters: Sequence[str] | None, device_name: str,
               pos_embed: np.ndarray | None = None) -> VisionEncoder:
        """Create and launch the vision MXQ on its device and cores.

        Raises:
            MbltTargetError: targets that do not resolve.
            QbRuntimeError: the runtime's error, unchanged (the model disposed).
        """
        mode = "single" if core_mode == "auto" and target_cores else core_mode
        placement = resolve_targets((dev_no,), mode, tuple(target_cores) if target_cores else None,
                                    tuple(target_clusters) if target_clusters else None, device_name)
        acc = runtime.Accelerator(device_name, dev_no)
        model = runtime.Model(release.vision_mxq, make_slot_config(runtime, placement, dev_no, 0, 1))
        try:
            model.launch(acc)
            return cls(release, model, acc, pos_embed)
        except BaseException:
            model.dispose()
            raise

    # ------------------------------------------------------------------ host inputs
    def call_inputs(self, patches: np.ndarray, grid: tuple[int, int, int]) -> list[np.ndarray]:
        """The MXQ inputs of one call: one image (``t`` = 1) or one video frame's patches
        ``[h*w, fold]`` (Qwen2-VL dynamic: a whole item, ``t*h*w``), in the MXQ's input order.

        Raises:
            VlmInputError: patches that do not fit the layout (a static frame of another size...).
        """
        layout = self.release.vision
        x = np.ascontiguousarray(patches, np.float32)
        if x.ndim != 2 or x.shape[1] != self.fold or x.shape[0] != int(np.prod(grid)):
            raise VlmInputError(f"pixel values {x.shape} for grid {grid}: expected [t*h*w, {self.fold}]")
        if layout.kind in ("static", "legacy"):
            relaid = static_relayout(x, grid, in_channels=self.in_channels,
                                     temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size)
            shape = layout.input_shapes[0]
            if all(v > 0 for v in shape) and int(np.prod(shape)) != relaid.size:
                raise VlmInputError(f"the static vision MXQ takes {shape}; an image of grid {grid} gives "
                                    f"{relaid.shape}: load the release's own processor so every image is resized "
                                    "to the compiled frame")
            return [_fit(relaid, shape)]
        if layout.kind == "folded":
            if layout.static_patches is not None and x.shape[0] != layout.static_patches:
                raise VlmInputError(f"Qwen3-VL static vision MXQ was compiled for {layout.static_patches} patches; the "
                                    f"processor produced {x.shape[0]}. Load the processor of the same release so "
                                    "every image is resized to the compiled frame size.")
            return [x[None]]
        n = x.shape[0]
        payload: list[np.ndarray | None] = [None] * len(layout.input_shapes)
        payload[layout.slots["folded"]] = x[None]
        cos, sin = vision_rope_cos_sin([grid], head_dim=self.head_dim, merge_size=self.merge_size, theta=self.theta)
        if "rope" in layout.slots:
            payload[layout.slots["rope"]] = pack_rotate(cos, sin)[None]
        else:
            payload[layout.slots["cos"]] = cos[None]
            payload[layout.slots["sin"]] = sin[None]
        if "pos" in layout.slots:
            assert self.pos_embed is not None
            payload[layout.slots["pos"]] = pos_embed_interpolate(self.pos_embed, [grid],
                                                                 merge_size=self.merge_size).reshape(1, n, -1)
        return payload  # type: ignore[return-value]

    def _calls(self, grid: tuple[int, int, int]) -> list[tuple[int, tuple[int, int, int]]]:
        """``(patch offset, call grid)`` of each call for one item: Qwen3-VL splits an item into its
        frames; Qwen2-VL runs an item in one call."""
        t, h, w = grid
        if self.release.family == "qwen3_vl" and t > 1:
            return [(f * h * w, (1, h, w)) for f in range(t)]
        return [(0, grid)]

    def _outputs(self, result: Any) -> tuple[np.ndarray, np.ndarray | None]:
        if result is None:
            raise VlmLayoutError(f"{self.release.family} vision MXQ inference returned None")
        outs = [np.asarray(o, np.float32) for o in result]
        if self.release.family == "qwen2_vl":
            return outs[0].reshape(-1, outs[0].shape[-1]), None
        if len(outs) < 4:
            raise VlmLayoutError(f"Expected at least 4 encoder outputs, got {len(outs)}")
        merger, *deep = self.release.output_order
        embeds = outs[merger].reshape(-1, outs[merger].shape[-1])
        return embeds, np.stack([outs[i].reshape(-1, outs[i].shape[-1]) for i in deep])

    def encode(self, pixel_values: np.ndarray, grid_thw: Sequence[Sequence[int]] | np.ndarray,
               *, kind: str = "image") -> tuple[np.ndarray, np.ndarray | None]:
        """Merged vision tokens of one or more items (``grid_thw`` rows, patches concatenated in
        ``pixel_values``): one MXQ call per image, per video frame (Qwen3-VL) or per video (Qwen2-VL).

        Returns:
            ``(embeds [sum t*h*w / m^2, H], deepstack [L, same, H] or None)`` float32.

        Raises:
            VlmInputError: patches that do not match the grids or the layout; a video on a static
                vision MXQ; VlmRuleError: a dynamic Qwen3-VL call above :data:`MAX_VISION_PATCHES`.
            VlmLayoutError: outputs that match no layout.
            QbRuntimeError: the runtime's error, unchanged.
        """
        grids = _grid_rows(grid_thw)
        x = np.asarray(pixel_values, np.float32)
        total = sum(t * h * w for t, h, w in grids)
        if x.ndim != 2 or x.shape[0] != total:
            raise VlmInputError(f"pixel values {x.shape} for grids {[list(g) for g in grids]}: expected {total} rows")
        if not self.release.vision.dynamic and (kind == "video" or any(t > 1 for t, _h, _w in grids)):
            raise VlmInputError(STATIC_VIDEO_REFUSAL)
        if self.release.multi_item:
            check_vision_patches(kind, grids)
        embeds, deep = [], []
        offset = 0
        for grid in grids:
            for start, call in self._calls(grid):
                n = int(np.prod(call))
                e, d = self._outputs(self.model.infer(self.call_inputs(x[offset + start:offset + start + n], call)))
                want = n // (self.merge_size ** 2)
                if e.shape[0] != want:
                    raise VlmLayoutError(f"the vision MXQ returned {e.shape[0]} tokens for grid {call}; "
                                         f"expected {want}")
                embeds.append(e)
                if d is not None:
                    deep.append(d)
            offset += int(np.prod(grid))
        return np.concatenate(embeds), (np.concatenate(deep, axis=1) if deep else None)

    def dispose(self) -> None:
        """Dispose the model (never raises: a failure is logged)."""
        try:
            self.model.dispose()
        except Exception as exc:  # noqa: BLE001 - teardown
            logger.warning("Disposing the Mobilint vision encoder failed: %s", exc)


# ------------------------------------------------------------------------------------------------
# a request's items and the rules


@dataclass(frozen=True)
class VisionItem:
    """One image or video of a request, encoded.

    Attributes:
        identifier: vLLM's item hash (``MultiModalFeatureSpec.identifier``).
        modality: ``image`` / ``video``.
        positions: prompt positions of its embeddings (``is_embed`` applied), ascending.
        rows: ``[n, H]`` merged vision tokens; None for an item vLLM's prefix cache covers and
            whose pixels it dropped (its KV must come from a prefix snapshot).
        deepstack: ``[L, n, H]`` (Qwen3-VL), else None.
        grid: ``(t, h, w)`` in patches; None when vLLM dropped it too.
    """

    identifier: str
    modality: str
    positions: np.ndarray
    rows: np.ndarray | None
    deepstack: np.ndarray | None
    grid: tuple[int, int, int] | None

    @property
    def end(self) -> int:
        """One past the item's last embedding position."""
        return int(self.positions[-1]) + 1 if len(self.positions) else 0


def _np(value: Any) -> np.ndarray:
    value = getattr(value, "data", value)
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _field(data: Any, *names: str) -> np.ndarray | None:
    for name in names:
        if data is not None and name in data:
            return _np(data[name])
    return None


def check_request_rules(modalities: Sequence[str], *, dynamic: bool) -> None:
    """The per-request rules of a release (fact sheet §4.2): dynamic Qwen3-VL takes images and
    videos; a static release exactly one image and nothing else.

    Raises:
        VlmRuleError: with vllm-mblt's text.
    """
    if not modalities:
        return
    if dynamic:
        bad = sorted({m for m in modalities if m not in ("image", "video")})
        if bad:
            raise VlmRuleError(DYNAMIC_MODALITY_REFUSAL.format(ms=bad))
        return
    if "video" in modalities:
        raise VlmRuleError(STATIC_VIDEO_REFUSAL)
    other = [m for m in modalities if m != "image"]
    if other:
        raise VlmRuleError(STATIC_MODALITY_REFUSAL.format(m=other[0]))
    if len(modalities) != 1:
        raise VlmRuleError(STATIC_IMAGE_COUNT_REFUSAL.format(n=len(modalities)))


def feature_items(mm_features: Sequence[Any], encoder: VisionEncoder, *, computed_tokens: int = 0) -> list[VisionItem]:
    """Encode each image/video of a new request once (vLLM's ``MultiModalFeatureSpec`` list), in
    prompt order, after :func:`check_request_rules`.

    ``data`` holds the processor's ``pixel_values`` / ``image_grid_thw`` (``pixel_values_videos`` /
    ``video_grid_thw`` for a video); the rows go to the placeholder's ``is_embed`` positions in order.
    An item inside vLLM's prefix-cache hit (``computed_tokens``) may arrive without its pixels
    (vLLM 0.32 strips them, ``strip_covered_mm_data``): it is not encoded (``rows`` None).

    Raises:
        VlmRuleError: a rule broken; VlmInputError: an item without its pixels outside the
            prefix-cache hit, or whose token count differs from its placeholder's embedding count.
    """
    specs = sorted(mm_features, key=lambda f: f.mm_position.offset)
    check_request_rules([f.modality for f in specs], dynamic=encoder.release.multi_item)
    out = []
    for spec in specs:
        video = spec.modality == "video"
        data = spec.data
        pixels = _field(data, "pixel_values_videos" if video else "pixel_values")
        grid = _field(data, "video_grid_thw" if video else "image_grid_thw")
        pos = spec.mm_position
        positions = int(pos.offset) + np.arange(int(pos.length))
        if pos.is_embed is not None:
            positions = positions[_np(pos.is_embed).astype(bool)]
        grid_row = _grid_rows(grid)[0] if grid is not None else None
        if pixels is None and int(pos.offset) + int(pos.length) <= int(computed_tokens):
            out.append(VisionItem(spec.identifier, spec.modality, positions, None, None, grid_row))
            continue
        if pixels is None or grid_row is None:
            raise VlmInputError(f"{spec.modality} item {spec.identifier} arrived without its pixels (fields: "
                                f"{sorted(data) if data is not None else None})")
        rows, deep = encoder.encode(pixels, [grid_row], kind=spec.modality)
        if positions.size != rows.shape[0]:
            raise VlmInputError(f"Multimodal placeholder embed-count mismatch: {spec.modality} item {spec.identifier} "
                                f"gives {rows.shape[0]} vision tokens (grid {list(grid_row)}) for {positions.size} "
                                "placeholder embedding positions")
        out.append(VisionItem(spec.identifier, spec.modality, positions, rows, deep, grid_row))
    return out


def image_signature(placeholder: Any) -> tuple:
    """An image's position signature ``(offset, length, is_embed tuple or None)`` (vllm-mblt's)."""
    is_embed = getattr(placeholder, "is_embed", None)
    return (int(placeholder.offset), int(placeholder.length),
            None if is_embed is None else tuple(bool(b) for b in _np(is_embed).tolist()))


class SessionImagePositions:
    """The fixed image position of each session of a static release (fact sheet §4.3).

    A session is what the client names with ``session_id`` in the request's ``vllm_xargs``
    (vLLM's ``SamplingParams.extra_args``): vLLM 0.32 has no session of its own, and a chat turn
    re-sends the whole conversation. The first image-bearing request of a session records its
    image's signature; a later one must carry it at the same signature, else it is refused; text-only
    requests pass. Without a ``session_id`` every request is its own session (what vllm-mblt does on
    vLLM 0.11.2, whose requests carry no session either). At most ``capacity`` sessions are kept,
    least recently used dropped first.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = int(capacity)
        self._by_session: OrderedDict[str, tuple] = OrderedDict()

    def check(self, session_id: str | None, signature: tuple | None) -> None:
        """Record or check one request's image ``signature`` (None: a text-only request).

        Raises:
            VlmRuleError: a signature other than the session's (vllm-mblt's text).
        """
        if session_id is None or signature is None:
            return
        sid = str(session_id)
        expected = self._by_session.get(sid)
        if expected is not None and expected != signature:
            raise VlmRuleError(FIXED_POSITION_REFUSAL.format(s=sid, e=expected, g=signature))
        self._by_session[sid] = signature
        self._by_session.move_to_end(sid)
        while len(self._by_session) > self.capacity:
            self._by_session.popitem(last=False)


def session_id_of(params: Any) -> str | None:
    """The client's ``session_id`` (``vllm_xargs``, i.e. ``SamplingParams.extra_args``), or None."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get("session_id") if isinstance(extra, Mapping) else None
    return None if value is None else str(value)
