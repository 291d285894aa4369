"""Multimodal RoPE (M-RoPE) of Qwen2-VL / Qwen3-VL: position rows and cos/sin tables (numpy only).

Positions (:func:`rope_index`, transformers 5.19's ``get_rope_index``): the prompt is cut into
runs of text, image (``image_token_id``) and video (``video_token_id``) tokens. A text run of
``n`` tokens takes ``p, p + 1, ..., p + n - 1`` on all three rows (time, height, width) and
``p += n``. A vision run takes the next grid ``(t, h, w)`` (``h, w`` in patches) and its
``t * (h / m) * (w / m)`` tokens (``m`` = ``spatial_merge_size``) get rows
``(p + i_t, p + i_h, p + i_w)`` in ``(i_t, i_h, i_w)`` row-major order; then ``p += max(h, w) / m``.
``delta = max(positions) + 1 - T``: decoding continues at ``cache position + delta`` on all rows.
Qwen3-VL splits every video grid into ``t`` grids of one frame (its prompts put each frame in its
own ``<|vision_start|>...<|vision_end|>`` block after a timestamp), as upstream does.

Tables (:func:`mrope_cos_sin`): ``inv_freq[j] = 1 / theta ** (2j / head_dim)`` (float32), the
angle of frequency ``j`` taken from row ``r(j)``, and ``cos = concat(cos(a), cos(a))`` (same for
sin), as transformers' rotary embeddings compute them (float32). ``r(j)``:

* chunked (Qwen2-VL, ``interleaved=False``): the first ``mrope_section[0]`` frequencies from the
  time row, the next ``mrope_section[1]`` from height, the next ``mrope_section[2]`` from width;
* interleaved (Qwen3-VL): ``j % 3 == 1`` and ``j < 3 * mrope_section[1]`` from height,
  ``j % 3 == 2`` and ``j < 3 * mrope_section[2]`` from width, every other ``j`` from time.

With three equal rows both are plain RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["FAMILIES", "mrope_cos_sin", "mrope_row_of_frequency", "rope_index"]

FAMILIES = ("qwen2_vl", "qwen3_vl")


def _grids(name: str, grids: Sequence[Sequence[int]] | np.ndarray | None) -> list[tuple[int, int, int]]:
    if grids is None:
        return []
    arr = np.asarray(grids, dtype=np.int64)
    if arr.size == 0:
        return []
    if arr.ndim != 2 or arr.shape[1] != 3 or (arr < 1).any():
        raise ValueError(f"{name} must be a sequence of positive (t, h, w) triples, got {grids!r}")
    return [tuple(int(v) for v in row) for row in arr]


def rope_index(input_ids: Sequence[int] | np.ndarray, *, image_grid_thw: Sequence[Sequence[int]] | np.ndarray = (),
               video_grid_thw: Sequence[Sequence[int]] | np.ndarray = (), image_token_id: int, video_token_id: int,
               vision_start_token_id: int, spatial_merge_size: int, family: str) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt (module docstring), upstream's ``get_rope_index`` semantics.

    Args:
        input_ids: the prompt, 1-D, with each image/video expanded to its merged-token count.
        image_grid_thw, video_grid_thw: one ``(t, h, w)`` (patches) per image / video, in prompt order.
        image_token_id, video_token_id: the ``<|image_pad|>`` / ``<|video_pad|>`` ids.
        vision_start_token_id: the ``<|vision_start|>`` id (a text token here; kept for the
            signature upstream's older versions had).
        spatial_merge_size: the merger's window side ``m`` (2).
        family: ``"qwen2_vl"`` or ``"qwen3_vl"`` (video grids split per frame).

    Returns:
        ``(positions int64 [3, T], delta)``.

    Raises:
        ValueError: unknown family; ids not 1-D integers; a vision run whose length is not its
            grid's token count, more runs than grids or grids left over (counts named); a grid
            whose ``h``/``w`` is not a multiple of ``spatial_merge_size``.
    """
    del vision_start_token_id
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (choices: {', '.join(FAMILIES)})")
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"input_ids must be a 1-D sequence of integers, got shape {ids.shape} dtype {ids.dtype}")
    m = int(spatial_merge_size)
    if m < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size!r}")
    queues = {1: _grids("image_grid_thw", image_grid_thw), 2: _grids("video_grid_thw", video_grid_thw)}
    if family == "qwen3_vl":
        queues[2] = [(1, h, w) for t, h, w in queues[2] for _ in range(t)]
    kind = np.where(ids == image_token_id, 1, np.where(ids == video_token_id, 2, 0))
    names = {1: "image", 2: "video"}
    used = {1: 0, 2: 0}
    parts: list[np.ndarray] = []
    pos = 0
    i, n = 0, len(ids)
    while i < n:
        k = int(kind[i])
        j = i
        while j < n and kind[j] == k:
            j += 1
        run = j - i
        if k == 0:
            parts.append(np.broadcast_to(pos + np.arange(run, dtype=np.int64), (3, run)))
            pos += run
        else:
            q = queues[k]
            if used[k] >= len(q):
                raise ValueError(f"the prompt has more {names[k]} runs than the {len(q)} {names[k]} grid(s) given")
            t, h, w = q[used[k]]
            used[k] += 1
            if h % m or w % m:
                raise ValueError(f"{names[k]} grid {(t, h, w)}: h and w must be multiples of spatial_merge_size={m}")
            lh, lw = h // m, w // m
            if run != t * lh * lw:
                raise ValueError(f"{names[k]} run at token {i} has {run} tokens but its grid {(t, h, w)} "
                                 f"gives {t * lh * lw}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            parts.append(pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()]).astype(np.int64))
            pos += max(h, w) // m
        i = j
    for k in (1, 2):
        if used[k] != len(queues[k]):
            raise ValueError(f"{len(queues[k])} {names[k]} grid(s) given (per frame for qwen3_vl videos) "
                             f"but the prompt has {used[k]} {names[k]} run(s)")
    if not parts:
        return np.zeros((3, 0), np.int64), 0
    positions = np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.int64)
    return positions, int(positions.max()) + 1 - n


