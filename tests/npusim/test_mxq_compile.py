"""npusim.mxq.compile.compile_artifact: the Mobilint artifact layout, defaults, and input validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npusim.llm import load_safetensors
from npusim.mxq.compile import compile_artifact
from npusim.mxq.mxqfile import read_mxq


def test_artifact_layout_and_config(mxq_hf_dir, tmp_path):
    out = compile_artifact(mxq_hf_dir, tmp_path / "art", max_batch_size=4, prefill_chunk_size={"single": 64, "default": 192})
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.mxq", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mobilint-llama" and cfg["architectures"] == ["MobilintLlamaForCausalLM"]
    assert (cfg["mxq_path"], cfg["max_batch_size"], cfg["core_mode"], cfg["target_device"], cfg["dev_no"]) == (
        "model.mxq", 4, "single", "aries", 0)
    assert cfg["npu_prefill_chunk_size"] == {"single": 64, "default": 192}
    assert cfg["tie_word_embeddings"] is False and cfg["max_position_embeddings"] == 256
    assert cfg["_name_or_path"] == str(mxq_hf_dir) and cfg["hidden_size"] == 128
    emb = load_safetensors(out / "model.safetensors")
    assert list(emb) == ["model.embed_tokens.weight"]
    np.testing.assert_array_equal(emb["model.embed_tokens.weight"], load_safetensors(mxq_hf_dir)["model.embed_tokens.weight"])
    assert (out / "tokenizer.json").read_bytes() == (mxq_hf_dir / "tokenizer.json").read_bytes()
    header, _ = read_mxq(out / "model.mxq")
    assert (header["max_batch_size"], header["max_cache_size"], header["max_width"]) == (4, 256, 128)  # defaults: T=min(256, 4096), W=128 (batch MXQ)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_batch_size": 0}, "max_batch_size 0 must be an integer >= 1"),
     ({"max_cache_size": 0}, "max_cache_size 0 must be an integer >= 1"),
     ({"max_cache_size": 257}, "max_cache_size 257 must be <= max_position_embeddings 256"),
     ({"core_mode": "dual"}, "core_mode 'dual' must be one of auto, single, multi, global4, global8"),
     ({"max_batch_size": 2, "core_mode": "global4"}, "core_mode 'global4' is not allowed with max_batch_size 2"),
     ({"prefill_chunk_size": 0}, "prefill_chunk_size 0 must be an integer >= 1"),
     ({"prefill_chunk_size": {"turbo": 64}}, "prefill_chunk_size key 'turbo' must be one of"),
     ({"prefill_chunk_size": {"single": -1}}, "prefill_chunk_size['single'] -1 must be an integer >= 1"),
     ({"max_width": 64, "prefill_chunk_size": 128}, "max_width 64 must be >= every prefill chunk size (largest: 128)"),
     ({"output_logits": "first"}, "output_logits 'first' must be 'last' or 'all'")],
)
def test_bad_arguments_name_value_and_rule(mxq_hf_dir, tmp_path, kwargs, message):
    with pytest.raises(ValueError) as exc:
        compile_artifact(mxq_hf_dir, tmp_path / "art", **kwargs)
    assert message in str(exc.value)
    assert not (tmp_path / "art").exists()


def test_unsupported_model_type(mxq_hf_dir, tmp_path):
    src = tmp_path / "gpt"
    src.mkdir()
    cfg = json.loads((mxq_hf_dir / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' must be one of llama, qwen2, qwen3"):
        compile_artifact(src, tmp_path / "art")


def test_batch_mxq_width_is_the_128_token_batch_limit(tmp_path):
    """A batch MXQ (K > 1) is 128 wide by default even when its config advertises bigger
    chunks (the plugin clamps those to 128), and cannot be compiled wider."""
    from npusim import tinymodel
    from npusim.mxq.compile import BATCH_MAX_WIDTH, compile_artifact
    from npusim.mxq.mxqfile import read_mxq

    hf = tinymodel.build("llama", tmp_path / "hf")
    out = compile_artifact(hf, tmp_path / "k4", max_batch_size=4, prefill_chunk_size={"single": 256})
    assert read_mxq(out / "model.mxq")[0]["max_width"] == BATCH_MAX_WIDTH == 128
    with pytest.raises(ValueError, match=r"max_width 256 exceeds 128, the most tokens a batch MXQ"):
        compile_artifact(hf, tmp_path / "k4w", max_batch_size=4, max_width=256)
    one = compile_artifact(hf, tmp_path / "k1", max_batch_size=1, prefill_chunk_size={"single": 256})
    assert read_mxq(one / "model.mxq")[0]["max_width"] == 256
