"""Golden reference decoder scenarios (the ``ref`` column): ``npusim.llm`` against Hugging Face
transformers on the project's tiny checkpoints, and the KV-cache contract every device
simulator builds on.

Tolerances (fp32): max |logit difference| ≤ 1e-4 against transformers over a 64-token
prompt; chunked or batched prefill within 1e-5 of one-shot prefill; greedy decoding of 32
tokens identical to ``transformers`` ``generate``.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from npusim.tinymodel import ARCHES

HF_TOLERANCE = 1e-4
SELF_TOLERANCE = 1e-5
PROMPT_LEN = 64
NEW_TOKENS = 32

scenario = pytest.mark.scenario(devices=("ref",))
arches = pytest.mark.parametrize("arch", ARCHES)


def _prompt(vocab_size: int, n: int = PROMPT_LEN, seed: int = 1234) -> np.ndarray:
    """``n`` random ordinary token ids (the tiny tokenizers put their 4 special tokens at 0-3)."""
    return np.random.default_rng(seed).integers(4, vocab_size, size=n)


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None])).logits[0].float().numpy()


@scenario
@arches
def test_logits_vs_transformers(target, record, arch, tiny_model_dir, hf_model, golden_decoder):
    dec = golden_decoder(arch)
    ids = _prompt(dec.config.vocab_size)
    ours = dec.prefill(ids, dec.new_cache(PROMPT_LEN))
    theirs = _hf_logits(hf_model(tiny_model_dir(arch)), ids)
    assert ours.shape == theirs.shape == (PROMPT_LEN, dec.config.vocab_size)
    diff = float(np.max(np.abs(ours - theirs)))
    record.figure("max_abs_logit_diff", diff)
    assert diff <= HF_TOLERANCE, f"max |Δlogit| {diff:.3g} > {HF_TOLERANCE}"


@scenario
@arches
def test_greedy_vs_transformers(target, record, arch, tiny_model_dir, hf_model, golden_decoder):
    """32 greedy tokens equal to ``generate(do_sample=False)``, both sides decoding exactly 32
    (no eos stop); the logits along the generated path also stay within 1e-4."""
    import torch

    model = hf_model(tiny_model_dir(arch))
    dec = golden_decoder(arch)
    ids = _prompt(dec.config.vocab_size, n=16)
    ours = dec.generate_greedy(ids, NEW_TOKENS)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor(ids[None]), generation_config=config,
                             do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    record.figure("tokens_equal", sum(a == b for a, b in zip(ours, theirs)), f"of {NEW_TOKENS}")
    assert ours == theirs
    path = np.concatenate([ids, ours[:-1]])
    diff = float(np.max(np.abs(dec.prefill(path, dec.new_cache(len(path))) - _hf_logits(model, path))))
    record.figure("max_abs_logit_diff_on_path", diff)
    assert diff <= HF_TOLERANCE


@scenario
@arches
def test_chunked_prefill(target, record, arch, golden_decoder):
    dec = golden_decoder(arch)
    ids = _prompt(dec.config.vocab_size)
    whole = dec.prefill(ids, dec.new_cache(PROMPT_LEN))
    worst = 0.0
    for chunk in (1, 5, 16, 63):
        cache = dec.new_cache(PROMPT_LEN)
        parts = [dec.prefill(ids[i:i + chunk], cache) for i in range(0, PROMPT_LEN, chunk)]
        worst = max(worst, float(np.max(np.abs(np.concatenate(parts) - whole))))
        assert cache.length == PROMPT_LEN
    record.figure("max_abs_diff_vs_one_shot", worst)
    assert worst <= SELF_TOLERANCE


@scenario
@arches
def test_batched_steps(target, record, arch, golden_decoder):
    """Three sequences of different cached lengths advance in one batched step."""
    dec = golden_decoder(arch)
    vocab = dec.config.vocab_size
    prefixes = [_prompt(vocab, n, seed=n) for n in (3, 17, 40)]
    steps = [_prompt(vocab, n, seed=100 + n) for n in (1, 1, 4)]
    solo, batch_caches = [], []
    for prefix, step in zip(prefixes, steps):
        cache = dec.new_cache(64)
        dec.prefill(prefix, cache)
        batch_caches.append(cache.copy())
        solo.append(dec.prefill(step, cache))
    batched = dec.step_batch(list(zip(steps, batch_caches)))
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(batched, solo))
    record.figure("max_abs_diff_vs_solo", worst)
    assert worst <= SELF_TOLERANCE
    assert [c.length for c in batch_caches] == [3 + 1, 17 + 1, 40 + 4]


@scenario
@arches
def test_kv_capacity_overflow(target, arch, golden_decoder):
    from npusim.llm import KVCacheOverflowError

    dec = golden_decoder(arch)
    cache = dec.new_cache(20)
    dec.prefill(_prompt(dec.config.vocab_size, 16), cache)
    with pytest.raises(KVCacheOverflowError, match="20") as info:
        dec.prefill(_prompt(dec.config.vocab_size, 8), cache)
    assert "16" in str(info.value) and "24" in str(info.value)
    assert cache.length == 16, "a refused append must leave the cache unchanged"


@scenario
@arches
def test_decode_speed(target, record, arch, golden_decoder):
    """Figures only: prefill and decode speed of the numpy reference on this machine."""
    dec = golden_decoder(arch)
    ids = _prompt(dec.config.vocab_size)
    dec.prefill(ids, dec.new_cache(PROMPT_LEN))  # warm-up: first-call allocations
    t0 = time.perf_counter()
    cache = dec.new_cache(PROMPT_LEN + NEW_TOKENS)
    logits = dec.prefill(ids, cache)
    t1 = time.perf_counter()
    token = int(np.argmax(logits[-1]))
    for _ in range(NEW_TOKENS):
        token = int(np.argmax(dec.prefill([token], cache)[-1]))
    t2 = time.perf_counter()
    assert cache.length == PROMPT_LEN + NEW_TOKENS
    record.figure("prefill_tok_per_s", PROMPT_LEN / (t1 - t0), "tok/s")
    record.figure("decode_tok_per_s", NEW_TOKENS / (t2 - t1), "tok/s")
