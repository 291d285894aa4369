"""``ime2_hp_gemm``: the Q4_0 x 32 HP GEMM ``C[M, N] = A[M, K] @ W[N, K]^T`` at two fidelity levels.

``level="exact"``
    float64 math on the quantized operands: ``C = a_deq @ w_deq.T`` with
    ``a_deq = q * fp16(rel_j) * fp16(scale_avg)`` (A quantized exactly as the kernel does it,
    4-row groups included) and ``w_deq = (code - 8) * fp16(scales)`` (the tile's fp16 scales).
    Isolates the kernel's accumulation error; one BLAS ``dgemm``.

``level="hardware"``
    The kernel's arithmetic, rounding where it rounds (ime2.md section 3.3, llama.cpp
    ``gemm_kernel_i8i4_hp_m1`` / ``_m4`` at 81b0d882): rows ``0 .. 4*(M//4)-1`` by the m4 kernel
    (4 rows at a time), the ``M % 4`` remaining rows by the m1 kernel, 32 columns per tile as four
    8-column N groups. Per row, column and superblock ``s`` (``sa = fp16 scale_avg``)::

        acc = 0.0f                                                    # fp32
        for s: d16 = 0 (fp16)
          for j in 0..7:
            sc   = fp16(d_b * rel_j)                                  # vfmul.vf e16
            sc16 = fp16(sc * 16)            (m1)  | fp16(d_b * fp16(rel_j * 16))  (m4)
            zp   = fp16(sc * asum8_j)
            acc  = fp32(acc + sa * zp)                                # vfwmacc.vf: exact product
            d16  = hp(d16, dot(a_hi, q), sc16)                        # vmadotsu.hp, i4
            d16  = hp(d16, dot(a_lo, q), sc)                          # vmadotu.hp,  i4
          acc = fp32(acc + sa * d16)                                  # vfwmacc.vf
        C = acc

    with ``a = 16 * a_hi + a_lo`` (``a_hi = a >> 4`` signed -8..7, ``a_lo = a & 15``), ``q`` the
    unsigned nibble codes and ``hp`` the instruction arithmetic of
    :func:`npusim.q4x32.instr.hp_accumulate` (options ``rounding``, ``dot``, ``overflow``; the
    instruction order is ``order``). Columns past ``32 * (N // 32)`` use the scalar tail (the
    seed's formula, evaluated in fp32 left to right, per superblock ``s`` and sub-block ``j``)::

        acc = fp32(acc + fp32(fp32(fp32(sa * rel_j) * d_b) * fp32(dot + asum8_j)))

    with ``dot = sum int8 x code`` (exact) and the stored ``asum8_j``; see :func:`scalar_tail_gemm`.

An fp16 accumulator can overflow (|sum| > 65504 gives inf at ``overflow="inf"``) with large
weight scales or outlier activations, exactly as on the device (ime2.md section 3.4); ``exact``
does not. Both levels share the kernel's activation quantizer, so its limits show at both:
activations so large that ``scale_avg`` exceeds fp16 (mean sub-block max|a| > 127 * 65504) give
inf/NaN, and tiny ones (mean sub-block max|a| < 127 * 2**-14 ~ 7.8e-3) make ``scale_avg`` an fp16
subnormal and lose relative precision, as the kernel's fp16 ``scale_avg`` would.
"""

from __future__ import annotations

import numpy as np

from .checks import QK, check_dtype, check_finite, check_k, check_ndim
from .errors import ShapeMismatchError
from .fp16 import mul_f16
from .instr import hp_accumulate
from .layout import TILE_N, pack_b
from .options import LEVELS, HpMode, check_option, resolve
from .quant import SUBBLOCKS, QuantizedA, _check_weight_pair, codes_from_qweight, n_superblocks, quantize_a

__all__ = ["PreparedWeight", "ime2_hp_gemm", "ime2_hp_gemm_prepared", "prepare_weight", "scalar_tail_gemm"]

_F32 = np.float32
#: byte -> (low nibble - 8, high nibble - 8) as float64
_BYTE_LUT = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=1).astype(np.float64) - 8.0
#: Soft cap on elements per intermediate array of the hardware model (memory / cache use).
_CHUNK_ELEMENTS = 1 << 21


