"""The questions a SpacemiT K3 board settles for the IME2 kernel (issue 15, section 2).

QEMU cannot say how the real ``vmadot*.hp`` rounds, nor which nibble order or row grouping the
opensolvers/vllm fork's op uses (shared reference ime2.md, "Open questions"). Each question here
is a set of hand-made inputs whose expected outputs differ between the question's possible
answers (its *values*); running them once on a K3 and finding which value's expectation the
output equals answers the question. The scenarios (``scenarios/test_ime2_board.py``) run them,
record the answer in the report and in ``ime2-board-answers.json``
(:data:`npusim.q4x32.options.ANSWERS_FILE`), from which ``npusim.q4x32`` takes its defaults.

Instruction questions (one ``.hp`` word per case, on a whole register file; run by the native
probe ``npu_ime2_hp_probe --ai-cores`` on the board, by the SIGILL emulator under QEMU):

* ``rounding`` (``unfused``, ``fused``): ``vd + t*scale`` just past a tie ``fp16(t*scale)`` makes;
* ``dot`` (``fp16``, ``exact``): ``tmp`` = 2049 / -2049, not an fp16 value;
* ``overflow`` (``inf``, ``saturate``): ``vd + t*scale`` beyond +/-65504;
* ``subnormals`` (``keep``, ``flush``): a subnormal scale, result and accumulator;
* ``layout`` (``spec`` and eight misreadings, :data:`LAYOUTS`): one non-zero element in vs1 and
  one in vs2, distinct scales 1..64 (v0) and 100..163 (v1).

Op questions (whole GEMMs through an op ``C = op(A, qweight, scales)``; the fork's
``torch.ops._C.ime2_hp_gemm_cpu`` on the board, this project's kernel under QEMU):

* ``qweight_nibbles`` (``adjacent_low_first``, ``ggml``, ``adjacent_high_first``): one non-zero
  nibble per probed column, one-hot activation rows;
* ``m4`` (``grouped``, ``rowwise``): an outlier row inside a 4-row group;
* ``order`` (``hi_lo``, ``lo_hi``): the high-nibble product overflows the fp16 accumulator only
  when it is added first.

Every expectation is computed with ``npusim.q4x32`` under every combination of the options the
question is not about, so a question's answer does not depend on the others'. The register
layout's alternatives and ``subnormals="flush"`` are not ``npusim.q4x32`` options (the kernel
relies on the spec's layout; no flushing is modelled): they are computed here.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import importlib.util
import itertools
import json
import mmap
import os
import platform
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Registers the cases use, as the kernel does (gemm_ime2.c): vd, vs1 (A), vs2 (B).
VD, VS1, VS2 = 16, 8, 12
VLENB = 128
NREGS = 32
#: The answers file of a target (``ime2-hw``: the board's; ``ime2-qemu``: the emulator's, plumbing).
ANSWER_FILES = {"ime2-hw": "ime2-board-answers.json", "ime2-qemu": "ime2-qemu-answers.json"}
ANSWERS_SCHEMA = 1
#: The native board probe (kernels/ime2/driver/ime2_probe.c without the emulator).
HP_PROBE_NAME = "npu_ime2_hp_probe"
HP_PROBE_ENV = "NPU_IME2_HP_PROBE"
HP_PROBE_BUILD = "make -C kernels/ime2 OUT=plugins/vllm_npu/ime2/_build  (on the riscv64 board; or bash ci/setup.sh)"
#: The fork's op and where it comes from.
FORK_OP = "torch.ops._C.ime2_hp_gemm_cpu"
FORK = "the opensolvers/vllm k3-a100-ime2 fork"


class BoardRunError(RuntimeError):
    """A board or QEMU run of the cases failed (probe missing, crash, SIGILL, bad response)."""


class ForkOpMissing(BoardRunError):
    """The fork's ``torch.ops._C.ime2_hp_gemm_cpu`` is not installed here."""


# ---------------------------------------------------------------------------------------------
# questions


@dataclass(frozen=True)
class HpCase:
    """One ``.hp`` word and the register file it runs on (uint8 [32, 128])."""

    name: str
    word: int
    regs: np.ndarray


@dataclass(frozen=True)
class OpCase:
    """One GEMM: A float32 [M, K], qweight uint8 [N, K/32, 16], scales float32 [N, K/32]."""

    name: str
    a: np.ndarray
    qweight: np.ndarray
    scales: np.ndarray


