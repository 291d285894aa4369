"""The host build of kernels/ime2 (issue 3, sections 2 and 4) against npusim.q4x32.

The C kernel implements the algorithm of ``npusim.q4x32.ime2_hp_gemm(level="hardware")`` with
its default options, so the two must agree bit for bit (inf/NaN positions included); packing
and quantization must give byte-identical buffers; both must be within llama.cpp's mul_mat
NMSE bound of the float reference. Only the tests compare the plugin with the simulator.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npusim.q4x32 as q
from vllm_npu.ime2 import kernel

#: llama.cpp test-backend-ops' bound for mul_mat (vs the float reference A @ dequant(W).T).
MUL_MAT_NMSE = 5e-4

SEED_SHAPES = [  # (K, N) of the seed's IME2 GEMM table
    (576, 1536), (960, 2560), (896, 4864), (2048, 5632), (1536, 8960),
    (2048, 5632), (2048, 8192), (2560, 10240), (2048, 11008),
]


def activations(rng: np.random.Generator, m: int, k: int, dist: str = "normal") -> np.ndarray:
    if dist == "uniform":
        a = rng.uniform(-1, 1, (m, k))
    elif dist == "positive":
        a = np.abs(rng.standard_normal((m, k)))
    elif dist == "outlier" and m and k:
        a = rng.standard_normal((m, k))
        a[rng.integers(m), rng.integers(k)] = 200.0
    else:
        a = rng.standard_normal((m, k))
    return a.astype(np.float32)


def weights(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights quantized by npusim's Q4_0 quantizer from a random float matrix."""
    return q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))


