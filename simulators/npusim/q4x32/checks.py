"""Input validation shared by the quantizers, the packers and the GEMM.

Each check raises a specific :class:`~npusim.q4x32.errors.Q4x32Error` subclass whose message names
the offending array, value and the rule.
"""

from __future__ import annotations

import numpy as np

from .errors import DTypeError, KDimensionError, NonFiniteError, ShapeMismatchError

__all__ = ["QK", "check_finite", "check_k", "check_ndim", "check_dtype"]

#: Q4_0 block length (K elements per scale).
QK = 32


def check_dtype(name: str, x: np.ndarray, allowed: tuple[type, ...]) -> None:
    """Raises DTypeError unless ``x.dtype`` is one of ``allowed``."""
    if x.dtype not in tuple(np.dtype(a) for a in allowed):
        names = " or ".join(np.dtype(a).name for a in allowed)
        raise DTypeError(f"{name} must have dtype {names}, got {x.dtype}")


def check_ndim(name: str, x: np.ndarray, ndim: int, layout: str) -> None:
    """Raises ShapeMismatchError unless ``x`` has ``ndim`` dimensions (``layout`` names them)."""
    if x.ndim != ndim:
        raise ShapeMismatchError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def check_k(k: int, where: str) -> None:
    """Raises KDimensionError unless ``k`` is a positive multiple of 32.

    Args:
        k: the reduction length.
        where: which array it comes from, e.g. ``"A of shape (4, 100)"``.
    """
    if k <= 0 or k % QK:
        raise KDimensionError(
            f"K={k} (from {where}) must be a positive multiple of {QK}, the Q4_0 block length "
            f"(K % 32 = {k % QK}); K need not be a multiple of 256"
        )


def check_finite(name: str, x: np.ndarray) -> None:
    """Raises NonFiniteError if ``x`` holds a NaN or an infinity (naming the first one)."""
    if x.size == 0:
        return
    finite = np.isfinite(x)
    if not finite.all():
        idx = tuple(int(i) for i in np.argwhere(~finite)[0])
        count = int((~finite).sum())
        raise NonFiniteError(
            f"{name} must be finite: {name}[{', '.join(map(str, idx))}] = {float(x[idx])} "
            f"({count} non-finite value{'s' if count != 1 else ''} in total)"
        )
