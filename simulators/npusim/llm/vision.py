"""The Qwen2-VL and Qwen3-VL vision towers (numpy only).

Input: the flat patches of :func:`npusim.llm.vision_inputs.patchify` (``[N, 3 * tp * p * p]``,
merge-window order: every ``m * m`` consecutive rows are one merge window) and their grids
``(t, h, w)`` in patches. Computation, as transformers 5.19's ``Qwen2VisionTransformerPretrainedModel``
and ``Qwen3VLVisionModel``::

    x = patches @ patch_embed.proj.weight.reshape(D, -1).T (+ bias, Qwen3)   the Conv3d with stride = kernel
    x = x + pos_embeds                                                      Qwen3: pos_embed bilinearly resized
    per block:  x = x + proj(attention(norm1(x)))     LayerNorm eps 1e-6, qkv with bias, 2-D RoPE,
                x = x + mlp(norm2(x))                 block-diagonal: each frame (h * w patches) attends to itself
    y = merger(x)                                                           -> [N / m^2, out_hidden]

* RoPE (the host's part, :meth:`rope`): head dim ``d``, ``inv_freq[j] = 1 / 10000 ** (2j / (d/2))``
  (``d/4`` frequencies, ``rope_parameters.rope_theta`` if the config has one); a patch at row
  ``y``, column ``x`` of its frame gets angles ``concat(y * inv_freq, x * inv_freq)`` repeated
  twice (``rotate half`` over the whole head), in the patches' merge-window order.
* Qwen2-VL: MLP ``fc2(quick_gelu(fc1))`` (``hidden_act``); merger ``mlp.2(gelu(mlp.0(ln_q(x)
  viewed [N/4, 4D])))`` (exact GELU).
* Qwen3-VL: MLP ``linear_fc2(gelu_tanh(linear_fc1))``; position embeddings (the host's part,
  :meth:`Qwen3VisionTower.pos_embeds`): the ``S x S`` table (``S = sqrt(num_position_embeddings)``)
  resized to ``h x w`` bilinearly with ``align_corners=True`` (source ``i * (S-1) / (h-1)``,
  taps clamped to the border), in merge-window order, repeated per frame; merger
  ``linear_fc2(gelu(linear_fc1(norm(x) viewed [N/4, 4D])))``; after block
  ``deepstack_visual_indexes[k]`` the DeepStack merger ``k`` (norm over the 4D merged vector:
  "postshuffle") gives ``deepstack[k]``.

Numerics: every operation is evaluated in float64 and its result rounded to float32 (as
:class:`npusim.llm.Decoder` does), so results do not depend on how items are batched.
:meth:`forward` equals the concatenation of per-item :meth:`forward_patches` exactly.
Against transformers' float32 towers: NMSE <= 1e-10 (tests/npusim/test_vlm_golden.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .decoder import checked_weights
from .errors import CheckpointError, UnsupportedModelError

__all__ = ["GridError", "Qwen2VisionTower", "Qwen3VisionTower", "VISION_PREFIX", "grid_list", "vision_tensor_shapes"]

VISION_PREFIX = "model.visual."
_F32 = np.dtype(np.float32)
_ACC = np.float64
LAYER_NORM_EPS = 1e-6


class GridError(ValueError):
    """A ``(t, h, w)`` grid that does not match the patches or the merge size (values named)."""


def grid_list(grid_thw: Sequence[int] | Sequence[Sequence[int]] | np.ndarray) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of ``(t, h, w)``: one triple or a sequence of them.

    Raises:
        GridError: not positive integer triples.
    """
    arr = np.asarray(grid_thw, dtype=np.int64)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] < 1 or (arr < 1).any():
        raise GridError(f"grid_thw must be one or more positive (t, h, w) triples, got {np.asarray(grid_thw).tolist()!r}")
    return [tuple(int(v) for v in row) for row in arr]


def _r(x: np.ndarray) -> np.ndarray:
    """Round to float32, held as float64."""
    return x.astype(_F32).astype(_ACC)


_ERF = np.frompyfunc(math.erf, 1, 1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0)).astype(_ACC))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _quick_gelu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-1.702 * x))