class PreparedWeight:
    """Validated weights in the forms the GEMM levels use, built once per weight matrix.

    The seed's benchmark packs each weight once and then times the GEMM; this object plays that
    role for the simulator. Attributes are read-only by convention.

    Attributes:
        n, k: output columns and reduction length.
        qweight: uint8 ``[N, K/32, 16]``; scales: float32 ``[N, K/32]`` (the inputs).
        codes: uint8 ``[N, Kp]`` unsigned codes, K padded to a multiple of 256 with code 8.
        d16: float16 ``[N, Kp/32]`` the tile's scales ``fp16(scales)`` (0 in the padding).
    """

    def __init__(self, qweight: np.ndarray, scales: np.ndarray) -> None:
        qweight = np.asarray(qweight)
        scales = np.asarray(scales)
        self.n, self.k = _check_weight_pair(qweight, scales)
        self.qweight = qweight
        self.scales = scales
        self._codes: np.ndarray | None = None
        self._d16: np.ndarray | None = None
        self._w_deq: np.ndarray | None = None
        self._packed: bytes | None = None

    @property
    def codes(self) -> np.ndarray:
        """uint8 ``[N, Kp]`` unsigned codes, K padded to a multiple of 256 with code 8 (cached)."""
        if self._codes is None:
            kp = n_superblocks(self.k) * SUBBLOCKS * QK
            codes = np.full((self.n, kp), 8, dtype=np.uint8)
            codes[:, : self.k] = codes_from_qweight(self.qweight)
            self._codes = codes
        return self._codes

    @property
    def d16(self) -> np.ndarray:
        """float16 ``[N, Kp/32]``: the tile's scales ``fp16(scales)``, 0 in the padding (cached)."""
        if self._d16 is None:
            d16 = np.zeros((self.n, n_superblocks(self.k) * SUBBLOCKS), dtype=np.float16)
            with np.errstate(over="ignore"):
                d16[:, : self.k // QK] = self.scales.astype(np.float16)
            self._d16 = d16
        return self._d16

    @property
    def w_deq(self) -> np.ndarray:
        """float64 ``[N, K]``: ``(code - 8) * fp16(scale)`` (cached; used by ``level="exact"``)."""
        if self._w_deq is None:
            kb = self.k // QK
            vals = _BYTE_LUT[self.qweight].reshape(self.n, kb, QK)  # (lo - 8, hi - 8) per byte
            with np.errstate(over="ignore"):
                vals *= self.scales.astype(np.float16).astype(np.float64)[..., None]
            self._w_deq = vals.reshape(self.n, self.k)
        return self._w_deq

    @property
    def packed(self) -> bytes:
        """The packed B tile bytes (:func:`npusim.q4x32.layout.pack_b`, cached)."""
        if self._packed is None:
            self._packed = pack_b(self.qweight, self.scales)
        return self._packed


def prepare_weight(qweight: np.ndarray, scales: np.ndarray) -> PreparedWeight:
    """Validate and prepare ``qweight [N, K/32, 16]`` uint8 and ``scales [N, K/32]`` float32.

    Raises:
        DTypeError: ``qweight`` not uint8 or ``scales`` not float32.
        ShapeMismatchError: the shapes disagree.
        KDimensionError: K = 32 * qweight.shape[1] is not positive.
        NonFiniteError: ``scales`` holds NaN/Inf.
    """
    return PreparedWeight(qweight, scales)


def _check_a(a: np.ndarray, k_w: int | None) -> np.ndarray:
    a = np.asarray(a)
    check_dtype("A", a, (np.float32,))
    check_ndim("A", a, 2, "[M, K]")
    check_k(a.shape[1], f"A of shape {tuple(a.shape)}")
    if k_w is not None and a.shape[1] != k_w:
        raise ShapeMismatchError(
            f"A has K={a.shape[1]} (shape {tuple(a.shape)}) but the weights have K={k_w} "
            f"(qweight [N, K/32, 16] with K/32={k_w // QK}); they must agree"
        )
    return a


def ime2_hp_gemm(
    a: np.ndarray,
    qweight: np.ndarray,
    scales: np.ndarray,
    *,
    level: str = "exact",
    rounding: str | None = None,
    dot: str | None = None,
    overflow: str | None = None,
    order: str | None = None,
    m4: str | None = None,
) -> np.ndarray:
    """``C[M, N] = A @ dequant(qweight, scales)^T`` as the IME2 HP kernel computes it.

    Args:
        a: float32 ``[M, K]`` activations (M >= 0), finite.
        qweight: uint8 ``[N, K/32, 16]`` Q4_0 codes (see :mod:`npusim.q4x32.quant` for the
            nibble order). K must be a multiple of 32; it need not be a multiple of 256.
        scales: float32 ``[N, K/32]``, finite.
        level: ``"exact"`` or ``"hardware"`` (module docstring).
        rounding, dot, overflow: the open ``.hp`` details (``hardware`` only), see
            :mod:`npusim.q4x32.options`.
        order: ``"hi_lo"`` (the kernels' order) or ``"lo_hi"`` (``hardware`` only).
        m4: ``"grouped"`` (4-row groups, then single rows) or ``"rowwise"`` (both levels: it
            decides how A is quantized).
        Every option left None takes the current default (:func:`npusim.q4x32.get_defaults`).

    Returns:
        float32 ``[M, N]``.

    Raises:
        OptionError: unknown ``level``/``rounding``/``dot``/``overflow``/``order``/``m4``.
        DTypeError: ``a``/``scales`` not float32 or ``qweight`` not uint8.
        ShapeMismatchError: ``a`` not 2-D, or the shapes of ``a``, ``qweight``, ``scales``
            disagree.
        KDimensionError: K not a positive multiple of 32.
        NonFiniteError: NaN/Inf in ``a`` or ``scales``.
    """
    _check_a(a, None)  # A's own errors first, before the weights are prepared
    w = prepare_weight(qweight, scales)
    return ime2_hp_gemm_prepared(a, w, level=level, rounding=rounding, dot=dot, overflow=overflow,
                                 order=order, m4=m4)


def ime2_hp_gemm_prepared(
    a: np.ndarray,
    w: PreparedWeight,
    *,
    level: str = "exact",
    rounding: str | None = None,
    dot: str | None = None,
    overflow: str | None = None,
    order: str | None = None,
    m4: str | None = None,
) -> np.ndarray:
    """:func:`ime2_hp_gemm` with weights prepared once by :func:`prepare_weight`.

    Raises:
        The same errors as :func:`ime2_hp_gemm` for ``a`` and the options.
    """
    check_option("level", level, LEVELS)
    mode = HpMode.current(rounding, dot, overflow)
    order = resolve("order", order)
    m4 = resolve("m4", m4)
    a = _check_a(a, w.k)
    check_finite("A", a)
    qa = quantize_a(a, m4=m4)
    if level == "exact":
        return _exact(qa, w)
    return _hardware(qa, w, mode, order)


def _exact(qa: QuantizedA, w: PreparedWeight) -> np.ndarray:
    if qa.m == 0:
        return np.zeros((0, w.n), dtype=_F32)
    return (qa.dequantize() @ w.w_deq.T).astype(_F32)


def _planes(qa: QuantizedA) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sub-block A operands as float32 ``[S*8, M, 32]``: (a_hi, a_lo, a)."""
    m, nb = qa.m, qa.n_superblocks * SUBBLOCKS
    q = qa.q.reshape(m, nb, QK).transpose(1, 0, 2)
    hi = (q >> 4).astype(_F32)  # arithmetic shift: signed high nibble -8..7
    lo = (q & 0x0F).astype(_F32)
    return hi, lo, q.astype(_F32)


def _chunk_columns(n_cols: int, per_column: int) -> int:
    step = max(TILE_N, (_CHUNK_ELEMENTS // max(per_column, 1)) // TILE_N * TILE_N)
    return min(step, max(n_cols, TILE_N))


def _hardware(qa: QuantizedA, w: PreparedWeight, mode: HpMode, order: str) -> np.ndarray:
    m, s = qa.m, qa.n_superblocks
    nb = s * SUBBLOCKS
    out = np.zeros((m, w.n), dtype=_F32)
    if m == 0:
        return out
    n_full = TILE_N * (w.n // TILE_N)
    hi, lo, _ = _planes(qa)
    rel = qa.rel.reshape(m, nb).T[:, :, None]  # [S*8, M, 1] fp16
    asum8 = qa.asum8.reshape(m, nb).T[:, :, None]
    sa = qa.scale_avg.astype(_F32)  # [M, S]
    grouped = qa.grouped[None, :, None]
    rel16 = mul_f16(rel, np.float16(16))
    step = _chunk_columns(n_full, nb * m)
    sixteen = np.float16(16)
    for n0 in range(0, n_full, step):
        n1 = min(n0 + step, n_full)
        nc = n1 - n0
        codes = w.codes[n0:n1].reshape(nc, nb, QK).transpose(1, 2, 0).astype(_F32)  # [S*8, 32, nc]
        dot_hi = np.matmul(hi, codes).reshape(s, SUBBLOCKS, m, nc)  # exact: |.| <= 3840
        dot_lo = np.matmul(lo, codes).reshape(s, SUBBLOCKS, m, nc)  # exact: |.| <= 7200
        d = w.d16[n0:n1].T[:, None, :]  # [S*8, 1, nc] fp16
        sc = mul_f16(d, rel)  # [S*8, M, nc]
        sc16 = mul_f16(sc, sixteen)  # m1: fp16(fp16(d*rel) * 16)
        if qa.n_grouped:
            sc16 = np.where(grouped, mul_f16(d, rel16), sc16)  # m4: fp16(d * fp16(rel * 16))
        zp = mul_f16(sc, asum8).reshape(s, SUBBLOCKS, m, nc)
        sc = sc.reshape(s, SUBBLOCKS, m, nc)
        sc16 = sc16.reshape(s, SUBBLOCKS, m, nc)
        d16 = np.zeros((s, m, nc), dtype=np.float16)
        for j in range(SUBBLOCKS):
            steps = [(dot_hi[:, j], sc16[:, j]), (dot_lo[:, j], sc[:, j])]
            if order == "lo_hi":
                steps.reverse()
            for tmp, scale in steps:
                d16 = hp_accumulate(d16, tmp, scale, mode)
        acc = np.zeros((m, nc), dtype=_F32)
        with np.errstate(over="ignore", invalid="ignore"):
            for si in range(s):
                sas = sa[:, si, None]
                for j in range(SUBBLOCKS):
                    acc = (acc + sas * zp[si, j].astype(_F32)).astype(_F32)
                acc = (acc + sas * d16[si].astype(_F32)).astype(_F32)
        out[:, n0:n1] = acc
    if n_full < w.n:
        out[:, n_full:] = _scalar_tail(qa, w.codes[n_full:], w.d16[n_full:])
    return out


def _scalar_tail(qa: QuantizedA, codes: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """The scalar tail for the given columns: float32 ``[M, len(codes)]`` (module docstring)."""
    m, s = qa.m, qa.n_superblocks
    nb = s * SUBBLOCKS
    nt = codes.shape[0]
    acc = np.zeros((m, nt), dtype=_F32)
    if m == 0 or nt == 0:
        return acc
    _, _, q = _planes(qa)
    step = _chunk_columns(nt, nb * m)
    sa = np.repeat(qa.scale_avg.astype(_F32), SUBBLOCKS, axis=1).T[:, :, None]  # [S*8, M, 1]
    rel = qa.rel.reshape(m, nb).T[:, :, None].astype(_F32)
    asum8 = qa.asum8.reshape(m, nb).T[:, :, None].astype(_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        sa_as = (sa * rel).astype(_F32)
        for n0 in range(0, nt, step):
            n1 = min(n0 + step, nt)
            c = codes[n0:n1].reshape(n1 - n0, nb, QK).transpose(1, 2, 0).astype(_F32)
            t = (np.matmul(q, c) + asum8).astype(_F32)  # dot exact (|.| <= 61440), + asum8 exact
            coef = (sa_as * d16[n0:n1].T[:, None, :].astype(_F32)).astype(_F32)
            prod = (coef * t).astype(_F32)
            a_ = acc[:, n0:n1]
            for b in range(nb):
                a_ = (a_ + prod[b]).astype(_F32)
            acc[:, n0:n1] = a_
    return acc


def scalar_tail_gemm(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray, *, m4: str | None = None) -> np.ndarray:
    """Every column through the scalar tail ``acc += scale_avg * as * bs * (dot + asum)``.

    The ``hardware`` level uses this formula only for columns past a multiple of 32; applying it to
    whole tiles measures how far it is from the instruction path (the seed: "within about 0.7
    absolute on random tiles").

    Args:
        m4: how A is quantized (:func:`~npusim.q4x32.quant.quantize_a`); None: the current default.

    Returns:
        float32 ``[M, N]``.

    Raises:
        The same errors as :func:`ime2_hp_gemm`.
    """
    w = prepare_weight(qweight, scales)
    a = _check_a(a, w.k)
    check_finite("A", a)
    return _scalar_tail(quantize_a(a, m4=m4), w.codes, w.d16)
