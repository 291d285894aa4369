"""Byte-exact packed B and quantized-A layouts: sizes, hand-checked offsets, round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npusim.q4x32 import (
    LayoutError,
    a_packed_size,
    b_packed_size,
    b_tiles,
    pack_a,
    pack_b,
    quantize_a,
    unpack_a,
    unpack_b,
)

ks = st.integers(1, 40).map(lambda i: 32 * i)  # K = 32 .. 1280, most not multiples of 256


def random_weights(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    qw = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    sc = (rng.standard_normal((n, k // 32)) * 0.05).astype(np.float32)
    return qw, sc


# --------------------------------------------------------------------------- sizes


@given(st.integers(0, 13), ks, st.integers(1, 200))
def test_layout_sizes(m, k, n):
    s = -(-k // 256)
    assert b_packed_size(n, k) == -(-n // 32) * s * 4608
    assert a_packed_size(m, k) == m * s * 290
    rng = np.random.default_rng(m * 1000 + n)
    assert len(pack_b(*random_weights(rng, n, k))) == b_packed_size(n, k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    assert len(pack_a(quantize_a(a))) == a_packed_size(m, k)


@pytest.mark.parametrize("k, n", [(576, 1536), (960, 2560), (896, 4864), (2048, 5632), (1536, 8960),
                                  (2048, 8192), (2560, 10240), (2048, 11008)])
def test_seed_shapes_sizes(k, n):
    # every seed shape has N % 32 == 0; K = 576, 960, 896 are not multiples of 256
    assert b_packed_size(n, k) == (n // 32) * -(-k // 256) * 4608
    assert a_packed_size(4, k) == 4 * -(-k // 256) * 290 == -(-k // 256) * 1160


# --------------------------------------------------------------------------- B


def test_packed_b_offsets_single_nonzero_probe():
    n, k = 70, 544  # 3 tiles (the last partial), 3 superblocks (the last partial)
    qw = np.full((n, k // 32, 16), 0x88, dtype=np.uint8)
    sc = np.zeros((n, k // 32), dtype=np.float32)
    qw[33, 9, 3] = 0x5A  # column 33 = tile 1, col 1; block 9 = superblock 1, sub-block 1; byte 3
    sc[33, 9] = 2.0
    buf = pack_b(qw, sc)
    s = 3
    base = 1 * s * 4608 + 1 * 4608 + 1 * 576
    assert buf[base + 64 + 16 * 1 + 3] == 0x5A
    assert buf[base + 2 * 1: base + 2 * 1 + 2] == b"\x00\x40"  # fp16 2.0, little-endian
    nz = [i for i, b in enumerate(buf) if b not in (0x88, 0x00)]
    assert nz == [base + 3, base + 64 + 16 + 3]  # 0x40 (scale high byte) and the 0x5A byte
    # padding: K 544..767 and columns 70..95 are code 8 / scale 0
    d, qs = b_tiles(buf, n, k)
    assert d.shape == (3, 3, 8, 32) and qs.shape == (3, 3, 8, 32, 16)
    assert np.all(qs[2, :, :, 6:] == 0x88) and np.all(d[2, :, :, 6:] == 0)
    assert np.all(qs[:, 2, 1:] == 0x88) and np.all(d[:, 2, 1:] == 0)


@given(st.integers(0, 2**32 - 1), ks, st.integers(1, 100))
def test_packed_b_round_trip(seed, k, n):
    rng = np.random.default_rng(seed)
    qw, sc = random_weights(rng, n, k)
    buf = pack_b(qw, sc)
    qw2, sc2 = unpack_b(buf, n, k)
    assert np.array_equal(qw2, qw)
    assert np.array_equal(sc2, sc.astype(np.float16).astype(np.float32))  # the tile stores fp16
    assert pack_b(qw2, sc2) == buf


def test_packed_b_scale_rounding_and_overflow():
    qw = np.zeros((32, 1, 16), dtype=np.uint8)
    sc = np.zeros((32, 1), dtype=np.float32)
    sc[:4, 0] = [70000.0, 1e-9, 1 + 2.0**-11, -(1 + 3 * 2.0**-11)]
    d, _ = b_tiles(pack_b(qw, sc), 32, 32)
    assert np.isposinf(d[0, 0, 0, 0]) and d[0, 0, 0, 1] == 0
    assert d[0, 0, 0, 2] == 1.0  # tie -> even
    assert d[0, 0, 0, 3] == np.float16(-(1 + 2 * 2.0**-10))  # tie -> even (away from the odd)


# --------------------------------------------------------------------------- A


def test_quantized_a_offsets_single_row_and_group():
    m, k = 5, 512
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, k)).astype(np.float32)
    qa = quantize_a(a)
    buf = np.frombuffer(pack_a(qa), dtype=np.uint8)
    f16 = lambda off: buf[off: off + 2].view("<f2")[0]  # noqa: E731
    # row 4 is a remainder row: its superblock 1 starts at 4 * 2 * 290 + 290
    base = 4 * 2 * 290 + 290
    for j in range(8):
        assert f16(base + 34 * j) == qa.rel[4, 1, j]
        assert np.array_equal(buf[base + 34 * j + 2: base + 34 * j + 34].view(np.int8),
                              qa.q[4, 256 + 32 * j: 256 + 32 * j + 32])
        assert f16(base + 272 + 2 * j) == qa.asum8[4, 1, j]
    assert f16(base + 288) == qa.scale_avg[4, 1]
    # rows 0..3 are one group: superblock 1 at 1160, sub-block j at +136j, row r at +8+32r
    g = 1160
    for j in range(8):
        assert f16(g + 136 * j) == qa.rel[0, 1, j]
        assert not buf[g + 136 * j + 2: g + 136 * j + 8].any()  # unused scale slots
        for r in range(4):
            assert np.array_equal(buf[g + 136 * j + 8 + 32 * r: g + 136 * j + 40 + 32 * r].view(np.int8),
                                  qa.q[r, 256 + 32 * j: 256 + 32 * j + 32])
            assert f16(g + 1088 + 16 * r + 2 * j) == qa.asum8[r, 1, j]
    assert f16(g + 1152) == qa.scale_avg[0, 1] and not buf[g + 1154: g + 1160].any()


@given(st.integers(0, 2**32 - 1), st.integers(0, 11), ks, st.sampled_from([1e-2, 1.0, 1e3]))
def test_quantized_a_round_trip(seed, m, k, mag):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * mag).astype(np.float32)
    qa = quantize_a(a)
    buf = pack_a(qa)
    back = unpack_a(buf, m, k)
    for f in ("q", "rel", "asum8", "scale_avg"):
        assert np.array_equal(getattr(back, f), getattr(qa, f)), f
    assert (back.k, back.n_grouped) == (qa.k, qa.n_grouped)
    assert pack_a(back) == buf
    assert np.array_equal(back.dequantize(), qa.dequantize())  # the values the kernel uses


def test_wrong_buffer_sizes_are_layout_errors():
    with pytest.raises(LayoutError, match=r"packed B for N=33, K=64 must be exactly 9216 bytes, got 9215"):
        unpack_b(b"\x00" * 9215, 33, 64)
    with pytest.raises(LayoutError, match=r"quantized A for M=5, K=288 must be exactly 2900 bytes, got 290"):
        unpack_a(b"\x00" * 290, 5, 288)
    with pytest.raises(LayoutError, match="uint8"):
        unpack_a(np.zeros(290, dtype=np.int8), 1, 32)
