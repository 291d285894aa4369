"""ModelConfig / RopeConfig parsing and the configs the golden decoder refuses (numpy only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npusim.llm import (
    CheckpointError,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
    load_config,
)
from npusim.tinymodel import ARCHES, make_config


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_configs_parse(arch):
    cfg = ModelConfig.from_dict(make_config(arch))
    assert cfg.model_type == arch
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 4, 2, 32)
    assert (cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings) == (256, 2, 1024, 1024)
    assert cfg.num_key_value_groups == 2 and cfg.q_size == 128 and cfg.kv_size == 64
    assert cfg.tie_word_embeddings == (arch != "llama")
    assert cfg.attention_bias == (arch == "qwen2") and not cfg.o_proj_bias and not cfg.mlp_bias
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.rope == RopeConfig("default", 10000.0 if arch == "llama" else 1e6, 32, 1024)
    assert cfg.eos_token_ids == (0,) and cfg.bos_token_id == 1 and cfg.pad_token_id == 0
    assert cfg.dtype == "float32"
    hash(cfg)  # frozen and hashable


def test_llama_biases_follow_the_config():
    cfg = ModelConfig.from_dict(make_config("llama", attention_bias=True, mlp_bias=True))
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias
    # qwen2 always has q/k/v biases and never an o_proj bias, whatever attention_bias says
    q2 = ModelConfig.from_dict(make_config("qwen2", attention_bias=False))
    assert q2.attention_bias and not q2.o_proj_bias


def test_head_dim_defaults_to_hidden_over_heads():
    d = make_config("qwen2")
    del d["head_dim"]
    assert ModelConfig.from_dict(d).head_dim == 32


def test_load_config_reads_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(make_config("qwen3")))
    assert load_config(tmp_path) == load_config(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no such config"):
        load_config(tmp_path / "missing")
    (tmp_path / "bad" ).mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read config"):
        load_config(tmp_path / "bad")
    d = make_config("llama")
    del d["hidden_size"]
    (tmp_path / "bad" / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_config(tmp_path / "bad")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"model_type": "mistral"}, r"model_type 'mistral' is not supported \(supported: llama, qwen2, qwen3\)"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported.*silu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
         r"rope type 'yarn' is not supported \(supported: default, linear, dynamic, llama3\)"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, r"rope type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         r"partial_rotary_factor 0.5 is not supported"),
    ],
)
def test_unsupported_llama_configs(overrides, pattern):
    with pytest.raises(UnsupportedModelError, match=pattern):
        ModelConfig.from_dict(make_config("llama", **overrides))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sliding_window_is_unsupported(arch):
    with pytest.raises(UnsupportedModelError, match=r"sliding-window attention \(use_sliding_window=true, sliding_window=64\)"):
        ModelConfig.from_dict(make_config(arch, use_sliding_window=True, sliding_window=64))
    with pytest.raises(UnsupportedModelError, match=r"layer_types \['sliding_attention'\]"):
        ModelConfig.from_dict(make_config(arch, layer_types=["full_attention", "sliding_attention"]))


def test_unsupported_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError) and issubclass(CheckpointError, ValueError)


def test_bad_sizes_are_checkpoint_errors():
    with pytest.raises(CheckpointError, match="num_key_value_heads 3"):
        ModelConfig.from_dict(make_config("llama", num_key_value_heads=3))
    with pytest.raises(CheckpointError, match="vocab_size"):
        ModelConfig.from_dict(make_config("llama", vocab_size=0))


def test_rope_old_and_new_formats_agree():
    """transformers 5.x ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` parse the same."""
    new = make_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    old = make_config("llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    del old["rope_parameters"]
    assert ModelConfig.from_dict(new).rope == ModelConfig.from_dict(old).rope
    old2 = make_config("llama", rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    del old2["rope_parameters"]
    assert ModelConfig.from_dict(old2).rope == ModelConfig.from_dict(new).rope
    plain = make_config("llama", rope_theta=3e4)
    del plain["rope_parameters"]
    assert ModelConfig.from_dict(plain).rope == RopeConfig("default", 3e4, 32, 1024)
    assert ModelConfig.from_dict({k: v for k, v in plain.items() if k != "rope_theta"}).rope.theta == 10000.0


def test_llama3_original_max_defaults():
    p = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5}
    assert ModelConfig.from_dict(make_config("llama", rope_parameters=p)).rope.original_max_position_embeddings == 1024
    top = make_config("llama", rope_parameters={**p, "original_max_position_embeddings": 64}, original_max_position_embeddings=128)
    assert ModelConfig.from_dict(top).rope.original_max_position_embeddings == 128  # as transformers: top level wins
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_dict(make_config("llama", rope_parameters={"rope_type": "llama3", "factor": 8.0}))


def test_rope_frequencies():
    r = RopeConfig("default", 10000.0, 8, 64)
    np.testing.assert_allclose(r.inv_freq(dtype=np.float64), 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8))
    lin = RopeConfig("linear", 10000.0, 8, 64, factor=4.0)
    np.testing.assert_allclose(lin.inv_freq(dtype=np.float64), r.inv_freq(dtype=np.float64) / 4)
    dyn = RopeConfig("dynamic", 10000.0, 8, 64, factor=2.0)
    np.testing.assert_array_equal(dyn.inv_freq(64), r.inv_freq(64))  # no rescale up to max_position_embeddings
    base = 10000.0 * (2.0 * 128 / 64 - 1.0) ** (8 / 6)
    np.testing.assert_allclose(dyn.inv_freq(128, np.float64), 1.0 / base ** (np.arange(0, 8, 2) / 8))
    cos, sin = r.cos_sin(np.arange(3))
    assert cos.shape == sin.shape == (3, 8)
    np.testing.assert_allclose(cos[0], 1.0) and np.testing.assert_allclose(sin[0], 0.0)
