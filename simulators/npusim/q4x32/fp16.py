"""IEEE 754 binary16 (fp16) arithmetic on numpy arrays, correctly rounded.

Every function takes fp16-representable inputs (numpy float16, or float32/float64 arrays holding
fp16 values, or integers where stated), computes the exact result in float64, and rounds it once
to fp16 with round-to-nearest-even (RNE, the RISC-V default ``frm``). numpy's float64 -> float16
and float32 -> float16 casts are correctly rounded, including subnormals (|x| < 2**-14) and
overflow (|x| >= 65520 rounds to +/-inf); the tests check this at every fp16 tie point.

``saturate=True`` clamps finite-overflowing results to +/-65504 instead of +/-inf (one of the
open ``.hp`` options, see :mod:`npusim.q4x32.instr`); NaN stays NaN.
"""

from __future__ import annotations

import numpy as np

__all__ = ["F16_MAX", "add_f16", "fma_f16", "mul_f16", "to_f16"]

#: Largest finite fp16 value.
F16_MAX = 65504.0


def to_f16(x: np.ndarray | float, *, saturate: bool = False) -> np.ndarray:
    """Round ``x`` (float64-exact values) to fp16 with RNE.

    Args:
        x: values; anything exactly representable in float64 (ints up to 2**53, float32, ...).
        saturate: clamp results beyond +/-65504 to +/-65504 instead of +/-inf.

    Returns:
        ``np.float16`` array of ``x``'s shape.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.asarray(x, dtype=np.float64).astype(np.float16)
    if saturate:
        r = np.clip(r, np.float16(-F16_MAX), np.float16(F16_MAX))
    return r


def mul_f16(a: np.ndarray, b: np.ndarray, *, saturate: bool = False) -> np.ndarray:
    """``fp16(a * b)``: one rounding of the exact product (as ``vfmul`` / ``fmul.h`` at e16).

    The product of two fp16 values (11-bit significands) is exact in float64.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    return to_f16(p, saturate=saturate)


def add_f16(a: np.ndarray, b: np.ndarray, *, saturate: bool = False) -> np.ndarray:
    """``fp16(a + b)``: one rounding of the exact sum of two fp16 values (exact in float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(a, dtype=np.float64) + np.asarray(b, dtype=np.float64)
    return to_f16(s, saturate=saturate)


def fma_f16(a: np.ndarray, b: np.ndarray, c: np.ndarray, *, saturate: bool = False) -> np.ndarray:
    """``fp16(a * b + c)`` with a single rounding (a fused multiply-add).

    ``a * b`` must be exact in float64: true when ``a`` and ``b`` are fp16, or when ``a`` is an
    integer below 2**31 and ``b`` is fp16. The sum ``a*b + c`` is not always exact in float64, so
    it is formed with Knuth's TwoSum (``s + e == a*b + c`` exactly), ``s`` is rounded to odd at
    53 bits (moved one float64 ulp towards ``e`` when ``e != 0`` and ``s`` has an even
    significand), and then rounded to fp16: round-to-odd followed by RNE at fewer than 52 bits
    is a correctly rounded single rounding.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
        c64 = np.asarray(c, dtype=np.float64)
        s = p + c64
        bb = s - p
        e = (p - (s - bb)) + (c64 - bb)
        e = np.where(np.isfinite(s), e, 0.0)
        even = (np.asarray(s).view(np.int64) & 1) == 0
        nudge = (e != 0) & even
        if np.any(nudge):
            s = np.where(nudge, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return to_f16(s, saturate=saturate)