@dataclass(frozen=True)
class Question:
    """A question, its cases, and the expected outputs under each value.

    Attributes:
        name: the answer key (an ``npusim.q4x32`` option name where it is one).
        values: the possible answers; the first is what ``npusim.q4x32`` models by default.
        kind: ``"hp"`` (cases are :class:`HpCase`, outputs compared bit for bit) or ``"op"``
            (cases are :class:`OpCase`, outputs compared by the nearest expectation).
        cases: the inputs.
        expect: value -> the alternative expected outputs (one per combination of the options
            the question is not about): for ``hp`` each a uint16 array [cases, 64] (vd's fp16
            bits), for ``op`` a list of float32 C arrays (one per case).
    """

    name: str
    values: tuple[str, ...]
    kind: str
    cases: tuple
    expect: Callable[[str], list]


def _hp_combos(exclude: str) -> list[dict[str, str]]:
    import npusim.q4x32 as q

    names = [n for n in ("rounding", "dot", "overflow") if n != exclude]
    return [dict(zip(names, vals)) for vals in itertools.product(*(q.OPTIONS[n] for n in names))]


def _f16_fill(value: float | int, *, bits: bool = False) -> np.ndarray:
    """A 128-byte register of 64 equal fp16 values (``bits``: value is the fp16 bit pattern)."""
    h = np.full(64, np.uint16(value)) if bits else np.full(64, value, dtype=np.float16).view(np.uint16)
    return h.astype("<u2").view(np.uint8)


def _tile(entries: Mapping[tuple[int, int], int] | None = None, *, column: Sequence[int] = ()) -> np.ndarray:
    """An 8 x 32 int4 tile: ``entries`` {(row, k): value}, or every row = ``column`` (first elements)."""
    t = np.zeros((8, 32), dtype=np.int64)
    if column:
        t[:, : len(column)] = np.asarray(column)
    for (r, k), v in (entries or {}).items():
        t[r, k] = v
    return t


def _hp_case(name: str, *, vd: np.ndarray, a: np.ndarray, b: np.ndarray, v0: np.ndarray,
             v1: np.ndarray | None = None, signedness: str = "u", imm3: int = 0, vscale: int = 0) -> HpCase:
    import npusim.q4x32 as q

    regs = np.zeros((NREGS, VLENB), dtype=np.uint8)
    regs[VD] = vd
    regs[VS1] = np.frombuffer(q.pack_tile(a), dtype=np.uint8)
    regs[VS2] = np.frombuffer(q.pack_tile(b), dtype=np.uint8)
    regs[0] = v0
    if v1 is not None:
        regs[1] = v1
    word = q.encode_hp(VD, VS1, VS2, imm3=imm3, vscale=vscale, signedness=signedness)  # type: ignore[arg-type]
    return HpCase(name, word, regs)


def _vd_bits(case_regs: np.ndarray, word: int) -> np.ndarray:
    import npusim.q4x32 as q

    return np.ascontiguousarray(case_regs[q.decode_hp(word).vd]).view("<u2").astype(np.uint16)


def _model_hp(cases: Sequence[HpCase], **options: str) -> np.ndarray:
    """vd's fp16 bits after each case under npusim.q4x32.execute_hp: uint16 [cases, 64]."""
    import npusim.q4x32 as q

    return np.stack([_vd_bits(q.execute_hp(c.word, c.regs, **options), c.word) for c in cases])


def _option_question(name: str, cases: Sequence[HpCase]) -> Question:
    """A question about one npusim.q4x32 .hp option: each value under every other combination."""
    import npusim.q4x32 as q

    cases = tuple(cases)

    def expect(value: str) -> list[np.ndarray]:
        return [_model_hp(cases, **{name: value}, **other) for other in _hp_combos(name)]

    return Question(name, q.OPTIONS[name], "hp", cases, expect)


def rounding_question() -> Question:
    """``rounding``: the exact ``vd + t*scale`` lies just past a tie that ``fp16(t*scale)`` creates.

    Case ``tie_2048``: vd = 2048, tmp = 3, scale = 0x3556: ``3 * scale = 1 + 2**-11`` rounds to 1,
    then 2049 ties down to 2048 (unfused); fused, 2049.00049 rounds up to 2050. The others are
    the same at -2048 (signed A), around 1.0 and around 4096.
    """
    s3556 = _f16_fill(0x3556, bits=True)
    cases = [
        _hp_case("tie_2048", vd=_f16_fill(2048), a=_tile(column=[1]), b=_tile(column=[3]), v0=s3556),
        _hp_case("tie_minus_2048", vd=_f16_fill(-2048), a=_tile(column=[15]), b=_tile(column=[3]), v0=s3556,
                 signedness="su"),
        _hp_case("near_1", vd=_f16_fill(1.0), a=_tile(column=[1]), b=_tile(column=[5]),
                 v0=_f16_fill(0x0667, bits=True)),
        _hp_case("near_4096", vd=_f16_fill(4096), a=_tile(column=[1]), b=_tile(column=[5]),
                 v0=_f16_fill(0x3667, bits=True)),
    ]
    return _option_question("rounding", cases)


