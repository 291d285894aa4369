"""The pure host logic of an EAGLE-3 round (``vllm_npu.mblt.eagle3_tree``) against the vendor's own.

transformers-mblt 0.6.1 is installed in the test environment (the plugin never imports it): its
``topk_generate`` runs here on a fake draft (a deterministic numpy function of the fed ids and
hidden rows), and our :class:`TreeGrowth` + :func:`finish_tree` must pick the same nodes in the
same order, with the same masks, depths, ``retrieve_indices`` and per-level draft inputs. Greedy
acceptance is compared with its ``evaluate_posterior``, RoPE rows with its
``CachedRotaryEmbedding``, the masks with its mask builders, the warpers with Hugging Face's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_npu.mblt.eagle3_tree import (SamplingSpec, TreeGrowth, accept_greedy, accept_sampled, causal_mask,
                                       finish_tree, level_mask, rope_rows, verify_mask)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers_mblt")

e3: Any = None  # transformers_mblt.utils.eagle3.eagle3_utils, bound by the _vendor fixture
td: Any = None  # transformers_mblt.utils.eagle3.tree_decoding


@pytest.fixture(scope="module", autouse=True)
def _vendor() -> Iterator[None]:
    """transformers-mblt imported on the simulator's ``qbruntime`` alias for this module only."""
    global e3, td
    from npusim import alias

    if alias.status("qbruntime").state == "real":
        pytest.skip("a real qbruntime is installed")
    alias.activate("qbruntime")
    import transformers_mblt.utils.eagle3.eagle3_utils as e3_mod
    import transformers_mblt.utils.eagle3.tree_decoding as td_mod

    e3, td = e3_mod, td_mod
    yield
    alias.deactivate("qbruntime")
    for name in [n for n in sys.modules if n.split(".")[0] in ("qbruntime", "transformers_mblt", "mblt_npu")]:
        del sys.modules[name]

HD = 24


