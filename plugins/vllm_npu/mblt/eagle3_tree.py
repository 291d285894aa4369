"""The pure host logic of an EAGLE-3 speculative round, in numpy (no runtime, no torch).

What the host computes between MXQ calls (``docs/mblt-eagle3-release.md`` §2-§3), in the order
transformers-mblt 0.6.1 computes it, so that a round settles the same tokens on the same MXQs:

- :func:`rope_rows`: the RoPE rows an EAGLE-3 MXQ takes for arbitrary position ids;
- :func:`causal_mask`, :func:`verify_mask`, :func:`level_mask`: the attention masks
  (``1.0`` = masked, ``0.0`` = visible) of a prefill or delta, of the base's tree verification and
  of one draft tree level;
- :class:`TreeGrowth` and :func:`finish_tree`: the draft tree's top-k expansion and the choice of
  its ``N`` nodes (:class:`DraftTree`: tokens, ``retrieve_indices``, tree mask, depths);
- :func:`accept_greedy` and :func:`accept_sampled`: which path the base accepts, and the logits
  or probabilities of the token after it;
- :class:`SamplingSpec`: temperature, top_k and top_p applied as Hugging Face's warpers are.

Ties resolve as the vendor's torch calls do on CPU for distinct values, and to the lower index
on an exact tie (``argmax`` takes the first maximum; every top-k here is a stable descending
sort).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Acceptance", "DraftTree", "SamplingSpec", "TreeGrowth", "TOP_PROBS", "accept_greedy",
           "accept_sampled", "causal_mask", "finish_tree", "level_mask", "log_softmax", "rope_rows",
           "topk", "verify_mask"]

#: How many of a node's most likely tokens the sampling walk reads (transformers-mblt's 10).
TOP_PROBS = 10


# ------------------------------------------------------------------------------------ RoPE
def rope_width(head_dim: int) -> int:
    """``P``, the width of a RoPE row: ``2 * ceil64(head_dim)`` channels."""
    return 2 * (-(-int(head_dim) // 64) * 64)


def rope_rows(position_ids: Sequence[int] | np.ndarray, head_dim: int, theta: float) -> np.ndarray:
    """The RoPE rows ``[T, P]`` (float32) of positions ``position_ids`` (any order, repeats allowed).

    With ``C = head_dim``, ``h = C/2`` and ``Cp = ceil64(C)``: ``row[0:C:2] = cos[:h]``,
    ``row[1:C:2] = -sin[:h]``, ``row[Cp:Cp+C:2] = sin[h:]``, ``row[Cp+1:Cp+C:2] = cos[h:]``, zeros
    elsewhere, where cos/sin of position ``p`` are Hugging Face Llama's (``inv_freq = 1 /
    theta^(2i/C)``, ``emb = cat(freqs, freqs)``), computed in float32.

    Raises:
        ValueError: ``head_dim`` not a positive even int, or a negative position.
    """
    c = int(head_dim)
    if c <= 0 or c % 2:
        raise ValueError(f"head_dim={head_dim!r} must be a positive even int")
    pos = np.asarray(position_ids, dtype=np.int64).reshape(-1)
    if pos.size and pos.min() < 0:
        raise ValueError(f"position ids must be >= 0, got {int(pos.min())}")
    h, cp = c // 2, rope_width(c) // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, c, 2, dtype=np.float32) / np.float32(c)))).astype(np.float32)
    freqs = pos.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    rows = np.zeros((pos.size, 2 * cp), dtype=np.float32)
    rows[:, 0:c:2] = cos[:, :h]
    rows[:, 1:c:2] = -sin[:, :h]
    rows[:, cp:cp + c:2] = sin[:, h:]
    rows[:, cp + 1:cp + c:2] = cos[:, h:]
    return rows


# ------------------------------------------------------------------------------------ masks
def causal_mask(past: int, tokens: int) -> np.ndarray:
    """``[tokens, past + tokens]`` float32: every cached position visible, causal among the new ones."""
    m = np.zeros((tokens, past + tokens), dtype=np.float32)
    m[:, past:] = np.triu(np.ones((tokens, tokens), dtype=np.float32), k=1)
    return m


def verify_mask(past: int, accepted: int, tree_mask: np.ndarray) -> np.ndarray:
    """The base's verification mask ``[a + n, past + a + n]``: causal over the re-fed accepted
    tokens and the tree nodes, then each node sees among the tree only its ancestors and itself
    (``tree_mask`` ``[n, n]``, true on ancestors)."""
    n = tree_mask.shape[-1]
    m = causal_mask(past, accepted + n)
    m[-n:, -n:][~np.asarray(tree_mask, dtype=bool)] = 1.0
    return m


def level_mask(past: int, tree_mask: np.ndarray) -> np.ndarray:
    """A draft tree level's mask ``[k, past + w]``: the committed draft KV visible, the tree
    columns (``tree_mask`` ``[k, w]``, the level's nodes' ancestors among the earlier levels' fed
    nodes, and themselves) as the tree says."""
    t = np.asarray(tree_mask, dtype=bool)
    m = np.zeros((t.shape[0], past + t.shape[1]), dtype=np.float32)
    m[:, past:] = (~t).astype(np.float32)
    return m


# ------------------------------------------------------------------------------------ scores
def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in float32."""
    x = np.asarray(x, dtype=np.float32)
    s = x - x.max(axis=-1, keepdims=True)
    return (s - np.log(np.exp(s).sum(axis=-1, keepdims=True, dtype=np.float32))).astype(np.float32)


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, indices)`` of the ``k`` largest along the last axis, largest first, the lower
    index first among equal values."""
    idx = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(np.asarray(x), idx, axis=-1), idx


@dataclass(frozen=True)
class DraftTree:
    """A draft tree of ``n + 1`` nodes (node 0 is the root).

    Attributes:
        tokens: ``[n + 1]`` target token ids, root first, nodes in candidate-index order (parents
            before children).
        retrieve_indices: ``[leaves, max_depth]`` node indices of each root-to-leaf path, -1 padded.
        mask: ``[n + 1, n + 1]`` bool, true on a node's ancestors and itself.
        depths: ``[n + 1]`` depth of each node (root 0): its position offset.
    """

    tokens: np.ndarray
    retrieve_indices: np.ndarray
    mask: np.ndarray
    depths: np.ndarray

    @property
    def size(self) -> int:
        """Nodes, root included."""
        return int(self.tokens.shape[0])

    def candidates(self) -> np.ndarray:
        """``[leaves, max_depth]`` the token of each path node, -1 on padding."""
        padded = np.concatenate([self.tokens, np.array([-1], dtype=np.int64)])
        return padded[self.retrieve_indices]


#: ``(target ids [k], hidden [k, Hd], level index i from 0, tree mask [k, (i+1)k]) -> (hidden
#: [k, Hd], draft logits [k, Dv])``: one draft infer on a tree level's ``k`` fed nodes.
DraftLevel = Callable[[np.ndarray, np.ndarray, int, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class TreeGrowth:
    """The top-k expansion of a draft tree (transformers-mblt's ``topk_generate``).

    Level 1 is the ``k`` best tokens of the delta call's last logits; each further level feeds
    the previous level's ``k`` kept nodes to the draft (one infer), and keeps the ``k`` best of
    their ``k * k`` children by cumulative log-probability. :func:`finish_tree` then picks the
    tree's nodes from every candidate.

    Attributes:
        top_k: ``k``.
        d2t: draft index -> target id offset (``[Dv]``), or None when the draft vocabulary is the
            target's.
    """

    top_k: int
    d2t: np.ndarray | None = None
    scores: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    parents: list[np.ndarray] = field(default_factory=list)

    def _target(self, draft_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(draft_ids, dtype=np.int64)
        return ids if self.d2t is None else ids + self.d2t[ids]

    def grow(self, first_logits: np.ndarray, first_hidden: np.ndarray, depth: int, level: DraftLevel) -> None:
        """Expand ``depth`` levels from the root's draft logits ``first_logits`` ``[Dv]`` and the
        draft hidden row ``first_hidden`` ``[Hd]`` that produced them, calling ``level`` for
        levels 2..depth.

        Raises:
            ValueError: ``depth`` or ``top_k`` not positive, or ``top_k`` above the draft vocabulary.
        """
        k = self.top_k
        if depth < 1 or k < 1:
            raise ValueError(f"EAGLE-3 tree depth and top_k must be positive, got depth={depth}, top_k={k}")
        if k > np.asarray(first_logits).shape[-1]:
            raise ValueError(f"eagle3_tree_top_k={k} exceeds the draft vocabulary ({np.asarray(first_logits).shape[-1]})")
        scores, idx = topk(log_softmax(first_logits), k)
        self.scores.append(scores.astype(np.float32))
        self.parents.append(np.zeros(1, dtype=np.int64))
        self.tokens.append(self._target(idx))
        next_ids = self._target(idx)
        hidden = np.repeat(np.asarray(first_hidden, dtype=np.float32)[None, :], k, axis=0)
        eye = np.eye(k, dtype=bool)
        tree = eye
        kept = np.arange(k)
        for i in range(depth - 1):
            out_hidden, logits = level(next_ids, hidden, i, tree)
            bias = 1 + k * k * max(0, i - 1) + (k if i > 0 else 0)
            self.parents.append(kept + bias)
            top_p, top_idx = topk(log_softmax(logits), k)  # [k, k]
            cumulative = (top_p + scores[:, None]).astype(np.float32)
            scores, kept = topk(cumulative.reshape(-1), k)
            rows = kept // k
            hidden = np.asarray(out_hidden, dtype=np.float32)[rows]
            next_ids = self._target(top_idx.reshape(-1)[kept])
            self.tokens.append(self._target(top_idx))
            self.scores.append(cumulative)
            tree = np.concatenate([tree[rows], eye], axis=1)

    @property
    def num_candidates(self) -> int:
        """Candidate nodes: ``k + (depth - 1) * k * k``."""
        return int(sum(s.size for s in self.scores))


def finish_tree(growth: TreeGrowth, root: int, total_tokens: int, *, sampling: bool) -> DraftTree:
    """Pick the tree's nodes: the ``min(total_tokens, candidates)`` best candidates by cumulative
    score, in candidate-index order, under ``root``; their mask, depths and root-to-leaf paths
    (leaf order; sorted path by path, -1 last, when ``sampling``).

    Raises:
        ValueError: ``total_tokens`` < 1 or no candidates.
    """
    if total_tokens < 1 or not growth.scores:
        raise ValueError(f"a draft tree needs total_tokens >= 1 and grown candidates (got {total_tokens})")
    k = growth.top_k
    flat_scores = np.concatenate([s.reshape(-1) for s in growth.scores])
    flat_tokens = np.concatenate([t.reshape(-1) for t in growth.tokens])
    n = min(int(total_tokens), int(flat_scores.size))
    picked = np.sort(topk(flat_scores, n)[1])
    tokens = np.concatenate([np.array([root], dtype=np.int64), flat_tokens[picked].astype(np.int64)])
    parents = np.concatenate(growth.parents)[picked // k].astype(np.int64)
    mask_index = np.searchsorted(picked, parents - 1, side="left").astype(np.int64)
    mask_index[parents == 0] = -1
    mask_index += 1
    mask = np.eye(n + 1, dtype=bool)
    mask[:, 0] = True
    for t in range(n):
        mask[t + 1] |= mask[mask_index[t]]
    depths = mask.sum(axis=1).astype(np.int64) - 1
    max_depth = int(depths.max()) + 1
    non_leaf = set(np.unique(mask_index).tolist())
    leaves = n - (len(non_leaf) - 1)
    rows = [[-1] * max_depth for _ in range(leaves)]
    r = 0
    for t in range(n + 1):
        if t in non_leaf:
            continue
        cur = t
        for d in range(int(depths[t]), -1, -1):
            rows[r][d] = cur
            cur = int(mask_index[cur - 1]) if cur > 0 else 0
        r += 1
    if sampling:
        big = n + 5
        rows.sort(key=lambda row: [v if v >= 0 else big for v in row])
    return DraftTree(tokens, np.array(rows, dtype=np.int64), mask, depths)


# ------------------------------------------------------------------------------------ sampling
@dataclass(frozen=True)
class SamplingSpec:
    """A request's sampling: greedy at ``temperature <= 1e-5``, else temperature, top_k (> 0) and
    top_p (``1e-8 <= top_p < 1``) applied in Hugging Face's warper order."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The processed logits (float32, ``-inf`` where filtered) of one row ``[V]``."""
        x = np.asarray(logits, dtype=np.float32)
        if self.temperature != 1.0:
            x = (x / np.float32(self.temperature)).astype(np.float32)
        if self.top_k > 0:
            k = min(int(self.top_k), x.shape[-1])
            kth = np.sort(x)[-k]
            x = np.where(x < kth, np.float32(-np.inf), x).astype(np.float32)
        if 1e-8 <= self.top_p < 1.0:
            order = np.argsort(x, kind="stable")  # ascending
            s = x[order]
            p = np.exp(s - s.max())
            cum = np.cumsum(p / p.sum())
            drop = cum <= (1.0 - self.top_p)
            drop[-1] = False
            x = x.copy()
            x[order[drop]] = -np.inf
        return x

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """Softmax of :meth:`process`, float64."""
        x = self.process(logits).astype(np.float64)
        e = np.exp(x - x.max())
        return e / e.sum()

    def top_probs(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(probs, ids)`` of the :data:`TOP_PROBS` most likely processed tokens, probabilities
        against the whole vocabulary (so they sum to at most 1)."""
        p = self.probs(logits)
        vals, idx = topk(p, min(TOP_PROBS, p.shape[-1]))
        return vals.copy(), idx

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token from the processed distribution of ``logits`` ``[V]``."""
        return int(rng.choice(np.asarray(logits).shape[-1], p=self.probs(logits)))


def _normalized(p: np.ndarray) -> np.ndarray:
    total = p.sum()
    if not np.isfinite(total) or total <= 0:
        return np.full_like(p, 1.0 / max(1, p.size))
    return p / total


@dataclass(frozen=True)
class Acceptance:
    """What the base accepted of a tree.

    Attributes:
        path: the accepted path's row in ``retrieve_indices``.
        accepted: draft tokens accepted on it (the root not counted).
        next_logits: the base logits row ``[V]`` the next token is drawn from (greedy: argmax;
            sampling: the processed distribution), or None when ``next_probs`` is.
        next_probs: ``(probs, ids)`` of the renormalised top tokens the next token is drawn from,
            after a rejection (the sampling walk), else None.
    """

    path: int
    accepted: int
    next_logits: np.ndarray | None
    next_probs: tuple[np.ndarray, np.ndarray] | None = None

    def next_token(self, spec: SamplingSpec, rng: np.random.Generator | None) -> int:
        """The token after the accepted path (argmax when greedy, else drawn with ``rng``)."""
        if self.next_probs is not None:
            assert rng is not None
            probs, ids = self.next_probs
            return int(ids[rng.choice(ids.shape[0], p=_normalized(probs.astype(np.float64)))])
        assert self.next_logits is not None
        if spec.greedy:
            return int(np.argmax(self.next_logits))
        assert rng is not None
        return spec.sample(self.next_logits, rng)


def accept_greedy(tree: DraftTree, logits: np.ndarray) -> Acceptance:
    """The longest path whose every draft token is the base's argmax at its parent (the first
    such path on a tie; path 0 when none matches); the next token comes from the last accepted
    node's logits. ``logits`` ``[n + 1, V]`` are the base's at the tree nodes."""
    ri = tree.retrieve_indices
    cand = tree.candidates()
    pos = ri[:, :-1]
    greedy = np.argmax(logits, axis=-1)[np.clip(pos, 0, None)]
    targets = cand[:, 1:]
    ok = (targets == greedy) & (pos >= 0) & (targets >= 0)
    counts = np.cumprod(ok.astype(np.int64), axis=1).sum(axis=1)
    acc = int(counts.max())
    best = 0 if acc == 0 else int(np.argmax(counts))
    node = int(ri[best, acc])
    if not 0 <= node < logits.shape[0]:
        node = int(np.clip(pos, 0, None)[best, min(acc, pos.shape[1] - 1)])
    return Acceptance(best, acc, np.asarray(logits[node]))


def accept_sampled(tree: DraftTree, logits: np.ndarray, spec: SamplingSpec, rng: np.random.Generator) -> Acceptance:
    """The sampling walk: from the root down, each distinct next token among the paths that
    match so far is accepted when a uniform draw is at most its processed probability (0 outside
    the node's :data:`TOP_PROBS`), else its probability is zeroed and the rest renormalised; the
    walk stops at the first depth where nothing is accepted. The next token is drawn from the
    renormalised top tokens after a rejection that left the path unfinished, else from the last
    accepted node's full processed distribution."""
    ri = tree.retrieve_indices
    cand = tree.candidates()
    length, prefix, best = 1, [int(cand[0, 0])], 0
    node = int(ri[0, 0])
    probs = ids = None
    adjusted = False
    for idx in range(1, cand.shape[1]):
        if idx != length:
            break
        matching = np.all(cand[:, :length] == np.array(prefix), axis=1)
        probs, ids = spec.top_probs(logits[node])
        seen: set[int] = set()
        for c in range(cand.shape[0]):
            if not matching[c]:
                continue
            tok = int(cand[c, idx])
            if tok in seen or tok == -1:
                continue
            seen.add(tok)
            hit = np.nonzero(ids == tok)[0]
            p = float(probs[hit[0]]) if hit.size else 0.0
            if rng.random() <= p:
                prefix.append(tok)
                length += 1
                best = c
                node = int(ri[c, idx])
                break
            if hit.size:
                probs[hit[0]] = 0.0
                probs = _normalized(probs)
                adjusted = True
    if adjusted and length != cand.shape[1]:
        assert probs is not None and ids is not None
        return Acceptance(best, length - 1, None, (probs, ids))
    return Acceptance(best, length - 1, np.asarray(logits[int(ri[best, length - 1])]))
