"""The golden EAGLE-3 round (``npusim.llm.eagle3_round``): greedy speculation changes no token,
the tree's structure, acceptance worked out by hand, acceptance with the fitted tiny draft
(transformers-mblt 0.6.1's own rounds against it: ``test_eagle3_round_mblt.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from npusim.llm import Decoder, KVCacheOverflowError, ModelConfig
from npusim.llm.eagle3 import Eagle3Draft, Eagle3DraftConfig, draft_tensor_shapes
from npusim.llm.eagle3_round import DraftTree, Eagle3Reference, Sampling, greedy_acceptance
from npusim.tinymodel import make_config, make_weights

PROMPTS = ([5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 2, 2, 7, 11, 500, 61], [42])
SHAPES = ((5, 8, 64), (3, 4, 16), (2, 3, 5), (1, 1, 2), (4, 2, 64))  # depth, top_k, num_assistant_tokens


@pytest.fixture(scope="module")
def base() -> Decoder:
    """A 4-layer tiny llama (vocab 1024), numpy only."""
    cfg = ModelConfig.from_dict(make_config("llama", vocab_size=1024, num_hidden_layers=4))
    return Decoder(cfg, make_weights(cfg, 0))


@pytest.fixture(scope="module")
def random_draft() -> Eagle3Draft:
    """A random draft over ``base`` (taps 1, 2, 3; draft vocabulary 256 random target ids)."""
    cfg = Eagle3DraftConfig.from_dict(dict(
        hidden_size=64, target_hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        head_dim=32, vocab_size=1024, draft_vocab_size=256,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    rng = np.random.default_rng(7)
    w: dict[str, np.ndarray] = {}
    for name, shape in draft_tensor_shapes(cfg).items():
        if name == "d2t":
            ids = np.sort(rng.choice(1024, 256, replace=False))
            w[name] = (ids - np.arange(256)).astype(np.int64)
        elif name == "t2d":
            w[name] = np.zeros(shape, bool)
        elif len(shape) == 1:
            w[name] = np.ones(shape, np.float32)
        else:
            w[name] = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), shape).astype(np.float32)
    return Eagle3Draft(cfg, w)


def _rounds(ref: Eagle3Reference, prompt: list[int], budget: int, eos: Any = None) -> list[tuple[list[int], int | None]]:
    """``[([root], None)]`` then ``(tokens, next_token)`` per round: transformers-mblt's groups."""
    root = ref.prefill(prompt, budget)
    groups: list[tuple[list[int], int | None]] = [([root], None)]
    left = budget
    while True:
        r = ref.round(left, eos)
        groups.append((r.tokens, r.next_token))
        left -= len(r.tokens)
        if r.stopped:
            return groups


# ---------------------------------------------------------------- greedy equals plain decoding


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}k{}n{}".format(*s))
@pytest.mark.parametrize("budget", [1, 2, 7, 25])
def test_greedy_generate_equals_base_greedy(base, random_draft, shape, budget):
    for prompt in PROMPTS:
        ref = Eagle3Reference(base, random_draft, *shape, capacity=128)
        out, stats = ref.generate(prompt, budget)
        assert out == base.generate_greedy(prompt, budget), (prompt, shape)
        assert sum(stats.tokens_per_round) == len(out) == budget
        assert min(stats.tokens_per_round) >= 1


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "d{}k{}n{}".format(*s))
def test_greedy_stops_at_eos_like_base(base, random_draft, shape):
    for prompt in PROMPTS:
        plain = base.generate_greedy(prompt, 20)
        for cut in (0, 3, 11):
            eos = plain[cut]
            want = base.generate_greedy(prompt, 20, eos_token_id=[eos, 1023])
            ref = Eagle3Reference(base, random_draft, *shape, capacity=128)
            out, stats = ref.generate(prompt, 20, eos_ids=[eos, 1023])
            assert out == want and out[-1] == eos
            assert ref.tree is None


def test_greedy_with_the_fitted_draft_equals_base_and_accepts(eagle3_golden):
    """The lead's draft fitted to its base: speculation settles more than one token a round on
    average, and changes no token."""
    base, draft = eagle3_golden.base, eagle3_golden.draft
    rng = np.random.default_rng(5)
    means: dict[str, float] = {}
    for shape in ((5, 8, 64), (3, 4, 16), (1, 1, 2)):
        tokens = rounds = accepted = 0
        for _ in range(4):
            prompt = rng.integers(4, base.config.vocab_size, size=int(rng.integers(3, 12))).tolist()
            ref = Eagle3Reference(base, draft, *shape, capacity=256)
            out, stats = ref.generate(prompt, 40)
            assert out == base.generate_greedy(prompt, 40)
            assert all(t >= 1 for t in stats.tokens_per_round)
            assert all(a <= c for a, c in zip(stats.accepted_per_round, stats.candidates_per_round))
            tokens, rounds, accepted = tokens + len(out), rounds + stats.rounds, accepted + sum(stats.accepted_per_round)
        means["d{}k{}n{}".format(*shape)] = tokens / rounds
        assert accepted > 0, shape
    print(f"\nEAGLE-3 golden, fitted tiny draft, mean tokens per round: {means}")
    assert means["d5k8n64"] > 1.2


