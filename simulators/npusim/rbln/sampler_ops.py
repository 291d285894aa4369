"""``torch.ops.rbln`` sampler operators (registered on import of :mod:`npusim.rbln`).

vllm-rbln's sampler (``v1/sample/rbln_sampler.py``, used with ``use_custom_sampler``, the
default) compiles two of the compiler's built-in operators:

* ``rbln.argmax(logits)``: ``logits [B, V]`` -> the greedy token of each row, ``[B]`` int32;
* ``rbln.top_k_top_p(probs, k, p)``: ``probs [B, V]`` (a softmax, temperature already applied),
  ``k [B]`` int (None: no top-k; ``k <= 0`` or ``k >= V`` keeps every token), ``p [B]`` float
  (None: no top-p) -> one token per row drawn from the renormalised distribution of the tokens
  that survive top-k then top-p (the smallest set of most likely tokens whose mass reaches
  ``p``), ``[B]`` int32. ``k == 1`` is greedy. The draw uses torch's generator
  (``rebel.manual_seed`` seeds it).

Non-finite or negative probabilities (vllm-rbln's sampler warm-up samples ``torch.empty``
logits, so the device sees whatever the memory held) are not an error on the device: a kernel
on the NPU returns a token for every row. Here such entries weigh nothing (before top-k and
top-p), and a row left with no positive weight returns token 0. Either way the result is a
token id in ``[0, V)``.

What is a guess: the int32 result (vllm-rbln calls ``.long()`` on it), that ties and the
nucleus boundary resolve as in vLLM's own top-k/top-p sampler (the first of equal tokens, the
token that crosses ``p`` kept), and which token a row without a finite positive probability
gets (any in-range id is what a board returns; the warm-up discards it).
"""

from __future__ import annotations

from typing import Optional

import torch

from .errors import RBLNInputError

__all__ = ["argmax", "top_k_top_p"]


@torch.library.custom_op("rbln::argmax", mutates_args=())
def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise RBLNInputError(f"rbln.argmax: logits must be [B, V], got {list(logits.shape)}")
    return torch.argmax(logits, dim=-1).to(torch.int32)


@argmax.register_fake
def _(logits):
    return logits.new_empty(logits.shape[:1], dtype=torch.int32)


@torch.library.custom_op("rbln::top_k_top_p", mutates_args=())
def top_k_top_p(probs: torch.Tensor, k: Optional[torch.Tensor], p: Optional[torch.Tensor]) -> torch.Tensor:
    if probs.dim() != 2:
        raise RBLNInputError(f"rbln.top_k_top_p: probs must be [B, V], got {list(probs.shape)}")
    b, v = probs.shape
    for name, t in (("k", k), ("p", p)):
        if t is not None and tuple(t.shape) != (b,):
            raise RBLNInputError(f"rbln.top_k_top_p: {name} must be [{b}], got {list(t.shape)}")
    usable = probs.float()
    usable = usable.masked_fill(~torch.isfinite(usable) | (usable < 0), 0.0)
    sorted_p, order = torch.sort(usable, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if k is not None:
        kk = k.to(torch.int64).clamp(min=0)
        kk = torch.where((kk <= 0) | (kk >= v), torch.full_like(kk, v), kk)
        keep &= torch.arange(v).reshape(1, v) < kk.reshape(b, 1)
    if p is not None:
        masked = sorted_p * keep
        before = torch.cumsum(masked, dim=-1) - masked  # mass of the more likely kept tokens
        first = torch.arange(v).reshape(1, v) == 0  # the most likely token always survives
        keep &= (before < p.float().reshape(b, 1) * masked.sum(-1, keepdim=True)) | first
    weights = sorted_p * keep
    weights[:, 0] += (weights.sum(-1) <= 0).to(weights.dtype)  # no usable mass: token 0 (stable sort)
    pick = torch.multinomial(weights, 1).squeeze(1)
    return order.gather(1, pick.unsqueeze(1)).squeeze(1).to(torch.int32)


@top_k_top_p.register_fake
def _(probs, k, p):
    return probs.new_empty(probs.shape[:1], dtype=torch.int32)
