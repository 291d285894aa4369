"""Error metrics used to compare GEMM results (as llama.cpp's ``test-backend-ops`` does)."""

from __future__ import annotations

import numpy as np

__all__ = ["nmse"]


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """Normalized mean squared error ``sum((a - b)**2) / sum(a**2)``, in float64.

    ``a`` is the reference (llama.cpp ``tests/test-backend-ops.cpp`` ``nmse(a, b)``). Returns 0.0
    when both are all zero and ``inf`` when only the reference is. NaN anywhere gives NaN.
    """
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    num = float(np.sum((a64 - b64) ** 2))
    den = float(np.sum(a64**2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
