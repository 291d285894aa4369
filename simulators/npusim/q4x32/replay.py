"""Instruction-by-instruction replay of the HP kernels over the packed bytes (slow; an oracle).

:func:`replay_gemm` reads quantized A and packed B as the kernels do (byte offsets, not the
decoded arrays of :mod:`npusim.q4x32.layout`), builds the register images of every
``vmadotsu.hp`` / ``vmadotu.hp`` and runs them through :func:`npusim.q4x32.instr.vmadot_hp`
one at a time, with the fp32 accumulations done per scalar step. It follows
``gemm_kernel_i8i4_hp_m1`` and ``gemm_kernel_i8i4_hp_m4`` (llama.cpp 81b0d882):

* m1 (one row): ``v0`` = ``vpack(sc, sc16)``: groups 0-3 hold ``sc`` for columns 0..31 and
  groups 4-7 ``sc16``; the high-nibble plane is multiplied with ``vmadotsu.hp v16+g, A_hi,
  v4+g, v0, 4+g`` and then the low plane with ``vmadotu.hp v16+g, A_lo, v4+g, v0, g``; the row
  is row 0 of the 8-row A tile.
* m4 (four rows sharing scales): ``v0`` = ``vpack(sc16, sc)`` (groups 0-3 ``sc16``, 4-7 ``sc``),
  ``vmadotsu.hp ... v0, g`` then ``vmadotu.hp ... v0, 4+g``; rows 0..3 of the A tile.
* ``v4+g`` (g = 0..3) is bytes ``64 + 128g .. 64 + 128g + 127`` of the 576-byte B block: columns
  8g..8g+7, column-major, as ``vl4r.v`` loads them.

Rows of the A tile that the kernels never read back (1..7 in m1, 4..7 in m4) are zero here; an
output row depends only on its own A row, so they cannot change the rows that are read. The
GEMM's vectorized ``hardware`` level must equal this replay bit for bit (a test checks it).
"""

from __future__ import annotations

import numpy as np

from .fp16 import mul_f16
from .instr import pack_tile, vmadot_hp
from .layout import (
    A_BLOCK_BYTES,
    A_GROUP_ASUM_OFFSET,
    A_GROUP_BLOCK_BYTES,
    A_GROUP_SCALE_AVG_OFFSET,
    A_GROUP_SUBBLOCK_STRIDE,
    A_ROW_ASUM_OFFSET,
    A_ROW_SCALE_AVG_OFFSET,
    A_ROW_SUBBLOCK_STRIDE,
    B_BLOCK_BYTES,
    B_SUPERBLOCK_BYTES,
    TILE_N,
    a_packed_size,
    b_packed_size,
)
from .options import HpMode, resolve
from .quant import ROW_GROUP, SUBBLOCKS, n_grouped_rows, n_superblocks

__all__ = ["replay_gemm"]

_F32 = np.float32
_QK = 32


def _f16_at(buf: np.ndarray, off: int, count: int = 1) -> np.ndarray:
    return buf[off: off + 2 * count].view("<f2").astype(np.float16)


def _a_registers(rows: list[np.ndarray]) -> tuple[bytes, bytes]:
    """(hi plane, lo plane) register images for up to 8 int8 rows of 32 values."""
    hi = np.zeros((8, _QK), dtype=np.int64)
    lo = np.zeros((8, _QK), dtype=np.int64)
    for r, q in enumerate(rows):
        hi[r] = q.astype(np.int64) >> 4
        lo[r] = q.astype(np.int64) & 0x0F
    return pack_tile(hi), pack_tile(lo)