def random_quantized(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random op inputs directly (fast for big shapes): any codes, fp16-representable scales."""
    qw = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    sc = (rng.uniform(0.5, 1.5, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32)) / 8)
    return qw, sc.astype(np.float16).astype(np.float32)


def float_reference(a: np.ndarray, qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ q.dequantize_q4_0(qw, sc, dtype=np.float64).T


def assert_bit_exact(c: np.ndarray, ref: np.ndarray) -> None:
    assert c.dtype == np.float32 and c.shape == ref.shape
    assert np.array_equal(np.isnan(c), np.isnan(ref)), "NaN positions differ"
    assert np.array_equal(c, ref, equal_nan=True), (
        f"{int((c != ref).sum())} of {c.size} values differ; first at "
        f"{tuple(np.argwhere(c != ref)[0]) if (c != ref).any() else None}"
    )


def assert_same_bits(c: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Identical float32 bit patterns (NaN payloads and signed zeros included)."""
    assert c.dtype == ref.dtype == np.float32 and c.shape == ref.shape
    diff = c.view(np.uint32) != ref.view(np.uint32)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {c.size} values differ; first at {tuple(np.argwhere(diff)[0])}"


def check_paths(ap: bytes, bp: bytes, m: int, k: int, n: int, hw: np.ndarray) -> None:
    """Every path this library can run here (kernel.usable_paths()) on the packed operands: equal
    to npusim hardware bit for bit, and to the portable path bit pattern for bit pattern."""
    paths = kernel.usable_paths()
    assert "portable" in paths
    portable = kernel.gemm_packed(ap, bp, m, k, n, path="portable")
    assert_bit_exact(portable, hw)
    for path in paths:
        c = kernel.gemm_packed(ap, bp, m, k, n, path=path)
        assert_bit_exact(c, hw)
        assert_same_bits(c, portable, f"path {path!r} vs portable")
    if "x86" in paths:  # the X86 path's other variants too (the best one for this CPU ran above)
        for isa in ("avx512-vnni", "avx2"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("NPU_IME2_X86_ISA", isa)
                assert_same_bits(kernel.gemm_packed(ap, bp, m, k, n, path="x86"), portable,
                                 f"x86 (NPU_IME2_X86_ISA={isa}: {kernel.x86_variant()}) vs portable")


def check_agreement(a: np.ndarray, qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """C == npusim hardware bit for bit on the whole op (AUTO) and on every usable path, and the
    packed bytes are identical. Returns C."""
    bp = kernel.pack_b(qw, sc)
    ap = kernel.quantize_a(a)
    assert bp == q.pack_b(qw, sc)
    assert ap == q.pack_a(q.quantize_a(a))
    c = kernel.ime2_hp_gemm_cpu(a, qw, sc)
    hw = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    assert_bit_exact(c, hw)
    if a.shape[0]:
        check_paths(ap, bp, a.shape[0], a.shape[1], qw.shape[0], hw)
    return c


# ---------------------------------------------------------------------------------------------
# agreement with npusim.q4x32


@given(
    m=st.integers(0, 9),
    kb=st.integers(1, 24),  # K = 32 .. 768, not always a multiple of 256
    n=st.integers(1, 100),
    dist=st.sampled_from(["normal", "uniform", "positive", "outlier"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_c_equals_numpy_hardware_bit_for_bit(m, kb, n, dist, seed):
    rng = np.random.default_rng(seed)
    k = 32 * kb
    qw, sc = weights(rng, n, k)
    a = activations(rng, m, k, dist)
    check_agreement(a, qw, sc)


@given(st.integers(0, 2**32 - 1), st.integers(1, 9), st.integers(1, 48).map(lambda i: 32 * i),
       st.integers(16, 96), st.sampled_from(["uniform", "normal", "positive"]),
       st.sampled_from(["uniform", "normal"]))
def test_c_and_numpy_hardware_vs_float_reference(seed, m, k, n, adist, wdist):
    """The bound on the ranges npusim's own NMSE property uses (tests/npusim/test_q4x32_gemm.py)."""
    rng = np.random.default_rng(seed)
    a = activations(rng, m, k, adist)
    w = rng.uniform(-1, 1, (n, k)) if wdist == "uniform" else rng.standard_normal((n, k)) * 0.02
    qw, sc = q.quantize_q4_0(w.astype(np.float32))
    ref = float_reference(a, qw, sc)
    c = check_agreement(a, qw, sc)
    hw = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    assert q.nmse(ref, c) <= MUL_MAT_NMSE
    assert q.nmse(ref, hw) <= MUL_MAT_NMSE


@pytest.mark.parametrize("k, n", sorted(set(SEED_SHAPES)))
def test_seed_gemm_shapes_at_m_1_4_5(k, n):
    rng = np.random.default_rng(k * 100_003 + n)
    qw, sc = random_quantized(rng, n, k)
    w = q.prepare_weight(qw, sc)
    wdeq = w.w_deq
    bp = kernel.pack_b(qw, sc)
    for m in (1, 4, 5):
        a = activations(rng, m, k, "uniform")
        c = kernel.ime2_hp_gemm_cpu(a, qw, sc)
        hw = q.ime2_hp_gemm_prepared(a, w, level="hardware")
        assert_bit_exact(c, hw)
        check_paths(kernel.quantize_a(a), bp, m, k, n, hw)
        ref = a.astype(np.float64) @ wdeq.T
        assert q.nmse(ref, c) <= MUL_MAT_NMSE
        assert q.nmse(ref, hw) <= MUL_MAT_NMSE


@pytest.mark.parametrize("k", [32, 96, 288])
@pytest.mark.parametrize("n", [1, 7, 31, 33, 63, 65, 97])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9])
def test_odd_n_tails_and_small_k(m, k, n):
    rng = np.random.default_rng(m * 10_000 + k * 100 + n)
    qw, sc = weights(rng, n, k)
    a = activations(rng, m, k)
    c = check_agreement(a, qw, sc)
    if n >= 7:  # NMSE is a mean: with a single output column it is one value's relative error
        assert q.nmse(float_reference(a, qw, sc), c) <= MUL_MAT_NMSE


def test_m_zero_gives_empty_result():
    rng = np.random.default_rng(1)
    qw, sc = weights(rng, 40, 64)
    a = np.zeros((0, 64), np.float32)
    c = kernel.ime2_hp_gemm_cpu(a, qw, sc)
    assert c.shape == (0, 40) and c.dtype == np.float32
    assert kernel.quantize_a(a) == b"" == q.pack_a(q.quantize_a(a))


def test_fp16_overflow_gives_the_same_inf_and_nan_positions():
    """Huge weight scales overflow the fp16 accumulator: inf (and NaN) exactly where npusim has them."""
    rng = np.random.default_rng(7)
    m, k, n = 5, 512, 70
    qw = np.full((n, k // 32, 16), 0xFF, np.uint8)  # code 15 everywhere (+7 after the zero point)
    qw[::3] = 0x00  # code 0 (-8) in every third column
    sc = np.full((n, k // 32), 3000.0, np.float32)
    sc[1::5] = 70000.0  # beyond fp16: the tile's scale is inf
    a = np.abs(activations(rng, m, k)) * 50
    c = check_agreement(a, qw, sc)
    assert np.isinf(c).any() and np.isnan(c).any()


def test_large_activations_overflow_scale_avg_like_numpy():
    rng = np.random.default_rng(8)
    m, k, n = 5, 256, 40
    qw, sc = weights(rng, n, k)
    a = np.full((m, k), 3.0e7, np.float32)  # scale_avg > 65504: fp16 inf
    a[:, ::2] *= -1
    c = check_agreement(a, qw, sc)
    assert not np.isfinite(c).all()


def test_tiny_activations_subnormal_scale_avg():
    rng = np.random.default_rng(9)
    qw, sc = weights(rng, 33, 320)
    a = activations(rng, 6, 320) * np.float32(1e-4)
    check_agreement(a, qw, sc)


@pytest.mark.parametrize("m", [1, 4, 6])
def test_gemm_on_packed_operands_and_paths(m):
    rng = np.random.default_rng(m)
    k, n = 544, 75
    qw, sc = weights(rng, n, k)
    a = activations(rng, m, k)
    ap, bp = kernel.quantize_a(a), kernel.pack_b(qw, sc)
    hw = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    for path in ["auto", *kernel.usable_paths()]:
        assert_bit_exact(kernel.gemm_packed(ap, bp, m, k, n, path=path), hw)
    for path in ("rvv", "ime2"):  # riscv64 builds only: never in the host library
        with pytest.raises(kernel.PathError, match="not built"):
            kernel.gemm_packed(ap, bp, m, k, n, path=path)
    with pytest.raises(kernel.PathError, match=r"path='avx' is not one of"):
        kernel.gemm_packed(ap, bp, m, k, n, path="avx")


def test_sizes_match_npusim():
    for m, k, n in [(0, 32, 1), (1, 32, 1), (5, 288, 33), (9, 2560, 10240), (4, 256, 32)]:
        assert kernel.a_packed_size(m, k) == q.a_packed_size(m, k)
        assert kernel.b_packed_size(n, k) == q.b_packed_size(n, k)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(3)
    qw, sc = weights(rng, 40, 128)
    a = activations(rng, 5, 256)[:, ::2]
    assert not a.flags.c_contiguous
    assert_bit_exact(kernel.ime2_hp_gemm_cpu(a, qw, sc),
                     q.ime2_hp_gemm(np.ascontiguousarray(a), qw, sc, level="hardware"))
