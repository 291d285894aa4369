"""RoPE scaling of the golden numpy decoder against Hugging Face transformers.

The per-family checks (64-token prefill within 1e-4, greedy decoding of 32 tokens identical
to ``generate``) are the reference conformance scenarios,
``conformance/npu_conformance/scenarios/test_llm_reference.py``, which this suite also runs.
Here: RoPE scaling types ``linear``, ``dynamic`` and ``llama3`` within 1e-4, and greedy
decoding identical.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from npusim.llm import Decoder, ModelConfig, load_safetensors  # noqa: E402

LOGIT_TOL = 1e-4


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