# ---------------------------------------------------------------- the tree


def _check_tree(tree: DraftTree, depth: int, top_k: int, budget: int) -> None:
    n = tree.size
    assert n == min(budget, top_k + (depth - 1) * top_k * top_k)
    assert tree.tokens.shape == tree.parents.shape == tree.position_ids.shape == (n + 1,)
    assert tree.parents[0] == -1 and all(0 <= tree.parents[i] < i for i in range(1, n + 1))  # parents first
    # the mask is the ancestor closure, depth the number of ancestors
    for i in range(n + 1):
        anc, j = {i}, i
        while tree.parents[j] >= 0:
            j = int(tree.parents[j])
            anc.add(j)
        assert set(np.flatnonzero(tree.tree_mask[i]).tolist()) == anc
        assert tree.position_ids[i] == len(anc) - 1 <= depth
    # retrieve_indices: one root-to-leaf path per leaf, padded with -1
    ri = tree.retrieve_indices
    leaves = sorted(set(range(n + 1)) - set(tree.parents[1:].tolist()))
    assert ri.shape == (len(leaves), int(tree.position_ids.max()) + 1)
    assert sorted(int(row[row >= 0][-1]) for row in ri) == leaves
    for row in ri:
        path = row[row >= 0]
        assert path[0] == 0 and (row[len(path):] == -1).all()
        assert all(tree.parents[path[d]] == path[d - 1] for d in range(1, len(path)))
    # siblings are distinct tokens; a child scores no better than its parent
    for p in range(n + 1):
        kids = np.flatnonzero(tree.parents == p)
        assert len(set(tree.tokens[kids].tolist())) == kids.size <= top_k
    for i in range(1, n + 1):
        if tree.parents[i] > 0:
            assert tree.scores[i - 1] <= tree.scores[tree.parents[i] - 1]


@pytest.mark.parametrize("shape", SHAPES + ((3, 3, 200), (2, 5, 3)), ids=lambda s: "d{}k{}n{}".format(*s))
def test_tree_structure(base, random_draft, shape):
    depth, top_k, n_assist = shape
    for prompt in PROMPTS[:2]:
        ref = Eagle3Reference(base, random_draft, *shape, capacity=128)
        root = ref.prefill(prompt)
        tree = ref.tree
        assert tree is not None and tree.tokens[0] == root
        _check_tree(tree, depth, top_k, n_assist - 1)
        assert ref.base_length == ref.draft_length == len(prompt)
        assert ref.draft_cache.length == len(prompt)  # the levels' KV is not committed
        r = ref.round()
        _check_tree(ref.tree, depth, top_k, n_assist - 1)
        assert ref.base_length == len(prompt) and ref.accept_tokens == r.tokens
        assert ref.draft_length == ref.base_length + len(ref.accept_tokens)


