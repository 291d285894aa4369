"""The on-device sampling kernel (numpy), after vllm-neuron ``functional/sampling.py::sample``.

Per row, with ``sampling_params`` columns ``[top_k, top_p, temperature]`` and a uniform ``rand``:

1. the top ``active = min(max_top_k, vocab)`` logits are taken (descending; lowest id first on
   ties); everything else is out;
2. ``top_k > 0``: values below the ``top_k``-th largest become ``-3000.0``; ``top_k <= 0``: no filter;
3. ``temperature < 1e-5``: greedy, the argmax of the row's logits (lowest id on ties);
4. else the candidates are divided by ``temperature`` and soft-maxed; top-p keeps the smallest
   prefix whose cumulative probability reaches ``top_p`` (at least one token);
5. the token is drawn by inverse CDF with ``rand`` (0.5 when ``deterministic``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MASK_VALUE", "GREEDY_TEMPERATURE", "sample"]

MASK_VALUE = -3000.0
GREEDY_TEMPERATURE = 1e-5


def sample(logits: np.ndarray, params: np.ndarray, rand: np.ndarray, *, max_top_k: int = 256,
           deterministic: bool = False) -> np.ndarray:
    """Sample one token per row.

    Args:
        logits: ``[rows, vocab]`` float32.
        params: ``[rows, 3]`` float32 ``[top_k, top_p, temperature]``.
        rand: ``[rows]`` uniforms in ``[0, 1)``.
        max_top_k: the kernel's top-k width.
        deterministic: use 0.5 instead of ``rand``.

    Returns:
        ``[rows]`` int32 token ids.
    """
    rows, vocab = logits.shape
    active = min(int(max_top_k), vocab)
    out = np.zeros(rows, np.int32)
    for r in range(rows):
        row = logits[r].astype(np.float64)
        top_k, top_p, temperature = (float(v) for v in params[r])
        if temperature < GREEDY_TEMPERATURE:
            out[r] = int(np.argmax(row))
            continue
        order = np.argsort(-row, kind="stable")[:active]
        vals = row[order]
        if top_k > 0:
            k = min(int(top_k), active)
            vals = np.where(vals < vals[k - 1], MASK_VALUE, vals)
        z = vals / temperature
        e = np.exp(z - z.max())
        probs = e / e.sum()
        cum = np.cumsum(probs)
        keep = np.concatenate([[True], cum[:-1] < top_p])
        probs = np.where(keep, probs, 0.0)
        cdf = np.cumsum(probs) / probs.sum()
        u = 0.5 if deterministic else float(rand[r])
        idx = min(int(np.searchsorted(cdf, u, side="right")), int(keep.sum()) - 1)
        out[r] = int(order[idx])
    return out