def _run_tile(
    a_buf: np.ndarray, a_off: int, grouped: bool, b_buf: np.ndarray, b_off: int, s_count: int, mode: HpMode, order: str
) -> np.ndarray:
    """One kernel invocation on one full 32-column tile: fp32 [rows, 32]."""
    rows = ROW_GROUP if grouped else 1
    blk_bytes = A_GROUP_BLOCK_BYTES if grouped else A_BLOCK_BYTES
    acc = np.zeros((rows, TILE_N), dtype=_F32)
    kw = {"rounding": mode.rounding, "dot": mode.dot, "overflow": mode.overflow}
    for s in range(s_count):
        a0 = a_off + s * blk_bytes
        if grouped:
            sa = _F32(_f16_at(a_buf, a0 + A_GROUP_SCALE_AVG_OFFSET)[0])
        else:
            sa = _F32(_f16_at(a_buf, a0 + A_ROW_SCALE_AVG_OFFSET)[0])
        vd = [np.zeros(64, dtype=np.float16) for _ in range(4)]
        for j in range(SUBBLOCKS):
            b0 = b_off + s * B_SUPERBLOCK_BYTES + j * B_BLOCK_BYTES
            d = _f16_at(b_buf, b0, TILE_N)
            vb = [b_buf[b0 + 64 + 128 * g: b0 + 64 + 128 * (g + 1)] for g in range(4)]
            if grouped:
                sub = a0 + j * A_GROUP_SUBBLOCK_STRIDE
                rel = _f16_at(a_buf, sub)[0]
                qrows = [a_buf[sub + 8 + 32 * r: sub + 8 + 32 * (r + 1)].view(np.int8) for r in range(rows)]
                asum = [_f16_at(a_buf, a0 + A_GROUP_ASUM_OFFSET + 16 * r + 2 * j)[0] for r in range(rows)]
                sc = mul_f16(d, rel)
                sc16 = mul_f16(d, mul_f16(rel, np.float16(16)))
                v0 = np.concatenate([sc16, sc])
                imm_hi, imm_lo = 0, 4
            else:
                sub = a0 + j * A_ROW_SUBBLOCK_STRIDE
                rel = _f16_at(a_buf, sub)[0]
                qrows = [a_buf[sub + 2: sub + 2 + _QK].view(np.int8)]
                asum = [_f16_at(a_buf, a0 + A_ROW_ASUM_OFFSET + 2 * j)[0]]
                sc = mul_f16(d, rel)
                sc16 = mul_f16(sc, np.float16(16))
                v0 = np.concatenate([sc, sc16])
                imm_hi, imm_lo = 4, 0
            for r in range(rows):  # vfwmacc.vf: acc += sa * fp16(sc * asum8), one fp32 rounding
                zp = mul_f16(sc, asum[r]).astype(_F32)
                with np.errstate(over="ignore", invalid="ignore"):
                    acc[r] = (acc[r] + sa * zp).astype(_F32)
            a_hi, a_lo = _a_registers(qrows)
            batches = [("su", a_hi, imm_hi), ("u", a_lo, imm_lo)]
            if order == "lo_hi":
                batches.reverse()
            for signedness, va, imm in batches:
                for g in range(4):
                    vd[g] = vmadot_hp(vd[g], va, vb[g], v0, imm + g, signedness=signedness, int4=True, **kw)
        for r in range(rows):
            d16 = np.concatenate([vd[g][8 * r: 8 * r + 8] for g in range(4)]).astype(_F32)
            with np.errstate(over="ignore", invalid="ignore"):
                acc[r] = (acc[r] + sa * d16).astype(_F32)
    return acc


