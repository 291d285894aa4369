"""Byte-exact tile layouts: packed B (``block_q4_0x32``) and the quantized-A rows, both directions.

All multi-byte values are little-endian fp16. Layouts follow llama.cpp's SpacemiT backend at commit
81b0d882ae7f (ime2.md section 2).

Packed B (weights), ``b_packed_size(N, K) = ceil(N/32) * ceil(K/256) * 4608`` bytes::

    [tile t = 0 .. ceil(N/32)-1]          columns 32t .. 32t+31,   stride ceil(K/256) * 4608
      [superblock s = 0 .. ceil(K/256)-1] K 256s .. 256s+255,      stride 4608
        [sub-block j = 0 .. 7]            K 256s+32j .. +31,       stride 576  (block_q4_0x32)
          +0    d[32]      fp16 scale of column c = 32t + c for this sub-block
          +64   qs[32][16] column c's 16 bytes at +64 + 16c: the 32 codes of the sub-block,
                           element 2b in bits 3:0 and 2b+1 in bits 7:4 of byte b, i.e. exactly
                           ``qweight[32t + c, 8s + j, :]``

  ``d = fp16(scales)`` (RNE; beyond 65504 -> inf). Padding (our choice, the fork is not public):
  K is padded to a multiple of 256 and N to a multiple of 32 with sub-blocks/columns whose scale is
  0 and whose bytes are 0x88 (code 8 = weight 0). The GEMM never reads padded columns: columns past
  ``32 * (N // 32)`` go through the scalar tail, which reads the real columns of the partial tile.

Quantized A (activations), ``a_packed_size(M, K) = M * ceil(K/256) * 290`` bytes, the kernel's
workspace: row ``m`` starts at ``m * ceil(K/256) * 290``. A row quantized on its own (one of the
``M % 4`` remainder rows) is ``ceil(K/256)`` blocks of 290 bytes::

    +34j        fp16 rel_j (relative sub-block scale), j = 0..7
    +34j + 2    int8[32] quantized values of sub-block j
    +272 + 2j   fp16 asum8_j = fp16(-sum_j) * 8
    +288        fp16 scale_avg

Four rows quantized together (rows ``4g .. 4g+3`` for ``g < M // 4``) start at row ``4g``'s offset
and are ``ceil(K/256)`` blocks of 1160 = 4 x 290 bytes::

    +136j           fp16 rel_j (shared by the 4 rows); +136j+2 .. +136j+7: 3 unused fp16 slots
    +136j + 8 + 32r int8[32] row r's values of sub-block j, r = 0..3
    +1088 + 16r + 2j fp16 asum8 of row r, sub-block j
    +1152           fp16 scale_avg (shared); +1154 .. +1159: 3 unused fp16 slots

The kernel neither writes nor reads the unused slots; this module writes them as zero (so
serialization is deterministic) and ignores them when decoding.
"""

from __future__ import annotations

import numpy as np

from .checks import QK, check_k
from .errors import LayoutError, ShapeMismatchError
from .quant import ROW_GROUP, SUBBLOCKS, SUPERBLOCK_K, QuantizedA, _check_weight_pair, n_grouped_rows, n_superblocks

__all__ = [
    "A_BLOCK_BYTES",
    "A_GROUP_BLOCK_BYTES",
    "B_BLOCK_BYTES",
    "B_SUPERBLOCK_BYTES",
    "TILE_N",
    "a_packed_size",
    "b_packed_size",
    "b_tiles",
    "pack_a",
    "pack_b",
    "unpack_a",
    "unpack_b",
]

