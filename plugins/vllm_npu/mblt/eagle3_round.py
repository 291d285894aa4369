"""One sequence's EAGLE-3 speculative decoding on an :class:`~vllm_npu.mblt.eagle3_backend.Eagle3Backend`:
:class:`Eagle3Sequence`.

The round is transformers-mblt 0.6.1's (``docs/mblt-eagle3-release.md`` §3), on our own code:

1. **Prefill** (:meth:`Eagle3Sequence.prefill`): the base runs the prompt causally (positions
   ``0..n-1``) at ``cache_size`` 0; the root is the argmax (or a sample) of its last row; the
   draft reads the prompt shifted by one plus the root with the base's taps (through fc) at
   ``cache_size`` 0 (``draft_len = n``), then the first tree grows from its last row.
2. **A round** (:meth:`Eagle3Sequence.round`): the base verifies, in one infer at
   ``cache_size = base_len``, the tokens the previous round accepted (re-fed, causal, positions
   ``base_len + [0, a)``; their KV overwrites the tree slots they had) and the tree (positions
   ``base_len + a + depth``, the tree mask); only then ``base_len += a`` (commit). Greedy
   acceptance takes the longest path of base argmaxes; sampling walks the tree
   (:func:`~vllm_npu.mblt.eagle3_tree.accept_sampled`). The accepted tokens are cut at the budget
   and at the first stop id; a cut, a budget reached or a stop id as the next token end the
   round (no next tree). Otherwise the draft reads ``accepted[1:] + next`` with the accepted
   nodes' taps (fc) at ``cache_size = draft_len`` (``draft_len += a``) and the next tree grows
   under ``next``.
3. **A tree** (:meth:`Eagle3Sequence._grow`): ``depth - 1`` draft infers of ``top_k`` tokens, the
   level ``L`` nodes at position ``draft_len + L - 2`` and ``cache_size = draft_len + (L-2) *
   top_k`` (never committed); ``min(N, candidates)`` nodes with ``N = min(num_assistant_tokens -
   1, max(1, budget left after the round - ...))`` as transformers-mblt caps it.

A tree is not grown when the round leaves no budget (the sequence is finished by the caller's
limit): transformers-mblt grows one that is never verified; skipping it changes no token.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from vllm_npu.mblt.eagle3_backend import Eagle3Backend
from vllm_npu.mblt.eagle3_tree import (DraftTree, SamplingSpec, TreeGrowth, accept_greedy, accept_sampled, causal_mask,
                                       finish_tree, level_mask, rope_rows, verify_mask)

__all__ = ["Eagle3Sequence", "KvDisplaced", "RoundResult"]


class KvDisplaced(RuntimeError):
    """Another sequence ran on the backend since this one's last call: its KV is gone."""


@dataclass(frozen=True)
class RoundResult:
    """What one round settled.

    Attributes:
        tokens: the root, then the accepted draft tokens (then a stop id drawn as the next token).
        next_token: the next tree's root, None when the round ended the sequence.
        accepted: draft tokens among ``tokens`` (the root and a trailing stop id not counted).
    """

    tokens: list[int]
    next_token: int | None
    accepted: int

    @property
    def stopped(self) -> bool:
        return self.next_token is None


