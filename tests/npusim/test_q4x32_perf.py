"""The SM10 board performance model, ``npusim.q4x32.perf`` (issue 12, section 2).

The measured figures below are copied from the seed (``shared/seeds/004_c20b689d24c6ef7a.txt``),
not from the module, so the checks are against the board. Only the visible rows exist here; the
withheld ones are a held-out check outside the project. The ``.hp`` counts are checked against
the kernel under QEMU in ``tests/npu_conformance/test_ime2_perf_counts.py``. numpy only, fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from npusim.q4x32 import perf

#: The seed's visible rows (its tables, typed in again).
SEED_GEMM = {(576, 1536, 1): 28.18, (576, 1536, 4): 69.37, (2048, 5632, 1): 37.20, (2048, 5632, 4): 95.25}
SEED_IME2 = {"SmolLM2 135M": (87.11, 11.14), "TinyLlama 1.1B": (30.09, 7.38)}
SEED_RVV = {"SmolLM2 135M": (1.95, 1.27), "TinyLlama 1.1B": (0.23, 0.17)}
#: The seed's model names, in its table order, and its GEMM table's (K = hidden, N = intermediate).
SEED_MODELS = ("SmolLM2 135M", "SmolLM2 360M", "Qwen2.5 0.5B", "TinyLlama 1.1B", "Qwen2.5 1.5B",
               "DeepSeek R1 distill Qwen 1.5B", "StableLM 2 Zephyr 1.6B", "SmolLM2 1.7B", "Phi-2", "Qwen2.5 3B")
SEED_SHAPES = {"SmolLM2 135M": (576, 1536), "SmolLM2 360M": (960, 2560), "Qwen2.5 0.5B": (896, 4864),
               "TinyLlama 1.1B": (2048, 5632), "Qwen2.5 1.5B": (1536, 8960),
               "DeepSeek R1 distill Qwen 1.5B": (1536, 8960), "StableLM 2 Zephyr 1.6B": (2048, 5632),
               "SmolLM2 1.7B": (2048, 8192), "Phi-2": (2560, 10240), "Qwen2.5 3B": (2048, 11008)}
JSON_FIELDS = ("name", "hf_id", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings", "mlp", "partial_rotary_factor",
               "prompt_tokens")


def _gops(k: int, n: int, m: int, seconds: float) -> float:
    return 2 * m * n * k / seconds / 1e9


# ---------------------------------------------------------------------------------------------
# instruction counts (hand-derived from gemm_ime2.c's loops)


def test_instruction_counts_follow_the_kernel_loops():
    c = perf.instruction_counts(576, 1536, 4)  # one 4-row group, 48 tiles, K padded to 3 superblocks
    assert (c.row_groups, c.full_tiles, c.superblocks, c.passes) == (1, 48, 3, 144)
    assert c.hp == 144 * 64 and c.weight_bytes == 144 * 4608 and c.row_passes == 4 * 144
    assert (c.vle8, c.vle16, c.vse16, c.vsetvli) == (144 * 8 * 6, 144 * 8 * 5, 144 * 8 * 4, 144 * 8 * 2)
    five = perf.instruction_counts(256, 40, 5)  # a group plus one row; one tile and an 8-column tail
    assert (five.row_groups, five.full_tiles, five.hp, five.tail_columns) == (2, 1, 128, 8)
    assert perf.instruction_counts(256, 32, 7).row_groups == 4  # 4 + 1 + 1 + 1
    assert perf.instruction_counts(256, 31, 1).hp == 0  # all tail
    split = perf.instruction_counts(2048, 5632, 1, cores=8)  # 176 tiles over 8 cores
    assert split.full_tiles == 22 and perf.instruction_counts(2048, 5664, 1, cores=8).full_tiles == 23


# ---------------------------------------------------------------------------------------------
# the visible rows


@pytest.mark.parametrize("shape", sorted(SEED_GEMM), ids=str)
def test_visible_gemm_rows_within_10_percent(shape):
    k, n, m = shape
    pred = perf.predict_gemm(k, n, m)
    assert pred.gops == pytest.approx(_gops(k, n, m, pred.seconds))
    assert abs(pred.gops - SEED_GEMM[shape]) / SEED_GEMM[shape] < 0.10, (shape, pred.gops)


@pytest.mark.parametrize("path,rows", [("ime2", SEED_IME2), ("rvv", SEED_RVV)])
def test_visible_tokens_rows_within_20_percent(path, rows):
    for name, (prompt, decode) in rows.items():
        pred = perf.predict_tokens(name, path)
        assert abs(pred.prompt_tps - prompt) / prompt < 0.20, (name, path, pred)
        assert abs(pred.decode_tps - decode) / decode < 0.20, (name, path, pred)
        assert pred.prompt_tps == pytest.approx(pred.prompt_tokens / pred.prefill_seconds)
        assert pred.decode_tps == pytest.approx(31 / pred.decode_seconds)


def test_tinyllama_rates_use_129_prompt_tokens():
    assert perf.model_config("TinyLlama 1.1B").prompt_tokens == 129
    assert {perf.model_config(n).prompt_tokens for n in SEED_MODELS if n != "TinyLlama 1.1B"} == {128}


# ---------------------------------------------------------------------------------------------
# the fitted parameters


def test_fitted_parameters_are_physical_and_the_fit_is_deterministic():
    p = perf.fit()
    values = (p.gemm.pass_s, p.gemm.row_s, p.host.step_s, p.host.element_s, p.rvv.bytes_per_s, p.rvv.macs_per_s)
    assert all(math.isfinite(v) and v > 0 for v in values), values
    assert perf.fit() == p and perf.fitted_params() == p
    # sane magnitudes: a pass (64 .hp + 4608 B) takes 10 ns .. 10 us; a step's overhead < 1 s;
    # the weight stream is 0.1 .. 100 GB/s
    assert 1e-8 < p.gemm.pass_s < 1e-5 and p.gemm.row_s < p.gemm.pass_s
    assert p.host.step_s < 1.0 and 1e8 < p.rvv.bytes_per_s < 1e11
    assert 1e8 < p.gemm.pass_bytes_per_s < 1e11 and p.gemm.hp_s == pytest.approx(p.gemm.pass_s / 64)
    with pytest.raises(FrozenInstanceError):
        p.gemm.pass_s = 1.0  # type: ignore[misc]
    text = perf.format_params(p)
    assert "gemm.pass_s" in text and "rvv.macs_per_s" in text and f"{p.host.step_s:.4e}" in text


# ---------------------------------------------------------------------------------------------
# monotonic sanity


@pytest.mark.parametrize("model", SEED_MODELS)
def test_four_rows_beat_one_row(model):
    k, n = SEED_SHAPES[model]
    assert perf.predict_gemm(k, n, 4).gops > perf.predict_gemm(k, n, 1).gops
    assert perf.predict_gemm(k, n, 4).seconds > perf.predict_gemm(k, n, 1).seconds


def test_bigger_shapes_take_longer():
    assert perf.predict_gemm(2048, 5632, 1).seconds > perf.predict_gemm(576, 1536, 1).seconds
    assert perf.predict_gemm(576, 1536 + 8, 1).seconds > perf.predict_gemm(576, 1536, 1).seconds  # tail


@pytest.mark.parametrize("path", ["ime2", "rvv"])
def test_a_bigger_model_is_slower(path):
    smol = [perf.predict_tokens(n, path) for n in ("SmolLM2 135M", "SmolLM2 360M", "SmolLM2 1.7B")]
    assert smol[0].prompt_tps > smol[1].prompt_tps > smol[2].prompt_tps
    assert smol[0].decode_tps > smol[1].decode_tps > smol[2].decode_tps
    assert perf.predict_tokens("Qwen2.5 0.5B", path).decode_tps > perf.predict_tokens("Qwen2.5 3B", path).decode_tps
    tiny = perf.predict_tokens("TinyLlama 1.1B", path)
    assert tiny.decode_tps < smol[0].decode_tps and tiny.prompt_tps < smol[0].prompt_tps


def test_ime2_is_faster_than_rvv_for_every_model():
    for name in SEED_MODELS:
        ime2, rvv = perf.predict_tokens(name, "ime2"), perf.predict_tokens(name, "rvv")
        assert ime2.prompt_tps > rvv.prompt_tps and ime2.decode_tps > rvv.decode_tps, name


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("k,n,m,needle", [
    (100, 32, 1, "K must be a multiple of 32"), (0, 32, 1, "K must be a positive integer"),
    (256, 0, 1, "N must be a positive integer"), (256, 32, 0, "M must be a positive integer"),
    (256, 32, True, "M must be a positive integer"), (256.0, 32, 1, "K must be a positive integer")])
def test_bad_gemm_shapes_raise_named_errors(k, n, m, needle):
    with pytest.raises(perf.GemmShapeError, match=needle) as info:
        perf.predict_gemm(k, n, m)
    assert isinstance(info.value, perf.PerfModelInputError) and isinstance(info.value, ValueError)
    with pytest.raises(perf.GemmShapeError, match="cores"):
        perf.instruction_counts(256, 32, 1, cores=0)


def test_unknown_model_and_path_raise_named_errors(tmp_path):
    with pytest.raises(perf.UnknownModelError, match="'GPT-5'"):
        perf.predict_tokens("GPT-5")
    with pytest.raises(perf.UnknownModelError, match="without config.json"):
        perf.resolve_model(str(tmp_path))
    with pytest.raises(perf.PathError, match="'gpu'"):
        perf.predict_tokens("SmolLM2 135M", "gpu")


def test_config_missing_a_field_raises_a_named_error(tmp_path):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(perf.ModelConfigError, match="'vocab_size' is missing"):
        perf.resolve_model(str(tmp_path))
    path.write_text(json.dumps({**cfg, "vocab_size": 0}))
    with pytest.raises(perf.ModelConfigError, match="'vocab_size' must be a positive integer, got 0"):
        perf.resolve_model(str(path))
    path.write_text(json.dumps({**cfg, "vocab_size": 256, "num_key_value_heads": 3}))
    with pytest.raises(perf.ModelConfigError, match="num_key_value_heads 3 must divide"):
        perf.resolve_model(str(path))
    path.write_text("{not json")
    with pytest.raises(perf.ModelConfigError, match="not a readable JSON config"):
        perf.resolve_model(str(path))


# ---------------------------------------------------------------------------------------------
# the shipped configs and HF config.json input


def test_shipped_configs_load_and_have_every_field():
    raw = json.loads(Path(perf.__file__).with_name("board_models.json").read_text())["models"]
    assert [m["name"] for m in raw] == list(SEED_MODELS)
    for entry in raw:
        missing = [f for f in JSON_FIELDS if f not in entry]
        assert not missing, (entry["name"], missing)
    loaded = perf.load_board_models()
    assert [c.name for c in loaded] == list(SEED_MODELS)
    for cfg in loaded:
        assert (cfg.hidden_size, cfg.intermediate_size) == SEED_SHAPES[cfg.name]  # the seed's GEMM table
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim * cfg.num_attention_heads \
            == cfg.hidden_size
    phi = perf.model_config("Phi-2")
    assert phi.mlp == "plain" and phi.partial_rotary_factor == 0.4 and not phi.tie_word_embeddings
    assert [name for name, _, _ in perf.linear_shapes(phi)] == ["qkv_proj", "o_proj", "fc1", "fc2"]
    assert perf.model_config("stabilityai/stablelm-2-zephyr-1_6b").partial_rotary_factor == 0.25


def test_hf_directory_gives_the_same_prediction_as_the_shipped_name(tmp_path):
    hf = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
          "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = perf.resolve_model(str(tmp_path))
    assert cfg.prompt_tokens == 128 and cfg.mlp == "gated"
    shipped = perf.predict_tokens("TinyLlama 1.1B")
    local = perf.predict_tokens(str(tmp_path / "config.json"))
    assert local.decode_tps == pytest.approx(shipped.decode_tps, rel=0.01)  # contexts of prompt 128, not 129
    (tmp_path / "config.json").write_text(json.dumps({**hf, "prompt_tokens": 129}))
    same = perf.predict_tokens(str(tmp_path))
    assert (same.prompt_tps, same.decode_tps) == (shipped.prompt_tps, shipped.decode_tps)
    phi_like = perf.config_from_hf({**hf, "model_type": "phi", "partial_rotary_factor": 0.4})
    assert phi_like.mlp == "plain"
    assert perf.predict_tokens(phi_like).prompt_tps > 0


def test_table_has_every_seed_row_and_marks_only_the_visible_ones():
    rows = perf.predict_table()
    assert sum(r.table == "gemm" for r in rows) == 18 and sum(r.table in ("ime2", "rvv") for r in rows) == 40
    visible = {r.label: r for r in rows if r.measured is not None}
    assert len(visible) == 12
    assert "StableLM 2 1.6B K=2048 N=5632 M=1" not in visible  # TinyLlama's shape, but withheld
    assert visible["TinyLlama 1.1B rvv decode"].measured == 0.17
    assert all(r.predicted > 0 and math.isfinite(r.predicted) for r in rows)
    text = perf.format_table()
    assert text.count("(withheld)") == 7 * 2 + 8 * 4 and "28.18 (" in text