def test_level_one_is_the_drafts_top_k(base, random_draft):
    """Level 1 of the first tree: the draft's top-k after reading the prompt shifted by one."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ref = Eagle3Reference(base, random_draft, depth=1, top_k=4, num_assistant_tokens=64, capacity=64)
    root = ref.prefill(prompt)
    bc = base.new_cache(16)
    n = len(prompt)
    cos, sin = base.config.rope.cos_sin(np.arange(n), dtype=np.float32)
    causal = np.triu(np.ones((n, n), bool), 1)
    logits, taps = base.forward_tree(base.embed(prompt), bc, cos, sin, causal, taps=(1, 2, 3))
    assert root == int(np.argmax(logits[-1]))
    dc = random_draft.new_cache(16)
    dcos, dsin = random_draft.config.rope.cos_sin(np.arange(n), dtype=np.float32)
    _, dlog = random_draft.forward(random_draft.embed(prompt[1:] + [root]), random_draft.fc(np.concatenate(taps, -1)),
                                   dc, dcos, dsin, causal)
    want = random_draft.to_target(np.argsort(-dlog[-1], kind="stable")[:4])
    tree = ref.tree
    assert tree.size == 4 and sorted(tree.tokens[1:].tolist()) == sorted(want.tolist())
    assert (tree.parents[1:] == 0).all() and (tree.position_ids[1:] == 1).all()


def test_near_budget_cut(base, random_draft):
    """``N = max(1, remaining - 1)`` after prefill, ``max(1, remaining - accepted - 1)`` after a round."""
    ref = Eagle3Reference(base, random_draft, 3, 4, 64, capacity=128)
    ref.prefill([5, 6, 7], max_new_tokens=4)
    assert ref.tree.size == 3
    ref.prefill([5, 6, 7], max_new_tokens=1)
    assert ref.tree.size == 1
    ref.prefill([5, 6, 7], max_new_tokens=10)
    r = ref.round(10)
    assert ref.tree.size == 10 - len(r.tokens) - 1


# ---------------------------------------------------------------- acceptance by hand


def test_greedy_acceptance_by_hand():
    """Tree ``r -> {A, B}``, ``A -> {C, D}``, ``B -> {E}``; nodes 0..5 are r, A, B, C, D, E."""
    A, B, C, D, E, X = 10, 11, 12, 13, 14, 15
    tokens = np.array([99, A, B, C, D, E])
    ri = np.array([[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    cand = np.append(tokens, -1)[ri]

    def logits(argmaxes: list[int]) -> np.ndarray:
        out = np.zeros((6, 32), np.float32)
        out[np.arange(6), argmaxes] = 1.0
        return out

    # the base wants A after r and D after A: path 1 accepts 2 drafts, bonus at node 4
    assert greedy_acceptance(logits([A, D, X, X, X, X]), cand, ri) == (1, 2)
    # the base wants B after r and X after B: path 2 accepts 1
    assert greedy_acceptance(logits([B, D, X, X, X, X]), cand, ri) == (2, 1)
    # nothing matches: path 0, no draft
    assert greedy_acceptance(logits([X, C, E, X, X, X]), cand, ri) == (0, 0)
    # two paths with one draft each: the first wins
    assert greedy_acceptance(logits([A, X, X, X, X, X]), cand, ri) == (0, 1)
    # a path's -1 padding is never a match
    ri2 = np.array([[0, 1, -1]])
    assert greedy_acceptance(logits([A, 0, 0, 0, 0, 0]), np.append(tokens, -1)[ri2], ri2) == (0, 1)


def test_depth1_top1_rounds_by_hand(base, random_draft):
    """With one draft node per tree, a round settles ``[root, d]`` when ``d`` is the base's next
    greedy token and ``[root]`` otherwise, and its next root is the greedy token after them."""
    prompt = [300, 2, 2, 7, 11, 500, 61]
    plain = base.generate_greedy(prompt, 30)
    ref = Eagle3Reference(base, random_draft, depth=1, top_k=1, num_assistant_tokens=2, capacity=64)
    assert ref.prefill(prompt) == plain[0]
    at = 0
    while at < 25:
        d = int(ref.tree.tokens[1])
        r = ref.round()
        want = [plain[at], d] if d == plain[at + 1] else [plain[at]]
        assert r.tokens == want and r.accepted_draft_tokens == len(want) - 1 and r.candidate_draft_tokens == 1
        at += len(want)
        assert r.next_token == plain[at]
        assert r.emitted == r.tokens[1:] + [r.next_token]


def test_an_oracle_draft_tree_is_fully_accepted(base, random_draft):
    """A tree whose deepest path is the base's greedy continuation is accepted whole, whatever the
    draft proposed: planting it before a round settles depth + 1 tokens."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    plain = base.generate_greedy(prompt, 12)
    ref = Eagle3Reference(base, random_draft, 3, 2, 64, capacity=64)
    ref.prefill(prompt)
    t = ref.tree
    ri = t.retrieve_indices
    path = ri[np.argmax((ri >= 0).sum(1))]
    tokens = t.tokens.copy()
    tokens[path] = plain[: path.size]
    siblings = [i for i in range(1, tokens.size) if i not in path]
    tokens[siblings] = 1023  # never a sibling of a planted node with the same token
    ref._tree = DraftTree(tokens, t.parents, t.tree_mask, t.position_ids, ri, t.scores)
    r = ref.round()
    assert r.tokens == plain[: path.size] and r.accepted_draft_tokens == path.size - 1
    assert r.next_token == plain[path.size]
    out = [*r.tokens]
    while len(out) < 12:
        rr = ref.round(12 - len(out))
        out += rr.tokens
        if rr.stopped:
            break
    assert out == plain


# ---------------------------------------------------------------- sampling