def dot_question() -> Question:
    """``dot``: vd = 0, ``tmp`` = 2049 (u x u: 9 x 15*15 + 8*3) or -2049 (su), scale 3:
    ``fp16(2049) * 3 = 6144`` against ``fp16(2049 * 3) = 6148``."""
    three = _f16_fill(3.0)
    cases = [
        _hp_case("tmp_2049", vd=_f16_fill(0), a=_tile(column=[15] * 9 + [8]), b=_tile(column=[15] * 9 + [3]),
                 v0=three),
        _hp_case("tmp_minus_2049", vd=_f16_fill(0), a=_tile(column=[8] * 17 + [15]),  # -8 x 17, -1
                 b=_tile(column=[15] * 17 + [9]), v0=three, signedness="su"),
    ]
    return _option_question("dot", cases)


def overflow_question() -> Question:
    """``overflow``: 65504 + 32, 7200 * 16 and -65504 - 32: +/-inf against +/-65504."""
    cases = [
        _hp_case("max_plus_32", vd=_f16_fill(65504), a=_tile(column=[1]), b=_tile(column=[1]), v0=_f16_fill(32)),
        _hp_case("product_115200", vd=_f16_fill(0), a=_tile(column=[15] * 32), b=_tile(column=[15] * 32),
                 v0=_f16_fill(16)),
        _hp_case("min_minus_32", vd=_f16_fill(-65504), a=_tile(column=[15]), b=_tile(column=[1]), v0=_f16_fill(32),
                 signedness="su"),
    ]
    return _option_question("overflow", cases)


def _flush(bits: np.ndarray) -> np.ndarray:
    """fp16 bits with subnormals replaced by zeros of the same sign."""
    b = np.asarray(bits, dtype=np.uint16)
    return np.where((b & 0x7C00) == 0, b & 0x8000, b).astype(np.uint16)


def _flushed_model(cases: Sequence[HpCase], **options: str) -> np.ndarray:
    """The model with subnormal inputs (vd, vscale) and results flushed to zero (FTZ + DAZ)."""
    import npusim.q4x32 as q

    out = []
    for c in cases:
        insn = q.decode_hp(c.word)
        regs = c.regs.copy()
        for r in (insn.vd, insn.vscale):
            regs[r] = _flush(regs[r].view("<u2")).astype("<u2").view(np.uint8)
        out.append(_flush(_vd_bits(q.execute_hp(c.word, regs, **options), c.word)))
    return np.stack(out)


def subnormals_question() -> Question:
    """``subnormals``: ``keep`` (IEEE, the model) or ``flush`` (subnormal inputs and results are 0).

    Cases: scale 2**-20 (a subnormal) times 1; -2**-14 + 1.5 * 2**-14 = 2**-15 (a subnormal result
    of normal operands); an accumulator of 2**-24 plus zero.
    """
    cases = (
        _hp_case("subnormal_scale", vd=_f16_fill(0), a=_tile(column=[1]), b=_tile(column=[1]),
                 v0=_f16_fill(0x0010, bits=True)),
        _hp_case("subnormal_result", vd=_f16_fill(0x8400, bits=True), a=_tile(column=[1]), b=_tile(column=[1]),
                 v0=_f16_fill(0x0600, bits=True)),
        _hp_case("subnormal_accumulator", vd=_f16_fill(0x0001, bits=True), a=_tile(), b=_tile(), v0=_f16_fill(1.0)),
    )

    def expect(value: str) -> list[np.ndarray]:
        model = _model_hp if value == "keep" else _flushed_model
        return [model(cases, **combo) for combo in _hp_combos("")]

    return Question("subnormals", ("keep", "flush"), "hp", cases, expect)


# ---- register layout

LAYOUTS = ("spec", "c_transposed", "a_k_major", "b_k_major", "nibbles_crossed", "signs_swapped", "scale_by_row",
           "imm3_ignored", "vscale_v0_only")


