"""vllm_npu.ime2.linear: a weight quantized (in C) and packed once, applied with threads (issue 5).

Checked against the numpy executable specification: the C Q4_0 weight quantizer equals
``npusim.q4x32.quantize_q4_0`` bit for bit; ``PackedQ4Weight.apply`` equals
``npusim.q4x32.ime2_hp_gemm(level="hardware")`` bit for bit for any thread count, and is within
llama.cpp's mul_mat NMSE bound (5e-4) of the float reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import npusim.q4x32 as q
from vllm_npu.ime2 import kernel
from vllm_npu.ime2.linear import THREADS_ENV, PackedQ4Weight, default_threads, pack_count

MUL_MAT_NMSE = 5e-4


def weights(n: int, k: int, seed: int, kind: str = "normal") -> np.ndarray:
    rng = np.random.default_rng([seed, n, k])
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    if kind == "ties":  # equal |max| of both signs, zeros, exact multiples of the scale
        w = np.round(w * 400).astype(np.float32) / 400
        w[:, ::32] = 0.05
        w[:, 1::32] = -0.05
    elif kind == "zeros":
        w[: n // 2] = 0
    elif kind == "wide":
        w *= np.exp(rng.uniform(-20, 20, (n, 1))).astype(np.float32)
    return w


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "wide"])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (70, 288), (64, 512)])
def test_c_weight_quantizer_equals_npusim(n, k, kind):
    w = weights(n, k, 1, kind)
    qw, sc = kernel.quantize_q4_0(w)
    qw_ref, sc_ref = q.quantize_q4_0(w)
    np.testing.assert_array_equal(qw, qw_ref)
    np.testing.assert_array_equal(sc.view(np.uint32), sc_ref.view(np.uint32))


@given(n=st.integers(1, 40), kb=st.integers(1, 10), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]))
def test_c_weight_quantizer_property(n, kb, seed, scale):
    w = (np.random.default_rng(seed).standard_normal((n, kb * 32)) * scale).astype(np.float32)
    qw, sc = kernel.quantize_q4_0(w)
    qw_ref, sc_ref = q.quantize_q4_0(w)
    np.testing.assert_array_equal(qw, qw_ref)
    np.testing.assert_array_equal(sc, sc_ref)


def test_weight_quantizer_errors_name_the_rule():
    with pytest.raises(kernel.KDimensionError, match="K=40"):
        kernel.quantize_q4_0(np.zeros((2, 40), np.float32))
    with pytest.raises(kernel.DTypeError, match="float32"):
        kernel.quantize_q4_0(np.zeros((2, 32), np.float64))
    w = np.zeros((2, 32), np.float32)
    w[1, 3] = np.inf
    with pytest.raises(kernel.NonFiniteError):
        kernel.quantize_q4_0(w)


@pytest.mark.parametrize("m", [1, 4, 5, 9])
@pytest.mark.parametrize("n, k", [(7, 32), (64, 96), (70, 288), (200, 512)])
def test_apply_equals_npusim_hardware_for_every_thread_count(m, n, k):
    w = weights(n, k, 2)
    a = np.random.default_rng([3, m, n, k]).standard_normal((m, k)).astype(np.float32)
    lin = PackedQ4Weight.from_float(w, name="layer")
    qw, sc = q.quantize_q4_0(w)
    want = np.asarray(q.ime2_hp_gemm(a, qw, sc, level="hardware"), dtype=np.float32)
    for threads in (1, 2, 3, 8, 256):
        got = lin.apply(a, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"threads={threads}")
    ref = a.astype(np.float64) @ q.dequantize_q4_0(qw, sc, dtype=np.float64).T
    assert q.nmse(ref, want) <= MUL_MAT_NMSE


def test_pack_count_does_not_grow_with_calls():
    before = pack_count()
    lin = PackedQ4Weight.from_float(weights(64, 64, 4), name="once")
    assert pack_count() == before + 1
    x = torch.randn(3, 5, 64)
    for _ in range(5):
        lin.apply(x)
    assert pack_count() == before + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_apply_keeps_dtype_shape_and_adds_bias(dtype):
    w = torch.randn(96, 64, dtype=torch.float32) * 0.05
    lin = PackedQ4Weight.from_float(w.to(dtype), name="proj")
    x = torch.randn(2, 3, 64, dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    y = lin.apply(x, bias)
    assert y.dtype == dtype and y.shape == (2, 3, 96)
    a = x.reshape(-1, 64).to(torch.float32).numpy()
    qw, sc = q.quantize_q4_0(w.to(dtype).to(torch.float32).numpy())
    want = np.asarray(q.ime2_hp_gemm(a, qw, sc, level="hardware"), np.float32) + bias.to(torch.float32).numpy()
    assert torch.equal(y.reshape(-1, 96), torch.from_numpy(want).to(dtype))


def test_errors_name_the_layer_and_the_rule():
    with pytest.raises(kernel.KDimensionError, match=r"model.layers.0.mlp.down_proj: input size K=40 is not a multiple of 32"):
        PackedQ4Weight.from_float(np.zeros((8, 40), np.float32), name="model.layers.0.mlp.down_proj")
    lin = PackedQ4Weight.from_float(np.ones((8, 64), np.float32), name="o_proj")
    with pytest.raises(kernel.ShapeMismatchError, match=r"o_proj: activations of shape \(2, 32\).*K=64"):
        lin.apply(np.zeros((2, 32), np.float32))
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = np.nan
    with pytest.raises(kernel.NonFiniteError, match="o_proj"):
        lin.apply(x)
    with pytest.raises(kernel.ShapeMismatchError, match="threads=0"):
        kernel.gemm_packed(kernel.quantize_a(np.zeros((1, 64), np.float32)), lin.packed, 1, 64, 8, threads=0)


def test_threads_env(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "zero")
    with pytest.raises(ValueError, match="NPU_HARNESS_IME2_THREADS='zero' must be an integer between 1 and 256"):
        default_threads()
    monkeypatch.delenv(THREADS_ENV)
    assert default_threads() >= 1


def test_mt_gemm_is_bit_identical_and_writes_nothing_on_error():
    n, k, m = 130, 288, 6
    lin = PackedQ4Weight.from_float(weights(n, k, 5), name="w")
    a = kernel.quantize_a_array(np.random.default_rng(6).standard_normal((m, k)).astype(np.float32))
    one = kernel.gemm_packed(a, lin.packed, m, k, n, threads=1)
    for threads in (2, 4, 5, 9):
        np.testing.assert_array_equal(kernel.gemm_packed(a, lin.packed, m, k, n, threads=threads), one)
    out = np.full((m, n), 7.0, np.float32)
    with pytest.raises(kernel.ShapeMismatchError):
        kernel.gemm_packed(a[:-1], lin.packed, m, k, n, threads=4, out=out)  # A too small for M
    assert (out == 7.0).all()
    with pytest.raises(kernel.PathError):
        kernel.gemm_packed(a, lin.packed, m, k, n, threads=4, path="rvv", out=out)
    assert (out == 7.0).all()


def test_quant_method_gives_nan_rows_for_non_finite_activations():
    """vLLM's profile run feeds uninitialised rows: those come out NaN; the other rows are what the
    kernel gives with those rows zeroed (a 4-row group shares its activation scales)."""
    quant = pytest.importorskip("vllm_npu.ime2.quant")
    lin = PackedQ4Weight.from_float(weights(40, 64, 8), name="qkv")
    x = torch.randn(6, 64)
    assert torch.equal(quant._apply_nan_rows(lin, x), lin.apply(x))
    bad = x.clone()
    bad[1, 7] = float("nan")
    bad[3, 0] = float("inf")
    zeroed = x.clone()
    zeroed[[1, 3]] = 0
    y = quant._apply_nan_rows(lin, bad)
    assert torch.isnan(y[[1, 3]]).all()
    keep = [0, 2, 4, 5]
    assert torch.equal(y[keep], lin.apply(zeroed)[keep])