def test_sampling_is_reproducible_and_in_range(base, random_draft):
    s = Sampling(temperature=0.9, top_k=20, top_p=0.9)
    outs = []
    for _ in range(2):
        ref = Eagle3Reference(base, random_draft, 3, 4, 16, capacity=128, sampling=s, rng=np.random.default_rng(3))
        out, stats = ref.generate([5, 6, 7], 30)
        assert len(out) == 30 and all(0 <= t < 1024 for t in out) and min(stats.tokens_per_round) >= 1
        outs.append(out)
    assert outs[0] == outs[1]
    # the retrieve rows are sorted (padding last) when sampling
    ref = Eagle3Reference(base, random_draft, 3, 4, 16, capacity=128, sampling=s, rng=np.random.default_rng(3))
    ref.prefill([5, 6, 7])
    rows = [[v if v >= 0 else 99 for v in row] for row in ref.tree.retrieve_indices.tolist()]
    assert rows == sorted(rows)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7, top_k=1), Sampling(temperature=1.3, top_p=1e-6),
                                      Sampling(temperature=1e-6, top_k=50)])
def test_sampling_that_keeps_only_the_argmax_is_greedy(base, random_draft, sampling):
    for prompt in PROMPTS[:3]:
        ref = Eagle3Reference(base, random_draft, 3, 4, 16, capacity=128, sampling=sampling,
                              rng=np.random.default_rng(0))
        out, _ = ref.generate(prompt, 20)
        assert out == base.generate_greedy(prompt, 20)


def test_sampling_processors_follow_hf():
    x = np.array([0.0, 3.0, 1.0, 2.0, 2.0, -1.0], np.float32)
    assert np.isneginf(Sampling(temperature=1.0, top_k=3).process(x)).tolist() == [True, False, True, False, False, True]
    p = Sampling(temperature=2.0).process(x)
    assert np.allclose(p, x / 2)
    kept = ~np.isneginf(Sampling(temperature=1.0, top_p=0.5).process(x))
    assert kept.tolist() == [False, True, False, False, False, False]
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=1.5)


# ---------------------------------------------------------------- errors


def test_errors_name_the_bad_value(base, random_draft):
    with pytest.raises(ValueError, match="num_assistant_tokens must be >= 2.*got 1"):
        Eagle3Reference(base, random_draft, 5, 8, 1)
    with pytest.raises(ValueError, match="depth=0"):
        Eagle3Reference(base, random_draft, 0, 8, 64)
    with pytest.raises(ValueError, match="top_k=0"):
        Eagle3Reference(base, random_draft, 5, 0, 64)
    with pytest.raises(ValueError, match="top_k=300 exceeds the draft vocabulary"):
        Eagle3Reference(base, random_draft, 2, 300, 64)
    with pytest.raises(ValueError, match="rng"):
        Eagle3Reference(base, random_draft, sampling=Sampling(temperature=1.0))
    ref = Eagle3Reference(base, random_draft, 3, 4, 16, capacity=64)
    with pytest.raises(ValueError, match="non-empty"):
        ref.prefill([])
    with pytest.raises(ValueError, match="out of range"):
        ref.prefill([5, 5000])
    with pytest.raises(RuntimeError, match="no draft tree"):
        ref.round()
    ref.prefill([5, 6, 7])
    with pytest.raises(ValueError, match="remaining_tokens must be >= 1, got 0"):
        ref.round(0)
    r = ref.round(1)
    assert r.stopped and r.tokens == [base.generate_greedy([5, 6, 7], 1)[0]] and ref.tree is None
    with pytest.raises(RuntimeError, match="no draft tree"):
        ref.round()
    with pytest.raises(ValueError, match="max_new_tokens"):
        ref.generate([5], -1)


def test_capacity_is_checked_before_any_write(base, random_draft):
    # the draft needs the prompt plus (depth - 1) * top_k tree slots
    ref = Eagle3Reference(base, random_draft, 3, 4, 16, capacity=10)
    with pytest.raises(KVCacheOverflowError, match="capacity 10"):
        ref.prefill([5, 6, 7])
    assert ref.base_cache.length == 0 and not ref.base_cache.keys[0].any()
    # a round that would overflow leaves everything as it was
    ref = Eagle3Reference(base, random_draft, 2, 2, 4, capacity=20)
    ref.prefill(list(range(4, 14)))
    while True:
        before = (ref.base_length, ref.draft_length, ref.accept_tokens, ref.tree,
                  [k.copy() for k in ref.base_cache.keys], ref.draft_cache.keys[0].copy())
        try:
            r = ref.round()
        except KVCacheOverflowError:
            assert (ref.base_length, ref.draft_length, ref.accept_tokens) == before[:3] and ref.tree is before[3]
            assert all((a == b).all() for a, b in zip(ref.base_cache.keys, before[4]))
            assert (ref.draft_cache.keys[0] == before[5]).all()
            break
        assert not r.stopped
