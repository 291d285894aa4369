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
    layers = 4 if arch == "exaone4" else 2
    assert cfg.model_type == arch
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 4, 2, 32)
    assert (cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, layers, 1024)
    assert cfg.max_position_embeddings == (40960 if arch == "qwen3_moe" else 1024)  # as Qwen3-30B-A3B declares
    assert cfg.num_key_value_groups == 2 and cfg.q_size == 128 and cfg.kv_size == 64
    assert cfg.tie_word_embeddings == (arch in ("qwen2", "qwen3"))
    assert cfg.attention_bias == (arch == "qwen2") and not cfg.o_proj_bias and not cfg.mlp_bias
    assert cfg.qk_norm == (arch in ("qwen3", "exaone4", "qwen3_moe"))
    theta = 10000.0 if arch in ("llama", "hyperclovax") else 1e6
    assert cfg.rope == RopeConfig("default", theta, 32, cfg.max_position_embeddings)
    assert cfg.norm_layout == {"exaone4": "post", "hyperclovax": "peri"}.get(arch, "pre")
    if arch == "exaone4":
        assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention",) and cfg.sliding_window == 8
    else:
        assert cfg.layer_types == ("full_attention",) * layers and cfg.sliding_window is None
    assert [cfg.uses_rope(i) for i in range(layers)] == [arch != "exaone4" or i < 3 for i in range(layers)]
    mults = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling)
    assert mults == ((1.5, 1.25, 0.125, 0.75) if arch == "hyperclovax" else (1.0, 1.0, 32**-0.5, 1.0))
    assert cfg.eos_token_ids == (0,) and cfg.bos_token_id == 1 and cfg.pad_token_id == 0
    assert cfg.dtype == "float32"
    moe = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.sparse_layers)
    assert moe == ((8, 2, 64, True, (True, True)) if arch == "qwen3_moe" else (0, 0, 0, False, ()))
    assert cfg.is_moe == (arch == "qwen3_moe")
    hash(cfg)  # frozen and hashable


@pytest.mark.parametrize(("overrides", "sparse"), [
    ({}, (True, True, True, True)),
    ({"mlp_only_layers": [0, 2]}, (False, True, False, True)),
    ({"decoder_sparse_step": 2}, (False, True, False, True)),  # transformers: (i + 1) % step == 0
    ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, (False, False, False, False)),
    ({"num_experts": 0}, (False, False, False, False)),
])
def test_qwen3_moe_sparse_layers(overrides, sparse):
    cfg = ModelConfig.from_dict(make_config("qwen3_moe", num_hidden_layers=4, **overrides))
    assert cfg.sparse_layers == sparse
    assert [cfg.is_sparse(i) for i in range(4)] == list(sparse)
    assert cfg.is_moe == any(sparse)
    # no sparse layer: the routing fields say so (a dense qwen3_moe config)
    assert (cfg.num_experts > 0) == any(sparse)


def test_qwen3_moe_defaults_are_transformers():
    d = make_config("qwen3_moe")
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers"):
        del d[key]
    cfg = ModelConfig.from_dict(d)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (128, 8, 768, False)
    assert cfg.sparse_layers == (True, True)


