"""Quantization: weights to Q4_0 (the op's ``qweight``/``scales``), activations to the HP int8 rows.

Weights (the op's input format; ime2.md section 2.1 and the seed):

* ``qweight``: uint8 ``[N, K/32, 16]``. Byte ``b`` of block ``qweight[n, kb]`` holds the 4-bit
  codes of K elements ``32*kb + 2*b`` (bits 3:0, low nibble) and ``32*kb + 2*b + 1`` (bits 7:4,
  high nibble): "adjacent pairs, low nibble first", the order of ONNX Runtime's MatMulNBits and of
  the IME Int4 register layout, so the 16 bytes go into the B tile unchanged. (ggml's
  ``block_q4_0`` pairs element ``j`` with ``j + 16`` instead; see :func:`qweight_from_ggml`.)
* Codes are unsigned ``q`` in 0..15 with the implicit symmetric zero point 8:
  ``w = (q - 8) * scales[n, kb]``.
* :func:`quantize_q4_0` follows ggml's ``quantize_row_q4_0_ref`` (in fp32): ``max`` = the signed
  value of largest magnitude in the block (first one on ties), ``d = max / -8``,
  ``id = 1/d`` (0 when ``d == 0``), ``q = min(15, trunc(x*id + 8.5))``. ``d`` is negative when the
  largest-magnitude value is positive, as in ggml.

Activations (the kernel's ``quantize_a_row_i8_hp`` / ``quantize_a_4row_i8_hp``, RVV path for
``vlenb == 128``; ime2.md section 2.2), per row and 256-K superblock, all fp32 unless stated:

* K is zero-padded to a multiple of 256 (our choice for K % 256 != 0: the padded sub-blocks have
  scale 0, values 0 and sum 0, and count in ``scale_avg``'s division by 8).
* ``scale_j = max|a| / 127`` over sub-block ``j`` (32 values; over the 4 rows x 32 values when the
  row is in a 4-row group), ``scale_avg = (((0 + scale_0) + scale_1) + ... + scale_7) / 8``,
  ``fac = 1/scale_avg`` (0 when ``scale_avg == 0``), stored ``rel_j = fp16(fp32(scale_j * fac))``
  and ``fp16(scale_avg)``.
* ``rep_j = 1/scale_j`` (0 when ``scale_j == 0``), ``q = int8(sat16(rne(fp32(a * rep_j))))``:
  ``vfncvt.x.f.w`` (RNE, saturating to int16, NaN -> 32767) then ``vncvt`` (keeps the low 8 bits).
  In practice ``|a * rep_j| <= 127.00003`` so this equals ggml-ref's clamp to [-128, 127].
* ``asum8_j = fp16(fp16(-sum_j q) * 8)`` (the folded zero point, ``fp16(-sum)*8``).
* Rows ``0 .. 4*(M//4) - 1`` are quantized in groups of 4 that share ``scale_j``/``rel_j`` and
  ``scale_avg`` (``quantize_a_4row_i8_hp``); the ``M % 4`` remaining rows one at a time
  (``quantize_a_row_i8_hp``), as ggml's ``ime.cpp`` does. So a row quantizes differently in a
  full group of 4 than as a remainder row. That is option ``m4="grouped"`` (the built-in
  default); ``m4="rowwise"`` quantizes every row alone (:mod:`npusim.q4x32.options`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import QK, check_dtype, check_finite, check_k, check_ndim
from .errors import ShapeMismatchError
from .fp16 import mul_f16, to_f16
from .options import resolve

__all__ = [
    "SUPERBLOCK_K",
    "QuantizedA",
    "codes_from_qweight",
    "dequantize_q4_0",
    "qweight_from_codes",
    "qweight_from_ggml",
    "qweight_to_ggml",
    "quantize_a",
    "quantize_q4_0",
]

#: K elements per superblock (8 sub-blocks of 32 share one fp16 ``scale_avg``).
SUPERBLOCK_K = 256
#: Sub-blocks per superblock.
SUBBLOCKS = SUPERBLOCK_K // QK
#: Rows quantized together (``quantize_a_4row_i8_hp``).
ROW_GROUP = 4

_F32 = np.float32


def n_superblocks(k: int) -> int:
    """Superblocks per row: ``ceil(K / 256)``."""
    return -(-k // SUPERBLOCK_K)


# ---------------------------------------------------------------------------------------------
# weights


def _check_weight_pair(qweight: np.ndarray, scales: np.ndarray) -> tuple[int, int]:
    """Validate ``qweight [N, K/32, 16]`` uint8 and ``scales [N, K/32]`` float32; return (N, K)."""
    check_dtype("qweight", qweight, (np.uint8,))
    check_ndim("qweight", qweight, 3, "[N, K/32, 16]")
    if qweight.shape[2] != QK // 2:
        raise ShapeMismatchError(
            f"qweight must have shape [N, K/32, 16] (16 bytes = 32 nibbles per block), got {tuple(qweight.shape)}"
        )
    check_dtype("scales", scales, (np.float32,))
    check_ndim("scales", scales, 2, "[N, K/32]")
    if scales.shape != qweight.shape[:2]:
        raise ShapeMismatchError(
            f"scales has shape {tuple(scales.shape)} but qweight {tuple(qweight.shape)} needs scales "
            f"[N, K/32] = {tuple(qweight.shape[:2])}"
        )
    check_k(qweight.shape[1] * QK, f"qweight of shape {tuple(qweight.shape)}")
    check_finite("scales", scales)
    return qweight.shape[0], qweight.shape[1] * QK


def quantize_q4_0(w: np.ndarray, *, fp16_scales: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a weight matrix to Q4_0 in the op's input format.

    Args:
        w: float16/float32/float64 array ``[N, K]`` (an ``nn.Linear`` weight: N outputs, K
            inputs), K a multiple of 32, all finite. Computed in fp32 like ggml.
        fp16_scales: round the returned scales to fp16 values (what ggml stores and what the
            tile holds). The codes are computed with the fp32 scale either way, as ggml does.

    Returns:
        ``(qweight, scales)``: uint8 ``[N, K/32, 16]`` (adjacent-pair nibbles, low first) and
        float32 ``[N, K/32]``.

    Raises:
        DTypeError: ``w`` is not a float16/32/64 array.
        ShapeMismatchError: ``w`` is not 2-D.
        KDimensionError: K is not a positive multiple of 32.
        NonFiniteError: ``w`` holds NaN/Inf.
    """
    w = np.asarray(w)
    check_dtype("w", w, (np.float16, np.float32, np.float64))
    check_ndim("w", w, 2, "[N, K]")
    n, k = w.shape
    check_k(k, f"w of shape {(n, k)}")
    check_finite("w", w)
    x = w.astype(_F32).reshape(n, k // QK, QK)
    idx = np.argmax(np.abs(x), axis=-1)  # first index of the largest |x|, as ggml's strict '<'
    vmax = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    d = (vmax / _F32(-8)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    t = (x * inv[..., None]).astype(_F32) + _F32(8.5)
    codes = np.minimum(np.trunc(t), 15).astype(np.uint8)
    scales = d.astype(np.float16).astype(_F32) if fp16_scales else d
    return qweight_from_codes(codes.reshape(n, k)), scales


def codes_from_qweight(qweight: np.ndarray) -> np.ndarray:
    """Unpack ``qweight [N, K/32, 16]`` into unsigned codes ``[N, K]`` (0..15), K order."""
    n, kb, _ = qweight.shape
    codes = np.empty((n, kb, QK), dtype=np.uint8)
    codes[..., 0::2] = qweight & 0x0F
    codes[..., 1::2] = qweight >> 4
    return codes.reshape(n, kb * QK)


def qweight_from_codes(codes: np.ndarray) -> np.ndarray:
    """Pack codes ``[N, K]`` (0..15) into ``qweight [N, K/32, 16]`` (element 2b low, 2b+1 high)."""
    n, k = codes.shape
    c = np.asarray(codes, dtype=np.uint8).reshape(n, k // QK, QK)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def dequantize_q4_0(qweight: np.ndarray, scales: np.ndarray, *, dtype: type = np.float32) -> np.ndarray:
    """The inverse of :func:`quantize_q4_0`: ``w[n, k] = (q[n, k] - 8) * scales[n, k // 32]``.

    Computed in float64 and cast to ``dtype``.

    Raises:
        DTypeError, ShapeMismatchError, KDimensionError, NonFiniteError: bad ``qweight``/``scales``.
    """
    qweight = np.asarray(qweight)
    scales = np.asarray(scales)
    n, k = _check_weight_pair(qweight, scales)
    codes = codes_from_qweight(qweight).reshape(n, k // QK, QK).astype(np.float64) - 8.0
    return (codes * scales.astype(np.float64)[..., None]).reshape(n, k).astype(dtype)


def qweight_from_ggml(qs: np.ndarray) -> np.ndarray:
    """Convert ggml ``block_q4_0.qs`` bytes ``[N, K/32, 16]`` to the op's ``qweight``.

    ggml: ``qs[j]`` low nibble = element j, high nibble = element j + 16. The op (and the tile):
    byte b = elements 2b (low) and 2b + 1 (high).
    """
    qs = np.asarray(qs, dtype=np.uint8)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, 16..31
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)


def qweight_to_ggml(qweight: np.ndarray) -> np.ndarray:
    """Inverse of :func:`qweight_from_ggml`."""
    qweight = np.asarray(qweight, dtype=np.uint8)
    codes = np.empty(qweight.shape[:-1] + (QK,), dtype=np.uint8)
    codes[..., 0::2] = qweight & 0x0F
    codes[..., 1::2] = qweight >> 4
    return codes[..., :16] | (codes[..., 16:] << 4)


# ---------------------------------------------------------------------------------------------
# activations


@dataclass(frozen=True)
class QuantizedA:
    """Activation rows quantized as the HP kernel quantizes them (the values it reads).

    Attributes:
        q: int8 ``[M, Kp]`` quantized values, ``Kp = 256 * ceil(K/256)`` (zero-padded).
        rel: float16 ``[M, S, 8]`` relative sub-block scales ``fp16(scale_j / scale_avg)``
            (rows of a 4-row group hold the group's shared value).
        asum8: float16 ``[M, S, 8]`` folded zero points ``fp16(-sum q) * 8``.
        scale_avg: float16 ``[M, S]`` superblock scales (shared within a 4-row group).
        k: the unpadded K.
        n_grouped: rows ``0 .. n_grouped-1`` were quantized in groups of 4 (``4 * (M // 4)``).
    """

    q: np.ndarray
    rel: np.ndarray
    asum8: np.ndarray
    scale_avg: np.ndarray
    k: int
    n_grouped: int

    @property
    def m(self) -> int:
        """Number of rows."""
        return int(self.q.shape[0])

    @property
    def n_superblocks(self) -> int:
        """Superblocks per row, ``S = ceil(K/256)``."""
        return int(self.scale_avg.shape[1])

    @property
    def grouped(self) -> np.ndarray:
        """bool ``[M]``: True for rows quantized in a 4-row group (and run by the m4 kernel)."""
        return np.arange(self.m) < self.n_grouped

    def dequantize(self) -> np.ndarray:
        """float64 ``[M, K]``: ``q * fp16(rel_j) * fp16(scale_avg)``, the values the kernel uses."""
        m, s = self.m, self.n_superblocks
        scale = self.rel.astype(np.float64) * self.scale_avg.astype(np.float64)[..., None]
        vals = self.q.reshape(m, s, SUBBLOCKS, QK).astype(np.float64) * scale[..., None]
        return vals.reshape(m, s * SUPERBLOCK_K)[:, : self.k]


def _rvv_narrow_to_i8(v: np.ndarray) -> np.ndarray:
    """``vfncvt.x.f.w`` (fp32 -> int16, RNE, saturating, NaN -> 32767) then ``vncvt`` to int8."""
    with np.errstate(invalid="ignore"):
        r = np.rint(v.astype(np.float64))
    r = np.where(np.isnan(r), 32767.0, np.clip(r, -32768.0, 32767.0)).astype(np.int64)
    return (r & 0xFF).astype(np.uint8).view(np.int8)


def n_grouped_rows(m: int, m4: str | None = None) -> int:
    """Rows quantized (and computed) in 4-row groups: ``4 * (M // 4)`` for ``m4="grouped"``, 0 for
    ``"rowwise"``; None: the current default.

    Raises:
        OptionError: an unknown ``m4``.
    """
    return ROW_GROUP * (m // ROW_GROUP) if resolve("m4", m4) == "grouped" else 0


def quantize_a(a: np.ndarray, *, m4: str | None = None) -> QuantizedA:
    """Quantize activation rows exactly as the kernel does (see the module docstring).

    Args:
        a: float32 ``[M, K]``, K a positive multiple of 32, all finite. M may be 0.
        m4: ``"grouped"`` (4-row groups first, then single rows) or ``"rowwise"`` (every row
            alone); None: the current default (:mod:`npusim.q4x32.options`).

    Returns:
        :class:`QuantizedA`; :func:`npusim.q4x32.layout.pack_a` serializes it to the kernel's
        ``M * ceil(K/256) * 290`` bytes.

    Raises:
        DTypeError: ``a`` is not float32.
        ShapeMismatchError: ``a`` is not 2-D.
        KDimensionError: K is not a positive multiple of 32.
        NonFiniteError: ``a`` holds NaN/Inf.
        OptionError: an unknown ``m4``.
    """
    a = np.asarray(a)
    check_dtype("A", a, (np.float32,))
    check_ndim("A", a, 2, "[M, K]")
    m, k = a.shape
    check_k(k, f"A of shape {(m, k)}")
    check_finite("A", a)
    ng = n_grouped_rows(m, m4)
    s = n_superblocks(k)
    kp = s * SUPERBLOCK_K
    ap = np.zeros((m, kp), dtype=_F32)
    ap[:, :k] = a
    blocks = ap.reshape(m, s, SUBBLOCKS, QK)

    amax = np.abs(blocks).max(axis=-1) if m else np.zeros((0, s, SUBBLOCKS), _F32)  # [M, S, 8]
    g = ng // ROW_GROUP
    if g:
        gmax = amax[:ng].reshape(g, ROW_GROUP, s, SUBBLOCKS).max(axis=1)
        amax = amax.copy()
        amax[:ng] = np.repeat(gmax, ROW_GROUP, axis=0)

    scale = (amax / _F32(127)).astype(_F32)  # scale_j, fp32
    ssum = np.zeros((m, s), dtype=_F32)
    for j in range(SUBBLOCKS):  # sequential fp32 sum j = 0..7, like the C loop
        ssum = (ssum + scale[..., j]).astype(_F32)
    scale_avg = (ssum / _F32(SUBBLOCKS)).astype(_F32)
    with np.errstate(divide="ignore"):
        fac = np.where(scale_avg != 0, _F32(1) / np.where(scale_avg != 0, scale_avg, _F32(1)), _F32(0)).astype(_F32)
        rep = np.where(scale != 0, _F32(1) / np.where(scale != 0, scale, _F32(1)), _F32(0)).astype(_F32)
    rel = to_f16((scale * fac[..., None]).astype(_F32))
    with np.errstate(over="ignore", invalid="ignore"):
        v = (blocks * rep[..., None]).astype(_F32)
    q = _rvv_narrow_to_i8(v)  # [M, S, 8, 32]
    qsum = q.astype(np.int64).sum(axis=-1)
    asum8 = mul_f16(to_f16(-qsum), np.float16(8.0))
    return QuantizedA(
        q=q.reshape(m, kp),
        rel=rel,
        asum8=asum8,
        scale_avg=to_f16(scale_avg),
        k=k,
        n_grouped=ng,
    )
