"""The IME2 ``.hp`` matrix instructions (``vmadot{u,us,su,}.hp``, i4 and i8) on register images.

One instruction, at VLEN 1024 (``vlenb`` = 128 bytes, the A100 cores of the SpacemiT K3),
following Zvvm_spacemit v0.6 section 5.4.3 as summarised in ime2.md section 4:

* ``.hp`` tiles use lambda = 8, SEW = 16, MUL_C = 1. Shapes (M x K x N):

  ============ ============================ ============================ ======================
  form         vs1 = A (row-major)          vs2 = B^T (column-major B)   vd = C (row-major)
  ============ ============================ ============================ ======================
  i4           8 rows x 32 int4 = 128 B     8 columns x 32 int4 = 128 B  8 x 8 fp16 = 128 B
  i8           8 rows x 16 int8 = 128 B     8 columns x 16 int8 = 128 B  8 x 8 fp16 = 128 B
  ============ ============================ ============================ ======================

  Element ``e`` of an i4 register is byte ``e // 2``, bits 3:0 for even ``e`` and bits 7:4 for
  odd ``e`` ("Int4 packed low nibble first"); A row ``r`` is elements ``r*K .. r*K+K-1`` and B
  column ``c`` is elements ``c*K .. c*K+K-1``. The fp16 registers (vd, v0/v1) are 64
  little-endian fp16 values; output ``p`` is row ``p // 8``, column ``p % 8``.
* ``vscale`` is v0 or v1 (instruction bit 25): 8 groups of 8 fp16; ``imm3`` (bits 14:12) picks
  the group, and output ``p`` uses ``vscale[imm3*8 + p % 8]`` (one scale per output column).
* For each output: ``tmp = sum_q A[p//8, q] * B[q, p%8]`` in int32, then
  ``vd[p] += (fp16)tmp * scale`` in fp16. How that is rounded is open: see
  :mod:`npusim.q4x32.options` (``rounding``, ``dot``, ``overflow``).
* Signedness: ``u`` = unsigned A x unsigned B, ``us`` = unsigned A x signed B, ``su`` = signed
  A x unsigned B, ``ss`` (mnemonic without suffix, ``vmadot.hp``) = signed x signed.

Encoding (custom-1 opcode 0x2B): bit 31 = 1, bits 30:29 = data type (``10`` i4, ``11`` i8),
bits 28:26 = ``011`` u / ``110`` us / ``101`` su / ``100`` ss, bit 25 = vscale (0 = v0,
1 = v1), 24:20 vs2, 19:15 vs1, 14:12 imm3, 11:7 vd. ``.insn r 0x2b, imm3, funct7, vd, vs1, vs2``
with funct7 = bits 31:25 (e.g. ``0x6A`` = ``vmadotsu.hp`` i4 with v0).

This module is the oracle for the C-side SIGILL emulator: :func:`execute_hp` decodes a word and
applies it to a 32 x 128-byte register file, exactly as the emulator must.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import InstructionError
from .fp16 import add_f16, fma_f16, mul_f16, to_f16
from .options import HpMode

__all__ = [
    "OPCODE",
    "SIGNEDNESS",
    "VLENB",
    "HpInstruction",
    "decode_hp",
    "encode_hp",
    "execute_hp",
    "format_hp",
    "hp_accumulate",
    "pack_tile",
    "unpack_tile",
    "vmadot_hp",
]

#: Vector register length in bytes at VLEN 1024 (the only VLEN the ``.hp`` tiles are defined for).
VLENB = 128
#: Major opcode of the IME instructions (custom-1).
OPCODE = 0x2B
#: Output tile is 8 x 8 fp16.
TILE_M = TILE_N = 8

Signedness = Literal["u", "us", "su", "ss"]
#: signedness -> (A signed, B signed)
SIGNEDNESS: dict[str, tuple[bool, bool]] = {
    "u": (False, False),
    "us": (False, True),
    "su": (True, False),
    "ss": (True, True),
}
_FUNCT_OF = {"u": 0b011, "us": 0b110, "su": 0b101, "ss": 0b100}
_SIGN_OF = {v: k for k, v in _FUNCT_OF.items()}


def tile_k(int4: bool) -> int:
    """K of one ``.hp`` tile: 32 for i4, 16 for i8."""
    return 32 if int4 else 16


# ---------------------------------------------------------------------------------------------
# register images


def _register_bytes(x: object, name: str) -> np.ndarray:
    """A 128-byte register image as a uint8 array of shape (128,).

    Raises:
        InstructionError: ``x`` is not 128 bytes (bytes-like or a uint8 array of 128 elements).
    """
    if isinstance(x, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(x), dtype=np.uint8)
    else:
        arr = np.asarray(x)
        if arr.dtype != np.uint8:
            raise InstructionError(f"{name} must be 128 bytes or a uint8 array, got dtype {arr.dtype}")
        arr = arr.reshape(-1)
    if arr.size != VLENB:
        raise InstructionError(f"{name} must be {VLENB} bytes (one VLEN-1024 register), got {arr.size}")
    return arr


def _f16_register(x: object, name: str) -> np.ndarray:
    """A register of 64 fp16 values: a float16 array of 64 elements or 128 little-endian bytes.

    Raises:
        InstructionError: wrong size or dtype.
    """
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _register_bytes(x, name).view("<f2").astype(np.float16)
    arr = np.asarray(x)
    if arr.dtype == np.uint8:
        return _register_bytes(arr, name).view("<f2").astype(np.float16)
    if arr.dtype != np.float16:
        raise InstructionError(f"{name} must hold 64 fp16 values (float16 array or 128 bytes), got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size != VLENB // 2:
        raise InstructionError(f"{name} must hold {VLENB // 2} fp16 values, got {arr.size}")
    return arr


def pack_tile(tile: np.ndarray, *, int4: bool = True) -> bytes:
    """Serialize an 8 x K integer tile into a 128-byte register image.

    Args:
        tile: integers, shape (8, 32) for i4 (values -8..15: the low 4 bits are stored) or
            (8, 16) for i8 (values -128..255: the low 8 bits are stored). For ``vs1`` pass A
            (rows = output rows); for ``vs2`` pass B transposed (rows = output columns).
        int4: i4 (two elements per byte, low nibble first) or i8.

    Returns:
        128 bytes.

    Raises:
        InstructionError: wrong shape or a value outside the representable range.
    """
    k = tile_k(int4)
    t = np.asarray(tile)
    if t.shape != (TILE_M, k) or not np.issubdtype(t.dtype, np.integer):
        raise InstructionError(f"tile must be an integer array of shape (8, {k}), got {t.dtype} {t.shape}")
    lo, hi = (-8, 15) if int4 else (-128, 255)
    if t.size and (t.min() < lo or t.max() > hi):
        raise InstructionError(f"tile values must lie in [{lo}, {hi}] for {'i4' if int4 else 'i8'}")
    flat = t.astype(np.int64).reshape(-1)
    if int4:
        nib = flat & 0xF
        return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()
    return (flat & 0xFF).astype(np.uint8).tobytes()


def unpack_tile(register: object, *, int4: bool = True, signed: bool = False) -> np.ndarray:
    """Decode a 128-byte register image into an 8 x K int64 tile (inverse of :func:`pack_tile`).

    Args:
        register: 128 bytes (bytes-like or uint8 array).
        int4: i4 (8 x 32) or i8 (8 x 16).
        signed: two's-complement elements (-8..7 / -128..127) instead of unsigned (0..15 / 0..255).

    Raises:
        InstructionError: not a 128-byte register.
    """
    reg = _register_bytes(register, "register").astype(np.int64)
    if int4:
        el = np.empty(2 * VLENB, dtype=np.int64)
        el[0::2] = reg & 0xF
        el[1::2] = reg >> 4
        if signed:
            el = np.where(el >= 8, el - 16, el)
    else:
        el = np.where(reg >= 128, reg - 256, reg) if signed else reg
    return el.reshape(TILE_M, tile_k(int4))


# ---------------------------------------------------------------------------------------------
# arithmetic


def hp_accumulate(vd: np.ndarray, tmp: np.ndarray, scale: np.ndarray, mode: HpMode | None = None) -> np.ndarray:
    """The per-output arithmetic of every ``.hp`` instruction: ``vd + (fp16)tmp * scale``.

    Elementwise and broadcasting, so the GEMM model applies it to whole tiles at once.

    Args:
        vd: fp16 accumulator values.
        tmp: the int32 dot products (integers, |tmp| < 2**31).
        scale: fp16 scales.
        mode: the open rounding details (:class:`~npusim.q4x32.options.HpMode`); None: the
            current defaults (:func:`npusim.q4x32.options.get_defaults`).

    Returns:
        float16 array: ``unfused`` = ``fp16(vd + fp16(t * scale))``, ``fused`` =
        ``fp16(vd + t * scale)`` with ``t = fp16(tmp)`` (``dot="fp16"``) or ``t = tmp``
        (``dot="exact"``); each fp16 rounding is RNE, overflowing to inf or clamping to 65504
        per ``mode.overflow``.
    """
    if mode is None:
        mode = HpMode.current()
    sat = mode.saturate
    t = to_f16(tmp, saturate=sat) if mode.dot == "fp16" else np.asarray(tmp, dtype=np.float64)
    if mode.rounding == "unfused":
        return add_f16(vd, mul_f16(t, scale, saturate=sat), saturate=sat)
    return fma_f16(t, scale, vd, saturate=sat)


def vmadot_hp(
    vd: object,
    vs1: object,
    vs2: object,
    vscale: object,
    imm3: int = 0,
    *,
    signedness: Signedness = "u",
    int4: bool = True,
    rounding: str | None = None,
    dot: str | None = None,
    overflow: str | None = None,
) -> np.ndarray:
    """Execute one ``vmadot{signedness}.hp`` on register images and return the new ``vd``.

    Args:
        vd: accumulator, 64 fp16 (float16 array or 128 little-endian bytes); row-major 8 x 8.
        vs1: A tile, 128 bytes: 8 rows x 32 int4 (``int4``) or 8 rows x 16 int8.
        vs2: B tile, 128 bytes, column-major: 8 columns x 32 int4 or 8 columns x 16 int8.
        vscale: the scale register (v0 or v1), 64 fp16 = 8 groups of 8.
        imm3: scale group, 0..7; output ``p`` uses ``vscale[imm3*8 + p % 8]``.
        signedness: ``"u"`` (vmadotu.hp), ``"us"``, ``"su"`` (vmadotsu.hp: signed A x unsigned
            B) or ``"ss"`` (vmadot.hp).
        int4: i4 form (K = 32 per tile) or i8 form (K = 16).
        rounding, dot, overflow: the open details, see :mod:`npusim.q4x32.options`; None: the
            current default.

    Returns:
        The new vd: float16 array of 64 values (``vd.tobytes()`` is the register image).

    Raises:
        InstructionError: a register of the wrong size/dtype, ``imm3`` outside 0..7 or an
            unknown ``signedness``.
        OptionError: an unknown rounding option.
    """
    mode = HpMode.current(rounding, dot, overflow)
    if signedness not in SIGNEDNESS:
        raise InstructionError(f"signedness={signedness!r} is not one of 'u', 'us', 'su', 'ss'")
    if not isinstance(imm3, (int, np.integer)) or not 0 <= int(imm3) <= 7:
        raise InstructionError(f"imm3={imm3!r} must be an integer in 0..7 (the scale group)")
    acc = _f16_register(vd, "vd")
    scales = _f16_register(vscale, "vscale")
    a_signed, b_signed = SIGNEDNESS[signedness]
    a = unpack_tile(_register_bytes(vs1, "vs1"), int4=int4, signed=a_signed)
    bt = unpack_tile(_register_bytes(vs2, "vs2"), int4=int4, signed=b_signed)
    tmp = a @ bt.T  # int64 (8 rows, 8 columns); |tmp| <= 16 * 255 * 255 fits int32
    group = scales[int(imm3) * 8: int(imm3) * 8 + 8]
    out = hp_accumulate(acc.reshape(TILE_M, TILE_N), tmp, group[None, :], mode)
    return out.reshape(-1)


# ---------------------------------------------------------------------------------------------
# encoding


@dataclass(frozen=True)
class HpInstruction:
    """A decoded ``.hp`` instruction (all register numbers 0..31)."""

    vd: int
    vs1: int
    vs2: int
    vscale: int  # 0 = v0, 1 = v1
    imm3: int
    signedness: Signedness
    int4: bool

    @property
    def mnemonic(self) -> str:
        """E.g. ``vmadotsu.hp`` (``vmadot.hp`` for signed x signed)."""
        suffix = "" if self.signedness == "ss" else self.signedness
        return f"vmadot{suffix}.hp"


def encode_hp(
    vd: int, vs1: int, vs2: int, *, imm3: int = 0, vscale: int = 0, signedness: Signedness = "u", int4: bool = True
) -> int:
    """The 32-bit instruction word of a ``.hp`` instruction.

    Raises:
        InstructionError: a register outside 0..31, ``vscale`` not 0/1, ``imm3`` outside 0..7 or
            an unknown ``signedness``.
    """
    for name, reg in (("vd", vd), ("vs1", vs1), ("vs2", vs2)):
        if not 0 <= int(reg) <= 31:
            raise InstructionError(f"{name}=v{reg} is not a vector register (v0..v31)")
    if vscale not in (0, 1):
        raise InstructionError(f"vscale={vscale!r} must be 0 (v0) or 1 (v1)")
    if not 0 <= int(imm3) <= 7:
        raise InstructionError(f"imm3={imm3!r} must be in 0..7")
    if signedness not in _FUNCT_OF:
        raise InstructionError(f"signedness={signedness!r} is not one of 'u', 'us', 'su', 'ss'")
    funct7 = (1 << 6) | ((0b10 if int4 else 0b11) << 4) | (_FUNCT_OF[signedness] << 1) | vscale
    return (funct7 << 25) | (int(vs2) << 20) | (int(vs1) << 15) | (int(imm3) << 12) | (int(vd) << 7) | OPCODE


def decode_hp(word: int) -> HpInstruction:
    """Decode a 32-bit word as a ``.hp`` instruction.

    Raises:
        InstructionError: the word is not an IME2 ``.hp`` instruction (wrong opcode, bit 31
            clear, data type not i4/i8, or funct bits 28:26 not one of the four ``.hp`` forms).
    """
    w = int(word)
    if not 0 <= w < 1 << 32:
        raise InstructionError(f"instruction word {word!r} is not a 32-bit value")
    if w & 0x7F != OPCODE or not (w >> 31) & 1:
        raise InstructionError(f"0x{w:08x} is not an IME instruction (opcode 0x{w & 0x7F:02x}, bit31={w >> 31})")
    dt = (w >> 29) & 0b11
    funct = (w >> 26) & 0b111
    if dt not in (0b10, 0b11) or funct not in _SIGN_OF:
        raise InstructionError(f"0x{w:08x} is not a .hp instruction (data type {dt:02b}, bits 28:26 {funct:03b})")
    return HpInstruction(
        vd=(w >> 7) & 0x1F,
        vs1=(w >> 15) & 0x1F,
        vs2=(w >> 20) & 0x1F,
        vscale=(w >> 25) & 1,
        imm3=(w >> 12) & 0b111,
        signedness=_SIGN_OF[funct],  # type: ignore[arg-type]
        int4=dt == 0b10,
    )


def format_hp(insn: HpInstruction) -> str:
    """Assembly text, e.g. ``vmadotsu.hp v16, v3, v4, v0, 4, i4``."""
    return (
        f"{insn.mnemonic} v{insn.vd}, v{insn.vs1}, v{insn.vs2}, v{insn.vscale}, {insn.imm3}, "
        f"{'i4' if insn.int4 else 'i8'}"
    )


def execute_hp(word: int, vregs: np.ndarray, **mode: str | None) -> np.ndarray:
    """Apply one ``.hp`` instruction word to a register file, as a SIGILL emulator would.

    Args:
        word: the 32-bit instruction.
        vregs: uint8 array of shape (32, 128): v0..v31 at VLEN 1024. Not modified.
        **mode: ``rounding``, ``dot``, ``overflow`` (see :mod:`npusim.q4x32.options`; unset or
            None: the current default).

    Returns:
        A new (32, 128) uint8 register file with ``vd`` replaced (all sources are read before
        ``vd`` is written, so ``vd`` may alias a source).

    Raises:
        InstructionError: not a ``.hp`` word, or ``vregs`` not (32, 128) uint8.
    """
    insn = decode_hp(word)
    regs = np.asarray(vregs)
    if regs.dtype != np.uint8 or regs.shape != (32, VLENB):
        raise InstructionError(f"vregs must be a uint8 array of shape (32, {VLENB}), got {regs.dtype} {regs.shape}")
    new_vd = vmadot_hp(
        regs[insn.vd], regs[insn.vs1], regs[insn.vs2], regs[insn.vscale], insn.imm3,
        signedness=insn.signedness, int4=insn.int4, **mode,
    )
    out = regs.copy()
    out[insn.vd] = new_vd.astype("<f2").view(np.uint8)
    return out
