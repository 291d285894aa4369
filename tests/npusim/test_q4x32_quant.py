"""Weight Q4_0 quantization (nibble order, ggml formula) and the HP activation quantizer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from npusim.q4x32 import (
    codes_from_qweight,
    dequantize_q4_0,
    qweight_from_ggml,
    qweight_to_ggml,
    quantize_a,
    quantize_q4_0,
)

F32 = np.float32


# --------------------------------------------------------------------------- weights


def test_nibble_order_single_nonzero_probe():
    # One non-zero weight at K index 5 (odd): byte 5 // 2 = 2, high nibble. max = 1.0, d = -1/8,
    # code = trunc(1 * -8 + 8.5) = 0; every other code is trunc(0 + 8.5) = 8.
    w = np.zeros((2, 64), dtype=np.float32)
    w[1, 32 + 5] = 1.0
    qw, sc = quantize_q4_0(w)
    assert qw.shape == (2, 2, 16) and qw.dtype == np.uint8
    assert sc.shape == (2, 2) and sc.dtype == np.float32
    expect = np.full((2, 2, 16), 0x88, dtype=np.uint8)
    expect[1, 1, 2] = 0x08  # element 4 (low, code 8) and element 5 (high, code 0)
    assert np.array_equal(qw, expect)
    assert sc[1, 1] == np.float32(-0.125) and sc[0, 0] == 0
    # even index -> low nibble
    w2 = np.zeros((1, 32), dtype=np.float32)
    w2[0, 4] = -2.0
    qw2, sc2 = quantize_q4_0(w2)
    assert qw2[0, 0, 2] == 0x80 and sc2[0, 0] == np.float32(0.25)  # code 0 in bits 3:0
    deq = dequantize_q4_0(qw2, sc2)
    assert deq[0, 4] == -2.0 and np.count_nonzero(deq) == 1


def _ggml_quantize_row_q4_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scalar port of ggml's quantize_row_q4_0_ref (fp32), returning codes [K] and d [K/32]."""
    k = x.size
    codes = np.zeros(k, dtype=np.uint8)
    ds = np.zeros(k // 32, dtype=np.float32)
    for i in range(k // 32):
        amax, vmax = F32(0), F32(0)
        for j in range(32):
            v = F32(x[i * 32 + j])
            if amax < abs(v):
                amax, vmax = abs(v), v
        d = F32(vmax / F32(-8))
        idv = F32(F32(1) / d) if d != 0 else F32(0)
        ds[i] = d
        for j in range(32):
            t = F32(F32(F32(x[i * 32 + j]) * idv) + F32(8.5))
            codes[i * 32 + j] = min(15, int(t))
    return codes, ds


@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_matches_ggml_reference_formula(seed, kb):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((3, 32 * kb)) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    w[0, :7] = 0.0
    w[1, 3] = -w[1].max() if kb else 0  # a tie in |x| between +a and -a: the first one wins
    qw, sc = quantize_q4_0(w)
    for n in range(3):
        codes, d = _ggml_quantize_row_q4_0_ref(w[n])
        assert np.array_equal(codes_from_qweight(qw)[n], codes)
        assert np.array_equal(sc[n], d)


@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 9))
def test_dequantize_error_bounded_by_the_step(seed, kb, n):
    rng = np.random.default_rng(seed)
    w = rng.uniform(-1, 1, (n, 32 * kb)).astype(np.float32)
    qw, sc = quantize_q4_0(w)
    deq = dequantize_q4_0(qw, sc, dtype=np.float64)
    step = np.repeat(np.abs(sc.astype(np.float64)), 32, axis=1)
    err = np.abs(deq - w)
    codes = codes_from_qweight(qw)
    # round-half-up to the nearest code; the clamp 16 -> 15 (x = -max) costs one full step
    assert np.all(err <= np.where(codes == 15, 1.0, 0.5) * step * (1 + 1e-5) + 1e-12)
    # the block's largest-magnitude value is reproduced exactly (code 0, weight -8 * d)
    blk = w.reshape(n, kb, 32)
    i = np.argmax(np.abs(blk), axis=-1)
    assert np.allclose(np.take_along_axis(deq.reshape(n, kb, 32), i[..., None], -1),
                       np.take_along_axis(blk, i[..., None], -1), rtol=1e-6, atol=0)
    # fp16_scales rounds the returned scales only; the codes are the same
    qw16, sc16 = quantize_q4_0(w, fp16_scales=True)
    assert np.array_equal(qw16, qw) and np.array_equal(sc16, sc.astype(np.float16).astype(np.float32))


