"""Linear layers of the golden decoder: float (the default) or the IME2 Q4_0x32 GEMM (``q4x32``).

``linear="q4x32"`` is the reference for the ``ime2_q4`` vLLM quantization method: every attention
and MLP projection is quantized once with :func:`npusim.q4x32.quantize_q4_0` (from the weight as
rounded to the decoder's dtype) and evaluated with :func:`npusim.q4x32.ime2_hp_gemm_prepared` at
``level="hardware"`` (the C kernel's bit-exact arithmetic) on the float32-rounded activations.
Embeddings and the LM head stay float.

Fusion follows vLLM: q, k, v are one ``[Nq+Nk+Nv, K]`` GEMM (``QKVParallelLinear``, order q, k, v)
and gate, up one ``[2I, K]`` GEMM (``MergedColumnParallelLinear``, order gate, up). It matters:
columns past ``32 * (N // 32)`` of a GEMM go through the kernel's scalar tail, whose rounding
differs from the tile path, so fused and separate GEMMs agree bit for bit only when every part's
size is a multiple of 32. Biases are added after the GEMM in float64, as the float path does.

The kernel also quantizes activation rows in groups of 4 (then the ``M % 4`` rest one by one),
so with ``q4x32`` a token's logits depend on how many tokens share its forward call (as on the
device); prefill-in-chunks equals one prefill only for the float path.

numpy only (imports :mod:`npusim.q4x32`, never torch or vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..q4x32 import Q4x32Error, ime2_hp_gemm_prepared, prepare_weight, quantize_q4_0

__all__ = ["LINEAR_KINDS", "FusedQ4Linear", "UnsupportedLinearError", "check_linear_kind"]

#: The values of ``Decoder(linear=...)``.
LINEAR_KINDS = ("float", "q4x32")

_ACC = np.float64


class UnsupportedLinearError(ValueError):
    """``linear`` is not one of :data:`LINEAR_KINDS`, or a weight cannot be quantized for it."""


def check_linear_kind(linear: object) -> str:
    """Return ``linear`` if it is one of :data:`LINEAR_KINDS`.

    Raises:
        UnsupportedLinearError: anything else (the message lists the supported values).
    """
    if not isinstance(linear, str) or linear not in LINEAR_KINDS:
        raise UnsupportedLinearError(
            f"linear={linear!r} is not supported; use one of {', '.join(map(repr, LINEAR_KINDS))}")
    return linear


class FusedQ4Linear:
    """One Q4_0x32 GEMM over the row-wise concatenation of several weights (vLLM's fused layers).

    Attributes:
        names: the parts' names (e.g. ``("q_proj", "k_proj", "v_proj")``), for messages.
        sizes: output rows of each part, in order.
        k: the reduction length.
        weight: the prepared Q4_0 weight (:class:`npusim.q4x32.PreparedWeight`), built once.
    """

    def __init__(self, weights: Sequence[np.ndarray], names: Sequence[str], *, source: str = "weights") -> None:
        """Quantize ``concat(weights)`` once.

        Args:
            weights: ``[N_i, K]`` arrays (the decoder-dtype values) with one common K.
            names: one name per weight, for error messages.
            source: where the weights came from (checkpoint path), for error messages.

        Raises:
            UnsupportedLinearError: K is not a multiple of 32, the Ks differ, or a weight is not
                finite (the message names the tensor and the shape).
        """
        if len(weights) != len(names) or not weights:
            raise ValueError("FusedQ4Linear needs one name per weight and at least one weight")
        ks = {int(np.shape(w)[1]) for w in weights}
        if len(ks) != 1:
            raise UnsupportedLinearError(
                f"{source}: cannot fuse {', '.join(names)}: their K differ "
                f"({', '.join(f'{n} {tuple(np.shape(w))}' for n, w in zip(names, weights))})")
        self.names = tuple(names)
        self.sizes = tuple(int(np.shape(w)[0]) for w in weights)
        self.k = ks.pop()
        try:
            qweight, scales = quantize_q4_0(np.concatenate([np.asarray(w, dtype=np.float32) for w in weights]))
            self.weight = prepare_weight(qweight, scales)
        except Q4x32Error as exc:
            raise UnsupportedLinearError(
                f"{source}: linear='q4x32' cannot quantize {'+'.join(self.names)} "
                f"(shapes {', '.join(f'{n} {tuple(np.shape(w))}' for n, w in zip(names, weights))}): {exc}"
            ) from exc

    @property
    def n(self) -> int:
        return sum(self.sizes)

    def __call__(self, x: np.ndarray, biases: Sequence[np.ndarray | None], dtype: np.dtype) -> list[np.ndarray]:
        """The parts' outputs ``[T, N_i]`` in ``dtype``: the kernel's float32 GEMM on ``float32(x)``,
        plus each part's bias in float64, rounded to ``dtype``."""
        y = ime2_hp_gemm_prepared(np.ascontiguousarray(x, dtype=np.float32), self.weight, level="hardware")
        y = y.astype(_ACC)
        outs, start = [], 0
        for size, b in zip(self.sizes, biases):
            part = y[:, start : start + size]
            if b is not None:
                part = part + b
            outs.append(part.astype(dtype))
            start += size
        return outs