#: Columns per B tile.
TILE_N = 32
#: One ``block_q4_0x32`` (K32 x N32): 64 B of fp16 scales + 512 B of nibbles.
B_BLOCK_BYTES = 2 * TILE_N + TILE_N * QK // 2
#: One ``block_q4_0x32x256`` (K256 x N32).
B_SUPERBLOCK_BYTES = SUBBLOCKS * B_BLOCK_BYTES
#: One activation row per 256 K: ``q8_hp_blk_size(256, true, true)``.
A_BLOCK_BYTES = SUPERBLOCK_K + SUBBLOCKS * 2 + SUBBLOCKS * 2 + 2
#: Four rows quantized together per 256 K.
A_GROUP_BLOCK_BYTES = ROW_GROUP * A_BLOCK_BYTES
#: Offsets inside a 290-byte row block.
A_ROW_SUBBLOCK_STRIDE = 2 + QK  # 34
A_ROW_ASUM_OFFSET = SUBBLOCKS * A_ROW_SUBBLOCK_STRIDE  # 272
A_ROW_SCALE_AVG_OFFSET = A_ROW_ASUM_OFFSET + 2 * SUBBLOCKS  # 288
#: Offsets inside a 1160-byte 4-row block.
A_GROUP_SUBBLOCK_STRIDE = ROW_GROUP * (2 + QK)  # 136
A_GROUP_ASUM_OFFSET = SUBBLOCKS * A_GROUP_SUBBLOCK_STRIDE  # 1088
A_GROUP_SCALE_AVG_OFFSET = A_GROUP_ASUM_OFFSET + 2 * SUBBLOCKS * ROW_GROUP  # 1152

