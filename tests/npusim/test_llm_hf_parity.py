"""RoPE scaling of the golden numpy decoder against Hugging Face transformers.

The per-family checks (64-token prefill within 1e-4, greedy decoding of 32 tokens identical
to ``generate``) are the reference conformance scenarios,
``conformance/npu_conformance/scenarios/test_llm_reference.py``, which this suite also runs.
Here: RoPE scaling types ``linear``, ``dynamic`` and ``llama3`` within 1e-4, and greedy
decoding identical; and the EXAONE 4 / HyperCLOVA X / Qwen3-MoE variants (sliding window 8 crossed by
prompts and decoding, global NoPE layers, post/Peri-LN norms, MuP multipliers): one-shot and
chunked prefill of 64 tokens within 1e-4 (NMSE <= 1e-9) of transformers' forward, chunked
prefill also against transformers fed the same chunks through its own cache, and greedy
decoding identical to ``generate(do_sample=False)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from npusim.llm import Decoder, ModelConfig, load_safetensors  # noqa: E402

LOGIT_TOL = 1e-4
NMSE_TOL = 1e-9  # mean squared error / mean squared reference logit
CHUNK_TOL = 1e-5


def _prompt(n: int, seed: int = 7, vocab: int = 1024) -> np.ndarray:
    # ids 4.. avoid the special tokens (ids 0..3)
    return np.random.default_rng(seed).integers(4, vocab, size=n)


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)[None]).logits[0].float().numpy()


def _hf_greedy(model, ids: np.ndarray, n: int) -> list[int]:
    with torch.no_grad():
        inp = torch.tensor(ids, dtype=torch.long)[None]
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


ROPE_CASES = {
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
    # max_position_embeddings < prompt length, so the NTK rescale really happens
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32},
    # original context 64: with head_dim 32 and theta 1e4 the wavelengths span all three bands
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_CASES))
def test_rope_scaling_matches_hf(rope_type, tiny_model_dir, hf_model, record_diff):
    """Llama with RoPE scaling: 64-token prefill within 1e-4 of HF, and greedy decoding identical.

    For ``dynamic`` each decode step has a longer sequence, so the base is rescaled again for
    the new token while cached keys keep their rotation (as in transformers). A fresh HF model
    is used for each comparison because transformers' dynamic RoPE is stateful.
    """
    d = tiny_model_dir("llama", **ROPE_CASES[rope_type])
    dec = Decoder.from_pretrained(d)
    assert dec.config.rope.rope_type == rope_type
    ids = _prompt(64, seed=3)
    ours = dec.prefill(ids, dec.new_cache(64))
    ref = _hf_logits(hf_model(d, fresh=True), ids)
    diff = float(np.abs(ours - ref).max())
    record_diff(f"llama rope={rope_type}: prefill(64) vs HF forward", diff)
    assert diff <= LOGIT_TOL

    if rope_type == "dynamic":  # the rescale must matter, or this test proves nothing
        plain_cfg = ModelConfig.from_dict({**dec.config.raw, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
        plain = Decoder(plain_cfg, load_safetensors(d))
        assert np.abs(plain.prefill(ids, plain.new_cache(64)) - ours).max() > 1e-2

    prompt = _prompt(40, seed=5)
    ours_gen = dec.generate_greedy(prompt, 16, eos_token_id=list(dec.config.eos_token_ids))
    assert ours_gen == _hf_greedy(hf_model(d, fresh=True), prompt, 16)


# ---------------------------------------------------------------- exaone4 / hyperclovax

#: name -> (arch, config overrides). The default tiny exaone4 is hybrid: layers
#: sliding(8) / sliding / sliding / global, RoPE only in the sliding ones.
FAMILY_CASES = {
    "exaone4": ("exaone4", {}),
    # sliding_window null: every layer global and rotated (transformers' non-hybrid EXAONE 4)
    "exaone4-no-window": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}),
    "hyperclovax": ("hyperclovax", {}),
    # no Peri-LN output norms, the standard head_dim ** -0.5 attention scale
    "hyperclovax-plain": ("hyperclovax", {"use_post_norm": False, "attention_multiplier": None}),
    # Qwen3-MoE: every layer sparse (8 experts, top-2, renormalised); a dense first layer
    # (mlp_only_layers); every second layer sparse and the top-k weights not renormalised
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-dense-first": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "qwen3_moe-step2-raw-weights": ("qwen3_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2, "norm_topk_prob": False}),
}
#: Chunk sizes of a 64-token prompt that start and end chunks inside and across windows of 8.
CHUNKS = [5, 3, 8, 1, 13, 2, 32]


def _nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean((ours.astype(np.float64) - ref) ** 2) / np.mean(ref.astype(np.float64) ** 2))


def _check_logits(name: str, ours: np.ndarray, ref: np.ndarray, record_diff) -> None:
    diff, nmse = float(np.abs(ours - ref).max()), _nmse(ours, ref)
    record_diff(name, diff)
    record_diff(name + " NMSE", nmse)
    assert ours.shape == ref.shape
    assert diff <= LOGIT_TOL and nmse <= NMSE_TOL, (diff, nmse)


def _hf_chunked_logits(model, ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    """transformers fed ``ids`` in chunks through its own cache (sliding layers keep only the
    last ``sliding_window - 1`` tokens there)."""
    from transformers import DynamicCache

    cache, out, pos = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in sizes:
            chunk = torch.tensor(ids[pos : pos + n], dtype=torch.long)[None]
            res = model(chunk, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            out.append(res.logits[0].float().numpy())
            pos += n
    return np.concatenate(out)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_family_prefill_matches_hf(case, tiny_model_dir, hf_model, record_diff):
    """64-token prompt (8 windows of 8): one-shot and chunked prefill equal transformers'
    forward (max |d| <= 1e-4, NMSE <= 1e-9), chunked equals one-shot (<= 1e-5), and
    transformers fed the same chunks agrees too."""
    arch, overrides = FAMILY_CASES[case]
    d = tiny_model_dir(arch, **overrides)
    dec = Decoder.from_pretrained(d)
    model = hf_model(d)
    assert type(model).__name__ == {"exaone4": "Exaone4ForCausalLM", "hyperclovax": "HyperCLOVAXForCausalLM",
                                    "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    ids = _prompt(64, seed=3)
    ref = _hf_logits(model, ids)
    ours = dec.prefill(ids, dec.new_cache(64))
    _check_logits(f"{case}: prefill(64) vs HF forward", ours, ref, record_diff)

    cache, parts, pos = dec.new_cache(64), [], 0
    for n in CHUNKS:
        parts.append(dec.prefill(ids[pos : pos + n], cache))
        pos += n
    chunked = np.concatenate(parts)
    record_diff(f"{case}: chunked vs one-shot prefill", float(np.abs(chunked - ours).max()))
    assert np.abs(chunked - ours).max() <= CHUNK_TOL
    _check_logits(f"{case}: chunked prefill vs HF forward", chunked, ref, record_diff)
    _check_logits(f"{case}: chunked prefill vs HF chunked", chunked, _hf_chunked_logits(model, ids, CHUNKS), record_diff)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_family_greedy_matches_hf(case, tiny_model_dir, hf_model, record_diff):
    """A 5-token prompt (inside the window) and 24 greedy tokens (decode steps cross the window
    at step 4): identical to ``generate(do_sample=False)``; the logits along the path within 1e-4."""
    arch, overrides = FAMILY_CASES[case]
    d = tiny_model_dir(arch, **overrides)
    dec = Decoder.from_pretrained(d)
    model = hf_model(d)
    for seed in (5, 11):
        prompt = _prompt(5, seed=seed)
        ours = dec.generate_greedy(prompt, 24)  # no eos stop on either side
        with torch.no_grad():
            inp = torch.tensor(prompt, dtype=torch.long)[None]
            out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=24,
                                 min_new_tokens=24, pad_token_id=0)
        assert ours == out[0, len(prompt) :].tolist()
        path = np.concatenate([prompt, ours[:-1]])
        _check_logits(f"{case}: prefill(greedy path) vs HF", dec.prefill(path, dec.new_cache(len(path))),
                      _hf_logits(model, path), record_diff)


def test_exaone4_window_and_nope_matter(tiny_model_dir, hf_model):
    """The parity above proves something: a much wider window, or RoPE in the global layer,
    moves the logits far beyond the tolerance."""
    d = tiny_model_dir("exaone4")
    dec = Decoder.from_pretrained(d)
    assert [dec.config.uses_rope(i) for i in range(4)] == [True, True, True, False]
    weights = load_safetensors(d)
    ids = _prompt(64, seed=3)
    ours = dec.prefill(ids, dec.new_cache(64))
    wide = Decoder(ModelConfig.from_dict({**dec.config.raw, "sliding_window": 64}), weights)
    assert np.abs(wide.prefill(ids, wide.new_cache(64)) - ours).max() > 1e-2
    roped = Decoder(dataclasses.replace(dec.config, full_attention_rope=True), weights)  # RoPE in layer 3 too
    assert np.abs(roped.prefill(ids, roped.new_cache(64)) - ours).max() > 1e-2


def test_qwen3_moe_routing_matters(tiny_model_dir, hf_model):
    """The Qwen3-MoE parity above proves something: each layer's router spreads 64 inputs over
    all 8 experts (none is dead weight), and routing differently (top-1, or the top-2 weights not renormalised) moves
    the logits far beyond the tolerance."""
    d = tiny_model_dir("qwen3_moe")
    dec = Decoder.from_pretrained(d)
    weights = load_safetensors(d)
    ids = _prompt(64, seed=3)
    ours = dec.prefill(ids, dec.new_cache(64))
    for layer in range(dec.config.num_hidden_layers):
        h = np.random.default_rng(layer).normal(size=(64, dec.config.hidden_size))
        experts, _ = dec.route(layer, h)
        assert set(experts.ravel().tolist()) == set(range(8))
    for change in ({"num_experts_per_tok": 1}, {"norm_topk_prob": False}):
        other = Decoder(ModelConfig.from_dict({**dec.config.raw, **change}), weights)
        assert np.abs(other.prefill(ids, other.new_cache(64)) - ours).max() > 1e-2, change