@pytest.mark.parametrize(("overrides", "pattern"), [
    ({"num_experts": -1}, r"'num_experts' must be an integer >= 0, got -1"),
    ({"num_experts_per_tok": 0}, r"'num_experts_per_tok' must be an integer >= 1, got 0"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 must be <= num_experts 8"),
    ({"moe_intermediate_size": "64"}, r"'moe_intermediate_size' must be an integer >= 1, got '64'"),
    ({"decoder_sparse_step": 0}, r"'decoder_sparse_step' must be an integer >= 1, got 0"),
    ({"mlp_only_layers": [2]}, r"mlp_only_layers entry 2 is not a layer index \(0 \.\. 1\)"),
    ({"mlp_only_layers": "0"}, r"'mlp_only_layers' must be a list of layer indices, got '0'"),
    ({"norm_topk_prob": 1}, r"'norm_topk_prob' must be true or false, got 1"),
])
def test_bad_qwen3_moe_configs(overrides, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        ModelConfig.from_dict(make_config("qwen3_moe", **overrides))


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
        ({"model_type": "mistral"},
         r"model_type 'mistral' is not supported \(supported: llama, qwen2, qwen3, exaone4, hyperclovax, qwen3_moe\)"),
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


def test_exaone4_attention_pattern():
    """Global layers are NoPE when a sliding_window is set; rotated (and windowless) when it is null."""
    cfg = ModelConfig.from_dict(make_config("exaone4", num_hidden_layers=6))
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention",) + ("sliding_attention", "full_attention")
    assert [cfg.is_sliding(i) for i in range(6)] == [True, True, True, False, True, False]
    assert [cfg.uses_rope(i) for i in range(6)] == [True, True, True, False, True, False]
    assert not cfg.full_attention_rope and cfg.sliding_window == 8 and cfg.qk_norm
    glob = ModelConfig.from_dict(make_config("exaone4", sliding_window=None, layer_types=["full_attention"] * 4))
    assert glob.full_attention_rope and glob.sliding_window is None and all(glob.uses_rope(i) for i in range(4))
    # without layer_types: transformers' integer sliding_window_pattern rule (default 4)
    d = make_config("exaone4", num_hidden_layers=5, sliding_window_pattern=2)
    del d["layer_types"]
    assert ModelConfig.from_dict(d).layer_types == ("sliding_attention", "full_attention") * 2 + ("sliding_attention",)
    del d["sliding_window_pattern"]
    assert ModelConfig.from_dict(d).layer_types == ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    # exaone4 has no biases whatever the config says, and its own rms_norm_eps default
    d = make_config("exaone4", attention_bias=True, mlp_bias=True)
    del d["rms_norm_eps"]
    cfg = ModelConfig.from_dict(d)
    assert not (cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias) and cfg.rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"layer_types": ["sliding_attention", "foo_attention", "sliding_attention", "full_attention"]},
         UnsupportedModelError,
         r"layer_types \['foo_attention'\] are not supported for exaone4 \(only 'full_attention', 'sliding_attention'\)"),
        ({"layer_types": ["chunked_attention"] * 4}, UnsupportedModelError, r"layer_types \['chunked_attention'\] are not supported"),
        ({"layer_types": ["full_attention"] * 3}, CheckpointError, r"layer_types must list one attention type per layer \(4\)"),
        ({"sliding_window": 0}, CheckpointError, r"sliding_window must be a positive integer \(tokens\) or null, got 0"),
        ({"sliding_window": None}, CheckpointError, r"'sliding_attention' layers need a positive sliding_window, got null"),
    ],
)
def test_bad_exaone4_configs(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        ModelConfig.from_dict(make_config("exaone4", **overrides))


def test_exaone4_needs_layer_types_unless_an_int_pattern():
    """transformers itself cannot derive layer_types from a string pattern or without a window."""
    d = make_config("exaone4", sliding_window_pattern="LLLG")
    del d["layer_types"]
    with pytest.raises(UnsupportedModelError, match=r"sliding_window_pattern='LLLG'.*give layer_types"):
        ModelConfig.from_dict(d)
    d = make_config("exaone4", sliding_window=None)
    del d["layer_types"]
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=None.*give layer_types"):
        ModelConfig.from_dict(d)


def test_hyperclovax_options():
    plain = ModelConfig.from_dict(make_config("hyperclovax", use_post_norm=False, attention_multiplier=None,
                                              attention_bias=True, mlp_bias=True))
    assert plain.norm_layout == "pre" and plain.attention_multiplier is None and plain.attention_scale == 32**-0.5
    assert plain.attention_bias and plain.o_proj_bias and plain.mlp_bias  # as llama
    d = make_config("hyperclovax")
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling", "use_post_norm"):
        del d[key]
    dflt = ModelConfig.from_dict(d)  # transformers' defaults: all 1, standard scale, Peri-LN on
    assert (dflt.embedding_multiplier, dflt.residual_multiplier, dflt.logits_scaling) == (1.0, 1.0, 1.0)
    assert dflt.attention_scale == 32**-0.5 and dflt.norm_layout == "peri"


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"embedding_multiplier": "2"}, r"'embedding_multiplier' must be a finite number, got '2'"),
        ({"logits_scaling": float("nan")}, r"'logits_scaling' must be a finite number, got nan"),
        ({"residual_multiplier": True}, r"'residual_multiplier' must be a finite number, got True"),
        ({"hidden_size": 130, "head_dim": 32}, r"hidden_size 130 must be a multiple of num_attention_heads 4"),
    ],
)
def test_bad_hyperclovax_configs(overrides, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        ModelConfig.from_dict(make_config("hyperclovax", **overrides))


@pytest.mark.parametrize("arch", ["llama", "hyperclovax"])
def test_sliding_layers_are_unsupported_without_exaone4(arch):
    with pytest.raises(UnsupportedModelError, match=rf"layer_types \['sliding_attention'\] are not supported for {arch}"):
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
