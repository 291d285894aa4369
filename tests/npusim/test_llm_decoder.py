"""The golden decoder on its own (numpy only): chunking, batching, KV cache rules, bad inputs,
sliding-window exactness (exaone4) and the hyperclovax multipliers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from npusim.llm import (
    CheckpointError,
    Decoder,
    KVCache,
    KVCacheOverflowError,
    ModelConfig,
    save_safetensors,
)
from npusim.tinymodel import ARCHES, make_config, make_weights

CHUNK_TOL = 1e-5
BATCH_TOL = 1e-5


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 1024, size=n)


def _chunked(dec: Decoder, ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    assert sum(sizes) == len(ids)
    cache = dec.new_cache(len(ids))
    out, pos = [], 0
    for n in sizes:
        out.append(dec.prefill(ids[pos : pos + n], cache))
        pos += n
    assert cache.length == len(ids)
    return np.concatenate(out)


CHUNKINGS = {
    "1x64": [1] * 64,
    "7s": [7] * 9 + [1],
    "13s": [13] * 4 + [12],
    "43+21": [43, 21],
    "mixed": [5, 1, 30, 2, 26],
}


@pytest.mark.parametrize("arch", ARCHES)
def test_chunked_prefill_equals_one_shot(arch, tiny_decoder, record_diff):
    """Chunked prefill (chunks of 1, 7, 13, 43+21 and a mix) equals one-shot prefill: max abs diff <= 1e-5."""
    dec = tiny_decoder(arch)
    ids = _ids(64)
    one_shot = dec.prefill(ids, dec.new_cache(64))
    worst = 0.0
    for sizes in CHUNKINGS.values():
        worst = max(worst, float(np.abs(_chunked(dec, ids, sizes) - one_shot).max()))
    record_diff(f"{arch}: chunked vs one-shot prefill", worst)
    assert worst <= CHUNK_TOL


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_chunked_prefill_with_static_rope_scaling(rope, tiny_decoder):
    """Static RoPE scaling types do not depend on the chunking either (<= 1e-5)."""
    params = {"rope_type": "linear", "factor": 4.0} if rope == "linear" else {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    dec = tiny_decoder("llama", rope_parameters=params)
    ids = _ids(64, seed=2)
    one_shot = dec.prefill(ids, dec.new_cache(64))
    assert np.abs(_chunked(dec, ids, [13] * 4 + [12]) - one_shot).max() <= CHUNK_TOL


def test_dynamic_rope_depends_on_the_forward_length(tiny_decoder):
    """Dynamic NTK RoPE rescales per forward (max position + 1 > max_position_embeddings), so
    chunking past the threshold changes results, exactly as in transformers; below it nothing changes."""
    dec = tiny_decoder("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32)
    ids = _ids(48, seed=3)
    one_shot = dec.prefill(ids, dec.new_cache(48))
    chunked = _chunked(dec, ids, [16, 16, 16])
    assert np.abs(chunked[:32] - one_shot[:32]).max() > 1e-3  # one-shot rescaled all 48 positions
    short = dec.prefill(ids[:32], dec.new_cache(32))
    assert np.abs(_chunked(dec, ids[:32], [16, 16]) - short).max() <= CHUNK_TOL
    assert np.abs(chunked[:32] - short).max() <= CHUNK_TOL


@pytest.mark.parametrize("arch", ARCHES)
def test_step_batch_equals_per_sequence_prefill(arch, tiny_decoder, record_diff):
    """step_batch over 3 caches of different lengths equals per-sequence prefill (<= 1e-5), caches too."""
    dec = tiny_decoder(arch)
    caches = []
    for i, n in enumerate([0, 5, 23]):
        c = dec.new_cache(40)
        if n:
            dec.prefill(_ids(n, seed=10 + i), c)
        caches.append(c)
    chunks = [_ids(9, seed=20), _ids(1, seed=21), _ids(4, seed=22)]
    refs = [c.copy() for c in caches]
    expected = [dec.prefill(ids, c) for ids, c in zip(chunks, refs)]
    got = dec.step_batch(list(zip(chunks, caches)))
    assert [g.shape for g in got] == [(9, 1024), (1, 1024), (4, 1024)]
    worst = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
    record_diff(f"{arch}: step_batch vs per-sequence prefill", worst)
    assert worst <= BATCH_TOL
    for c, r in zip(caches, refs):
        assert c.length == r.length
        for layer in range(c.num_layers):
            assert np.abs(c.keys[layer] - r.keys[layer]).max() <= BATCH_TOL
            assert np.abs(c.values[layer] - r.values[layer]).max() <= BATCH_TOL
    assert dec.step_batch([]) == []


def test_overflow_raises_before_writing(tiny_decoder):
    dec = tiny_decoder("llama")
    cache = dec.new_cache(64)
    dec.prefill(_ids(60), cache)
    before = cache.copy()
    with pytest.raises(KVCacheOverflowError) as ei:
        dec.prefill(_ids(8, seed=1), cache)
    err = ei.value
    assert isinstance(err, ValueError)
    assert (err.capacity, err.length, err.requested) == (64, 60, 8)
    assert str(err) == "KV cache holds 60 of 64 tokens; appending 8 would need 68 > capacity 64"
    _assert_same_cache(cache, before)
    # exactly filling the cache is fine
    dec.prefill(_ids(4, seed=2), cache)
    assert cache.length == cache.capacity == 64


def test_step_batch_overflow_leaves_every_cache_unchanged(tiny_decoder):
    """One sequence overflowing fails the whole batch before any cache is written."""
    dec = tiny_decoder("qwen2")
    ok, full = dec.new_cache(32), dec.new_cache(8)
    dec.prefill(_ids(3), ok)
    dec.prefill(_ids(6, seed=1), full)
    snap = [ok.copy(), full.copy()]
    with pytest.raises(KVCacheOverflowError, match=r"holds 6 of 8 tokens; appending 3 would need 9 > capacity 8"):
        dec.step_batch([(_ids(5, seed=2), ok), (_ids(3, seed=3), full)])
    _assert_same_cache(ok, snap[0])
    _assert_same_cache(full, snap[1])
    with pytest.raises(ValueError, match="out of range"):  # a bad id later in the batch: nothing written
        dec.step_batch([(_ids(2), ok), ([1, 5000], full)])
    _assert_same_cache(ok, snap[0])
    with pytest.raises(ValueError, match="twice"):
        dec.step_batch([(_ids(1), ok), (_ids(1), ok)])
    _assert_same_cache(ok, snap[0])


def _assert_same_cache(a: KVCache, b: KVCache) -> None:
    assert a.length == b.length and a.capacity == b.capacity
    for layer in range(a.num_layers):
        np.testing.assert_array_equal(a.keys[layer], b.keys[layer])
        np.testing.assert_array_equal(a.values[layer], b.values[layer])


def test_kvcache_truncate_and_copy(tiny_decoder):
    dec = tiny_decoder("qwen3")
    ids = _ids(20, seed=4)
    cache = dec.new_cache(24)
    assert (cache.capacity, cache.length, cache.num_layers, cache.num_kv_heads, cache.head_dim) == (24, 0, 2, 2, 32)
    assert cache.keys[0].shape == cache.values[1].shape == (2, 24, 32)
    full = dec.prefill(ids, cache)
    twin = cache.copy()
    cache.truncate(10)
    assert cache.length == 10 and twin.length == 20
    assert not cache.keys[0][:, 10:].any()
    assert twin.keys[0][:, 10:20].any()  # the copy is independent
    redo = dec.prefill(ids[10:], cache)
    assert np.abs(redo - full[10:]).max() <= CHUNK_TOL
    for layer in range(cache.num_layers):
        assert np.abs(cache.keys[layer] - twin.keys[layer]).max() <= CHUNK_TOL
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(21)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    cache.truncate(20)  # no-op
    cache.truncate(0)
    assert cache.length == 0 and not cache.keys[1].any()
    with pytest.raises(ValueError):
        KVCache(2, 2, 32, -1)


def test_generate_greedy(tiny_decoder):
    dec = tiny_decoder("llama")
    prompt = _ids(10, seed=5)
    toks = dec.generate_greedy(prompt, 12)
    assert len(toks) == 12 and all(isinstance(t, int) for t in toks)
    # the same by hand
    cache, manual, nxt = dec.new_cache(22), [], prompt
    for _ in range(12):
        manual.append(int(np.argmax(dec.prefill(nxt, cache)[-1])))
        nxt = [manual[-1]]
    assert toks == manual
    # stopping on eos includes the eos token
    stop = toks[4]
    assert dec.generate_greedy(prompt, 12, eos_token_id=stop) == toks[: toks.index(stop) + 1]
    assert dec.generate_greedy(prompt, 12, eos_token_id=[9999, stop]) == toks[: toks.index(stop) + 1]
    assert dec.generate_greedy(prompt, 0) == []
    assert dec.generate_greedy(prompt, 12, capacity=21) == toks  # the last token is never cached
    with pytest.raises(KVCacheOverflowError):
        dec.generate_greedy(prompt, 12, capacity=20)
    with pytest.raises(ValueError):
        dec.generate_greedy(prompt, -1)


def test_bad_inputs(tiny_decoder):
    dec = tiny_decoder("qwen2")
    cache = dec.new_cache(8)
    with pytest.raises(ValueError, match=r"token id 1024 .*\[0, 1024\)"):
        dec.prefill([3, 1024], cache)
    with pytest.raises(ValueError, match=r"token id -1 "):
        dec.prefill([-1], cache)
    with pytest.raises(ValueError, match="empty chunk"):
        dec.prefill([], cache)
    with pytest.raises(ValueError, match="integers"):
        dec.prefill(np.array([1.5]), cache)
    with pytest.raises(ValueError, match=r"\[T, 128\].*\(3, 64\)"):
        dec.forward_embeddings(np.zeros((3, 64), np.float32), cache)
    with pytest.raises(ValueError, match=r"\(0, 128\)"):
        dec.forward_embeddings(np.zeros((0, 128), np.float32), cache)
    with pytest.raises(ValueError, match=r"\(128,\)"):
        dec.forward_embeddings(np.zeros(128, np.float32), cache)
    with pytest.raises(ValueError, match="geometry"):
        dec.prefill([5], KVCache(1, 2, 32, 8))
    assert cache.length == 0
    assert dec.embed([]).shape == (0, 128)


def test_forward_embeddings_equals_prefill(tiny_decoder):
    dec = tiny_decoder("qwen3")
    ids = _ids(12, seed=6)
    x = dec.embed(ids)
    assert x.shape == (12, 128) and x.dtype == np.float32
    a = dec.prefill(ids, dec.new_cache(12))
    b = dec.forward_embeddings(x, dec.new_cache(12))
    np.testing.assert_array_equal(a, b)


def test_float64_decoder_agrees(tiny_decoder, record_diff):
    f32, f64 = tiny_decoder("llama"), tiny_decoder("llama", dtype=np.float64)
    ids = _ids(32, seed=8)
    a = f32.prefill(ids, f32.new_cache(32))
    b = f64.prefill(ids, f64.new_cache(32))
    assert b.dtype == np.float32 and f64.new_cache(1).keys[0].dtype == np.float64
    diff = float(np.abs(a - b).max())
    record_diff("llama: float32 vs float64 decoder", diff)
    assert diff <= 1e-4


def _write_model(tmp_path, arch: str, mutate=None) -> None:
    cfg = make_config(arch, vocab_size=1024)
    weights = make_weights(ModelConfig.from_dict(cfg), 0)
    if mutate:
        mutate(weights)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_safetensors(tmp_path / "model.safetensors", weights)


def test_checkpoint_missing_tensor(tmp_path):
    _write_model(tmp_path, "qwen2", lambda w: w.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        Decoder.from_pretrained(tmp_path)


def test_checkpoint_shape_mismatch(tmp_path):
    def shrink(w):
        w["model.norm.weight"] = w["model.norm.weight"][:100]

    _write_model(tmp_path, "llama", shrink)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(100,\).*\(128,\)"):
        Decoder.from_pretrained(tmp_path)


def test_untied_checkpoint_needs_lm_head(tmp_path):
    _write_model(tmp_path, "llama", lambda w: w.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        Decoder.from_pretrained(tmp_path)


def test_tied_checkpoint_uses_embeddings_as_lm_head(tmp_path, tiny_decoder):
    """With tie_word_embeddings, a stray lm_head.weight is ignored (transformers ties it too)."""
    _write_model(tmp_path, "qwen2", lambda w: w.__setitem__("lm_head.weight", np.zeros((1024, 128), np.float32)))
    dec, ref = Decoder.from_pretrained(tmp_path), tiny_decoder("qwen2")
    ids = _ids(5)
    np.testing.assert_array_equal(dec.prefill(ids, dec.new_cache(5)), ref.prefill(ids, ref.new_cache(5)))


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_decoder):
    cfg = make_config("qwen3", vocab_size=1024)
    weights = make_weights(ModelConfig.from_dict(cfg), 0)
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_safetensors(tmp_path / fname, {n: weights[n] for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dec = Decoder.from_pretrained(tmp_path)
    ids = _ids(6)
    ref = tiny_decoder("qwen3")
    np.testing.assert_array_equal(dec.prefill(ids, dec.new_cache(6)), ref.prefill(ids, ref.new_cache(6)))


# ---------------------------------------------------------------- sliding window, new families

#: exaone4 with every layer sliding (window 8): no global layer to see past the windows.
ALL_SLIDING = {"layer_types": ["sliding_attention"] * 4}


def test_sliding_window_receptive_field_is_exact(tiny_decoder):
    """4 sliding layers of window 8: the output at position p depends on tokens p - 28 .. p
    (each layer reaches 7 tokens back), so changing token 0 changes position 28 and leaves
    every position from 29 on bit-identical, in one-shot and in chunked prefill."""
    dec = tiny_decoder("exaone4", **ALL_SLIDING)
    ids = _ids(48, seed=4)
    other = ids.copy()
    other[0] = 4 if ids[0] != 4 else 5
    a = dec.prefill(ids, dec.new_cache(48))
    b = dec.prefill(other, dec.new_cache(48))
    assert np.abs(a[28] - b[28]).max() > 1e-4
    np.testing.assert_array_equal(a[29:], b[29:])
    np.testing.assert_array_equal(_chunked(dec, other, [3, 9, 1, 20, 15])[29:], a[29:])
    # the hybrid default has a global layer, which sees token 0 from everywhere
    hybrid = tiny_decoder("exaone4")
    h_a, h_b = hybrid.prefill(ids, hybrid.new_cache(48)), hybrid.prefill(other, hybrid.new_cache(48))
    assert np.abs(h_a[40:] - h_b[40:]).max() > 1e-6


def test_sliding_window_decode_past_the_window(tiny_decoder, record_diff):
    """Decode steps far past the window (30 tokens after a 3-token prompt, window 8; the cache
    keeps every token) equal one-shot prefill of the whole path, and greedy follows its argmax."""
    dec = tiny_decoder("exaone4")
    prompt = _ids(3, seed=9)
    toks = dec.generate_greedy(prompt, 30)
    path = np.concatenate([prompt, toks[:-1]])
    cache = dec.new_cache(len(path))
    steps = np.concatenate([dec.prefill(prompt, cache)] + [dec.prefill([t], cache) for t in toks[:-1]])
    whole = dec.prefill(path, dec.new_cache(len(path)))
    record_diff("exaone4: decode steps vs one-shot prefill", float(np.abs(steps - whole).max()))
    assert np.abs(steps - whole).max() <= CHUNK_TOL
    assert [int(np.argmax(r)) for r in whole[len(prompt) - 1 :]] == toks
    assert cache.length == len(path)  # every token kept, also those out of every window


def test_new_families_forward_embeddings_and_q4x32(tiny_decoder):
    """hyperclovax multiplies given embeddings by embedding_multiplier too (as transformers'
    inputs_embeds), so forward_embeddings(embed(ids)) == prefill(ids); both new families run
    with the Q4_0x32 linear layers."""
    ids = _ids(12, seed=6)
    for arch in ("exaone4", "hyperclovax"):
        dec = tiny_decoder(arch)
        a = dec.prefill(ids, dec.new_cache(12))
        np.testing.assert_array_equal(a, dec.forward_embeddings(dec.embed(ids), dec.new_cache(12)))
        q4 = Decoder(dec.config, make_weights(dec.config, 0), linear="q4x32")
        b = q4.prefill(ids, q4.new_cache(12))
        assert np.isfinite(b).all() and 0 < np.abs(a - b).max() < 0.5 * np.abs(a).max()


def test_hyperclovax_multipliers_are_applied(tiny_decoder):
    """Each MuP factor changes the result; logits_scaling alone scales the logits exactly."""
    base = tiny_decoder("hyperclovax")
    ids = _ids(16, seed=7)
    ref = base.prefill(ids, base.new_cache(16))
    for key, value in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", None)):
        other = tiny_decoder("hyperclovax", **{key: value})
        assert np.abs(other.prefill(ids, other.new_cache(16)) - ref).max() > 1e-2, key
    unit = tiny_decoder("hyperclovax", logits_scaling=1.0)
    np.testing.assert_allclose(unit.prefill(ids, unit.new_cache(16)) * 0.75, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("arch", "missing"), [
    ("exaone4", "model.layers.2.post_feedforward_layernorm.weight"),
    ("exaone4", "model.layers.0.self_attn.q_norm.weight"),
    ("hyperclovax", "model.layers.1.post_norm1.weight"),
])
def test_new_family_checkpoint_missing_norm(tmp_path, arch, missing):
    _write_model(tmp_path, arch, lambda w: w.pop(missing))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        Decoder.from_pretrained(tmp_path)


def test_npusim_imports_with_numpy_alone():
    """Importing npusim.llm and npusim.tinymodel pulls in none of the heavy optional packages."""
    code = (
        "import sys, npusim, npusim.llm, npusim.tinymodel\n"
        "heavy = {'torch', 'transformers', 'tokenizers', 'safetensors', 'vllm'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------- Qwen3-MoE


def test_moe_block_is_the_routed_weighted_sum_in_expert_order(tiny_decoder):
    """A sparse layer's output is, per token, the sum over its top-k experts in ascending expert
    id of weight x expert(x), each step rounded to the dtype (transformers' index_add_ order):
    bit for bit, in float16 where the order matters."""
    dec = tiny_decoder("qwen3_moe", dtype=np.float16)
    x = np.random.default_rng(3).normal(size=(16, 128)).astype(np.float16)
    experts, weights = dec.route(0, x)
    assert experts.shape == weights.shape == (16, 2) and weights.dtype == np.float16
    assert np.all(experts[:, 0] != experts[:, 1])
    np.testing.assert_allclose(weights.astype(np.float64).sum(axis=1), 1.0, atol=2e-3)  # norm_topk_prob
    got = dec._mlp(0, dec._layers[0], x)
    for t in range(16):
        acc = np.zeros(128, dtype=np.float16)
        for slot in np.argsort(experts[t]):
            y = dec.expert(0, int(experts[t, slot]), x[t : t + 1])[0]
            acc = (acc.astype(np.float64) + (y.astype(np.float64) * float(weights[t, slot])).astype(np.float16)).astype(np.float16)
        assert np.array_equal(got[t], acc), t


def test_moe_router_is_softmax_top_k(tiny_decoder):
    """route() picks the k largest softmax probabilities (lowest id first on a tie) and
    renormalises them with norm_topk_prob; without it the weights are the probabilities."""
    x = np.random.default_rng(4).normal(size=(8, 128))
    for norm in (True, False):
        dec = tiny_decoder("qwen3_moe", dtype=np.float64, norm_topk_prob=norm)
        logits = x @ dec._layers[1]["router"].T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        experts, weights = dec.route(1, x)
        want = np.argsort(-p, axis=1, kind="stable")[:, :2]
        assert np.array_equal(experts, want)
        w = np.take_along_axis(p, want, axis=1)
        np.testing.assert_allclose(weights, w / w.sum(axis=1, keepdims=True) if norm else w, rtol=1e-12)


def test_moe_errors_name_the_value(tiny_decoder):
    dense_first = tiny_decoder("qwen3_moe", mlp_only_layers=[0])
    with pytest.raises(ValueError, match=r"layer 0 has no router \(the sparse layers are \[1\]\)"):
        dense_first.route(0, np.zeros((1, 128)))
    with pytest.raises(ValueError, match=r"expected router inputs of shape \[T, 128\], got shape \(2, 64\)"):
        dense_first.route(1, np.zeros((2, 64)))
    with pytest.raises(ValueError, match=r"expert 8 is out of range \[0, 8\)"):
        dense_first.expert(1, 8, np.zeros((1, 128)))
    with pytest.raises(ValueError, match=r"layer 0 has no experts"):
        tiny_decoder("llama").expert(0, 0, np.zeros((1, 128)))


def test_moe_has_no_q4x32_path():
    from npusim.llm import UnsupportedLinearError

    cfg = ModelConfig.from_dict(make_config("qwen3_moe", vocab_size=1024))
    with pytest.raises(UnsupportedLinearError, match=r"linear='q4x32' does not cover Mixture-of-Experts layers \(qwen3_moe: 8 experts\)"):
        Decoder(cfg, make_weights(cfg), linear="q4x32")


def test_fingerprint_names_the_parameters(tmp_path):
    """Two decoders of one checkpoint share a fingerprint; another seed's weights do not."""
    import json

    from npusim.llm import Decoder, ModelConfig, save_safetensors
    from npusim.tinymodel import make_config, make_weights

    def build(d, seed):
        d.mkdir()
        cfg = make_config("llama")
        (d / "config.json").write_text(json.dumps(cfg))
        save_safetensors(d / "model.safetensors", make_weights(ModelConfig.from_dict(cfg), seed=seed))
        return Decoder.from_pretrained(d)

    a, b, c = build(tmp_path / "a", 0), build(tmp_path / "b", 0), build(tmp_path / "c", 1)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert len(a.fingerprint()) == 64