def layout_model(word: int, regs: np.ndarray, layout: str) -> np.ndarray:
    """vd's fp16 bits after ``word`` on ``regs`` if the hardware's register layout were ``layout``.

    ``spec`` is Zvvm_spacemit v0.6 5.4.3 (what ``npusim.q4x32.execute_hp`` implements): A
    row-major in vs1, B column-major in vs2 (element e = byte e//2, low nibble first for even e,
    in both), C row-major, scale ``vscale[imm3*8 + column]``, ``su`` = signed A. The others change
    exactly one of these: C column-major (``c_transposed``), A or B stored K-major (element
    ``k*8 + row``), vs2's nibbles in the opposite order to vs1's, the signed operand swapped, the
    scale indexed by row, ``imm3`` ignored (group 0), bit 25 ignored (always v0).

    Raises:
        ValueError: an unknown ``layout``.
    """
    import npusim.q4x32 as q
    from npusim.q4x32.instr import SIGNEDNESS

    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    insn = q.decode_hp(word)
    a_signed, b_signed = SIGNEDNESS[insn.signedness]
    if layout == "signs_swapped":
        a_signed, b_signed = b_signed, a_signed
    b_bytes = regs[insn.vs2]
    if layout == "nibbles_crossed":
        b_bytes = ((b_bytes >> 4) | (b_bytes << 4)).astype(np.uint8)
    a = q.unpack_tile(regs[insn.vs1], signed=a_signed)
    bt = q.unpack_tile(b_bytes, signed=b_signed)
    if layout == "a_k_major":
        a = a.reshape(32, 8).T
    if layout == "b_k_major":
        bt = bt.reshape(32, 8).T
    tmp = a @ bt.T  # [row, column]
    group = 0 if layout == "imm3_ignored" else insn.imm3
    sreg = 0 if layout == "vscale_v0_only" else insn.vscale
    scales = np.ascontiguousarray(regs[sreg]).view("<f2").astype(np.float16)[8 * group: 8 * group + 8]
    scale = scales[:, None] if layout == "scale_by_row" else scales[None, :]
    vd = np.ascontiguousarray(regs[insn.vd]).view("<f2").astype(np.float16).reshape(8, 8)
    if layout == "c_transposed":
        vd = vd.T  # vd[p] is row p % 8, column p // 8
    out = q.hp_accumulate(vd, tmp, np.broadcast_to(scale, (8, 8)), q.HpMode())
    if layout == "c_transposed":
        out = out.T
    return np.ascontiguousarray(out).reshape(-1).view(np.uint16).astype(np.uint16)


def layout_question() -> Question:
    """``layout``: single non-zero elements whose product lands (or not) where each layout says.

    Scales are distinct integers (v0[i] = i + 1, v1[i] = 100 + i), so an output's value names the
    scale it used; products are small integers, so every rounding option gives the same result.
    """
    v0 = np.arange(1, 65, dtype=np.float16).view(np.uint16).astype("<u2").view(np.uint8)
    v1 = np.arange(100, 164, dtype=np.float16).view(np.uint16).astype("<u2").view(np.uint8)
    zero = _f16_fill(0)
    cases = (
        # row 2, k 5 (odd: high nibbles) x column 6, k 5; scale group 3: spec out[22] = v0[30] = 31
        _hp_case("row2_col6_k5", vd=zero, a=_tile({(2, 5): 1}), b=_tile({(6, 5): 1}), v0=v0, v1=v1, imm3=3),
        # signed A = 15 (-1) x 2, scales from v1 group 1: spec out[41] = -2 * v1[9] = -218
        _hp_case("signed_a_v1", vd=zero, a=_tile({(5, 9): 15}), b=_tile({(1, 9): 2}), v0=v0, v1=v1, imm3=1,
                 vscale=1, signedness="su"),
        # k 4 (even: low nibbles): spec out[3] = v0[3] = 4
        _hp_case("row0_col3_k4", vd=zero, a=_tile({(0, 4): 1}), b=_tile({(3, 4): 1}), v0=v0, v1=v1),
        # A element 32 (spec: row 1, k 0; K-major: row 0, k 4) x B column 3, k 4: spec all zero
        _hp_case("a_element_32", vd=zero, a=_tile({(1, 0): 1}), b=_tile({(3, 4): 1}), v0=v0, v1=v1),
        # B element 35 (spec: column 1, k 3; K-major: column 3, k 4) x A row 0, k 4: spec all zero
        _hp_case("b_element_35", vd=zero, a=_tile({(0, 4): 1}), b=_tile({(1, 3): 1}), v0=v0, v1=v1),
    )

    def expect(value: str) -> list[np.ndarray]:
        return [np.stack([layout_model(c.word, c.regs, value) for c in cases])]

    return Question("layout", LAYOUTS, "hp", cases, expect)


def hp_questions() -> list[Question]:
    """Every instruction question, in report order."""
    return [rounding_question(), dot_question(), overflow_question(), subnormals_question(), layout_question()]


# ---- op questions

NIBBLE_ORDERS = ("adjacent_low_first", "ggml", "adjacent_high_first")


