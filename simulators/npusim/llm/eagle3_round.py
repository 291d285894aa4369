"""The golden reference of EAGLE-3 speculative decoding: one base model, one draft, rounds.

:class:`Eagle3Reference` replays the algorithm transformers-mblt 0.6.1 runs on a Mobilint
EAGLE-3 release (``docs/mblt-eagle3-release.md`` §3), in numpy, on :class:`npusim.llm.Decoder`
(the base, :meth:`~npusim.llm.Decoder.forward_tree`) and :class:`npusim.llm.eagle3.Eagle3Draft`:

- :meth:`Eagle3Reference.prefill`: a causal base forward of the prompt; the root (the next
  token) is the argmax, or a sample, of the last row; the draft reads the prompt shifted by one
  (token ``t + 1``'s draft embedding with ``fc`` of the base's taps at ``t``) and builds the
  first tree.
- The tree (``topk_generate``): level 1 is the top-``k`` of the log-softmax of the draft's
  last row; each of ``depth - 1`` more draft passes feeds the ``k`` kept nodes of the level
  before at one shared position, each node seeing its ancestors only; its ``k * k`` children are
  scored by parent score plus log-probability and the ``k`` best are kept. The top
  ``min(N, k + (depth - 1) * k * k)`` candidates by score, in candidate order (parents before
  children), are the tree's nodes after the root (``N = num_assistant_tokens - 1``, less near
  the token budget).
- :meth:`Eagle3Reference.round`: one base forward verifies the tokens accepted last round (not
  yet committed) and the tree, with a causal + tree mask and explicit positions; the accepted
  tokens are then committed. Greedy acceptance takes the longest path prefix whose tokens equal
  the argmax of their parents (the first path with the most), and the bonus token is the argmax
  at the last accepted node; the sampling variant follows transformers-mblt's top-10 walk. The
  accepted tokens are cut by the budget and at an EOS; the draft then reads them (shifted by
  one, the bonus last) and builds the next tree rooted at the bonus.

With greedy decoding every emitted token is an argmax of base logits, so :meth:`generate`
equals :meth:`npusim.llm.Decoder.generate_greedy` (up to float ties): the draft decides how many
tokens a round settles, never which.

Deliberate differences from transformers-mblt (documented, not hidden):

- Exact ties in a top-k (equal scores) resolve to the lower index; ``torch.topk``'s order for
  ties is unspecified. Arithmetic is the golden decoder's (float64 accumulation, rounded to the
  model dtype), and log-softmax scores are float32 as in torch, but not bit-identical to it.
- Sampling draws from the caller's :class:`numpy.random.Generator` (one ``random()`` per
  accept test, inverse-CDF for a token), so it cannot reproduce torch's global RNG stream; the
  distributions are the same. ``softmax_topk_cpu_torch``'s "auto" slice is computed as its
  full-vocabulary path, which the vendor documents as mathematically identical.
- ``fc`` is always applied to the base's taps. transformers-mblt skips its fc MXQ when
  ``3 * H`` equals the draft width, in which case the draft MXQ must contain fc itself.
- One sequence from :meth:`Eagle3Reference.prefill` (a fresh start); no multi-turn reuse of
  the caches, no chunking (chunked MXQ infers compute the same rows).
- The capacity of both caches is checked before any write of a call (the vendor has no host
  check; the MXQ fails instead). A round's check assumes the longest acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .decoder import Decoder
from .eagle3 import Eagle3Draft
from .errors import KVCacheOverflowError
from .kvcache import KVCache

__all__ = ["DraftTree", "Eagle3Reference", "Eagle3Stats", "RoundResult", "Sampling", "TOPK_SLICE", "greedy_acceptance"]

#: Candidates ``softmax_topk_cpu_torch`` returns per node in sampling acceptance (its default).
TOPK_SLICE = 10
#: Temperatures at or below this decode greedily (``prepare_logits_processor`` returns None).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """transformers-mblt's logits processing: temperature, then top-k, then top-p (HF order).

    Attributes:
        temperature: ``<= 1e-5`` means greedy (the other fields are then ignored).
        top_k: keep the ``top_k`` highest logits (and any tied with the last); ``0`` is off.
        top_p: nucleus mass in ``[1e-8, 1)``; anything else is off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (``temperature <= 1e-5``)."""
        return self.temperature <= GREEDY_TEMPERATURE

    def process(self, logits: np.ndarray) -> np.ndarray:
        """Processed float32 logits of one row ``[V]`` (filtered entries ``-inf``)."""
        x = np.asarray(logits, dtype=np.float32).copy()
        if self.temperature != 1.0:
            x = (x / np.float32(self.temperature)).astype(np.float32)
        if self.top_k > 0:
            kth = np.sort(x)[-min(int(self.top_k), x.size)]
            x[x < kth] = -np.inf
        if 1e-8 <= self.top_p < 1.0:
            order = np.argsort(x, kind="stable")  # ascending, as HF's TopPLogitsWarper
            cum = np.cumsum(_softmax(x[order]))
            remove = cum <= 1.0 - self.top_p
            remove[-1] = False
            x[order[remove]] = -np.inf
        return x


@dataclass(frozen=True)
class DraftTree:
    """A draft tree (transformers-mblt's ``topk_generate`` outputs).

    Attributes:
        tokens: int64 ``[n + 1]`` target ids, the root first, then the picked candidates in
            candidate order (a parent precedes its children).
        parents: int64 ``[n + 1]`` index in ``tokens`` of each node's parent (``-1`` for the root).
        tree_mask: bool ``[n + 1, n + 1]``, true where node ``i`` sees node ``j`` (its ancestors
            and itself).
        position_ids: int64 ``[n + 1]`` depth of each node (the root is 0).
        retrieve_indices: int64 ``[leaves, max_depth]`` root-to-leaf paths of node indices, padded
            with ``-1`` (rows sorted when sampling).
        scores: float32 ``[n]`` cumulative draft log-probability of each picked node.
    """

    tokens: np.ndarray
    parents: np.ndarray
    tree_mask: np.ndarray
    position_ids: np.ndarray
    retrieve_indices: np.ndarray
    scores: np.ndarray

    @property
    def size(self) -> int:
        """Nodes after the root (``n``)."""
        return int(self.tokens.size) - 1


@dataclass(frozen=True)
class RoundResult:
    """One speculative round (transformers-mblt's ``Eagle3DecodeStep``).

    Attributes:
        tokens: the tokens the round settles: its root, the accepted draft tokens, then the
            next token when it is an EOS (the round then ended generation).
        next_token: the next tree's root (the bonus token), ``None`` when the round stopped.
        logits: float32 ``[n + 1, V]`` base logits of the verified tree's nodes.
        accepted_draft_tokens: draft tokens among ``tokens`` (without the root or an EOS bonus).
        candidate_draft_tokens: draft tokens on the tree's longest path (at least 1).
    """

    tokens: list[int]
    next_token: int | None
    logits: np.ndarray
    accepted_draft_tokens: int
    candidate_draft_tokens: int

    @property
    def stopped(self) -> bool:
        """True when the round ended generation (EOS or the budget) and built no tree."""
        return self.next_token is None

    @property
    def emitted(self) -> list[int]:
        """The step vllm-mblt's runner emits for this round: ``tokens[1:]`` then ``next_token``
        (the root was emitted by the step before)."""
        return self.tokens[1:] + ([] if self.next_token is None else [self.next_token])


@dataclass
class Eagle3Stats:
    """Per-round counts of one :meth:`Eagle3Reference.generate`.

    Attributes:
        tokens_per_round: tokens each round settled (``len(RoundResult.tokens)``).
        accepted_per_round: accepted draft tokens of each round.
        candidates_per_round: draft tokens on each tree's longest path.
    """

    tokens_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    candidates_per_round: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.tokens_per_round)

    @property
    def mean_tokens_per_round(self) -> float:
        """Mean tokens settled per round (0.0 with no round)."""
        return float(np.mean(self.tokens_per_round)) if self.tokens_per_round else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round (transformers-mblt's ``acceptance_avg``)."""
        return float(np.mean(self.accepted_per_round)) if self.accepted_per_round else 0.0


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _log_softmax32(x: np.ndarray) -> np.ndarray:
    """Log-softmax along the last axis, float32 like ``nn.LogSoftmax`` on float32 logits."""
    x = np.asarray(x, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(shifted.astype(np.float64)).sum(axis=-1, keepdims=True)).astype(np.float32)
    return (shifted - lse).astype(np.float32)


def _topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, indices)`` of the ``k`` largest along the last axis, descending; ties -> lower index."""
    order = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(np.asarray(x), order, axis=-1), order


def _causal(past: int, n: int) -> np.ndarray:
    """Bool ``[n, past + n]``: true where row ``t`` (at ``past + t``) must not see key ``j``."""
    return np.arange(past + n)[None, :] > (past + np.arange(n))[:, None]


def greedy_acceptance(logits: np.ndarray, candidates: np.ndarray, retrieve_indices: np.ndarray) -> tuple[int, int]:
    """transformers-mblt's greedy ``evaluate_posterior``: which path, and how many of its drafts.

    A path accepts its longest prefix whose draft tokens each equal the argmax (first maximum)
    of their parent node's logits; the best path is the first with the most.

    Args:
        logits: ``[n + 1, V]`` base logits of the tree's nodes.
        candidates: int ``[leaves, max_depth]`` tokens along each path (``-1`` padding).
        retrieve_indices: int ``[leaves, max_depth]`` node indices along each path (``-1`` padding).

    Returns:
        ``(best path row, accepted draft tokens)``; ``(0, 0)`` when nothing is accepted. The
        bonus token is the argmax at node ``retrieve_indices[best, accepted]``.
    """
    ri = np.asarray(retrieve_indices)
    path = ri[:, :-1]
    greedy = np.argmax(np.asarray(logits), axis=-1)[np.clip(path, 0, None)]
    targets = np.asarray(candidates)[:, 1:]
    ok = (targets == greedy) & (path >= 0) & (targets >= 0)
    counts = np.cumprod(ok.astype(np.int64), axis=1).sum(axis=1)
    acc = int(counts.max()) if counts.size else 0
    return (int(np.argmax(counts)) if acc > 0 else 0), acc


def _eos_set(eos_ids: int | Iterable[int] | None) -> frozenset[int]:
    if eos_ids is None:
        return frozenset()
    if isinstance(eos_ids, (int, np.integer)):
        return frozenset({int(eos_ids)})
    return frozenset(int(e) for e in eos_ids)


def _positive(name: str, v: object, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return int(v)


class Eagle3Reference:
    """EAGLE-3 speculative decoding of one sequence, in transformers-mblt's rounds (module docstring).

    State between calls: the base's committed KV length, the draft's KV length, the tokens
    accepted last round whose base KV is not yet committed, and the current tree.

    Attributes:
        base, draft: the models.
        depth, top_k: the tree's levels and fan-out (``eagle3_tree_depth``, ``eagle3_tree_top_k``).
        max_draft_tokens: ``num_assistant_tokens - 1``, the most nodes after the root.
        sampling: the logits processing (greedy by default).
        base_cache, draft_cache: the two KV caches (``capacity`` tokens each).
    """

    def __init__(self, base: Decoder, draft: Eagle3Draft, depth: int = 5, top_k: int = 8,
                 num_assistant_tokens: int = 64, capacity: int = 512, *, sampling: Sampling | None = None,
                 rng: np.random.Generator | None = None) -> None:
        """Pair a base and a draft.

        Args:
            depth, top_k: tree shape, each >= 1; ``top_k`` at most the draft vocabulary.
            num_assistant_tokens: tree size counting the root, >= 2.
            capacity: tokens each KV cache holds. The base needs ``len(prompt) + max_new_tokens``;
                the draft ``(depth - 1) * top_k`` more (its uncommitted tree levels).
            sampling: ``None`` or a greedy :class:`Sampling` decodes greedily.
            rng: the generator sampling draws from (required when sampling).

        Raises:
            ValueError: a bad tree shape or capacity (the value named); a draft whose
                vocabulary, target width or taps do not fit the base; sampling without ``rng``.
        """
        _positive("num_assistant_tokens", num_assistant_tokens, 1)
        if num_assistant_tokens < 2:
            raise ValueError("EAGLE-3 num_assistant_tokens must be >= 2 (the root token plus at least one draft "
                             f"token), got {num_assistant_tokens}.")
        if isinstance(depth, bool) or isinstance(top_k, bool) or not isinstance(depth, (int, np.integer)) or \
                not isinstance(top_k, (int, np.integer)) or depth < 1 or top_k < 1:
            raise ValueError(f"EAGLE-3 tree depth and top_k must be positive, got depth={depth!r}, top_k={top_k!r}.")
        dc, bc = draft.config, base.config
        if top_k > dc.draft_vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({dc.draft_vocab_size} tokens)")
        if dc.vocab_size != bc.vocab_size:
            raise ValueError(f"the draft's vocab_size {dc.vocab_size} differs from the base's {bc.vocab_size}")
        if dc.target_hidden_size != bc.hidden_size:
            raise ValueError(f"the draft's target_hidden_size {dc.target_hidden_size} differs from the base's "
                             f"hidden_size {bc.hidden_size}")
        bad = [t for t in dc.aux_layer_ids if t > bc.num_hidden_layers]
        if bad:
            raise ValueError(f"the draft's tap layer {bad[0]} is out of range [0, {bc.num_hidden_layers}] for the base")
        self.sampling = sampling if sampling is not None else Sampling()
        if not self.sampling.greedy and rng is None:
            raise ValueError(f"sampling at temperature {self.sampling.temperature} needs a numpy Generator (rng)")
        self.base, self.draft = base, draft
        self.depth, self.top_k = int(depth), int(top_k)
        self.max_draft_tokens = int(num_assistant_tokens) - 1
        self.rng = rng
        capacity = _positive("capacity", capacity, 1)
        self.base_cache: KVCache = base.new_cache(capacity)
        self.draft_cache: KVCache = draft.new_cache(capacity)
        self._base_len = 0
        self._draft_len = 0
        self._accept: list[int] = []
        self._tree: DraftTree | None = None
        self._base_rope_dt = np.float64 if base.dtype == np.float64 else np.float32
        self._draft_rope_dt = np.float64 if draft.dtype == np.float64 else np.float32

    # ------------------------------------------------------------------ state

    @property
    def base_length(self) -> int:
        """Base KV tokens committed (positions ``[0, base_length)``)."""
        return self._base_len

    @property
    def draft_length(self) -> int:
        """Draft KV tokens committed (after a round: ``base_length + len(accept_tokens)``)."""
        return self._draft_len

    @property
    def accept_tokens(self) -> list[int]:
        """Tokens accepted by the last round whose base KV the next round commits."""
        return list(self._accept)

    @property
    def tree(self) -> DraftTree | None:
        """The tree the next :meth:`round` verifies (``None`` before prefill or after a stop)."""
        return self._tree

    # ------------------------------------------------------------------ API

    def prefill(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int | None = None) -> int:
        """Start a sequence: base forward of the prompt, the root, the draft's first tree.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: the budget counting the root (>= 1); caps the tree at
                ``max(1, max_new_tokens - 1)`` nodes. ``None``: no cap.

        Returns:
            The root, the first new token.

        Raises:
            ValueError: an empty prompt, a bad id, ``max_new_tokens < 1``.
            KVCacheOverflowError: the prompt (base) or the prompt plus the tree's levels (draft)
                do not fit (checked before any write).
        """
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"EAGLE-3 prefill needs a non-empty 1-D prompt, got shape {list(ids.shape)}")
        ids = self.base._check_ids(ids, allow_empty=False)
        if max_new_tokens is not None:
            _positive("max_new_tokens", max_new_tokens, 1)
        n = int(ids.size)
        self._check_fit(self.base_cache, 0, n)
        self._check_fit(self.draft_cache, 0, n + (self.depth - 1) * self.top_k)
        self._base_len = self._draft_len = 0
        self._accept, self._tree = [], None
        logits, feats = self._base_forward(ids, np.arange(n), _causal(0, n))
        self._base_len = n
        root = self._pick(logits[-1])
        delta = np.concatenate([ids[1:], [root]]).astype(np.int64)
        self._tree = self._build_tree(feats, delta, root, None if max_new_tokens is None else max(1, max_new_tokens - 1))
        return root

    def round(self, remaining: int | None = None, eos_ids: int | Iterable[int] | None = None) -> RoundResult:
        """Verify the current tree, accept, and (unless stopping) draft the next tree.

        Args:
            remaining: the most tokens this round may settle, counting its root (>= 1);
                ``None``: no budget.
            eos_ids: ids that end generation (an accepted EOS cuts the round after it; an EOS
                bonus is appended). ``None``: never stop at EOS.

        Returns:
            The :class:`RoundResult` (transformers-mblt's ``eagle3_decode_step`` groups).

        Raises:
            ValueError: ``remaining < 1``.
            RuntimeError: no tree (no :meth:`prefill`, or the previous round stopped).
            KVCacheOverflowError: the verification (base) or the next tree (draft) would not fit
                (checked before any write; nothing changes).
        """
        if remaining is not None:
            if isinstance(remaining, bool) or not isinstance(remaining, (int, np.integer)) or remaining < 1:
                raise ValueError(f"A round settles at least its root, so remaining_tokens must be >= 1, got {remaining!r}.")
            remaining = int(remaining)
        tree = self._tree
        if tree is None:
            raise RuntimeError("The EAGLE-3 reference holds no draft tree: run prefill before round "
                               "(or the previous round stopped).")
        eos = _eos_set(eos_ids)
        a_prev, n1 = len(self._accept), tree.tokens.size
        width = tree.retrieve_indices.shape[1]
        self._check_fit(self.base_cache, self._base_len, a_prev + n1)
        longest = width if remaining is None else min(width, remaining - 1)
        if longest >= 1:
            self._check_fit(self.draft_cache, self._draft_len, longest + (self.depth - 1) * self.top_k)

        # verification: the uncommitted accepted tokens, then the tree, in one base forward
        fed = np.concatenate([np.asarray(self._accept, np.int64), tree.tokens])
        positions = self._base_len + np.concatenate([np.arange(a_prev), a_prev + tree.position_ids])
        mask = _causal(self._base_len, a_prev + n1)
        mask[a_prev:, self._base_len + a_prev:] = ~tree.tree_mask
        logits, feats = self._base_forward(fed, positions, mask)
        self._base_len += a_prev  # commit
        self._accept = []
        logits, feats = logits[a_prev:], feats[a_prev:]

        ri = tree.retrieve_indices
        candidates = np.append(tree.tokens, -1)[ri]
        if self.sampling.greedy:
            best, acc = greedy_acceptance(logits, candidates, ri)
            bonus_row, top_slice = logits[int(ri[best, acc])], None
        else:
            best, acc, bonus_row, top_slice = self._accept_sampled(logits, candidates, ri)

        accepted = [int(t) for t in candidates[best, : acc + 1]]
        if remaining is not None:
            accepted = accepted[:remaining]
        stop = not accepted
        hit = [i for i, t in enumerate(accepted) if t in eos]
        if hit:
            accepted, stop = accepted[: hit[0] + 1], True
        result = dict(logits=logits, candidate_draft_tokens=max(1, width - 1))
        if stop or (remaining is not None and len(accepted) >= remaining):
            self._tree = None
            return RoundResult(tokens=accepted, next_token=None,
                               accepted_draft_tokens=max(0, min(acc, len(accepted) - 1)), **result)
        bonus = self._bonus(bonus_row, top_slice)
        if bonus in eos:
            self._tree = None
            tokens = accepted + [bonus]
            return RoundResult(tokens=tokens, next_token=None, accepted_draft_tokens=max(0, min(acc, len(tokens) - 1)),
                               **result)
        self._accept = accepted
        nodes = ri[best, : len(accepted)]
        delta = np.asarray(accepted[1:] + [bonus], np.int64)
        cap = None if remaining is None else max(1, remaining - len(accepted) - 1)
        self._tree = self._build_tree(feats[nodes], delta, bonus, cap)
        return RoundResult(tokens=accepted, next_token=bonus, accepted_draft_tokens=max(0, min(acc, len(accepted) - 1)),
                           **result)

    def generate(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int,
                 eos_ids: int | Iterable[int] | None = None) -> tuple[list[int], Eagle3Stats]:
        """Prefill, then rounds until the budget or an EOS (transformers-mblt's ``generate`` loop).

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: tokens to generate at most (>= 0).
            eos_ids: stop after any of these ids (included in the result).

        Returns:
            ``(new tokens, per-round stats)``; the tokens are the rounds' ``tokens`` in order.

        Raises:
            ValueError: an empty prompt, a bad id, ``max_new_tokens < 0``.
            KVCacheOverflowError: a call would not fit (see :meth:`prefill`, :meth:`round`).
        """
        _positive("max_new_tokens", max_new_tokens, 0)
        stats = Eagle3Stats()
        if max_new_tokens == 0:
            if np.asarray(prompt_ids).size == 0:
                raise ValueError("EAGLE-3 generate needs a non-empty prompt")
            return [], stats
        self.prefill(prompt_ids, max_new_tokens)
        out: list[int] = []
        while len(out) < max_new_tokens:
            r = self.round(max_new_tokens - len(out), eos_ids)
            out += r.tokens
            stats.tokens_per_round.append(len(r.tokens))
            stats.accepted_per_round.append(r.accepted_draft_tokens)
            stats.candidates_per_round.append(r.candidate_draft_tokens)
            if r.stopped:
                break
        self._tree = None
        return out, stats

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_fit(cache: KVCache, start: int, n: int) -> None:
        if start + n > cache.capacity:
            raise KVCacheOverflowError(cache.capacity, start, n)

    def _base_forward(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Base rows at explicit positions, written at the committed length: ``(logits [T, V],
        concatenated taps [T, 3H])``."""
        self.base_cache.length = self._base_len
        cos, sin = self.base.config.rope.cos_sin(np.asarray(positions), dtype=self._base_rope_dt)
        logits, taps = self.base.forward_tree(self.base.embed(ids), self.base_cache, cos, sin, mask,
                                              taps=self.draft.config.aux_layer_ids)
        return logits, np.concatenate(taps, axis=-1)

    def _draft_forward(self, ids: np.ndarray, hidden: np.ndarray, positions: np.ndarray, start: int,
                       mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Draft rows written at ``start``: ``(out [T, Hd], logits [T, Dv])``."""
        self.draft_cache.length = start
        cos, sin = self.draft.config.rope.cos_sin(np.asarray(positions), dtype=self._draft_rope_dt)
        return self.draft.forward(self.draft.embed(ids), hidden, self.draft_cache, cos, sin, mask)

    def _to_target(self, draft_idx: np.ndarray) -> np.ndarray:
        c = self.draft.config
        idx = np.asarray(draft_idx, dtype=np.int64)
        return idx if c.draft_vocab_size == c.vocab_size else self.draft.to_target(idx)

    def _build_tree(self, feats: np.ndarray, delta_ids: np.ndarray, root: int, max_draft: int | None) -> DraftTree:
        """transformers-mblt's ``topk_generate``: the draft reads ``delta_ids`` with ``fc(feats)``
        (committing them to the draft KV), then expands the tree rooted at ``root``."""
        k, dl = self.top_k, self._draft_len
        total = self.max_draft_tokens if max_draft is None else min(self.max_draft_tokens, max(1, max_draft))
        a = int(delta_ids.size)
        out, logits = self._draft_forward(delta_ids, self.draft.fc(feats), np.arange(dl, dl + a), dl, _causal(dl, a))
        self._draft_len = dl = dl + a
        scores, idx = _topk(_log_softmax32(logits[-1]), k)
        score_steps, token_steps = [scores], [self._to_target(idx)]
        parents: list[int] = [0]
        fed_ids, fed_hidden = self._to_target(idx), np.repeat(out[-1:], k, axis=0)
        seen = np.eye(k, dtype=bool)  # [k, levels fed so far * k]: ancestors of each fed node
        kept = np.arange(k)
        for level in range(self.depth - 1):
            add = level * k
            mask = np.zeros((k, dl + add + k), dtype=bool)
            mask[:, dl:] = ~seen
            out, logits = self._draft_forward(fed_ids, fed_hidden, np.full(k, dl + level), dl + add, mask)
            parents.extend((kept + 1 + k * k * max(0, level - 1) + (k if level > 0 else 0)).tolist())
            child_p, child_i = _topk(_log_softmax32(logits), k)  # [k, k]
            cumulative = (child_p + scores[:, None]).astype(np.float32)
            scores, kept = _topk(cumulative.reshape(-1), k)
            rows = kept // k
            fed_hidden = out[rows]
            fed_ids = self._to_target(child_i.reshape(-1)[kept])
            token_steps.append(self._to_target(child_i).reshape(-1))
            score_steps.append(cumulative.reshape(-1))
            seen = np.concatenate([seen[rows], np.eye(k, dtype=bool)], axis=1)
        self.draft_cache.length = self._draft_len  # the levels' KV is never committed

        all_scores, all_tokens = np.concatenate(score_steps), np.concatenate(token_steps)
        n = min(total, int(all_scores.size))
        _, top = _topk(all_scores, n)
        top = np.sort(top)
        node_parent = np.asarray(parents, np.int64)[top // k]
        mask_index = np.searchsorted(top, node_parent - 1, side="left")
        mask_index[node_parent == 0] = -1
        mask_index += 1
        tree_mask = np.eye(n + 1, dtype=bool)
        tree_mask[:, 0] = True
        for i in range(n):
            tree_mask[i + 1] |= tree_mask[mask_index[i]]
        position_ids = tree_mask.sum(axis=1).astype(np.int64) - 1
        max_depth = int(position_ids.max()) + 1
        non_leaf = set(mask_index.tolist())
        rows_out = [[-1] * max_depth for _ in range(n - (len(non_leaf) - 1))]
        r = 0
        for node in range(n + 1):
            if node in non_leaf:
                continue
            cur = node
            for d in reversed(range(int(position_ids[node]) + 1)):
                rows_out[r][d] = cur
                cur = int(mask_index[cur - 1])
            r += 1
        if not self.sampling.greedy:
            big = n + 5
            rows_out.sort(key=lambda row: [v if v >= 0 else big for v in row])
        return DraftTree(
            tokens=np.concatenate([[root], all_tokens[top]]).astype(np.int64),
            parents=np.concatenate([[-1], mask_index]).astype(np.int64),
            tree_mask=tree_mask,
            position_ids=position_ids,
            retrieve_indices=np.asarray(rows_out, dtype=np.int64).reshape(len(rows_out), max_depth),
            scores=all_scores[top].astype(np.float32),
        )

    def _pick(self, row: np.ndarray) -> int:
        """The argmax of a base logits row, or a sample of its processed distribution."""
        if self.sampling.greedy:
            return int(np.argmax(row))
        return self._draw(_softmax(self.sampling.process(row)))

    def _draw(self, p: np.ndarray) -> int:
        """Inverse-CDF draw from (unnormalized) probabilities ``p`` with one ``rng.random()``."""
        assert self.rng is not None
        c = np.cumsum(np.asarray(p, dtype=np.float64))
        return int(min(np.searchsorted(c / c[-1], self.rng.random(), side="right"), c.size - 1))

    def _softmax_topk(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``softmax_topk_cpu_torch``: the top-10 processed tokens and their full-vocabulary probabilities."""
        x = self.sampling.process(row)
        m = x.max()
        denom = np.exp(x.astype(np.float64) - m).sum()
        vals, idx = _topk(x, min(TOPK_SLICE, x.size))
        return np.exp(vals.astype(np.float64) - m) / denom, idx

    def _accept_sampled(self, logits: np.ndarray, candidates: np.ndarray, ri: np.ndarray
                        ) -> tuple[int, int, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """transformers-mblt's sampling walk (``evaluate_posterior``); the last item is the
        rejection-adjusted top-10 ``(probs, ids)`` to sample the bonus from, or None (full row)."""
        length, best, node = 1, 0, 0
        prefix = candidates[0, :1]
        probs = ids = None
        adjusted = False
        for idx in range(1, candidates.shape[1]):
            if idx != length:
                break
            matching = (candidates[:, :length] == prefix).all(axis=1)
            probs, ids = self._softmax_topk(logits[node])
            tried: set[int] = set()
            for c in range(candidates.shape[0]):
                if not matching[c]:
                    continue
                tok = int(candidates[c, idx])
                if tok in tried or tok == -1:
                    continue
                tried.add(tok)
                where = np.flatnonzero(ids == tok)
                p = float(probs[where[0]]) if where.size else 0.0
                assert self.rng is not None
                if self.rng.random() <= p:
                    prefix = np.append(prefix, tok)
                    length += 1
                    best, node = c, int(ri[c, idx])
                    break
                if where.size:
                    probs = probs.copy()
                    probs[where[0]] = 0.0
                    total = probs.sum()
                    probs = probs / total if np.isfinite(total) and total > 0 else np.full_like(probs, 1.0 / probs.size)
                    adjusted = True
        acc = max(0, length - 1)
        if adjusted and length != candidates.shape[1]:
            assert probs is not None and ids is not None
            return best, acc, logits[node], (probs, ids)
        return best, acc, logits[int(ri[best, length - 1])], None

    def _bonus(self, row: np.ndarray, top_slice: tuple[np.ndarray, np.ndarray] | None) -> int:
        if self.sampling.greedy:
            return int(np.argmax(row))
        if top_slice is not None:
            probs, ids = top_slice
            return int(ids[self._draw(probs)])
        return self._pick(row)
