"""fp16 helpers of npusim.q4x32: every rounding is a single correctly rounded RNE step."""

from __future__ import annotations

import bisect
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npusim.q4x32.fp16 import F16_MAX, add_f16, fma_f16, mul_f16, to_f16

# Every finite fp16 value, sorted, as exact Fractions (the oracle below rounds with them).
_BITS = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
_ALL = _BITS.view(np.float16)
_FINITE = np.unique(_ALL[np.isfinite(_ALL)].astype(np.float64))
_FRACS = [Fraction(float(v)) for v in _FINITE]


def _round_exact(x: Fraction) -> float:
    """Reference RNE of an exact rational to fp16 (overflow to inf at >= 65520)."""
    if x >= Fraction(65520):
        return float("inf")
    if x <= Fraction(-65520):
        return float("-inf")
    i = bisect.bisect_left(_FRACS, x)
    if i < len(_FRACS) and _FRACS[i] == x:
        return float(_FRACS[i])
    lo, hi = _FRACS[i - 1], _FRACS[i]
    if x - lo < hi - x:
        return float(lo)
    if hi - x < x - lo:
        return float(hi)
    # tie: the even significand (the one whose bit pattern is even)
    lo_bits = int(np.float16(float(lo)).view(np.uint16))
    return float(lo) if lo_bits % 2 == 0 else float(hi)


def test_to_f16_rounds_every_tie_to_even_and_overflows_at_65520():
    pos = _FINITE[_FINITE >= 0]
    mids = (pos[:-1] + pos[1:]) / 2  # exact in float64
    got = to_f16(np.concatenate([mids, -mids])).astype(np.float64)
    want = np.array([_round_exact(Fraction(float(v))) for v in np.concatenate([mids[::97], -mids[::89]])])
    sel = np.concatenate([np.arange(0, len(mids), 97), len(mids) + np.arange(0, len(mids), 89)])
    assert np.array_equal(got[sel], want)
    # all ties at once: the result has an even bit pattern
    bits = to_f16(mids).view(np.uint16)
    assert np.all(bits % 2 == 0)
    assert to_f16(65519.99) == np.float16(65504) and np.isinf(to_f16(65520.0))
    assert to_f16(1e6, saturate=True) == np.float16(F16_MAX)
    assert to_f16(-1e6, saturate=True) == np.float16(-F16_MAX)
    assert np.isnan(to_f16(np.nan, saturate=True))


fp16_values = st.integers(0, 0xFFFF).map(lambda b: np.uint16(b).view(np.float16)).filter(np.isfinite)


@given(fp16_values, fp16_values, fp16_values)
def test_mul_add_fma_match_exact_rational_rounding(a, b, c):
    fa, fb, fc = Fraction(float(a)), Fraction(float(b)), Fraction(float(c))
    assert float(mul_f16(a, b)) == _round_exact(fa * fb)
    assert float(add_f16(a, c)) == _round_exact(fa + fc)
    assert float(fma_f16(a, b, c)) == _round_exact(fa * fb + fc)


@given(st.integers(-(2**20), 2**20), fp16_values, fp16_values)
def test_fma_with_integer_multiplicand_is_one_rounding(t, scale, c):
    want = _round_exact(Fraction(t) * Fraction(float(scale)) + Fraction(float(c)))
    assert float(fma_f16(t, scale, c)) == want


def test_fma_rounds_once_where_mul_then_add_rounds_twice():
    # -3 + 3 * (1 + 2**-10): exact 3 * 2**-10. Unfused: fp16(3.0029296875) is a tie between
    # 3 + 2**-9 (odd significand) and 3 + 2**-8 (even) -> 3.00390625, then + (-3) -> 2**-8.
    scale = np.float16(1 + 2.0**-10)
    assert float(fma_f16(3, scale, np.float16(-3))) == 3 * 2.0**-10
    assert float(add_f16(np.float16(-3), mul_f16(3, scale))) == 2.0**-8


@pytest.mark.parametrize("saturate", [False, True])
def test_overflow_modes(saturate):
    big = np.float16(60000)
    r = add_f16(big, big, saturate=saturate)
    assert (r == np.float16(F16_MAX)) if saturate else np.isinf(r)
    r = mul_f16(np.float16(-300), np.float16(300), saturate=saturate)
    assert (r == np.float16(-F16_MAX)) if saturate else (np.isinf(r) and r < 0)
