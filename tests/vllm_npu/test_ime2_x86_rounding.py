"""v16(), the fp16 rounding of src/gemm_x86.c's AVX2 and AVX-512 VNNI + F16C variants (issue 12),
in numpy float32: Veltkamp's split ``c = x * 8193; c - (c - x)`` (each operation one IEEE
rounding, as the vector code with -ffp-contract=off) is fp16's round-to-nearest-even on every value
the kernel gives it. The guards that keep the kernel inside these conditions are tested on the
kernel itself (tests/vllm_npu/test_ime2_x86.py: overflow in the middle of a superblock, packed A
with unusual asum8)."""

from __future__ import annotations

import numpy as np


def _v16(x: np.ndarray) -> np.ndarray:
    """gemm_x86.c's v16() in numpy float32 (each operation one IEEE rounding, as the vector code)."""
    c = x * np.float32(8193.0)
    return c - (c - x)


def test_veltkamp_split_is_fp16_rounding_on_every_normal_value():
    """v16(x) == fp16(x) (round to nearest even) for EVERY float32 x with 2**-14 <= x <= 65504:
    all 2**23 mantissas of each of fp16's 31 normal binades, plus the values up to the last one
    below 65520 that still round to 65504. Negative values mirror these (IEEE rounding is
    symmetric; a sample is checked). The kernel relies on this for its five .hp roundings."""
    lo = np.float32(2.0**-14).view(np.uint32)
    hi = np.float32(65519.996).view(np.uint32)
    step = 1 << 24
    for start in range(int(lo), int(hi) + 1, step):
        x = np.arange(start, min(start + step, int(hi) + 1), dtype=np.uint32).view(np.float32)
        ref = x.astype(np.float16).astype(np.float32)
        got = _v16(x)
        bad = got != ref
        assert not bad.any(), f"v16({x[bad][0]!r}) = {got[bad][0]!r}, fp16 gives {ref[bad][0]!r}"
    neg = -np.random.default_rng(5).uniform(2.0**-14, 65504, 1 << 20).astype(np.float32)
    np.testing.assert_array_equal(_v16(neg), neg.astype(np.float16).astype(np.float32))


def test_veltkamp_split_keeps_fp16_subnormal_grid_values():
    """Below 2**-14 the kernel only rounds multiples of 2**-24 (integer x fp16 products, sums of
    fp16 values): v16 leaves each of them unchanged, as fp16 does. Values off that grid are
    where v16 and fp16 part (which the asum8 guard is for)."""
    grid = np.arange(-1024, 1025, dtype=np.float32) * np.float32(2.0**-24)
    np.testing.assert_array_equal(_v16(grid), grid)
    np.testing.assert_array_equal(grid.astype(np.float16).astype(np.float32), grid)
    off = np.float32(5.25 * 2.0**-24)
    assert _v16(off) != off.astype(np.float16).astype(np.float32)