def mrope_row_of_frequency(head_dim: int, mrope_section: Sequence[int], interleaved: bool) -> np.ndarray:
    """For each of the ``head_dim / 2`` frequencies, the position row (0 time, 1 height, 2 width) it rotates by.

    Raises:
        ValueError: ``mrope_section`` is not 3 non-negative integers summing to ``head_dim / 2``.
    """
    sec = [int(s) for s in mrope_section]
    half = int(head_dim) // 2
    if len(sec) != 3 or min(sec) < 0 or sum(sec) != half or head_dim % 2:
        raise ValueError(f"mrope_section {list(mrope_section)!r} must be 3 non-negative integers summing to "
                         f"head_dim / 2 = {half} (head_dim {head_dim} even)")
    if not interleaved:
        return np.repeat(np.arange(3), sec)
    rows = np.zeros(half, np.int64)
    j = np.arange(half)
    rows[(j % 3 == 1) & (j < 3 * sec[1])] = 1
    rows[(j % 3 == 2) & (j < 3 * sec[2])] = 2
    return rows


def mrope_cos_sin(positions: np.ndarray, *, head_dim: int, rope_theta: float, mrope_section: Sequence[int],
                  interleaved: bool, dtype: np.dtype | type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The rotary tables of M-RoPE ``positions`` ``[3, T]`` (module docstring).

    Evaluated in float32 as transformers does (``dtype=np.float64`` evaluates in float64).

    Returns:
        ``(cos, sin)`` each ``[T, head_dim]`` in ``dtype``.

    Raises:
        ValueError: ``positions`` is not ``[3, T]``; a bad ``mrope_section`` (see
            :func:`mrope_row_of_frequency`); ``rope_theta <= 0``; ``dtype`` not float32/float64.
    """
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    pos = np.asarray(positions)
    if pos.ndim != 2 or pos.shape[0] != 3:
        raise ValueError(f"positions must have shape [3, T], got {pos.shape}")
    if not rope_theta > 0:
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
    rows = mrope_row_of_frequency(head_dim, mrope_section, interleaved)
    exponents = np.arange(0, head_dim, 2, dtype=dt) / dt.type(head_dim)
    # the power evaluated in float64 and rounded, then the float32 reciprocal: bit-equal to torch's
    # float32 ``1.0 / (theta ** exponents)`` (numpy's float32 pow differs in the last bit for some)
    inv = (dt.type(1) / (np.float64(rope_theta) ** exponents.astype(np.float64)).astype(dt)).astype(dt)
    angle = pos[rows].T.astype(dt) * inv  # [T, head_dim / 2]: frequency j from row rows[j]
    cos, sin = np.cos(angle).astype(dt), np.sin(angle).astype(dt)
    return np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)