def reinterpret_qweight(qweight: np.ndarray, order: str) -> np.ndarray:
    """The adjacent-low-first qweight an op reading ``qweight`` in ``order`` effectively sees.

    ``adjacent_low_first``: byte b = elements 2b (bits 3:0), 2b+1 (bits 7:4) (ours);
    ``ggml``: byte j = elements j (low), j+16 (high) (``block_q4_0.qs``);
    ``adjacent_high_first``: byte b = elements 2b (bits 7:4), 2b+1 (bits 3:0).

    Raises:
        ValueError: an unknown ``order``.
    """
    from npusim.q4x32 import qweight_from_ggml

    qw = np.asarray(qweight, dtype=np.uint8)
    if order == "adjacent_low_first":
        return qw
    if order == "ggml":
        return qweight_from_ggml(qw)
    if order == "adjacent_high_first":
        return ((qw >> 4) | (qw << 4)).astype(np.uint8)
    raise ValueError(f"order={order!r} is not one of {', '.join(NIBBLE_ORDERS)}")


def _gemm_alternatives(cases: Sequence[OpCase], **fixed: str) -> list[list[np.ndarray]]:
    """ime2_hp_gemm(level="hardware") of every case under every .hp option combination."""
    import npusim.q4x32 as q

    return [[q.ime2_hp_gemm(c.a, c.qweight, c.scales, level="hardware", **combo, **fixed) for c in cases]
            for combo in _hp_combos("")]


