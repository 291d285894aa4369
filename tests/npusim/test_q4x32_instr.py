"""The IME2 .hp instruction model: hand-computed tiles, both values of every open option, encodings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npusim.q4x32 import (
    InstructionError,
    decode_hp,
    encode_hp,
    execute_hp,
    format_hp,
    pack_tile,
    unpack_tile,
    vmadot_hp,
)

ZERO = np.zeros(64, dtype=np.float16)


def scales(groups: list[float] | None = None, fill: float = 1.0) -> np.ndarray:
    """A v0/v1 image: 8 groups of 8 fp16; group g filled with groups[g] (or ``fill``)."""
    vals = np.full(64, fill, dtype=np.float16)
    if groups is not None:
        for g, v in enumerate(groups):
            vals[8 * g: 8 * g + 8] = v
    return vals


def const_tile(value: int, int4: bool = True) -> bytes:
    return pack_tile(np.full((8, 32 if int4 else 16), value, dtype=np.int64), int4=int4)


# --------------------------------------------------------------------------- register layout


def test_i4_register_is_low_nibble_first_row_major():
    tile = np.zeros((8, 32), dtype=np.int64)
    tile[0, 0], tile[0, 1], tile[2, 5] = 3, 12, 9
    reg = pack_tile(tile)
    assert len(reg) == 128
    assert reg[0] == 0xC3  # element 0 in bits 3:0, element 1 in bits 7:4
    assert reg[(2 * 32 + 5) // 2] == 0x90  # element 69 is odd: high nibble of byte 34
    assert sum(reg) == 0xC3 + 0x90
    assert np.array_equal(unpack_tile(reg), tile)


@given(st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_pack_unpack_tile_round_trip(seed, int4, signed):
    rng = np.random.default_rng(seed)
    k = 32 if int4 else 16
    lo, hi = ((-8, 7) if signed else (0, 15)) if int4 else ((-128, 127) if signed else (0, 255))
    tile = rng.integers(lo, hi + 1, size=(8, k))
    assert np.array_equal(unpack_tile(pack_tile(tile, int4=int4), int4=int4, signed=signed), tile)


# --------------------------------------------------------------------------- hand-computed tiles


def test_all_ones_i4_u_and_scale_groups_by_imm3():
    for imm3 in range(8):
        out = vmadot_hp(ZERO, const_tile(1), const_tile(1), scales([g + 1 for g in range(8)]), imm3, signedness="u")
        assert np.all(out == np.float16(32 * (imm3 + 1)))


def test_scale_is_per_output_column():
    v = scales()
    v[3 * 8: 4 * 8] = np.arange(8, dtype=np.float16) + 1  # group 3: column c -> c + 1
    out = vmadot_hp(ZERO, const_tile(1), const_tile(1), v, 3).reshape(8, 8)
    assert np.array_equal(out, np.tile(np.arange(1, 9) * 32, (8, 1)).astype(np.float16))


def test_single_nonzero_lands_at_row_times_8_plus_column():
    a = np.zeros((8, 32), dtype=np.int64)
    bt = np.zeros((8, 32), dtype=np.int64)
    a[2, 5] = 3
    bt[6, 5] = 7  # column 6 of B, K index 5
    vd = np.arange(64, dtype=np.float16)
    out = vmadot_hp(vd, pack_tile(a), pack_tile(bt), scales(fill=0.5), 0)
    want = vd.copy()
    want[2 * 8 + 6] += np.float16(21 * 0.5)
    assert np.array_equal(out, want)
    # K indices must match: the same values at different K give nothing
    bt[6, 5], bt[6, 4] = 0, 7
    assert np.array_equal(vmadot_hp(vd, pack_tile(a), pack_tile(bt), scales(), 0), vd)


def test_signedness_u_su_us_ss_i4():
    a = const_tile(15)  # nibble 0xF: 15 unsigned, -1 signed
    b = const_tile(1)
    assert np.all(vmadot_hp(ZERO, a, b, scales(), signedness="u") == 480)
    assert np.all(vmadot_hp(ZERO, a, b, scales(), signedness="su") == -32)
    assert np.all(vmadot_hp(ZERO, b, a, scales(), signedness="us") == -32)
    assert np.all(vmadot_hp(ZERO, b, a, scales(), signedness="su") == 480)  # B unsigned
    assert np.all(vmadot_hp(ZERO, a, a, scales(), signedness="ss") == 32)


def test_signedness_i8_and_tile_k_16():
    a = const_tile(255, int4=False)  # 0xFF: 255 unsigned, -1 signed
    b = const_tile(2, int4=False)
    assert np.all(vmadot_hp(ZERO, a, b, scales(), int4=False, signedness="u") == 16 * 255 * 2)
    assert np.all(vmadot_hp(ZERO, a, b, scales(), int4=False, signedness="su") == -32)
    assert np.all(vmadot_hp(ZERO, a, a, scales(), int4=False, signedness="ss") == 16)
    # an i8 register holds 16 K values per row: element 16 belongs to row 1
    t = np.zeros((8, 16), dtype=np.int64)
    t[1, 0] = 5
    out = vmadot_hp(ZERO, pack_tile(t, int4=False), const_tile(1, int4=False), scales(), int4=False)
    assert np.array_equal(out.reshape(8, 8)[1], np.full(8, 5, dtype=np.float16))
    assert np.count_nonzero(out) == 8


def test_matches_integer_formula_on_random_tiles():
    rng = np.random.default_rng(7)
    for int4 in (True, False):
        for sg in ("u", "us", "su", "ss"):
            k = 32 if int4 else 16
            a = rng.integers(0, 16 if int4 else 256, size=(8, k))
            bt = rng.integers(0, 16 if int4 else 256, size=(8, k))
            sa, sb = sg in ("su", "ss"), sg in ("us", "ss")
            ai = unpack_tile(pack_tile(a, int4=int4), int4=int4, signed=sa)
            bi = unpack_tile(pack_tile(bt, int4=int4), int4=int4, signed=sb)
            v = (rng.standard_normal(64) * 0.01).astype(np.float16)
            tmp = ai @ bi.T
            out = vmadot_hp(ZERO, pack_tile(a, int4=int4), pack_tile(bt, int4=int4), v, 5, signedness=sg, int4=int4,
                            dot="exact")
            want = (tmp.astype(np.float64) * v[40:48].astype(np.float64)[None, :]).astype(np.float16)
            assert np.array_equal(out.reshape(8, 8), want)


# --------------------------------------------------------------------------- the open options


def test_rounding_unfused_vs_fused_hand_case():
    # vd = -3, tmp = 3 (A one 3 x B one 1), scale = 1 + 2**-10:
    # fused -> 3 * 2**-10; unfused -> fp16(3.0029296875) = 3.00390625 (tie to even) -> 2**-8.
    a = np.zeros((8, 32), dtype=np.int64)
    a[:, 0] = 3
    bt = np.zeros((8, 32), dtype=np.int64)
    bt[:, 0] = 1
    vd = np.full(64, -3, dtype=np.float16)
    v = scales(fill=1 + 2.0**-10)
    unfused = vmadot_hp(vd, pack_tile(a), pack_tile(bt), v, rounding="unfused")
    fused = vmadot_hp(vd, pack_tile(a), pack_tile(bt), v, rounding="fused")
    assert np.all(unfused == np.float16(2.0**-8))
    assert np.all(fused == np.float16(3 * 2.0**-10))


def test_dot_fp16_vs_exact_hand_case():
    # tmp = 2049: fp16(2049) = 2048 (tie to even). * 1.5 -> 3072; exact 2049 * 1.5 = 3073.5 -> 3074.
    a = np.zeros((8, 32), dtype=np.int64)
    bt = np.zeros((8, 32), dtype=np.int64)
    a[:, :9] = 15
    bt[:, :9] = 15  # 9 * 225 = 2025
    a[:, 9], bt[:, 9] = 4, 6  # + 24 = 2049
    out16 = vmadot_hp(ZERO, pack_tile(a), pack_tile(bt), scales(fill=1.5), dot="fp16")
    outx = vmadot_hp(ZERO, pack_tile(a), pack_tile(bt), scales(fill=1.5), dot="exact")
    assert np.all(out16 == 3072) and np.all(outx == 3074)
    # both rounding modes agree here (vd = 0)
    assert np.all(vmadot_hp(ZERO, pack_tile(a), pack_tile(bt), scales(fill=1.5), rounding="fused") == 3072)


@pytest.mark.parametrize("rounding", ["unfused", "fused"])
def test_fp16_accumulator_overflow_inf_or_saturate(rounding):
    vd = np.full(64, 65504, dtype=np.float16)
    # 65504 + 32 = 65536 >= 65520 -> inf (IEEE) or 65504 (saturate)
    out = vmadot_hp(vd, const_tile(1), const_tile(1), scales(), rounding=rounding)
    assert np.all(np.isposinf(out))
    out = vmadot_hp(vd, const_tile(1), const_tile(1), scales(), rounding=rounding, overflow="saturate")
    assert np.all(out == 65504)
    # negative: -65504 + (-1 * 1 * 32) -> -inf
    out = vmadot_hp(-vd, const_tile(15), const_tile(1), scales(), signedness="su", rounding=rounding)
    assert np.all(np.isneginf(out))
    # the product alone overflows: 7200 * 16 = 115200
    out = vmadot_hp(ZERO, const_tile(15), const_tile(15), scales(fill=16), rounding=rounding)
    assert np.all(np.isposinf(out))
    out = vmadot_hp(ZERO, const_tile(15), const_tile(15), scales(fill=16), rounding=rounding, overflow="saturate")
    assert np.all(out == 65504)
    # unfused: the product rounds to -inf first and inf + -inf is NaN; fused: inf - 115200 = inf
    inf = np.full(64, np.inf, dtype=np.float16)
    out = vmadot_hp(inf, const_tile(15), const_tile(15), scales(fill=-16), rounding=rounding)
    assert np.all(np.isnan(out)) if rounding == "unfused" else np.all(np.isposinf(out))


def test_i8_dot_to_fp16_overflows_before_the_scale():
    # u x u i8: 16 * 255 * 255 = 1040400 > 65504: fp16(tmp) = inf even though tmp * 2**-10 = 1016.02
    a = const_tile(255, int4=False)
    small = scales(fill=2.0**-10)
    assert np.all(np.isposinf(vmadot_hp(ZERO, a, a, small, int4=False, dot="fp16")))
    assert np.all(vmadot_hp(ZERO, a, a, small, int4=False, dot="exact") == 1016)
    sat = vmadot_hp(ZERO, a, a, small, int4=False, dot="fp16", overflow="saturate")
    assert np.all(sat == np.float16(65504 * 2.0**-10))


def test_accepts_register_bytes_for_vd_and_vscale():
    vd = np.full(64, 1.5, dtype=np.float16)
    out1 = vmadot_hp(vd, const_tile(1), const_tile(1), scales())
    out2 = vmadot_hp(vd.astype("<f2").tobytes(), const_tile(1), const_tile(1), scales().astype("<f2").tobytes())
    assert np.array_equal(out1, out2) and np.all(out1 == 33.5)


# --------------------------------------------------------------------------- encodings

FUNCT7 = {  # (signedness, int4, vscale) -> funct7, from ime2.md section 4
    ("u", True, 0): 0x66, ("u", True, 1): 0x67, ("su", True, 0): 0x6A, ("su", True, 1): 0x6B,
    ("us", True, 0): 0x6C, ("ss", True, 0): 0x68,
    ("u", False, 0): 0x76, ("su", False, 0): 0x7A, ("us", False, 0): 0x7C, ("ss", False, 0): 0x78,
}


def test_encodings_match_the_reference_words():
    assert encode_hp(16, 3, 4, imm3=4, signedness="su") == 0xD441C82B
    assert format_hp(decode_hp(0xD441C82B)) == "vmadotsu.hp v16, v3, v4, v0, 4, i4"
    assert encode_hp(16, 2, 4, imm3=0, signedness="u") == 0xCC41082B
    assert format_hp(decode_hp(0xCC41082B)) == "vmadotu.hp v16, v2, v4, v0, 0, i4"
    for (sg, int4, vs), f7 in FUNCT7.items():
        assert encode_hp(0, 0, 0, signedness=sg, int4=int4, vscale=vs) >> 25 == f7


@given(st.integers(0, 31), st.integers(0, 31), st.integers(0, 31), st.integers(0, 7), st.integers(0, 1),
       st.sampled_from(["u", "us", "su", "ss"]), st.booleans())
def test_encode_decode_round_trip(vd, vs1, vs2, imm3, vscale, sg, int4):
    word = encode_hp(vd, vs1, vs2, imm3=imm3, vscale=vscale, signedness=sg, int4=int4)
    insn = decode_hp(word)
    assert (insn.vd, insn.vs1, insn.vs2, insn.imm3, insn.vscale, insn.signedness, insn.int4) == (
        vd, vs1, vs2, imm3, vscale, sg, int4)


@pytest.mark.parametrize("word, why", [
    (0xE210382B, "not a .hp"),  # IME1 smt.vmadot v16, v0, v1 (bits 28:26 = 000)
    (0xE200302B, "not a .hp"),  # IME1 vmadot (ss)
    (0x4200302B, "not an IME"),  # vnpack4: bit 31 clear
    (0xCC410833, "not an IME"),  # wrong opcode
    (0x8C41082B, "not a .hp"),  # data type 00
])
def test_decode_rejects_other_instructions(word, why):
    with pytest.raises(InstructionError, match=why):
        decode_hp(word)


def test_execute_hp_on_a_register_file_reads_sources_before_writing_vd():
    rng = np.random.default_rng(3)
    regs = rng.integers(0, 256, size=(32, 128), dtype=np.uint8)
    regs[0] = (rng.standard_normal(64) * 0.01).astype("<f2").view(np.uint8)  # v0: finite scales
    regs[1] = (rng.standard_normal(64) * 0.01).astype("<f2").view(np.uint8)
    for k in (16, 3):  # finite accumulators
        regs[k] = (rng.standard_normal(64)).astype("<f2").view(np.uint8)
    word = encode_hp(16, 3, 4, imm3=4, signedness="su")
    out = execute_hp(word, regs)
    want = vmadot_hp(regs[16], regs[3], regs[4], regs[0], 4, signedness="su")
    assert np.array_equal(out[16].view("<f2"), want.astype("<f2"))
    assert np.array_equal(np.delete(out, 16, axis=0), np.delete(regs, 16, axis=0))
    # vd aliasing vs1, scale register v1, i8
    word = encode_hp(3, 3, 5, imm3=2, vscale=1, signedness="u", int4=False)
    out = execute_hp(word, regs, rounding="fused")
    want = vmadot_hp(regs[3], regs[3], regs[5], regs[1], 2, signedness="u", int4=False, rounding="fused")
    assert np.array_equal(out[3].view("<f2"), want.astype("<f2"), equal_nan=True)