assert B_BLOCK_BYTES == 576 and B_SUPERBLOCK_BYTES == 4608
assert A_BLOCK_BYTES == 290 and A_GROUP_BLOCK_BYTES == 1160
assert A_ROW_ASUM_OFFSET == 272 and A_ROW_SCALE_AVG_OFFSET == 288
assert A_GROUP_ASUM_OFFSET == 1088 and A_GROUP_SCALE_AVG_OFFSET == 1152


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """fp16 values as little-endian bytes, shape ``x.shape + (2,)``."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float16).astype("<f2"))
    return a.view(np.uint8).reshape(a.shape + (2,))


def _bytes_f16(b: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_f16_bytes`: ``(..., 2)`` uint8 -> float16 ``(...)``."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _buffer(buf: object, expected: int, what: str) -> np.ndarray:
    """A read-only uint8 view of ``buf`` after checking its size.

    Raises:
        LayoutError: ``len(buf) != expected``.
    """
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8:
            raise LayoutError(f"{what} must be bytes or a uint8 array, got dtype {buf.dtype}")
        arr = buf.reshape(-1)
    else:
        arr = np.frombuffer(bytes(buf), dtype=np.uint8)  # type: ignore[call-overload]
    if arr.size != expected:
        raise LayoutError(f"{what} must be exactly {expected} bytes, got {arr.size}")
    return arr


def _check_mk(m: int, k: int, what: str) -> None:
    if m < 0:
        raise ShapeMismatchError(f"{what}: M={m} must be >= 0")
    check_k(k, what)


# ---------------------------------------------------------------------------------------------
# B


def b_packed_size(n: int, k: int) -> int:
    """Bytes of packed B for N columns and reduction length K: ``ceil(N/32)*ceil(K/256)*4608``.

    Raises:
        KDimensionError: K is not a positive multiple of 32.
        ShapeMismatchError: N < 1.
    """
    if n < 1:
        raise ShapeMismatchError(f"N={n} must be >= 1")
    _check_mk(0, k, f"b_packed_size(N={n}, K={k})")
    return -(-n // TILE_N) * n_superblocks(k) * B_SUPERBLOCK_BYTES


def pack_b(qweight: np.ndarray, scales: np.ndarray) -> bytes:
    """Serialize ``qweight [N, K/32, 16]`` uint8 and ``scales [N, K/32]`` float32 to packed B.

    Returns:
        ``b_packed_size(N, K)`` bytes in the layout of the module docstring.

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad inputs.
    """
    qweight = np.asarray(qweight)
    scales = np.asarray(scales)
    n, k = _check_weight_pair(qweight, scales)
    kb = k // QK
    s = n_superblocks(k)
    t = -(-n // TILE_N)
    np_, kbp = t * TILE_N, s * SUBBLOCKS
    qw = np.full((np_, kbp, QK // 2), 0x88, dtype=np.uint8)
    qw[:n, :kb] = qweight
    d = np.zeros((np_, kbp), dtype=np.float16)
    with np.errstate(over="ignore"):
        d[:n, :kb] = scales.astype(np.float16)
    out = np.empty((t, s, SUBBLOCKS, B_BLOCK_BYTES), dtype=np.uint8)
    out[..., : 2 * TILE_N] = _f16_bytes(d.reshape(t, TILE_N, s, SUBBLOCKS).transpose(0, 2, 3, 1)).reshape(
        t, s, SUBBLOCKS, 2 * TILE_N
    )
    out[..., 2 * TILE_N:] = qw.reshape(t, TILE_N, s, SUBBLOCKS, QK // 2).transpose(0, 2, 3, 1, 4).reshape(
        t, s, SUBBLOCKS, TILE_N * QK // 2
    )
    data = out.tobytes()
    assert len(data) == b_packed_size(n, k)
    return data


def b_tiles(buf: object, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode packed B into its tile arrays (padding included).

    Returns:
        ``(d, qs)``: float16 ``[T, S, 8, 32]`` column scales and uint8 ``[T, S, 8, 32, 16]`` column
        nibble bytes, ``T = ceil(N/32)``, ``S = ceil(K/256)``.

    Raises:
        LayoutError: ``buf`` is not ``b_packed_size(N, K)`` bytes.
    """
    size = b_packed_size(n, k)
    arr = _buffer(buf, size, f"packed B for N={n}, K={k}").reshape(-1, n_superblocks(k), SUBBLOCKS, B_BLOCK_BYTES)
    d = _bytes_f16(arr[..., : 2 * TILE_N].reshape(arr.shape[:3] + (TILE_N, 2)))
    qs = arr[..., 2 * TILE_N:].reshape(arr.shape[:3] + (TILE_N, QK // 2))
    return d, qs


def unpack_b(buf: object, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_b`.

    Returns:
        ``(qweight, scales)``: uint8 ``[N, K/32, 16]`` and float32 ``[N, K/32]`` holding the fp16
        scales the tile stores (``fp16(scales)``).

    Raises:
        LayoutError: ``buf`` is not ``b_packed_size(N, K)`` bytes.
    """
    d, qs = b_tiles(buf, n, k)
    t, s = d.shape[:2]
    qw = qs.transpose(0, 3, 1, 2, 4).reshape(t * TILE_N, s * SUBBLOCKS, QK // 2)
    sc = d.transpose(0, 3, 1, 2).reshape(t * TILE_N, s * SUBBLOCKS)
    return np.ascontiguousarray(qw[:n, : k // QK]), sc[:n, : k // QK].astype(np.float32)


# ---------------------------------------------------------------------------------------------
# A


def a_packed_size(m: int, k: int) -> int:
    """Bytes of quantized A: ``M * ceil(K/256) * 290``.

    Raises:
        KDimensionError: K is not a positive multiple of 32.
        ShapeMismatchError: M < 0.
    """
    _check_mk(m, k, f"a_packed_size(M={m}, K={k})")
    return m * n_superblocks(k) * A_BLOCK_BYTES


def pack_a(qa: QuantizedA) -> bytes:
    """Serialize :class:`~npusim.q4x32.quant.QuantizedA` to the kernel's workspace bytes.

    Returns:
        ``a_packed_size(M, K)`` bytes: the 4-row groups (1160-byte blocks), then the remainder rows
        (290-byte blocks), in row order (layout in the module docstring).
    """
    m, s, ng = qa.m, qa.n_superblocks, qa.n_grouped
    g = ng // ROW_GROUP
    q = qa.q.view(np.uint8).reshape(m, s, SUBBLOCKS, QK)
    rel_b, asum_b, sa_b = _f16_bytes(qa.rel), _f16_bytes(qa.asum8), _f16_bytes(qa.scale_avg)

    grp = np.zeros((g, s, A_GROUP_BLOCK_BYTES), dtype=np.uint8)
    if g:
        sub = grp[..., :A_GROUP_ASUM_OFFSET].reshape(g, s, SUBBLOCKS, A_GROUP_SUBBLOCK_STRIDE)
        sub[..., 0:2] = rel_b[:ng:ROW_GROUP]  # the group's shared rel_j (row 4g's copy)
        sub[..., 2 * ROW_GROUP:] = q[:ng].reshape(g, ROW_GROUP, s, SUBBLOCKS, QK).transpose(0, 2, 3, 1, 4).reshape(
            g, s, SUBBLOCKS, ROW_GROUP * QK
        )
        grp[..., A_GROUP_ASUM_OFFSET:A_GROUP_SCALE_AVG_OFFSET] = (
            asum_b[:ng].reshape(g, ROW_GROUP, s, SUBBLOCKS, 2).transpose(0, 2, 1, 3, 4).reshape(g, s, -1)
        )
        grp[..., A_GROUP_SCALE_AVG_OFFSET:A_GROUP_SCALE_AVG_OFFSET + 2] = sa_b[:ng:ROW_GROUP]

    ns = m - ng
    one = np.empty((ns, s, A_BLOCK_BYTES), dtype=np.uint8)
    if ns:
        sub = one[..., :A_ROW_ASUM_OFFSET].reshape(ns, s, SUBBLOCKS, A_ROW_SUBBLOCK_STRIDE)
        sub[..., 0:2] = rel_b[ng:]
        sub[..., 2:] = q[ng:]
        one[..., A_ROW_ASUM_OFFSET:A_ROW_SCALE_AVG_OFFSET] = asum_b[ng:].reshape(ns, s, -1)
        one[..., A_ROW_SCALE_AVG_OFFSET:] = sa_b[ng:]
    data = grp.tobytes() + one.tobytes()
    assert len(data) == a_packed_size(m, qa.k)
    return data


def unpack_a(buf: object, m: int, k: int, *, m4: str | None = None) -> QuantizedA:
    """Inverse of :func:`pack_a`: decode ``M`` rows of quantized A for reduction length ``K``.

    With ``m4="grouped"`` rows ``0 .. 4*(M//4)-1`` are decoded as 4-row groups and the rest as
    single rows (the same split :func:`~npusim.q4x32.quant.quantize_a` makes); with
    ``"rowwise"`` every row as a single row; None: the current default. Unused slots are ignored.

    Raises:
        LayoutError: ``buf`` is not ``a_packed_size(M, K)`` bytes.
        KDimensionError: K is not a positive multiple of 32.
        OptionError: an unknown ``m4``.
    """
    size = a_packed_size(m, k)
    arr = _buffer(buf, size, f"quantized A for M={m}, K={k}")
    s = n_superblocks(k)
    ng = n_grouped_rows(m, m4)
    g = ng // ROW_GROUP
    q = np.empty((m, s, SUBBLOCKS, QK), dtype=np.uint8)
    rel = np.empty((m, s, SUBBLOCKS), dtype=np.float16)
    asum8 = np.empty((m, s, SUBBLOCKS), dtype=np.float16)
    sa = np.empty((m, s), dtype=np.float16)

    grp = arr[: ng * s * A_BLOCK_BYTES].reshape(g, s, A_GROUP_BLOCK_BYTES)
    if g:
        sub = grp[..., :A_GROUP_ASUM_OFFSET].reshape(g, s, SUBBLOCKS, A_GROUP_SUBBLOCK_STRIDE)
        rel[:ng] = np.repeat(_bytes_f16(sub[..., 0:2]), ROW_GROUP, axis=0)
        q[:ng] = sub[..., 2 * ROW_GROUP:].reshape(g, s, SUBBLOCKS, ROW_GROUP, QK).transpose(0, 3, 1, 2, 4).reshape(
            ng, s, SUBBLOCKS, QK
        )
        asum8[:ng] = _bytes_f16(
            grp[..., A_GROUP_ASUM_OFFSET:A_GROUP_SCALE_AVG_OFFSET]
            .reshape(g, s, ROW_GROUP, SUBBLOCKS, 2)
            .transpose(0, 2, 1, 3, 4)
        ).reshape(ng, s, SUBBLOCKS)
        sa[:ng] = np.repeat(_bytes_f16(grp[..., A_GROUP_SCALE_AVG_OFFSET:A_GROUP_SCALE_AVG_OFFSET + 2]), ROW_GROUP, 0)

    ns = m - ng
    one = arr[ng * s * A_BLOCK_BYTES:].reshape(ns, s, A_BLOCK_BYTES)
    if ns:
        sub = one[..., :A_ROW_ASUM_OFFSET].reshape(ns, s, SUBBLOCKS, A_ROW_SUBBLOCK_STRIDE)
        rel[ng:] = _bytes_f16(sub[..., 0:2])
        q[ng:] = sub[..., 2:]
        asum8[ng:] = _bytes_f16(one[..., A_ROW_ASUM_OFFSET:A_ROW_SCALE_AVG_OFFSET].reshape(ns, s, SUBBLOCKS, 2))
        sa[ng:] = _bytes_f16(one[..., A_ROW_SCALE_AVG_OFFSET:])
    return QuantizedA(
        q=q.view(np.int8).reshape(m, s * SUPERBLOCK_K), rel=rel, asum8=asum8, scale_avg=sa, k=k, n_grouped=ng
    )