def qweight_nibbles_question() -> Question:
    """``qweight_nibbles``: 32 one-hot activation rows (K = 256, N = 32); column 5 has one non-zero
    code in the low nibble of byte 3 and column 9 one in the high nibble of byte 10 of block 0, so
    the output's non-zero rows name the K element each order assigns: (6, 21) adjacent low-first,
    (3, 26) ggml, (7, 20) adjacent high-first."""
    k, n = 256, 32
    a = np.zeros((32, k), dtype=np.float32)
    a[np.arange(32), np.arange(32)] = 1.0
    qweight = np.full((n, k // 32, 16), 0x88, dtype=np.uint8)
    qweight[5, 0, 3] = 0x8F
    qweight[9, 0, 10] = 0xF8
    scales = np.full((n, k // 32), 0.25, dtype=np.float32)
    cases = (OpCase("one_hot_rows", a, qweight, scales),)

    def expect(value: str) -> list[list[np.ndarray]]:
        seen = tuple(OpCase(c.name, c.a, reinterpret_qweight(c.qweight, value), c.scales) for c in cases)
        return _gemm_alternatives(seen)

    return Question("qweight_nibbles", NIBBLE_ORDERS, "op", cases, expect)


def m4_question() -> Question:
    """``m4``: M = 5 and M = 8 with an outlier (1000) in a row of a 4-row group: grouped, the
    group's other rows quantize with the outlier's scale and lose their values; row-wise they
    keep them (K = 256, N = 32, seeded Q4_0 weights)."""
    import npusim.q4x32 as q

    rng = np.random.default_rng(15)
    k, n = 256, 32
    qweight, scales = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    cases = []
    for m, outlier_row in ((5, 1), (8, 6)):
        a = (((np.arange(m * k).reshape(m, k) * 7) % 11 - 5) / 5).astype(np.float32)
        a[outlier_row, 0] = 1000.0
        cases.append(OpCase(f"m{m}_outlier_row{outlier_row}", a, qweight, scales))
    cases_t = tuple(cases)

    def expect(value: str) -> list[list[np.ndarray]]:
        return _gemm_alternatives(cases_t, m4=value)

    return Question("m4", q.OPTIONS["m4"], "op", cases_t, expect)


def order_question() -> Question:
    """``order``: sub-block 0 (all activations -1: codes 15, so hi = -61440, lo = +480 at scale 1)
    leaves d16 = -60960; in sub-block 1 (one +1, thirty-one -1/127) the high-nibble product is
    -7440 and the low-nibble one +6975. High first, d16 passes -65520 and becomes -inf (or
    -65504 saturated); low first it stays finite. M = 1 and M = 5 (a group and a single row)."""
    import npusim.q4x32 as q

    k, n = 256, 32
    codes = np.full((n, k), 8, dtype=np.uint8)
    codes[:, :64] = 15
    codes[:, 32] = 0
    qweight = q.qweight_from_codes(codes)
    scales = np.full((n, k // 32), 0.25, dtype=np.float32)
    cases = []
    for m in (1, 5):
        a = np.zeros((m, k), dtype=np.float32)
        a[:, 0:32] = -1.0
        a[:, 32] = 1.0
        a[:, 33:64] = np.float32(-1 / 127)
        cases.append(OpCase(f"m{m}", a, qweight, scales))
    cases_t = tuple(cases)

    def expect(value: str) -> list[list[np.ndarray]]:
        return _gemm_alternatives(cases_t, order=value)

    return Question("order", q.OPTIONS["order"], "op", cases_t, expect)


def op_questions() -> list[Question]:
    """Every op question, in report order."""
    return [qweight_nibbles_question(), m4_question(), order_question()]


# ---------------------------------------------------------------------------------------------
# comparing


@dataclass(frozen=True)
class Verdict:
    """Which value a run showed.

    Attributes:
        value: the value whose expectation the output matches, or None (none, or several).
        distance: value -> how far the output is from that value's nearest expectation
            (``hp``: outputs whose fp16 bits differ; ``op``: the largest absolute difference,
            inf when an infinity or NaN differs).
        detail: one line for the report.
    """

    value: str | None
    distance: dict[str, float]
    detail: str


def _f16_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fp16 bit patterns equal, any NaN equal to any NaN."""
    nan = lambda x: ((x & 0x7C00) == 0x7C00) & ((x & 0x03FF) != 0)  # noqa: E731
    return (a == b) | (nan(a) & nan(b))


def _hp_distance(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(np.count_nonzero(~_f16_equal(observed, expected)))


def _op_distance(observed: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> float:
    worst = 0.0
    for o, e in zip(observed, expected):
        o64, e64 = np.asarray(o, dtype=np.float64), np.asarray(e, dtype=np.float64)
        if o64.shape != e64.shape:
            return float("inf")
        special = ~np.isfinite(o64) | ~np.isfinite(e64)
        same = (o64 == e64) | (np.isnan(o64) & np.isnan(e64))
        if np.any(special & ~same):
            return float("inf")
        finite = ~special
        if np.any(finite):
            worst = max(worst, float(np.max(np.abs(o64[finite] - e64[finite]))))
    return worst


def expectations(question: Question) -> dict[str, list]:
    """value -> its alternative expected outputs (see :class:`Question`)."""
    return {v: question.expect(v) for v in question.values}


def separation(question: Question, expected: Mapping[str, list] | None = None) -> float:
    """The smallest distance between expectations of two different values: 0 means the cases do
    not tell some two values apart."""
    expected = expected or expectations(question)
    dist = _hp_distance if question.kind == "hp" else _op_distance
    worst = float("inf")
    for x, y in itertools.combinations(question.values, 2):
        for ex in expected[x]:
            for ey in expected[y]:
                worst = min(worst, dist(ex, ey))
    return worst


#: An op output matches a value when it is this many times closer to it than to any other.
OP_MARGIN = 4.0


def classify(question: Question, observed, expected: Mapping[str, list] | None = None) -> Verdict:
    """Which of ``question``'s values ``observed`` shows.

    ``hp``: ``observed`` is vd's fp16 bits per case (uint16 [cases, 64]); a value matches when one
    of its expectations equals it bit for bit (NaN == NaN) and no other value's does. ``op``:
    ``observed`` is the list of C arrays; the value with the nearest expectation matches when it
    is :data:`OP_MARGIN` times nearer than every other (and not infinitely far).
    """
    expected = expected or expectations(question)
    dist = _hp_distance if question.kind == "hp" else _op_distance
    distance = {v: min(dist(observed, e) for e in expected[v]) for v in question.values}
    ranked = sorted(question.values, key=lambda v: distance[v])
    best, rest = ranked[0], ranked[1:]
    nearest_other = min((distance[v] for v in rest), default=float("inf"))
    if question.kind == "hp":
        ok = distance[best] == 0 and nearest_other > 0
    else:
        ok = np.isfinite(distance[best]) and (distance[best] * OP_MARGIN < nearest_other
                                              or (distance[best] == 0 and nearest_other > 0))
    unit = "outputs differ" if question.kind == "hp" else "max |diff|"
    listing = ", ".join(f"{v}: {distance[v]:.6g}" for v in ranked)
    if ok:
        return Verdict(best, distance, f"{question.name} = {best} ({unit}: {listing})")
    return Verdict(None, distance, f"{question.name}: none of {', '.join(question.values)} matches ({unit}: {listing})")


# ---------------------------------------------------------------------------------------------
# running the instruction cases


def _probe_request(cases: Sequence[HpCase]) -> bytes:
    body = b"".join(struct.pack("<I", c.word) + np.ascontiguousarray(c.regs, dtype=np.uint8).tobytes() for c in cases)
    return b"NPUIME2E" + struct.pack("<I", len(cases)) + body


def _probe_response(out: bytes, count: int) -> np.ndarray:
    expect = 12 + count * NREGS * VLENB
    if len(out) != expect or out[:8] != b"NPUIME2F":
        raise BoardRunError(f"probe response is {len(out)} bytes, expected {expect} starting NPUIME2F")
    return np.frombuffer(out[12:], dtype=np.uint8).reshape(count, NREGS, VLENB).copy()


def outputs_of(cases: Sequence[HpCase], files: np.ndarray) -> np.ndarray:
    """vd's fp16 bits per case from the register files a run returned: uint16 [cases, 64]."""
    return np.stack([_vd_bits(f, c.word) for c, f in zip(cases, files)])


def run_hp_qemu(cases: Sequence[HpCase], *, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> np.ndarray:
    """The cases through the SIGILL emulator under QEMU (``npu_ime2_emu_probe``): register files.

    Raises:
        BoardRunError: the probe failed (its stderr in the message).
        npu_conformance.qemu_ime2.QemuDriverNotFound: QEMU or the probe is not built.
    """
    from npu_conformance import qemu_ime2

    words = [c.word for c in cases]
    res = qemu_ime2.run_probe(words, np.stack([c.regs for c in cases]), env=dict(env or {}), timeout=timeout)
    if res.returncode != 0 or res.regs is None:
        raise BoardRunError(f"npu_ime2_emu_probe exited with {res.returncode}: {res.stderr or '(no stderr)'}")
    return res.regs


def hp_probe_path() -> Path:
    """The native probe: ``$NPU_IME2_HP_PROBE``, else ``npu_ime2_hp_probe`` beside the host library
    (where the riscv64 host build, the board build, writes it)."""
    env = os.environ.get(HP_PROBE_ENV)
    if env:
        return Path(env)
    from vllm_npu.ime2 import kernel

    return kernel.LIBRARY_PATH.parent / HP_PROBE_NAME


def hp_probe_missing_reason() -> str | None:
    """None when the native probe exists; else what to build."""
    path = hp_probe_path()
    return None if path.is_file() else f"the native .hp probe {path} is not built: {HP_PROBE_BUILD}"


def run_hp_native(cases: Sequence[HpCase], *, probe: Path | None = None, ai_cores: bool = True,
                  timeout: float = 60.0, env: Mapping[str, str] | None = None,
                  launcher: Sequence[str] = ()) -> np.ndarray:
    """The cases on this machine's own matrix unit (``npu_ime2_hp_probe [--ai-cores]``, no emulator).

    Args:
        cases: the words and register files.
        probe: the probe binary (default :func:`hp_probe_path`).
        ai_cores: pass ``--ai-cores`` (the seed's fence; required on the K3, where the X100 cores
            have no IME2) and require the probe to report ``emulator=no``.
        timeout: seconds for the whole run.
        env: extra environment variables for the probe.
        launcher: a command prefix (tests run the cross-built probe under ``qemu-riscv64-static``).

    Raises:
        BoardRunError: the probe is missing, is an emulating build, could not reach the A100
            cores, died (SIGILL: the core does not execute the word) or answered badly.
    """
    path = probe or hp_probe_path()
    if not path.is_file():
        raise BoardRunError(f"the native .hp probe {path} is not built: {HP_PROBE_BUILD}")
    cmd = [*launcher, str(path)] + (["--ai-cores"] if ai_cores else [])
    try:
        proc = subprocess.run(cmd, input=_probe_request(cases), capture_output=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        raise BoardRunError(f"{' '.join(cmd)} timed out after {timeout} s") from exc
    stderr = proc.stderr.decode("utf-8", "replace").strip()
    if proc.returncode == -signal.SIGILL:
        raise BoardRunError(f"{' '.join(cmd)}: SIGILL: this core does not execute the .hp word ({stderr})")
    if proc.returncode != 0:
        raise BoardRunError(f"{' '.join(cmd)} exited with {proc.returncode}: {stderr or '(no stderr)'}")
    if ai_cores and "emulator=no" not in stderr:
        raise BoardRunError(f"{' '.join(cmd)} is not the native build (no 'emulator=no' on stderr): {stderr}")
    return _probe_response(proc.stdout, len(cases))


# ---------------------------------------------------------------------------------------------
# running the op cases: this project's kernel under QEMU, the fork's op natively


def run_op_qemu(cases: Sequence[OpCase], *, timeout: float = 120.0) -> list[np.ndarray]:
    """Each case through this project's whole op (``npu_ime2_hp_gemm``) under QEMU at VLEN 1024.

    Raises:
        npu_conformance.qemu_ime2.KernelStatusError, QemuDriverError: the run failed.
    """
    from npu_conformance import qemu_ime2

    return [qemu_ime2.run_driver(c.a, c.qweight, c.scales, vlen=1024, path="hp_gemm", timeout=timeout)
            for c in cases]


def _vllm_c_libraries() -> list[Path]:
    """vLLM's ``_C*.so`` files, found without importing vllm (none when vllm is not installed)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("_C*.so"))


def _mentions(path: Path, needle: bytes) -> bool:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(needle) >= 0


_fork_reason: list[str | None] = []


def fork_op_missing_reason() -> str | None:
    """None when ``torch.ops._C.ime2_hp_gemm_cpu`` exists; else one line saying why not.

    A vLLM whose ``_C`` libraries do not contain the op's name cannot register it, so they are
    scanned first (no import, no torch); only a vLLM that names it is imported, in a child
    process (the fork's ``_C`` must load on the X100 cores). Memoized per process.
    """
    if not _fork_reason:
        libs = _vllm_c_libraries()
        if not libs:
            reason: str | None = f"{FORK_OP} does not exist: vllm is not installed ({FORK} provides the op)"
        elif not any(_mentions(p, b"ime2_hp_gemm_cpu") for p in libs):
            reason = (f"{FORK_OP} does not exist: {', '.join(p.name for p in libs)} of the installed vllm do not "
                      f"define it ({FORK} is not installed)")
        else:
            proc = subprocess.run([sys.executable, "-m", "npu_conformance.ime2_op_child", "--op", "fork", "--check"],
                                  capture_output=True, text=True, timeout=300, check=False)
            reason = None if proc.returncode == 0 else (
                f"{FORK_OP} is named in vllm's _C but does not load: {proc.stderr.strip().splitlines()[-1:]}")
        _fork_reason.append(reason)
    return _fork_reason[0]


def run_op_child(op: str, cases: Sequence[OpCase], *, ai_cores: bool, workdir: Path,
                 timeout: float = 600.0) -> list[np.ndarray]:
    """Each case through ``op`` (``"fork"`` or ``"ours"``) in a child process
    (:mod:`npu_conformance.ime2_op_child`), fenced onto the A100 cores when ``ai_cores``.

    Raises:
        ForkOpMissing: the child found no fork op (exit status 3).
        BoardRunError: the child failed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    src, dst = workdir / f"{op}-in.npz", workdir / f"{op}-out.npz"
    arrays = {}
    for i, c in enumerate(cases):
        arrays[f"a{i}"], arrays[f"qweight{i}"], arrays[f"scales{i}"] = c.a, c.qweight, c.scales
    np.savez(src, count=np.int64(len(cases)), **arrays)
    cmd = [sys.executable, "-m", "npu_conformance.ime2_op_child", "--op", op, str(src), str(dst)]
    if ai_cores:
        cmd.append("--ai-cores")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode == 3:
        raise ForkOpMissing(proc.stderr.strip())
    if proc.returncode != 0:
        raise BoardRunError(f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.strip()[-800:]}")
    with np.load(dst) as out:
        return [np.asarray(out[f"c{i}"], dtype=np.float32) for i in range(len(cases))]


# ---------------------------------------------------------------------------------------------
# the answers file


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s directory (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class AnswerBook:
    """The answers file of one target in one report directory (merged, so parallel scenario
    workers each add their own answers).

    Attributes:
        path: ``<report dir>/ime2-board-answers.json`` (``ime2-hw``) or
            ``ime2-qemu-answers.json`` (``ime2-qemu``).
        target: the target name written into the file.
    """

    path: Path
    target: str
    written: list[str] = field(default_factory=list)

    @classmethod
    def for_target(cls, report_dir: Path, target: str) -> AnswerBook:
        """The book of ``target`` (a key of :data:`ANSWER_FILES`).

        Raises:
            KeyError: a target without an answers file.
        """
        return cls(Path(report_dir) / ANSWER_FILES[target], target)

    def record(self, question: Question, verdict: Verdict, *, scenario: str) -> None:
        """Merge ``question``'s answer into the file (``value`` null when none matched)."""
        entry = {"value": verdict.value, "values": list(question.values), "scenario": scenario,
                 "distance": {k: (v if np.isfinite(v) else None) for k, v in verdict.distance.items()},
                 "detail": verdict.detail}
        with _locked(self.path):
            data = self.load() if self.path.is_file() else {}
            if data.get("schema") != ANSWERS_SCHEMA or data.get("target") != self.target:
                data = {"schema": ANSWERS_SCHEMA, "target": self.target, "answers": {}}
            data["machine"] = {"node": platform.node(), "machine": platform.machine()}
            data["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            data["answers"][question.name] = entry
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        self.written.append(question.name)

    def load(self) -> dict:
        """The file's content.

        Raises:
            FileNotFoundError: not written yet.
        """
        return json.loads(self.path.read_text(encoding="utf-8"))
