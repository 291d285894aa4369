"""M-RoPE positions of a Mobilint Qwen2-VL / Qwen3-VL prompt, on the plugin side (issue 14 §1).

A Qwen2-VL / Qwen3-VL text decoder rotates with three position rows (temporal, height, width).
Text tokens take equal rows counting up one per token; the merged tokens of one image (or one
video) take a 3-D index grid: row 0 the temporal index, rows 1 and 2 the merged patch row and
column, all offset by the position the item starts at. The text after an item resumes at that
start plus ``max(h, w)`` merged patches (transformers 5.19's ``get_rope_index``; the temporal
index does not advance it). The positions of the generated tokens are one plain count: token
``i`` (0-based, ``i >= T``) sits at ``i + delta`` on all three rows, ``delta`` being
``max(prompt positions) + 1 - T`` (:func:`decode_positions`).

Qwen3-VL's video is split into one grid per frame group (``t`` = 1 each), as upstream Qwen3-VL
does: its prompt gives every frame group its own ``<t seconds><|vision_start|>...<|vision_end|>``.

This module is the plugin's own: the same semantics as ``npusim.llm.mrope.rope_index`` (the
golden side; the plugin never imports npusim), numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

__all__ = ["MropeInputError", "decode_positions", "rope_index", "split_video_grids"]

Family = Literal["qwen2_vl", "qwen3_vl"]
_FAMILIES = ("qwen2_vl", "qwen3_vl")


class MropeInputError(ValueError):
    """The prompt's placeholder runs and the grids given do not match."""


def split_video_grids(video_grid_thw: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """Qwen3-VL's per-frame split: each ``(t, h, w)`` becomes ``t`` grids ``(1, h, w)``."""
    out: list[tuple[int, int, int]] = []
    for t, h, w in ((int(a), int(b), int(c)) for a, b, c in video_grid_thw):
        out.extend([(1, h, w)] * t)
    return out


def _runs(ids: np.ndarray, image_token_id: int, video_token_id: int) -> Iterator[tuple[int, int, int]]:
    """``(kind, start, end)`` runs of equal token kind: 0 text, 1 image pad, 2 video pad."""
    kinds = np.zeros(len(ids), dtype=np.int8)
    kinds[ids == image_token_id] = 1
    kinds[ids == video_token_id] = 2
    if len(ids) == 0:
        return
    cuts = np.flatnonzero(np.diff(kinds)) + 1
    bounds = [0, *cuts.tolist(), len(ids)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield int(kinds[a]), a, b


def rope_index(input_ids: Sequence[int] | np.ndarray, *, image_grid_thw: Sequence[Sequence[int]] = (),
               video_grid_thw: Sequence[Sequence[int]] = (), image_token_id: int, video_token_id: int,
               vision_start_token_id: int | None = None, spatial_merge_size: int,
               family: Family) -> tuple[np.ndarray, int]:
    """The M-RoPE positions of one prompt and its decode delta.

    Args:
        input_ids: the prompt's token ids, placeholders expanded (one ``<|image_pad|>`` /
            ``<|video_pad|>`` per merged visual token), ``T`` of them.
        image_grid_thw: one ``(t, h, w)`` per image in prompt order, in patches (before the merge).
        video_grid_thw: one ``(t, h, w)`` per video in prompt order (``t`` in temporal patches).
        image_token_id, video_token_id: the pad tokens.
        vision_start_token_id: accepted for the golden signature; the runs are found by the pad
            ids (each item's pads follow its ``<|vision_start|>``), so it is not needed.
        spatial_merge_size: patches merged per side (2).
        family: ``"qwen2_vl"`` or ``"qwen3_vl"`` (Qwen3-VL splits each video per frame group).

    Returns:
        ``(positions int64 [3, T], delta)``, ``delta = positions.max() + 1 - T`` (0 for text only).

    Raises:
        MropeInputError: an unknown family; a pad run whose length is not the sum of whole items'
            ``t*h*w/merge^2``; too few or too many grids for the runs.
    """
    del vision_start_token_id
    if family not in _FAMILIES:
        raise MropeInputError(f"family {family!r}: expected one of {_FAMILIES}")
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    m = int(spatial_merge_size)
    videos = split_video_grids(video_grid_thw) if family == "qwen3_vl" else [
        (int(t), int(h), int(w)) for t, h, w in video_grid_thw]
    grids = {1: [(int(t), int(h), int(w)) for t, h, w in image_grid_thw], 2: videos}
    used = {1: 0, 2: 0}
    names = {1: "image", 2: "video"}
    parts: list[np.ndarray] = []
    pos = 0
    for kind, start, end in _runs(ids, image_token_id, video_token_id):
        if kind == 0:
            parts.append(np.broadcast_to(np.arange(end - start, dtype=np.int64) + pos, (3, end - start)))
            pos += end - start
            continue
        left = end - start
        while left > 0:
            if used[kind] >= len(grids[kind]):
                raise MropeInputError(
                    f"{names[kind]} pad run at token {start} ({end - start} tokens): only "
                    f"{len(grids[kind])} {names[kind]} grid(s) given, all used")
            t, h, w = grids[kind][used[kind]]
            used[kind] += 1
            lh, lw = h // m, w // m
            n = t * lh * lw
            if n == 0 or n > left:
                raise MropeInputError(
                    f"{names[kind]} pad run at token {start} ({end - start} tokens) does not hold whole "
                    f"items: {names[kind]} {used[kind] - 1} grid ({t}, {h}, {w}) needs {n} tokens, {left} left")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            parts.append(np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]).astype(np.int64) + pos)
            pos += max(lh, lw)
            left -= n
    for kind in (1, 2):
        if used[kind] != len(grids[kind]):
            raise MropeInputError(
                f"{len(grids[kind])} {names[kind]} grid(s) given, the prompt's pad runs hold {used[kind]}")
    if not parts:
        return np.zeros((3, 0), dtype=np.int64), 0
    positions = np.ascontiguousarray(np.concatenate(parts, axis=1))
    return positions, int(positions.max()) + 1 - len(ids)


def decode_positions(start: int, count: int, delta: int) -> np.ndarray:
    """Positions of tokens ``start .. start+count-1`` past the prompt: ``index + delta`` on
    all three rows, int64 ``[3, count]``."""
    return np.broadcast_to(np.arange(start, start + count, dtype=np.int64) + int(delta), (3, count)).copy()