@dataclass
class Eagle3Sequence:
    """One sequence's state between rounds (see the module docstring).

    Attributes:
        backend: the release's MXQs.
        spec: the request's sampling.
        stop_ids: token ids that end the sequence (vLLM's ``eos_token_id`` and ``stop_token_ids``).
        rng: the sampling generator (unused when greedy).
        base_len, draft_len: committed KV tokens of the base and the draft.
        rounds, accepted_total, drafted_total: figures (rounds run, draft tokens accepted, tree
            nodes verified without the roots).
    """

    backend: Eagle3Backend
    spec: SamplingSpec
    stop_ids: Collection[int] = ()
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    base_len: int = 0
    draft_len: int = 0
    rounds: int = 0
    accepted_total: int = 0
    drafted_total: int = 0
    _accept: list[int] = field(default_factory=list)
    _tree: DraftTree | None = None

    # ---------------------------------------------------------------- prefill
    def prefill(self, prompt: list[int], budget: int) -> int:
        """Run the prompt and grow the first tree; return the root (the first new token).

        Args:
            prompt: the token ids (``n >= 1``); the sequence's KV restarts from 0.
            budget: tokens the sequence may still receive, the root included; no tree grows at 1
                or less.

        Raises:
            ValueError: an empty prompt.
            Eagle3CapacityError: the prompt (or the tree levels) exceed an MXQ's KV capacity.
        """
        if not prompt:
            raise ValueError("EAGLE-3 prefill needs at least one prompt token")
        b, r = self.backend, self.backend.release
        self.backend.owner = self
        self.base_len = self.draft_len = 0
        self._accept, self._tree = [], None
        n = len(prompt)
        ids = np.asarray(prompt, dtype=np.int64)
        taps, logits = b.base(ids, causal_mask(0, n), rope_rows(np.arange(n), r.head_dim, r.rope_theta), 0)
        self.base_len = n
        root = self._first_token(logits[-1])
        if budget > 1:
            self._draft_delta(np.concatenate([ids[1:], [root]]), taps)
            self._grow(root, max(1, budget - 1))
        return root

    def _first_token(self, row: np.ndarray) -> int:
        return int(np.argmax(row)) if self.spec.greedy else self.spec.sample(row, self.rng)

    # ---------------------------------------------------------------- draft
    def _draft_delta(self, ids: np.ndarray, taps: np.ndarray) -> None:
        """The draft reads ``ids`` with the base taps ``taps`` at ``draft_len``; keeps the last
        row's hidden and logits for the tree."""
        b, r = self.backend, self.backend.release
        t = ids.shape[0]
        pos = np.arange(self.draft_len, self.draft_len + t)
        hidden, logits = b.draft(ids, b.fc(taps), causal_mask(self.draft_len, t),
                                 rope_rows(pos, r.draft_head_dim, r.draft_rope_theta), self.draft_len)
        self.draft_len += t
        self._last = (hidden[-1], logits[-1])

    def _grow(self, root: int, total: int) -> None:
        """Grow the tree under ``root`` with ``min(num_assistant_tokens - 1, total)`` nodes."""
        b, r = self.backend, self.backend.release
        k = r.top_k

        def level(ids: np.ndarray, hidden: np.ndarray, i: int, tree: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            cache = self.draft_len + i * k
            rope = rope_rows(np.full(k, self.draft_len + i), r.draft_head_dim, r.draft_rope_theta)
            return b.draft(ids, hidden, level_mask(self.draft_len, tree), rope, cache)

        growth = TreeGrowth(k, b.d2t)
        growth.grow(self._last[1], self._last[0], r.depth, level)
        self._tree = finish_tree(growth, root, min(r.num_assistant_tokens - 1, max(1, total)),
                                 sampling=not self.spec.greedy)

    # ---------------------------------------------------------------- a round
    def round(self, budget: int) -> RoundResult:
        """Verify the pending tree and settle its tokens (see the module docstring).

        Args:
            budget: tokens the round may settle, its root included (>= 1).

        Raises:
            ValueError: ``budget`` < 1.
            RuntimeError: no pending tree (prefill first, or the sequence already ended).
            KvDisplaced: another sequence used the backend since this one's last call.
            Eagle3CapacityError: an infer would exceed an MXQ's KV capacity.
        """
        if budget < 1:
            raise ValueError(f"A round settles at least its root, so the budget must be >= 1, got {budget}.")
        tree = self._tree
        if tree is None:
            raise RuntimeError("the EAGLE-3 sequence holds no draft tree: prefill it before running a round")
        if self.backend.owner is not self:
            raise KvDisplaced("another sequence ran on the EAGLE-3 MXQs since this one's last round")
        b, r = self.backend, self.backend.release
        a = len(self._accept)
        ids = np.concatenate([np.asarray(self._accept, dtype=np.int64), tree.tokens])
        pos = np.concatenate([self.base_len + np.arange(a), self.base_len + a + tree.depths])
        taps, logits = b.base(ids, verify_mask(self.base_len, a, tree.mask),
                              rope_rows(pos, r.head_dim, r.rope_theta), self.base_len)
        self.base_len += a
        self._accept, self._tree = [], None
        taps, logits = taps[a:], logits[a:]
        if self.spec.greedy:
            acc = accept_greedy(tree, logits)
        else:
            acc = accept_sampled(tree, logits, self.spec, self.rng)
        self.rounds += 1
        self.drafted_total += tree.size - 1
        path = tree.retrieve_indices[acc.path]
        accepted = [int(t) for t in tree.tokens[path[: acc.accepted + 1]]][:budget]
        stop = next((i for i, t in enumerate(accepted) if t in self.stop_ids), None)
        if stop is not None:
            accepted = accepted[: stop + 1]
        n_drafts = max(0, len(accepted) - 1)
        self.accepted_total += n_drafts
        if stop is not None or len(accepted) >= budget:
            return RoundResult(accepted, None, n_drafts)
        nxt = acc.next_token(self.spec, self.rng)
        if nxt in self.stop_ids:
            return RoundResult(accepted + [nxt], None, n_drafts)
        self._accept = accepted
        left = budget - len(accepted) - 1
        if left > 0:
            self._draft_delta(np.asarray(accepted[1:] + [nxt], dtype=np.int64), taps[path[: len(accepted)]])
            self._grow(nxt, left)
        return RoundResult(accepted, nxt, n_drafts)

    @property
    def has_tree(self) -> bool:
        """Whether a tree waits for the next round."""
        return self._tree is not None