def test_ggml_block_order_conversion():
    # ggml: qs[j] low = element j, high = element j + 16
    qs = np.full((1, 1, 16), 0x88, dtype=np.uint8)
    qs[0, 0, 3] = 0x18  # element 3 -> code 8, element 19 -> code 1
    qw = qweight_from_ggml(qs)
    codes = codes_from_qweight(qw)[0]
    assert codes[19] == 1 and np.count_nonzero(codes != 8) == 1
    assert qw[0, 0, 9] == 0x18  # element 19 = byte 9, high nibble; element 18 low = 8


@given(st.integers(0, 2**32 - 1))
def test_ggml_conversion_round_trip(seed):
    rng = np.random.default_rng(seed)
    qw = rng.integers(0, 256, size=(3, 2, 16), dtype=np.uint8)
    assert np.array_equal(qweight_from_ggml(qweight_to_ggml(qw)), qw)
    assert np.array_equal(qweight_to_ggml(qweight_from_ggml(qw)), qw)


# --------------------------------------------------------------------------- activations


def _f16(x: float) -> np.float16:
    return np.float16(F32(x))


def _quantize_rows_ref(rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Scalar port of quantize_a_row_i8_hp (1 row) / quantize_a_4row_i8_hp (4 rows), one superblock.

    Returns q [R, 256], rel [8], asum8 [R, 8], scale_avg.
    """
    r = rows.shape[0]
    scale = [F32(0)] * 8
    sa = F32(0)
    for kk in range(8):
        m = F32(0)
        for row in range(r):
            for b in range(32):
                m = max(m, abs(F32(rows[row, kk * 32 + b])))
        scale[kk] = F32(m / F32(127))
        sa = F32(sa + scale[kk])
    sa = F32(sa / F32(8))
    fac = F32(F32(1) / sa) if sa else F32(0)
    q = np.zeros((r, 256), dtype=np.int8)
    rel = np.zeros(8, dtype=np.float16)
    asum8 = np.zeros((r, 8), dtype=np.float16)
    for kk in range(8):
        rep = F32(F32(1) / scale[kk]) if scale[kk] else F32(0)
        rel[kk] = _f16(F32(scale[kk] * fac))
        for row in range(r):
            s = 0
            for b in range(32):
                v = F32(F32(rows[row, kk * 32 + b]) * rep)
                qi = int(np.rint(v))
                q[row, kk * 32 + b] = qi
                s += qi
            asum8[row, kk] = np.float16(np.float16(-s) * np.float16(8))
    return q, rel, asum8, _f16(sa)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9])
def test_activation_quantizer_matches_scalar_port_of_the_kernel(m):
    rng = np.random.default_rng(m)
    k = 512
    a = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, size=(m, 1))).astype(np.float32)
    a[0, 40:72] = 0  # an all-zero sub-block: scale 0, rep guard
    qa = quantize_a(a)
    assert qa.n_grouped == 4 * (m // 4)
    groups = [(r, 4) for r in range(0, qa.n_grouped, 4)] + [(r, 1) for r in range(qa.n_grouped, m)]
    for r0, nr in groups:
        for s in range(2):
            q, rel, asum8, sa = _quantize_rows_ref(a[r0:r0 + nr, 256 * s: 256 * (s + 1)])
            assert np.array_equal(qa.q[r0:r0 + nr, 256 * s: 256 * (s + 1)], q)
            for row in range(nr):
                assert np.array_equal(qa.rel[r0 + row, s], rel)
                assert np.array_equal(qa.asum8[r0 + row, s], asum8[row])
                assert qa.scale_avg[r0 + row, s] == sa


def test_four_row_groups_share_scales_and_remainder_rows_are_alone():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 96)).astype(np.float32)
    a[1, 0] = 50.0  # an outlier in row 1 widens the shared scale of rows 0..3, sub-block 0
    qa = quantize_a(a)
    assert qa.n_grouped == 4 and list(qa.grouped) == [True] * 4 + [False] * 2
    assert np.all(qa.rel[:4] == qa.rel[0]) and np.all(qa.scale_avg[:4] == qa.scale_avg[0])
    alone = quantize_a(a[4:5])
    assert np.array_equal(qa.q[4:5], alone.q) and np.array_equal(qa.rel[4:5], alone.rel)
    together = quantize_a(a[:4])
    assert np.array_equal(qa.q[:4], together.q)
    # row 0 quantizes differently in its group than alone (the outlier's scale is shared)
    assert not np.array_equal(quantize_a(a[0:1]).q, qa.q[0:1])
    assert np.abs(qa.q[0, :32]).max() < 10  # row 0's small values are crushed by the outlier


@given(st.integers(0, 2**32 - 1), st.integers(1, 9), st.integers(1, 20), st.sampled_from([1e-3, 1.0, 100.0]))
@example(1048576, 4, 10, 100.0)  # a quotient 7e-6 above a half step, rounded down in fp32
def test_activation_values_the_kernel_uses_are_within_half_a_step(seed, m, kb, mag):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, 32 * kb)) * mag).astype(np.float32)
    qa = quantize_a(a)
    assert qa.q.shape == (m, 256 * -(-32 * kb // 256)) and qa.k == 32 * kb
    deq = qa.dequantize()
    assert deq.shape == a.shape
    # effective step: the max over the row (or 4-row group) of each 32-block / 127
    blk = np.abs(a.astype(np.float64)).reshape(m, kb, 32).max(-1)
    ng = qa.n_grouped
    if ng:
        blk[:ng] = np.repeat(blk[:ng].reshape(ng // 4, 4, kb).max(1), 4, axis=0)
    step = np.repeat(blk / 127, 32, axis=1)  # scale_j (float64)
    eff = np.repeat((qa.rel.astype(np.float64) * qa.scale_avg.astype(np.float64)[..., None]).reshape(m, -1),
                    32, axis=1)[:, : 32 * kb]  # fp16(rel_j) * fp16(scale_avg)
    q = qa.q[:, : 32 * kb].astype(np.float64)
    # q is a / scale_j rounded to nearest; the kernel then uses q * eff. The quotient is computed
    # in fp32 (scale_j = fp32(amax / 127), its fp32 reciprocal, the fp32 product: three roundings
    # of 2**-24 relative each), so a value within |a| * 3 * 2**-24 of a half step may round to
    # either side (seed 1048576, m=4, kb=10, mag=100: a / step = 118.500007, q = 118).
    half = 0.5 * step * (1 + 1e-5) + np.abs(a.astype(np.float64)) * 3 * 2.0**-24 + 1e-45
    assert np.all(np.abs(q * step - a) <= half)
    assert np.all(np.abs(deq - a) <= half + np.abs(q) * np.abs(eff - step))
    # eff is scale_j up to two fp16 roundings (relative 2**-11 each) unless scale_avg is an fp16
    # subnormal (< 2**-14), where its absolute error is up to 2**-25
    sa = np.repeat(qa.scale_avg.astype(np.float64), 8 * 32, axis=1)[:, : 32 * kb]
    rel = eff / np.where(sa == 0, 1, sa)
    assert np.all(np.abs(eff - step) <= step * 2.0**-10 * 1.01 + rel * 2.0**-25 + 1e-45)
    # asum8 is the folded zero point of the stored values
    qsum = qa.q.reshape(m, -1, 8, 32).astype(np.int64).sum(-1)
    assert np.array_equal(qa.asum8, (np.float16(1) * (-qsum).astype(np.float16) * np.float16(8)).astype(np.float16))


def test_zero_rows_and_k_padding():
    a = np.zeros((2, 288), dtype=np.float32)
    qa = quantize_a(a)
    assert qa.q.shape == (2, 512) and not qa.q.any()
    assert not qa.rel.any() and not qa.asum8.any() and not qa.scale_avg.any()
    assert not np.signbit(qa.asum8).any()  # +0, as fp16(-0) * 8 from an int sum
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 288)).astype(np.float32)
    padded = np.zeros((5, 512), dtype=np.float32)
    padded[:, :288] = a
    q1, q2 = quantize_a(a), quantize_a(padded)
    for f in ("q", "rel", "asum8", "scale_avg"):
        assert np.array_equal(getattr(q1, f), getattr(q2, f)), f
    # the padded sub-blocks count in scale_avg's division by 8 (our K % 256 choice)
    assert np.all(q1.rel[:, 1, 1:] == 0) and np.all(q1.rel[:, 1, 0] > 1)


def test_tiny_activations_lose_precision_in_the_fp16_scale_avg():
    # max|a| = 1e-3 in one of 8 sub-blocks: scale_avg = 1e-3 / 127 / 8 ~ 9.8e-7, an fp16 subnormal
    # (quantum 2**-24 ~ 6e-8): the kernel's effective scale is off by several percent.
    a = np.zeros((1, 256), dtype=np.float32)
    a[0, :32] = np.linspace(-1e-3, 1e-3, 32, dtype=np.float32)
    qa = quantize_a(a)
    assert 0 < qa.scale_avg[0, 0] < np.float16(2.0**-14)
    rel_err = np.abs(qa.dequantize()[0, 0] - a[0, 0]) / 1e-3
    assert rel_err > 1e-2
