"""Qwen2-VL / Qwen3-VL pixel preprocessing without resizing: images and videos to flat patches (numpy only).

:func:`patchify` is the host's part of the Qwen2-VL image processor (the same one serves
Qwen3-VL with ``patch_size`` 16 and mean/std 0.5) for pictures whose size the processor's
``smart_resize`` leaves unchanged (height and width multiples of ``patch_size * merge_size``,
pixel count inside ``min_pixels .. max_pixels``)::

    x = float32(uint8 * (1 / 255))            rescale (evaluated in float64, rounded once)
    x = (x - mean) / std                      normalize, per channel, in float32
    frames grouped by temporal_patch_size     an image is repeated to temporal_patch_size frames
    patch order (t, h / m, w / m, m, m)       m = merge_size: each m x m merge window contiguous
    patch features (channel, frame, y, x)     3 * temporal_patch_size * patch_size ** 2 floats

so the rows of each merge window are consecutive and a merge window is one LLM token after the
vision tower's merger. Resizing is not done here: callers pick sizes it would not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RESCALE_FACTOR", "patchify"]

#: The processors' ``rescale_factor`` (a Python float, as upstream's 1 / 255).
RESCALE_FACTOR = 1.0 / 255.0


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def patchify(pixels: np.ndarray, *, patch_size: int, temporal_patch_size: int, merge_size: int,
             image_mean: Sequence[float], image_std: Sequence[float]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Rescale, normalize and cut ``pixels`` into the processor's flat patches.

    Args:
        pixels: uint8 ``[H, W, 3]`` (an image: its one frame repeated to ``temporal_patch_size``
            frames, as upstream does) or ``[F, H, W, 3]`` (video frames; ``F`` a positive
            multiple of ``temporal_patch_size``).
        patch_size: spatial patch side in pixels (14 for Qwen2-VL, 16 for Qwen3-VL).
        temporal_patch_size: frames per patch (2).
        merge_size: the merger's window side in patches (2).
        image_mean, image_std: per-channel normalisation (3 floats each; std > 0).

    Returns:
        ``(pixel_values, (t, h, w))``: float32 ``[t * h * w, 3 * temporal_patch_size * patch_size ** 2]``
        in the HF processor's patch order (module docstring) and the grid in patches
        (``t = F / temporal_patch_size``, 1 for an image; ``h = H / patch_size``, ``w = W / patch_size``).

    Raises:
        ValueError: ``pixels`` is not uint8 with 3 channels in one of the two shapes; ``H`` or
            ``W`` is not a multiple of ``patch_size * merge_size`` (both named); a video's frame
            count is not a positive multiple of ``temporal_patch_size``; bad sizes or mean/std.
    """
    p = _positive("patch_size", patch_size)
    tp = _positive("temporal_patch_size", temporal_patch_size)
    m = _positive("merge_size", merge_size)
    arr = np.asarray(pixels)
    if arr.dtype != np.uint8:
        raise ValueError(f"pixels must be uint8, got dtype {arr.dtype}")
    if arr.ndim == 3 and arr.shape[-1] == 3:
        frames = np.repeat(arr[None], tp, axis=0)
    elif arr.ndim == 4 and arr.shape[-1] == 3:
        if arr.shape[0] < 1 or arr.shape[0] % tp:
            raise ValueError(f"a video needs a positive multiple of temporal_patch_size={tp} frames, "
                             f"got {arr.shape[0]}")
        frames = arr
    else:
        raise ValueError(f"pixels must be [H, W, 3] (image) or [F, H, W, 3] (video), got shape {arr.shape}")
    n_frames, height, width = frames.shape[:3]
    factor = p * m
    if height < factor or width < factor or height % factor or width % factor:
        raise ValueError(f"image height H={height} and width W={width} must be positive multiples of "
                         f"patch_size * merge_size = {factor}")
    mean = np.asarray(image_mean, dtype=np.float32)
    std = np.asarray(image_std, dtype=np.float32)
    if mean.shape != (3,) or std.shape != (3,) or not np.all(std > 0):
        raise ValueError(f"image_mean and image_std must be 3 floats (std > 0), got {image_mean!r}, {image_std!r}")
    x = (frames.astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
    x = (x - mean) / std  # float32, per channel
    t, gh, gw = n_frames // tp, height // p, width // p
    # [t, tp, H, W, C] -> [t, tp, C, gh/m, m, p, gw/m, m, p]
    x = x.reshape(t, tp, height, width, 3).transpose(0, 1, 4, 2, 3)
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p)
    # -> [t, gh/m, gw/m, m(y), m(x), C, tp, p, p]
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    out = np.ascontiguousarray(x.reshape(t * gh * gw, 3 * tp * p * p), dtype=np.float32)
    return out, (t, gh, gw)