def _tail_row(
    a_buf: np.ndarray, a_off: int, grouped: bool, r: int, b_buf: np.ndarray, b_off: int, cols: int, s_count: int
) -> np.ndarray:
    """The scalar tail for row r of a kernel block, over the first ``cols`` columns of a tile."""
    acc = np.zeros(cols, dtype=_F32)
    blk_bytes = A_GROUP_BLOCK_BYTES if grouped else A_BLOCK_BYTES
    for s in range(s_count):
        a0 = a_off + s * blk_bytes
        for j in range(SUBBLOCKS):
            if grouped:
                sub = a0 + j * A_GROUP_SUBBLOCK_STRIDE
                rel = _f16_at(a_buf, sub)[0]
                q = a_buf[sub + 8 + 32 * r: sub + 8 + 32 * (r + 1)].view(np.int8)
                asum = _f16_at(a_buf, a0 + A_GROUP_ASUM_OFFSET + 16 * r + 2 * j)[0]
                sa = _f16_at(a_buf, a0 + A_GROUP_SCALE_AVG_OFFSET)[0]
            else:
                sub = a0 + j * A_ROW_SUBBLOCK_STRIDE
                rel = _f16_at(a_buf, sub)[0]
                q = a_buf[sub + 2: sub + 2 + _QK].view(np.int8)
                asum = _f16_at(a_buf, a0 + A_ROW_ASUM_OFFSET + 2 * j)[0]
                sa = _f16_at(a_buf, a0 + A_ROW_SCALE_AVG_OFFSET)[0]
            b0 = b_off + s * B_SUPERBLOCK_BYTES + j * B_BLOCK_BYTES
            d = _f16_at(b_buf, b0, TILE_N)
            qs = b_buf[b0 + 64: b0 + B_BLOCK_BYTES].reshape(TILE_N, 16)
            codes = np.empty((TILE_N, _QK), dtype=np.int64)
            codes[:, 0::2] = qs & 0x0F
            codes[:, 1::2] = qs >> 4
            for c in range(cols):
                dot = int(np.dot(q.astype(np.int64), codes[c]))
                t = _F32(_F32(dot) + _F32(asum))
                coef = _F32(_F32(_F32(sa) * _F32(rel)) * _F32(d[c]))
                with np.errstate(over="ignore", invalid="ignore"):
                    acc[c] = _F32(acc[c] + _F32(coef * t))
    return acc


def replay_gemm(
    a_bytes: bytes,
    b_bytes: bytes,
    m: int,
    k: int,
    n: int,
    *,
    rounding: str | None = None,
    dot: str | None = None,
    overflow: str | None = None,
    order: str | None = None,
    m4: str | None = None,
) -> np.ndarray:
    """Run the HP GEMM instruction by instruction on packed bytes.

    Args:
        a_bytes: quantized A, :func:`npusim.q4x32.layout.pack_a` (``a_packed_size(M, K)`` bytes).
        b_bytes: packed B, :func:`npusim.q4x32.layout.pack_b` (``b_packed_size(N, K)`` bytes).
        m, k, n: the GEMM shape.
        rounding, dot, overflow, order: as for :func:`npusim.q4x32.gemm.ime2_hp_gemm`.
        m4: how ``a_bytes`` groups its rows (``"grouped"``: 4-row groups first, as
            :func:`~npusim.q4x32.layout.pack_a` wrote them) and which kernel runs them.
        Options left None take the current default.

    Returns:
        float32 ``[M, N]``.

    Raises:
        LayoutError: a buffer has the wrong size.
        OptionError: an unknown option.
    """
    from .errors import LayoutError

    mode = HpMode.current(rounding, dot, overflow)
    order = resolve("order", order)
    a_buf = np.frombuffer(bytes(a_bytes), dtype=np.uint8)
    b_buf = np.frombuffer(bytes(b_bytes), dtype=np.uint8)
    if a_buf.size != a_packed_size(m, k):
        raise LayoutError(f"quantized A for M={m}, K={k} must be {a_packed_size(m, k)} bytes, got {a_buf.size}")
    if b_buf.size != b_packed_size(n, k):
        raise LayoutError(f"packed B for N={n}, K={k} must be {b_packed_size(n, k)} bytes, got {b_buf.size}")
    s_count = n_superblocks(k)
    row_stride = s_count * A_BLOCK_BYTES
    tile_stride = s_count * B_SUPERBLOCK_BYTES
    out = np.zeros((m, n), dtype=_F32)
    n_grouped = n_grouped_rows(m, m4)
    starts = [(r, True) for r in range(0, n_grouped, ROW_GROUP)] + [(r, False) for r in range(n_grouped, m)]
    for r0, grouped in starts:
        rows = ROW_GROUP if grouped else 1
        for t in range(-(-n // TILE_N)):
            cols = min(TILE_N, n - t * TILE_N)
            if cols == TILE_N:
                out[r0: r0 + rows, t * TILE_N: (t + 1) * TILE_N] = _run_tile(
                    a_buf, r0 * row_stride, grouped, b_buf, t * tile_stride, s_count, mode, order
                )
            else:
                for r in range(rows):
                    out[r0 + r, t * TILE_N: t * TILE_N + cols] = _tail_row(
                        a_buf, r0 * row_stride, grouped, r, b_buf, t * tile_stride, cols, s_count
                    )
    return out
