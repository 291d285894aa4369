"""Every error path of npusim.q4x32: the specific class (a ValueError) and a message that names the
offending value and the rule."""

from __future__ import annotations

import numpy as np
import pytest

from npusim.q4x32 import (
    DTypeError,
    InstructionError,
    KDimensionError,
    NonFiniteError,
    OptionError,
    Q4x32Error,
    ShapeMismatchError,
    a_packed_size,
    b_packed_size,
    dequantize_q4_0,
    encode_hp,
    execute_hp,
    ime2_hp_gemm,
    ime2_hp_gemm_prepared,
    pack_b,
    pack_tile,
    prepare_weight,
    quantize_a,
    quantize_q4_0,
    replay_gemm,
    scalar_tail_gemm,
    vmadot_hp,
)
from npusim.q4x32.errors import LayoutError


def ok_inputs(m: int = 2, k: int = 64, n: int = 3):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    qw, sc = quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qw, sc


def test_error_classes_are_value_errors():
    for cls in (DTypeError, KDimensionError, NonFiniteError, OptionError, ShapeMismatchError, LayoutError,
                InstructionError):
        assert issubclass(cls, Q4x32Error) and issubclass(cls, ValueError)


@pytest.mark.parametrize("level", ["exact", "hardware"])
def test_k_not_a_multiple_of_32(level):
    a = np.zeros((2, 100), dtype=np.float32)
    qw = np.zeros((3, 3, 16), dtype=np.uint8)
    sc = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(KDimensionError, match=r"K=100 \(from A of shape \(2, 100\)\) must be a positive multiple "
                                              r"of 32.*K % 32 = 4.*need not be a multiple of 256"):
        ime2_hp_gemm(a, qw, sc, level=level)
    with pytest.raises(KDimensionError, match=r"K=0 .* positive multiple of 32"):
        ime2_hp_gemm(np.zeros((2, 0), dtype=np.float32), qw, sc, level=level)
    with pytest.raises(KDimensionError, match=r"K=0 \(from qweight of shape \(3, 0, 16\)\)"):
        ime2_hp_gemm(np.zeros((2, 32), dtype=np.float32), np.zeros((3, 0, 16), np.uint8),
                     np.zeros((3, 0), np.float32), level=level)


def test_k_errors_in_quantizers_and_sizes():
    with pytest.raises(KDimensionError, match=r"K=33 \(from w of shape \(2, 33\)\)"):
        quantize_q4_0(np.zeros((2, 33), dtype=np.float32))
    with pytest.raises(KDimensionError, match=r"K=48 \(from A of shape \(1, 48\)\)"):
        quantize_a(np.zeros((1, 48), dtype=np.float32))
    with pytest.raises(KDimensionError, match=r"K=40"):
        a_packed_size(1, 40)
    with pytest.raises(KDimensionError, match=r"K=16"):
        b_packed_size(32, 16)
    with pytest.raises(ShapeMismatchError, match=r"N=0 must be >= 1"):
        b_packed_size(0, 32)
    with pytest.raises(ShapeMismatchError, match=r"M=-1 must be >= 0"):
        a_packed_size(-1, 32)


def test_shape_mismatches():
    a, qw, sc = ok_inputs()
    with pytest.raises(ShapeMismatchError, match=r"A has K=96 \(shape \(2, 96\)\) but the weights have K=64"):
        ime2_hp_gemm(np.zeros((2, 96), np.float32), qw, sc)
    with pytest.raises(ShapeMismatchError, match=r"scales has shape \(3, 3\) but qweight \(3, 2, 16\) needs "
                                                 r"scales \[N, K/32\] = \(3, 2\)"):
        ime2_hp_gemm(a, qw, np.zeros((3, 3), np.float32))
    with pytest.raises(ShapeMismatchError, match=r"scales has shape \(4, 2\)"):
        ime2_hp_gemm(a, qw, np.zeros((4, 2), np.float32))
    with pytest.raises(ShapeMismatchError, match=r"qweight must have shape \[N, K/32, 16\].*got \(3, 2, 15\)"):
        ime2_hp_gemm(a, qw[:, :, :15], sc)
    with pytest.raises(ShapeMismatchError, match=r"qweight must be 3-D \[N, K/32, 16\], got shape \(3, 32\)"):
        ime2_hp_gemm(a, qw.reshape(3, 32), sc)
    with pytest.raises(ShapeMismatchError, match=r"A must be 2-D \[M, K\], got shape \(64,\)"):
        ime2_hp_gemm(a[0], qw, sc)
    with pytest.raises(ShapeMismatchError, match=r"scales must be 2-D \[N, K/32\], got shape \(6,\)"):
        ime2_hp_gemm(a, qw, sc.reshape(-1))
    with pytest.raises(ShapeMismatchError, match=r"w must be 2-D"):
        quantize_q4_0(np.zeros((2, 2, 32), np.float32))
    w = prepare_weight(qw, sc)
    with pytest.raises(ShapeMismatchError, match=r"A has K=32"):
        ime2_hp_gemm_prepared(np.zeros((1, 32), np.float32), w)
    with pytest.raises(ShapeMismatchError, match=r"A has K=32"):
        scalar_tail_gemm(np.zeros((1, 32), np.float32), qw, sc)