_ACTS = {"quick_gelu": _quick_gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh, "gelu": _gelu}


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return _r((x - mu) / np.sqrt(var + LAYER_NORM_EPS) * w + b)


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = x @ w.T
    if b is not None:
        y = y + b
    return _r(y)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` over the last axis; ``x`` ``[N, heads, d]``, tables ``[N, d]``."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return _r(x * cos[:, None] + rot * sin[:, None])


def _cfg_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise CheckpointError(f"vision_config.{key} must be a positive integer, got {v!r}")
    return int(v)


def vision_tensor_shapes(family: str, vision_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name (without the ``model.visual.`` prefix) -> shape, of a ``family`` tower.

    Raises:
        UnsupportedModelError: unknown family.
        CheckpointError: a missing or invalid size in ``vision_config``.
    """
    c = vision_config
    p, tp, ch, m = (_cfg_int(c, "patch_size"), _cfg_int(c, "temporal_patch_size", 2), _cfg_int(c, "in_channels", 3),
                    _cfg_int(c, "spatial_merge_size", 2))
    if family == "qwen2_vl":
        d, out, depth = _cfg_int(c, "embed_dim"), _cfg_int(c, "hidden_size"), _cfg_int(c, "depth")
        inter = int(d * c.get("mlp_ratio", 4))
        shapes: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (d, ch, tp, p, p)}
        mlp = {"mlp.fc1.weight": (inter, d), "mlp.fc1.bias": (inter,), "mlp.fc2.weight": (d, inter), "mlp.fc2.bias": (d,)}
    elif family == "qwen3_vl":
        d, out, depth = _cfg_int(c, "hidden_size"), _cfg_int(c, "out_hidden_size"), _cfg_int(c, "depth")
        inter = _cfg_int(c, "intermediate_size")
        npos = _cfg_int(c, "num_position_embeddings")
        shapes = {"patch_embed.proj.weight": (d, ch, tp, p, p), "patch_embed.proj.bias": (d,), "pos_embed.weight": (npos, d)}
        mlp = {"mlp.linear_fc1.weight": (inter, d), "mlp.linear_fc1.bias": (inter,),
               "mlp.linear_fc2.weight": (d, inter), "mlp.linear_fc2.bias": (d,)}
    else:
        raise UnsupportedModelError(f"unknown vision family {family!r} (qwen2_vl or qwen3_vl)")
    for i in range(depth):
        b = f"blocks.{i}."
        for n in ("norm1", "norm2"):
            shapes[b + n + ".weight"] = (d,)
            shapes[b + n + ".bias"] = (d,)
        shapes[b + "attn.qkv.weight"] = (3 * d, d)
        shapes[b + "attn.qkv.bias"] = (3 * d,)
        shapes[b + "attn.proj.weight"] = (d, d)
        shapes[b + "attn.proj.bias"] = (d,)
        shapes.update({b + k: v for k, v in mlp.items()})
    big = d * m * m
    if family == "qwen2_vl":
        shapes.update({"merger.ln_q.weight": (d,), "merger.ln_q.bias": (d,), "merger.mlp.0.weight": (big, big),
                       "merger.mlp.0.bias": (big,), "merger.mlp.2.weight": (out, big), "merger.mlp.2.bias": (out,)})
    else:
        mergers = ["merger."] + [f"deepstack_merger_list.{k}." for k in range(len(c.get("deepstack_visual_indexes", ())))]
        for j, pre in enumerate(mergers):
            nd = d if j == 0 else big
            shapes.update({pre + "norm.weight": (nd,), pre + "norm.bias": (nd,), pre + "linear_fc1.weight": (big, big),
                           pre + "linear_fc1.bias": (big,), pre + "linear_fc2.weight": (out, big),
                           pre + "linear_fc2.bias": (out,)})
    return shapes


class _Tower:
    """What both towers share: patch embedding, 2-D RoPE, blocks, mergers."""

    family = ""

    def __init__(self, vision_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                 prefix: str = VISION_PREFIX) -> None:
        c = dict(vision_config)
        self.config = c
        shapes = vision_tensor_shapes(self.family, c)
        named = {prefix + k: v for k, v in shapes.items()}
        w = checked_weights(named, tensors, _F32, f"vision tower ({prefix}*)")
        self._w = {k[len(prefix):]: v for k, v in w.items()}
        self.patch_size = _cfg_int(c, "patch_size")
        self.temporal_patch_size = _cfg_int(c, "temporal_patch_size", 2)
        self.merge_size = _cfg_int(c, "spatial_merge_size", 2)
        self.in_channels = _cfg_int(c, "in_channels", 3)
        self.num_heads = _cfg_int(c, "num_heads")
        self.width = shapes["patch_embed.proj.weight"][0]
        if self.width % self.num_heads or (self.width // self.num_heads) % 4:
            raise CheckpointError(f"vision width {self.width} / num_heads {self.num_heads} must be a multiple of 4")
        self.head_dim = self.width // self.num_heads
        self.depth = _cfg_int(c, "depth")
        act = c.get("hidden_act", "quick_gelu" if self.family == "qwen2_vl" else "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported ({', '.join(_ACTS)})")
        self._act = _ACTS[act]
        rp = c.get("rope_parameters") or {}
        self.rope_theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        self._proj = self._w["patch_embed.proj.weight"].reshape(self.width, -1)
        self._proj_bias = self._w.get("patch_embed.proj.bias")

    # ---------------------------------------------------------------- host parts

    def _merge_order(self, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Row and column of every patch of an ``h x w`` frame, in merge-window order."""
        m = self.merge_size
        if h % m or w % m:
            raise GridError(f"grid h={h}, w={w} must be multiples of spatial_merge_size={m}")
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()

    def rope(self, grid_thw: Sequence[int] | Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The vision RoPE tables of ``grid_thw`` (one ``(t, h, w)`` or several, concatenated),
        float32 ``[sum t*h*w, head_dim]`` each, in patch (merge-window) order.

        Raises:
            GridError: a bad grid.
        """
        quarter = np.arange(0, self.head_dim // 2, 2, dtype=np.float32) / np.float32(self.head_dim // 2)
        inv = (np.float32(1.0) / (np.float64(self.rope_theta) ** quarter.astype(np.float64)).astype(np.float32))
        cos_parts, sin_parts = [], []
        for t, h, w in grid_list(grid_thw):
            rows, cols = self._merge_order(h, w)
            ang = np.concatenate([rows[:, None].astype(np.float32) * inv, cols[:, None].astype(np.float32) * inv], axis=1)
            ang = np.concatenate([ang, ang], axis=1)
            cos_parts.append(np.tile(np.cos(ang).astype(np.float32), (t, 1)))
            sin_parts.append(np.tile(np.sin(ang).astype(np.float32), (t, 1)))
        return np.concatenate(cos_parts), np.concatenate(sin_parts)

    # ---------------------------------------------------------------- device parts

    def _check_patches(self, patches: np.ndarray, frames: int) -> np.ndarray:
        x = np.asarray(patches)
        if x.ndim != 2 or x.shape[1] != self.patch_dim or x.shape[0] < 1:
            raise ValueError(f"patches must be [N, {self.patch_dim}] with N >= 1, got shape {x.shape}")
        unit = self.merge_size ** 2
        if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 1 or x.shape[0] % (frames * unit):
            raise GridError(f"{x.shape[0]} patches cannot be {frames!r} frame(s) of whole {unit}-patch merge windows")
        return x

    def _check_table(self, name: str, table: np.ndarray, rows: int, cols: int) -> np.ndarray:
        arr = np.asarray(table)
        if arr.shape != (rows, cols):
            raise ValueError(f"{name} must have shape [{rows}, {cols}], got {arr.shape}")
        return _r(arr.astype(_ACC))

    def _embed(self, x: np.ndarray) -> np.ndarray:
        return _linear(_r(x.astype(_ACC)), self._proj, self._proj_bias)

    def _block(self, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, frames: int) -> np.ndarray:
        W = self._w
        b = f"blocks.{i}."
        n, nh, hd = x.shape[0], self.num_heads, self.head_dim
        y = _layer_norm(x, W[b + "norm1.weight"], W[b + "norm1.bias"])
        qkv = _linear(y, W[b + "attn.qkv.weight"], W[b + "attn.qkv.bias"]).reshape(n, 3, nh, hd)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        seg = n // frames
        out = np.empty((n, nh, hd))
        for f in range(frames):
            s = slice(f * seg, (f + 1) * seg)
            qs, ks, vs = q[s].transpose(1, 0, 2), k[s].transpose(1, 0, 2), v[s].transpose(1, 0, 2)  # [nh, seg, hd]
            scores = _r((qs @ ks.transpose(0, 2, 1)) * (hd ** -0.5))
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = _r(probs / probs.sum(axis=-1, keepdims=True))
            out[s] = _r(probs @ vs).transpose(1, 0, 2)
        x = _r(x + _linear(out.reshape(n, nh * hd), W[b + "attn.proj.weight"], W[b + "attn.proj.bias"]))
        y = _layer_norm(x, W[b + "norm2.weight"], W[b + "norm2.bias"])
        return _r(x + self._mlp(i, y))

    def _mlp(self, i: int, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _merge(self, pre: str, x: np.ndarray, postshuffle: bool, norm: str, fc1: str, fc2: str) -> np.ndarray:
        W = self._w
        big = self.width * self.merge_size ** 2
        if postshuffle:
            y = _layer_norm(x.reshape(-1, big), W[pre + norm + ".weight"], W[pre + norm + ".bias"])
        else:
            y = _layer_norm(x, W[pre + norm + ".weight"], W[pre + norm + ".bias"]).reshape(-1, big)
        y = _r(_gelu(_linear(y, W[pre + fc1 + ".weight"], W[pre + fc1 + ".bias"])))
        return _linear(y, W[pre + fc2 + ".weight"], W[pre + fc2 + ".bias"])

    def _items(self, pixel_values: np.ndarray, grid_thw: Sequence[Sequence[int]]) -> list[tuple[slice, tuple[int, int, int]]]:
        grids = grid_list(grid_thw)
        x = np.asarray(pixel_values)
        total = sum(t * h * w for t, h, w in grids)
        if x.ndim != 2 or x.shape != (total, self.patch_dim):
            raise GridError(f"pixel_values must be [{total}, {self.patch_dim}] for grids {grids}, got shape {x.shape}")
        out, s = [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            out.append((slice(s, s + n), g))
            s += n
        return out


class Qwen2VisionTower(_Tower):
    """The Qwen2-VL vision tower (module docstring) of ``vision_config`` and the checkpoint's ``tensors``.

    Attributes:
        config: the ``vision_config`` dict.
        head_dim, width, depth, merge_size, patch_size, temporal_patch_size, patch_dim: its sizes.
    """

    family = "qwen2_vl"

    def __init__(self, vision_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                 prefix: str = VISION_PREFIX) -> None:
        """Check and keep the tower's tensors (``prefix`` + the names of :func:`vision_tensor_shapes`).

        Raises:
            CheckpointError: a missing tensor, a shape the config does not imply, a bad size.
            UnsupportedModelError: an unsupported ``hidden_act``.
        """
        super().__init__(vision_config, tensors, prefix)
        self.out_hidden_size = _cfg_int(self.config, "hidden_size")

    def _mlp(self, i: int, y: np.ndarray) -> np.ndarray:
        W, b = self._w, f"blocks.{i}.mlp."
        return _linear(_r(self._act(_linear(y, W[b + "fc1.weight"], W[b + "fc1.bias"]))), W[b + "fc2.weight"], W[b + "fc2.bias"])

    def forward_patches(self, patches: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, frames: int = 1) -> np.ndarray:
        """The tower on one item's patches (what the vision MXQ computes).

        Args:
            patches: ``[N, patch_dim]`` in merge-window order (:func:`patchify`).
            cos, sin: ``[N, head_dim]`` from :meth:`rope`.
            frames: the item's ``t``: attention is block-diagonal over ``frames`` equal segments
                (1 for an image or a single video frame).

        Returns:
            float32 ``[N / merge_size**2, out_hidden_size]``.

        Raises:
            ValueError / GridError: shapes that do not fit (named).
        """
        x = self._check_patches(patches, frames)
        n = x.shape[0]
        cos, sin = self._check_table("cos", cos, n, self.head_dim), self._check_table("sin", sin, n, self.head_dim)
        h = self._embed(x)
        for i in range(self.depth):
            h = self._block(i, h, cos, sin, frames)
        return self._merge("merger.", h, False, "ln_q", "mlp.0", "mlp.2").astype(np.float32)

    def forward(self, pixel_values: np.ndarray, grid_thw: Sequence[Sequence[int]]) -> np.ndarray:
        """All items of ``pixel_values`` (concatenated patches of ``grid_thw``): ``[sum N_i / 4, out_hidden]`` float32.

        Raises:
            GridError: ``pixel_values`` does not hold the grids' patches.
        """
        outs = []
        for s, g in self._items(pixel_values, grid_thw):
            cos, sin = self.rope(g)
            outs.append(self.forward_patches(np.asarray(pixel_values)[s], cos, sin, frames=g[0]))
        return np.concatenate(outs)


class Qwen3VisionTower(_Tower):
    """The Qwen3-VL vision tower (module docstring): embeddings and DeepStack features.

    Attributes:
        config: the ``vision_config`` dict.
        deepstack_visual_indexes: the blocks after which the DeepStack mergers run.
        head_dim, width, depth, merge_size, patch_size, temporal_patch_size, patch_dim: its sizes.
    """

    family = "qwen3_vl"

    def __init__(self, vision_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                 prefix: str = VISION_PREFIX) -> None:
        """Check and keep the tower's tensors (``prefix`` + the names of :func:`vision_tensor_shapes`).

        Raises:
            CheckpointError: a missing tensor, a shape the config does not imply, a bad size, a
                DeepStack index outside ``0 .. depth - 1``, or a non-square position table.
            UnsupportedModelError: an unsupported ``hidden_act``.
        """
        super().__init__(vision_config, tensors, prefix)
        self.out_hidden_size = _cfg_int(self.config, "out_hidden_size")
        self.deepstack_visual_indexes = [int(i) for i in self.config.get("deepstack_visual_indexes", ())]
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise CheckpointError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside 0 .. {self.depth - 1}")
        npos = _cfg_int(self.config, "num_position_embeddings")
        self.grid_side = int(round(math.sqrt(npos)))
        if self.grid_side ** 2 != npos:
            raise CheckpointError(f"num_position_embeddings {npos} is not a square")

    def _mlp(self, i: int, y: np.ndarray) -> np.ndarray:
        W, b = self._w, f"blocks.{i}.mlp."
        return _linear(_r(self._act(_linear(y, W[b + "linear_fc1.weight"], W[b + "linear_fc1.bias"]))),
                       W[b + "linear_fc2.weight"], W[b + "linear_fc2.bias"])

    def _axis(self, index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Bilinear taps ``[n, 2]`` and weights (align_corners, border clamp) on one axis (float32 as upstream)."""
        side = self.grid_side
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        raw = floor.astype(np.int64)[:, None] + np.arange(2)
        taps = np.clip(raw, 0, side - 1)
        weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
        return taps, weights.astype(np.float32)

    def pos_embeds(self, grid_thw: Sequence[int] | Sequence[Sequence[int]]) -> np.ndarray:
        """The interpolated position embeddings of ``grid_thw`` (one or several grids, concatenated):
        float32 ``[sum t*h*w, hidden_size]`` in patch (merge-window) order, repeated per frame.

        Raises:
            GridError: a bad grid.
        """
        table = self._w["pos_embed.weight"]
        side = self.grid_side
        parts = []
        for t, h, w in grid_list(grid_thw):
            rows, cols = self._merge_order(h, w)
            ht, hw = self._axis(rows, h)
            wt, ww = self._axis(cols, w)
            idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
            wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4).astype(np.float32).astype(_ACC)
            emb = (table[idx] * wts[:, :, None]).sum(axis=1)
            parts.append(np.tile(emb.astype(np.float32), (t, 1)))
        return np.concatenate(parts)

    def forward_patches(self, patches: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, *,
                        frames: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The tower on one item's patches (what the vision MXQ computes).

        Args:
            patches: ``[N, patch_dim]`` in merge-window order.
            pos: ``[N, hidden_size]`` from :meth:`pos_embeds`.
            cos, sin: ``[N, head_dim]`` from :meth:`rope`.
            frames: the item's ``t`` (attention block-diagonal over ``frames`` equal segments).

        Returns:
            ``(embeds [N/4, out_hidden], deepstack [len(deepstack_visual_indexes), N/4, out_hidden])`` float32.

        Raises:
            ValueError / GridError: shapes that do not fit (named).
        """
        x = self._check_patches(patches, frames)
        n = x.shape[0]
        pos = self._check_table("pos", pos, n, self.width)
        cos, sin = self._check_table("cos", cos, n, self.head_dim), self._check_table("sin", sin, n, self.head_dim)
        h = _r(self._embed(x) + pos)
        deep = []
        for i in range(self.depth):
            h = self._block(i, h, cos, sin, frames)
            if i in self.deepstack_visual_indexes:
                k = self.deepstack_visual_indexes.index(i)
                deep.append(self._merge(f"deepstack_merger_list.{k}.", h, True, "norm", "linear_fc1", "linear_fc2"))
        emb = self._merge("merger.", h, False, "norm", "linear_fc1", "linear_fc2").astype(np.float32)
        stack = (np.stack(deep) if deep else np.zeros((0, emb.shape[0], self.out_hidden_size))).astype(np.float32)
        return emb, stack

    def forward(self, pixel_values: np.ndarray, grid_thw: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """All items: ``(embeds [sum N_i/4, out_hidden], deepstack [L, sum N_i/4, out_hidden])`` float32.

        Raises:
            GridError: ``pixel_values`` does not hold the grids' patches.
        """
        embs, deeps = [], []
        for s, g in self._items(pixel_values, grid_thw):
            cos, sin = self.rope(g)
            e, d = self.forward_patches(np.asarray(pixel_values)[s], self.pos_embeds(g), cos, sin, frames=g[0])
            embs.append(e)
            deeps.append(d)
        return np.concatenate(embs), np.concatenate(deeps, axis=1)
