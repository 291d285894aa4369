"""npusim.tinymodel: deterministic tiny HF checkpoints with a locally trained tokenizer."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import numpy as np
import pytest

import npusim.tinymodel as tinymodel
from npusim.llm import Decoder, load_config, load_safetensors
from npusim.tinymodel import ARCHES

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "hyperclovax": "HyperCLOVAXForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_arches():
    assert tinymodel.ARCHES == ("llama", "qwen2", "qwen3", "exaone4", "hyperclovax", "qwen3_moe")


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match=r"unknown arch 'gpt2' \(choices: llama, qwen2, qwen3, exaone4, hyperclovax, qwen3_moe\)"):
        tinymodel.build("gpt2", tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arch", ARCHES)
def test_files_and_contents(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    assert {p.name for p in d.iterdir()} == EXPECTED_FILES
    assert sum(p.stat().st_size for p in d.iterdir()) < 5 * 2**20
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["architectures"] == [ARCHITECTURES[arch]]
    assert cfg["dtype"] == "float32" and cfg["vocab_size"] == 1024
    theta = 10000.0 if arch in ("llama", "hyperclovax") else 1e6
    assert cfg["rope_parameters"] == {"rope_theta": theta, "rope_type": "default"}
    assert cfg["tie_word_embeddings"] == (arch in ("qwen2", "qwen3"))
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    tok = json.loads((d / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert specials == {"<|endoftext|>": 0, "<|begin_of_text|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    assert specials["<|endoftext|>"] == cfg["eos_token_id"] == cfg["pad_token_id"]
    assert specials["<|begin_of_text|>"] == cfg["bos_token_id"]
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tc["chat_template"]
    assert tc["model_max_length"] == cfg["max_position_embeddings"] == (40960 if arch == "qwen3_moe" else 1024)

    weights = load_safetensors(d)
    assert all(w.dtype == np.float32 for w in weights.values())
    assert ("lm_head.weight" in weights) == (arch in ("llama", "exaone4", "hyperclovax", "qwen3_moe"))
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (arch == "qwen2")
    assert ("model.layers.1.self_attn.k_norm.weight" in weights) == (arch in ("qwen3", "exaone4", "qwen3_moe"))
    assert ("model.layers.1.mlp.gate.weight" in weights) == (arch == "qwen3_moe")  # the MoE router
    assert ("model.layers.1.mlp.experts.7.down_proj.weight" in weights) == (arch == "qwen3_moe")
    assert ("model.layers.1.mlp.gate_proj.weight" in weights) == (arch != "qwen3_moe")
    assert ("model.layers.1.input_layernorm.weight" in weights) == (arch != "exaone4")
    assert ("model.layers.1.post_feedforward_layernorm.weight" in weights) == (arch == "exaone4")
    assert ("model.layers.1.post_norm2.weight" in weights) == (arch == "hyperclovax")
    assert all(w.std() < 0.2 for n, w in weights.items() if n.endswith("norm.weight") or ".post_norm" in n)
    dec = Decoder.from_pretrained(d)
    logits = dec.prefill(np.arange(4, 36), dec.new_cache(32))
    assert np.isfinite(logits).all() and 0.5 < logits.std() < 20


def test_deterministic_for_a_seed(tmp_path):
    """Same arguments -> byte-identical files (sha256); another seed changes only the weights."""
    pytest.importorskip("tokenizers")
    a = _digests(tinymodel.build("qwen2", tmp_path / "a", seed=3))
    b = _digests(tinymodel.build("qwen2", tmp_path / "b", seed=3))
    c = _digests(tinymodel.build("qwen2", tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {k: v for k, v in c.items() if k != "model.safetensors"}
    # rebuilding into an existing directory overwrites it with the same bytes
    assert _digests(tinymodel.build("qwen2", tmp_path / "a", seed=3)) == a


def test_overrides(tiny_model_dir):
    d = tiny_model_dir("qwen3", num_hidden_layers=1, max_position_embeddings=32,
                   rope_parameters={"rope_type": "linear", "factor": 2.0})
    cfg = load_config(d)
    assert cfg.num_hidden_layers == 1 and cfg.max_position_embeddings == 32
    assert cfg.rope.rope_type == "linear" and cfg.rope.theta == 1e6  # the arch's theta is kept
    assert cfg.raw["layer_types"] == ["full_attention"]
    assert not any(n.startswith("model.layers.1.") for n in load_safetensors(d))
    assert json.loads((d / "tokenizer_config.json").read_text())["model_max_length"] == 32


def test_exaone4_config(tiny_model_dir):
    """Hybrid attention: LLLG over 4 layers, window 8; fewer layers keep the last one global."""
    d = tiny_model_dir("exaone4")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"], cfg["num_hidden_layers"]) == (8, "LLLG", 4)
    names = set(load_safetensors(d))
    assert not any("input_layernorm" in n for n in names) and "model.layers.3.post_attention_layernorm.weight" in names
    two = tinymodel.make_config("exaone4", num_hidden_layers=2)
    assert two["layer_types"] == ["sliding_attention", "full_attention"]
    assert tinymodel.make_config("exaone4", num_hidden_layers=1)["layer_types"] == ["full_attention"]
    assert tinymodel.make_config("exaone4", num_hidden_layers=9)["layer_types"][4:] == ["sliding_attention"] * 3 + ["full_attention"] * 2
    assert "layer_types" not in tinymodel.make_config("hyperclovax") and "layer_types" not in tinymodel.make_config("llama")


def test_hyperclovax_config(tiny_model_dir):
    """MuP factors away from 1, Peri-LN norms written; use_post_norm=False drops post_norm1/2."""
    d = tiny_model_dir("hyperclovax")
    cfg = json.loads((d / "config.json").read_text())
    assert {k: cfg[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")} == {
        "embedding_multiplier": 1.5, "residual_multiplier": 1.25, "attention_multiplier": 0.125, "logits_scaling": 0.75}
    assert cfg["use_post_norm"] is True
    assert {"model.layers.0.post_norm1.weight", "model.layers.0.post_norm2.weight"} <= set(load_safetensors(d))
    plain = tiny_model_dir("hyperclovax", use_post_norm=False)
    assert not any(".post_norm" in n for n in load_safetensors(plain))


def test_vocab_override_must_cover_the_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match="smaller than the tokenizer's 1024 tokens"):
        tinymodel.build("llama", tmp_path, vocab_size=512)


def test_corpus_is_a_few_kb_of_text():
    module = importlib.import_module("npusim.tinymodel.build")
    text = (Path(module.__file__).parent / "corpus.txt").read_text(encoding="utf-8")
    assert 4_000 < len(text.encode()) < 50_000
    assert len(set(text.lower().split())) > 600


@pytest.mark.parametrize("arch", ARCHES)
def test_transformers_loads_tokenizer_and_chat_template(arch, tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    d = tiny_model_dir(arch)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == 1024
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|endoftext|>", "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 0, 0)
    text = "The keeper climbed the steps and wrote the weather into her logbook."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text) // 2  # real merges, no bos added
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == prompt[: -len("<|im_start|>assistant\n")]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    assert ids[0] == 2 and ids.count(3) == 2
    cfg = transformers.AutoConfig.from_pretrained(d)
    assert cfg.model_type == arch and cfg.vocab_size == 1024