def test_wrong_dtypes():
    a, qw, sc = ok_inputs()
    with pytest.raises(DTypeError, match=r"A must have dtype float32, got float64"):
        ime2_hp_gemm(a.astype(np.float64), qw, sc)
    with pytest.raises(DTypeError, match=r"A must have dtype float32, got int32"):
        ime2_hp_gemm(a.astype(np.int32), qw, sc)
    with pytest.raises(DTypeError, match=r"qweight must have dtype uint8, got int8"):
        ime2_hp_gemm(a, qw.view(np.int8), sc)
    with pytest.raises(DTypeError, match=r"scales must have dtype float32, got float16"):
        ime2_hp_gemm(a, qw, sc.astype(np.float16))
    with pytest.raises(DTypeError, match=r"w must have dtype float16 or float32 or float64, got int64"):
        quantize_q4_0(np.zeros((2, 32), dtype=np.int64))
    with pytest.raises(DTypeError, match=r"A must have dtype float32, got float16"):
        quantize_a(np.zeros((1, 32), dtype=np.float16))
    with pytest.raises(DTypeError, match=r"qweight must have dtype uint8, got float32"):
        dequantize_q4_0(qw.astype(np.float32), sc)
    with pytest.raises(DTypeError, match=r"scales must have dtype float32, got float64"):
        pack_b(qw, sc.astype(np.float64))


@pytest.mark.parametrize("bad, shown", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
def test_non_finite_inputs(bad, shown):
    a, qw, sc = ok_inputs()
    a2 = a.copy()
    a2[1, 3] = bad
    with pytest.raises(NonFiniteError,
                       match=rf"A must be finite: A\[1, 3\] = {shown} \(1 non-finite value in total\)"):
        ime2_hp_gemm(a2, qw, sc, level="hardware")
    sc2 = sc.copy()
    sc2[2, 1] = bad
    sc2[0, 0] = bad
    with pytest.raises(NonFiniteError,
                       match=rf"scales must be finite: scales\[0, 0\] = {shown} \(2 non-finite values in total\)"):
        ime2_hp_gemm(a, qw, sc2)
    w = np.zeros((1, 32), np.float32)
    w[0, 31] = bad
    with pytest.raises(NonFiniteError, match=r"w must be finite: w\[0, 31\]"):
        quantize_q4_0(w)
    with pytest.raises(NonFiniteError, match=r"A must be finite"):
        quantize_a(a2)
    with pytest.raises(NonFiniteError, match=r"scales must be finite"):
        pack_b(qw, sc2)


def test_unknown_options():
    a, qw, sc = ok_inputs()
    with pytest.raises(OptionError, match=r"level='fast' is not one of 'exact', 'hardware'"):
        ime2_hp_gemm(a, qw, sc, level="fast")
    with pytest.raises(OptionError, match=r"rounding='fma' is not one of 'unfused', 'fused'"):
        ime2_hp_gemm(a, qw, sc, level="hardware", rounding="fma")
    with pytest.raises(OptionError, match=r"dot='int' is not one of 'fp16', 'exact'"):
        ime2_hp_gemm(a, qw, sc, dot="int")
    with pytest.raises(OptionError, match=r"overflow='wrap' is not one of 'inf', 'saturate'"):
        vmadot_hp(np.zeros(64, np.float16), bytes(128), bytes(128), np.zeros(64, np.float16), overflow="wrap")
    with pytest.raises(OptionError, match=r"order='hi' is not one of 'hi_lo', 'lo_hi'"):
        ime2_hp_gemm(a, qw, sc, level="hardware", order="hi")
    with pytest.raises(OptionError, match=r"order='x'"):
        replay_gemm(b"", b"", 0, 32, 1, order="x")


def test_instruction_operand_errors():
    zero = np.zeros(64, np.float16)
    with pytest.raises(InstructionError, match=r"vs1 must be 128 bytes \(one VLEN-1024 register\), got 64"):
        vmadot_hp(zero, bytes(64), bytes(128), zero)
    with pytest.raises(InstructionError, match=r"vd must hold 64 fp16 values, got 32"):
        vmadot_hp(zero[:32], bytes(128), bytes(128), zero)
    with pytest.raises(InstructionError, match=r"vscale must hold 64 fp16 values .* got dtype float32"):
        vmadot_hp(zero, bytes(128), bytes(128), zero.astype(np.float32))
    with pytest.raises(InstructionError, match=r"imm3=8 must be an integer in 0..7"):
        vmadot_hp(zero, bytes(128), bytes(128), zero, 8)
    with pytest.raises(InstructionError, match=r"signedness='uu'"):
        vmadot_hp(zero, bytes(128), bytes(128), zero, signedness="uu")
    with pytest.raises(InstructionError, match=r"vd=v32 is not a vector register"):
        encode_hp(32, 0, 0)
    with pytest.raises(InstructionError, match=r"vscale=2 must be 0 \(v0\) or 1 \(v1\)"):
        encode_hp(0, 0, 0, vscale=2)
    with pytest.raises(InstructionError, match=r"vregs must be a uint8 array of shape \(32, 128\)"):
        execute_hp(encode_hp(0, 1, 2), np.zeros((32, 64), np.uint8))
    with pytest.raises(InstructionError, match=r"tile values must lie in \[-8, 15\] for i4"):
        pack_tile(np.full((8, 32), 16))
    with pytest.raises(InstructionError, match=r"tile must be an integer array of shape \(8, 16\)"):
        pack_tile(np.zeros((8, 32), np.int64), int4=False)


def test_replay_buffer_sizes():
    with pytest.raises(LayoutError, match=r"quantized A for M=1, K=32 must be 290 bytes, got 0"):
        replay_gemm(b"", bytes(4608), 1, 32, 1)
    with pytest.raises(LayoutError, match=r"packed B for N=33, K=32 must be 9216 bytes, got 4608"):
        replay_gemm(bytes(290), bytes(4608), 1, 32, 33)