class _FakeDraft:
    """Enough of transformers-mblt's draft mixin for ``topk_generate``; ``self(...)`` is a numpy
    function of (ids, hidden) and records each call's inputs and the vendor's mask."""

    def __init__(self, vocab: int, draft_vocab: int, depth: int, top_k: int, total: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal((vocab, draft_vocab)).astype(np.float32) * 3
        self.M = rng.standard_normal((HD, draft_vocab)).astype(np.float32)
        self.A = rng.standard_normal((HD, HD)).astype(np.float32) * 0.5
        self.E = rng.standard_normal((vocab, HD)).astype(np.float32)
        self.draft_config = SimpleNamespace(vocab_size=vocab, draft_vocab_size=draft_vocab)
        self.d2t = torch.from_numpy(rng.integers(0, vocab - draft_vocab + 1, draft_vocab).astype(np.int64)) \
            if draft_vocab < vocab else torch.zeros(draft_vocab, dtype=torch.long)
        self.max_draft_tokens, self.depth, self.top_k = total, depth, top_k
        self.logsoftmax = torch.nn.LogSoftmax(dim=-1)
        self.tree_mask_init = torch.eye(top_k, dtype=torch.float32)[None, None]
        self.position_ids = torch.zeros(top_k, dtype=torch.long)
        self.calls: list[dict] = []

    def fn(self, ids: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.tanh(hidden @ self.A + self.E[ids]).astype(np.float32)
        return out, (self.W[ids] + out @ self.M).astype(np.float32)

    def __call__(self, hidden_states, *, input_ids, cache, position_ids=None, requires_all_features=False,
                 add_cache_position=0, tree_mask=None, count_npu_time=False):
        past = cache.get_draft_seq_length() + add_cache_position
        t = hidden_states.shape[1]
        mask = e3.MobilintEagle3DraftModelMixin._prepare_decoder_attention_mask(
            self, None, (1, t), hidden_states, past, cache, tree_mask)
        ids = input_ids.reshape(-1).numpy()
        hidden = hidden_states[0].numpy()
        self.calls.append({"ids": ids.copy(), "hidden": hidden.copy(), "past": past, "mask": (mask[0, 0] != 0).numpy(),
                           "pos": None if position_ids is None else position_ids.reshape(-1).numpy().copy()})
        out, logits = self.fn(ids, hidden)
        if requires_all_features:
            return torch.from_numpy(out)[None], torch.from_numpy(logits)[None]
        return torch.from_numpy(out[-1:]), torch.from_numpy(logits[-1:])


class _FakeCache:
    def __init__(self, length: int) -> None:
        self.length = length

    def get_draft_seq_length(self) -> int:
        return self.length

    def update_draft_seen_tokens(self, n: int) -> None:
        self.length += n


def _vendor_tree(fake: _FakeDraft, delta_ids: np.ndarray, delta_hidden: np.ndarray, draft_len: int, root: int,
                 sampling: bool):
    cache = _FakeCache(draft_len)
    proc = td.prepare_logits_processor(temperature=0.7) if sampling else None
    return e3.MobilintEagle3DraftModelMixin.topk_generate(
        fake, torch.from_numpy(delta_hidden)[None], input_ids=torch.tensor([[root]]), cache=cache,
        logits_processor=proc, input_ids_delta=torch.from_numpy(delta_ids)[None])


@pytest.mark.parametrize("vocab,draft_vocab,depth,top_k,total,sampling", [
    (96, 96, 5, 8, 63, False), (96, 64, 5, 8, 63, False), (96, 64, 5, 8, 63, True), (80, 80, 3, 4, 15, False),
    (80, 48, 4, 3, 200, True), (80, 80, 1, 4, 3, False), (80, 80, 2, 2, 1, False), (60, 40, 6, 5, 40, True),
])
def test_tree_equals_transformers_mblt(vocab, draft_vocab, depth, top_k, total, sampling):
    for seed in range(4):
        fake = _FakeDraft(vocab, draft_vocab, depth, top_k, total, seed)
        rng = np.random.default_rng(100 + seed)
        draft_len = int(rng.integers(0, 40))
        delta_ids = rng.integers(0, vocab, 3)
        delta_hidden = rng.standard_normal((3, HD)).astype(np.float32)
        root = int(delta_ids[-1])
        v_tokens, v_ri, v_mask, v_pos = _vendor_tree(fake, delta_ids, delta_hidden, draft_len, root, sampling)
        vendor_calls = fake.calls

        # ours: the delta call's last row, then the levels through the same numpy function
        out, logits = fake.fn(delta_ids, delta_hidden)
        ours_calls = []

        def level(ids, hidden, i, tree, fake=fake, calls=ours_calls, dl=draft_len + 3):
            calls.append({"ids": ids.copy(), "hidden": hidden.copy(), "past": dl + i * top_k,
                          "mask": level_mask(dl, tree) != 0})
            return fake.fn(ids, hidden)

        g = TreeGrowth(top_k, fake.d2t.numpy() if draft_vocab < vocab else None)
        g.grow(logits[-1], out[-1], depth, level)
        tree = finish_tree(g, root, total, sampling=sampling)
        assert tree.tokens.tolist() == v_tokens[0].tolist()
        assert tree.retrieve_indices.tolist() == v_ri.tolist()
        assert tree.mask.tolist() == v_mask[0, 0].bool().tolist()
        assert tree.depths.tolist() == v_pos.tolist()
        assert len(ours_calls) == len(vendor_calls) - 1 == depth - 1
        for i, (mine, theirs) in enumerate(zip(ours_calls, vendor_calls[1:])):
            assert mine["ids"].tolist() == theirs["ids"].tolist()
            np.testing.assert_array_equal(mine["hidden"], theirs["hidden"])
            assert mine["past"] == theirs["past"]
            assert (theirs["pos"] == draft_len + 3 + i).all()
            np.testing.assert_array_equal(mine["mask"], theirs["mask"])
        # the delta call's own mask is causal at the committed draft length
        np.testing.assert_array_equal(causal_mask(draft_len, 3) != 0, vendor_calls[0]["mask"])


def test_tree_candidates_capped():
    g = TreeGrowth(2)
    g.grow(np.array([0.0, 1.0, 2.0]), np.zeros(4), 2,
           lambda ids, h, i, t: (h, np.tile(np.array([[3.0, 1.0, 0.0]]), (2, 1))))
    assert g.num_candidates == 2 + 4
    tree = finish_tree(g, 7, 100, sampling=False)
    assert tree.size == 7 and tree.tokens[0] == 7 and tree.depths.max() == 2


@pytest.mark.parametrize("head_dim,theta", [(32, 10000.0), (64, 500000.0), (128, 1e6), (48, 10000.0)])
def test_rope_rows_equal_transformers_mblt(head_dim, theta):
    table = e3.CachedRotaryEmbedding(head_dim, 300, base=int(theta)).position_table
    pos = np.array([0, 5, 5, 17, 299, 3, 0])
    rows = rope_rows(pos, head_dim, theta)
    assert rows.shape == (7, 2 * (-(-head_dim // 64) * 64)) and rows.dtype == np.float32
    # torch's and numpy's float32 pow/cos differ in the last ulp: at position 299 one ulp of the angle is 3e-5
    np.testing.assert_allclose(rows, table[pos], rtol=0, atol=5e-5)
    # bit for bit the golden decoder's float32 cos/sin (npusim.llm.rope), which the base is checked against
    from npusim.llm.rope import RopeConfig

    cos, sin = RopeConfig("default", theta, head_dim, 300).cos_sin(pos)
    h, cp = head_dim // 2, rows.shape[1] // 2
    np.testing.assert_array_equal(rows[:, 0:head_dim:2], cos[:, :h])
    np.testing.assert_array_equal(rows[:, 1:head_dim:2], -sin[:, :h])
    np.testing.assert_array_equal(rows[:, cp:cp + head_dim:2], sin[:, h:])
    np.testing.assert_array_equal(rows[:, cp + 1:cp + head_dim:2], cos[:, h:])


def test_rope_rows_layout():
    c = 32
    rows = rope_rows([3], c, 10000.0)[0]
    inv = 1.0 / (10000.0 ** (np.arange(0, c, 2) / c))
    emb = np.concatenate([3 * inv, 3 * inv])
    np.testing.assert_allclose(rows[0:c:2], np.cos(emb[:16]), atol=1e-6)
    np.testing.assert_allclose(rows[1:c:2], -np.sin(emb[:16]), atol=1e-6)
    np.testing.assert_allclose(rows[64:64 + c:2], np.sin(emb[16:]), atol=1e-6)
    np.testing.assert_allclose(rows[65:64 + c:2], np.cos(emb[16:]), atol=1e-6)
    assert not rows[c:64].any() and not rows[64 + c:].any()
    with pytest.raises(ValueError, match="head_dim"):
        rope_rows([0], 33, 1.0)


@pytest.mark.parametrize("past,accepted", [(0, 0), (7, 0), (7, 3), (30, 1)])
def test_verify_mask_equals_transformers_mblt(past, accepted):
    g = TreeGrowth(3)
    rng = np.random.default_rng(past)
    g.grow(rng.standard_normal(20), np.zeros(4), 3, lambda ids, h, i, t: (h, rng.standard_normal((3, 20))))
    tree = finish_tree(g, 1, 9, sampling=False)
    n = tree.size
    cache = SimpleNamespace(tree_mask=torch.from_numpy(tree.mask.astype(np.float32))[None, None])
    t = accepted + n
    m = e3.MobilintEagle3BaseModelMixin._prepare_decoder_attention_mask(
        None, torch.ones((1, past + t), dtype=torch.bool), (1, t), torch.zeros(1, t, 4), past, cache)
    theirs = e3.convert_attention_mask_to_numpy(m, squeeze_channel_dim=True)
    np.testing.assert_array_equal(verify_mask(past, accepted, tree.mask), theirs[0])


def _tree(seed: int, vocab: int = 50, depth: int = 4, k: int = 3, total: int = 12, sampling: bool = False):
    rng = np.random.default_rng(seed)
    g = TreeGrowth(k)
    g.grow(rng.standard_normal(vocab), np.zeros(4), depth, lambda ids, h, i, t: (h, rng.standard_normal((k, vocab))))
    return finish_tree(g, int(rng.integers(vocab)), total, sampling=sampling)


def test_greedy_acceptance_equals_transformers_mblt():
    for seed in range(30):
        tree = _tree(seed)
        rng = np.random.default_rng(seed + 1000)
        logits = rng.standard_normal((tree.size, 50)).astype(np.float32)
        # make the base agree with the draft along a random walk down the tree
        node = 0
        for _ in range(int(rng.integers(0, 4))):
            kids = [j for j in range(1, tree.size) if tree.depths[j] == tree.depths[node] + 1 and tree.mask[j, node]]
            if not kids:
                break
            child = kids[int(rng.integers(len(kids)))]
            logits[node, tree.tokens[child]] = 10.0
            node = child
        acc = accept_greedy(tree, logits)
        cand = torch.from_numpy(tree.candidates())
        best, count, sample_p, idx = td.evaluate_posterior(torch.from_numpy(logits), cand, None,
                                                           torch.from_numpy(tree.retrieve_indices))
        assert (acc.path, acc.accepted) == (int(best), int(count)) and idx is None
        np.testing.assert_array_equal(acc.next_logits, sample_p.numpy())
        assert acc.next_token(SamplingSpec(), None) == int(np.argmax(sample_p.numpy()))


def test_sampling_walk_accepts_a_sure_path_and_rejects_impossible_tokens():
    tree = _tree(3, sampling=True)
    spec = SamplingSpec(temperature=1.0)
    leaf_row = tree.retrieve_indices[0]
    depth = int((leaf_row >= 0).sum())
    logits = np.zeros((tree.size, 50), dtype=np.float32)
    for d in range(depth - 1):
        logits[leaf_row[d], tree.tokens[leaf_row[d + 1]]] = 60.0  # probability ~1
    acc = accept_sampled(tree, logits, spec, np.random.default_rng(0))
    assert acc.accepted == depth - 1 and acc.next_probs is None
    # every draft token far below the top 10: nothing accepted, the next token from the renormalised top 10
    logits = np.zeros((tree.size, 50), dtype=np.float32)
    drafted = set(tree.tokens[1:].tolist())
    top = [t for t in range(50) if t not in drafted][:12]
    logits[:, top] = 5.0
    acc = accept_sampled(tree, logits, spec, np.random.default_rng(0))
    assert acc.accepted == 0
    tok = acc.next_token(spec, np.random.default_rng(1))
    assert tok in top


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6),
                                                     (2.0, 100, 0.95)])
def test_sampling_spec_equals_hf_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(64).astype(np.float32) * 2
    proc = td.prepare_logits_processor(temperature=temperature, top_k=top_k, top_p=top_p)
    theirs = proc(None, torch.from_numpy(x)[None])[0].numpy()
    ours = SamplingSpec(temperature, top_k, top_p).process(x)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    np.testing.assert_allclose(ours[~np.isinf(ours)], theirs[~np.isinf(theirs)], rtol=1e-6)
    probs, ids = SamplingSpec(temperature, top_k, top_p).top_probs(x)
    v_probs, v_ids = td._softmax_topk_full_vocab(torch.from_numpy(x), 10, proc)
    np.testing.assert_allclose(probs, v_probs.numpy(), rtol=1e-5)
    assert ids.tolist()[: int((probs > 0).sum())] == v_ids.tolist()[: int((probs > 0).sum())]


def test_greedy_spec():
    assert SamplingSpec(0.0).greedy and SamplingSpec(1e-6).greedy and not SamplingSpec(0.1).greedy
