"""``vllm_npu.rbln.compile_plan``: vLLM settings -> optimum-rbln's ``rbln_config``, and a compiled
directory's ``rbln_config.json`` -> the scheduler plan (the artifact wins).

Pure Python: no vLLM, torch or optimum-rbln; ``rbln_config.json`` files are written by hand in the
shape optimum-rbln 0.12.0 saves them (``tests/npusim/test_rbln_optimum.py`` compiles real ones).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_npu.rbln import compile_plan as cp
from vllm_npu.rbln.compile_plan import (BLOCK_SIZE_REQUIRED, CompiledModelSpec, CompilePlanError,
                                        SchedulerPlan, rbln_config_for, scheduler_plan)

CONFLICT = "rbln_overrides conflict with vllm-derived compile config: "


def _cfg(**kw):
    args = dict(max_num_seqs=4, max_model_len=2048, block_size=2048, num_devices=1,
                prefill_chunk_size=128, npu="RBLN-CA25")
    args.update(kw)
    return rbln_config_for(**args)


# ---------------------------------------------------------------------------- rbln_config_for


def test_eager_when_the_block_is_the_model_length():
    assert _cfg() == {"num_devices": 1, "batch_size": 4, "max_seq_len": 2048,
                      "prefill_chunk_size": 128, "npu": "RBLN-CA25"}


def test_flash_attention_when_the_block_is_shorter():
    cfg = _cfg(max_num_seqs=2, max_model_len=8192, block_size=1024, num_devices=2,
               prefill_chunk_size=512, npu="RBLN-CR03")
    assert cfg == {"num_devices": 2, "batch_size": 2, "max_seq_len": 8192, "prefill_chunk_size": 512,
                   "npu": "RBLN-CR03", "kvcache_partition_len": 1024, "attn_impl": "flash_attn"}
    assert all(type(v) is int for k, v in cfg.items() if k not in ("npu", "attn_impl"))


def test_values_are_coerced_to_int():
    cfg = rbln_config_for(max_num_seqs="3", max_model_len=4096, block_size=1024, num_devices="1",
                          prefill_chunk_size="128", npu="RBLN-CA25")
    assert (cfg["batch_size"], cfg["num_devices"], cfg["prefill_chunk_size"]) == (3, 1, 128)


def test_no_block_size_is_the_reference_error():
    with pytest.raises(CompilePlanError) as info:
        _cfg(block_size=None)
    assert str(info.value) == BLOCK_SIZE_REQUIRED
    assert BLOCK_SIZE_REQUIRED.startswith("`block_size` is required to run optimum-rbln models in vLLM RBLN.")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("block", [1000, 3000, 4096, 0, -1024])
def test_a_block_that_does_not_divide_the_model_length(block):
    with pytest.raises(CompilePlanError, match=re.escape(
            f"--block-size {block} must divide --max-model-len 2048 (the KV partition of flash "
            "attention), or equal it (eager attention)")):
        _cfg(block_size=block)


def test_overrides_add_keys_and_equal_values_pass():
    over = {"kvcache_num_blocks": 16, "decoder_batch_sizes": [4, 2, 1], "batch_size": 4,
            "quantization": {"weights": "int4"}}
    cfg = _cfg(block_size=1024, overrides=over)
    assert cfg["kvcache_num_blocks"] == 16 and cfg["decoder_batch_sizes"] == [4, 2, 1]
    assert cfg["quantization"] == {"weights": "int4"} and cfg["batch_size"] == 4
    # the caller's mapping is not modified, and the derived keys are all there
    assert over == {"kvcache_num_blocks": 16, "decoder_batch_sizes": [4, 2, 1], "batch_size": 4,
                    "quantization": {"weights": "int4"}}
    assert cfg["kvcache_partition_len"] == 1024 and cfg["attn_impl"] == "flash_attn"
    assert _cfg(overrides=None) == _cfg(overrides={})


def test_an_override_that_restates_an_implied_value_is_kept():
    assert _cfg(block_size=1024, overrides={"kvcache_block_size": 1024})["kvcache_block_size"] == 1024
    eager = _cfg(overrides={"attn_impl": "eager", "kvcache_block_size": 2048})
    assert eager["attn_impl"] == "eager" and eager["kvcache_block_size"] == 2048
    assert "kvcache_partition_len" not in eager


@pytest.mark.parametrize(("block", "over", "where", "derived", "given"), [
    (2048, {"batch_size": 8}, "batch_size", 4, 8),
    (2048, {"max_seq_len": 4096}, "max_seq_len", 2048, 4096),
    (2048, {"num_devices": 2}, "num_devices", 1, 2),
    (2048, {"prefill_chunk_size": 256}, "prefill_chunk_size", 128, 256),
    (2048, {"npu": "RBLN-CR03"}, "npu", "RBLN-CA25", "RBLN-CR03"),
    (1024, {"kvcache_partition_len": 2048}, "kvcache_partition_len", 1024, 2048),
    (1024, {"attn_impl": "eager"}, "attn_impl", "flash_attn", "eager"),
    (1024, {"kvcache_block_size": 512}, "kvcache_block_size", 1024, 512),
    # eager attention: a partition or flash_attn would make optimum-rbln compile a smaller KV
    # block than vLLM's block_size = max_model_len
    (2048, {"kvcache_partition_len": 1024}, "kvcache_partition_len", None, 1024),
    (2048, {"attn_impl": "flash_attn"}, "attn_impl", "eager", "flash_attn"),
    (2048, {"kvcache_block_size": 1024}, "kvcache_block_size", 2048, 1024),
    (2048, {"batch_size": {"x": 1}}, "batch_size", 4, {"x": 1}),
])
def test_an_override_that_changes_a_derived_value_is_refused(block, over, where, derived, given):
    with pytest.raises(CompilePlanError) as info:
        _cfg(block_size=block, overrides={"kvcache_num_blocks": 8, **over})
    assert str(info.value) == f"{CONFLICT}{where} (compiled={derived!r}, override={given!r})"


def test_nested_overrides_merge_and_name_the_nested_path():
    base = {"language_model": {"batch_size": 2, "max_seq_len": 4096}, "top": 1}
    merged = cp._merge(base, {"language_model": {"kvcache_num_blocks": 8, "batch_size": 2},
                              "vision": {"x": 1}})
    assert merged == {"language_model": {"batch_size": 2, "max_seq_len": 4096, "kvcache_num_blocks": 8},
                      "top": 1, "vision": {"x": 1}}
    assert base == {"language_model": {"batch_size": 2, "max_seq_len": 4096}, "top": 1}, "base untouched"
    deep = cp._merge({"a": {"b": {"c": 1, "d": 2}}}, {"a": {"b": {"e": 3}}})
    assert deep == {"a": {"b": {"c": 1, "d": 2, "e": 3}}}
    with pytest.raises(CompilePlanError) as info:
        cp._merge(base, {"language_model": {"batch_size": 4}})
    assert str(info.value) == f"{CONFLICT}language_model.batch_size (compiled=2, override=4)"
    with pytest.raises(CompilePlanError) as info:
        cp._merge({"a": {"b": {"c": 1}}}, {"a": {"b": {"c": 5}}})
    assert str(info.value) == f"{CONFLICT}a.b.c (compiled=1, override=5)"
    with pytest.raises(CompilePlanError, match=re.escape(f"{CONFLICT}a (compiled={{'b': 1}}, override=3)")):
        cp._merge({"a": {"b": 1}}, {"a": 3})


def test_a_nested_override_of_a_key_the_config_lacks_is_added_whole():
    cfg = _cfg(overrides={"language_model": {"batch_size": 9}})
    assert cfg["language_model"] == {"batch_size": 9} and cfg["batch_size"] == 4


# ---------------------------------------------------------------------------- CompiledModelSpec


def _write(d: Path, **fields) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "rbln_config.json").write_text(json.dumps(fields))
    return d


EAGER = dict(cls_name="RBLNLlamaForCausalLMConfig", dtype="float32", optimum_rbln_version="0.12.0",
             _compile_cfgs=[], batch_size=1, max_seq_len=1024, attn_impl="eager",
             kvcache_partition_len=None, kvcache_block_size=1024, prefill_chunk_size=128,
             kvcache_num_blocks=1, decoder_batch_sizes=[1])
FLASH = dict(EAGER, batch_size=4, max_seq_len=2048, attn_impl="flash_attn", kvcache_partition_len=1024,
             kvcache_block_size=1024, kvcache_num_blocks=8, decoder_batch_sizes=[4, 2, 1], dtype="bfloat16")


def test_spec_of_an_eager_compile(tmp_path):
    spec = CompiledModelSpec.from_dir(_write(tmp_path / "m", **EAGER))
    assert spec == CompiledModelSpec(str(tmp_path / "m"), "RBLNLlamaForCausalLMConfig", 1, 1024, 1024, 128, 1,
                                     (1,), "float32", "eager")
    assert spec.model_class == "RBLNLlamaForCausalLM"


def test_spec_of_a_flash_compile(tmp_path):
    spec = CompiledModelSpec.from_dir(str(_write(tmp_path, **FLASH)))
    assert (spec.batch_size, spec.max_seq_len, spec.block_size, spec.prefill_chunk_size) == (4, 2048, 1024, 128)
    assert spec.kvcache_num_blocks == 8 and spec.decoder_batch_sizes == (1, 2, 4)
    assert spec.dtype == "bfloat16" and spec.attn_impl == "flash_attn" and spec.path == str(tmp_path)


def test_spec_block_from_the_partition_or_the_model_length(tmp_path):
    part_only = {k: v for k, v in FLASH.items() if k != "kvcache_block_size"}
    assert CompiledModelSpec.from_dir(_write(tmp_path / "a", **part_only)).block_size == 1024
    neither = {k: v for k, v in EAGER.items()
               if k not in ("kvcache_block_size", "kvcache_partition_len", "attn_impl", "dtype",
                            "decoder_batch_sizes", "kvcache_num_blocks")}
    spec = CompiledModelSpec.from_dir(_write(tmp_path / "b", **neither))
    assert (spec.block_size, spec.attn_impl, spec.dtype) == (1024, "eager", "float32")
    assert spec.decoder_batch_sizes == (1,) and spec.kvcache_num_blocks == 0
    nulls = dict(EAGER, attn_impl=None, decoder_batch_sizes=None, kvcache_num_blocks=None)
    spec = CompiledModelSpec.from_dir(_write(tmp_path / "c", **nulls))
    assert (spec.attn_impl, spec.decoder_batch_sizes, spec.kvcache_num_blocks) == ("eager", (1,), 0)


def test_spec_of_a_missing_file(tmp_path):
    with pytest.raises(CompilePlanError, match=re.escape(
            f"{tmp_path / 'rbln_config.json'}: cannot read the compiled model's rbln_config.json (")):
        CompiledModelSpec.from_dir(tmp_path)


def test_spec_of_a_file_that_is_not_json(tmp_path):
    (tmp_path / "rbln_config.json").write_text("{not json")
    with pytest.raises(CompilePlanError, match="cannot read the compiled model's rbln_config.json"):
        CompiledModelSpec.from_dir(tmp_path)


def test_spec_partition_and_block_must_agree(tmp_path):
    _write(tmp_path, **dict(FLASH, kvcache_block_size=2048))
    with pytest.raises(CompilePlanError) as info:
        CompiledModelSpec.from_dir(tmp_path)
    assert str(info.value) == "kvcache_partition_len must equal kvcache_block_size for RBLNLlamaForCausalLMConfig models."


@pytest.mark.parametrize("fields", [
    {"cls_name": "RBLNBertModelConfig", "batch_size": 1, "max_seq_len": 512},   # no prefill chunk
    {k: v for k, v in EAGER.items() if k != "cls_name"},
    {k: v for k, v in EAGER.items() if k != "batch_size"},
    dict(EAGER, batch_size="four"),
    dict(EAGER, decoder_batch_sizes=[1, None]),
], ids=["encoder", "no-cls-name", "no-batch", "bad-batch", "bad-bucket"])
def test_spec_of_something_that_is_not_a_decoder(tmp_path, fields):
    _write(tmp_path, **fields)
    with pytest.raises(CompilePlanError, match=re.escape(f"{tmp_path / 'rbln_config.json'}: not a decoder's "
                                                         "rbln_config.json (")):
        CompiledModelSpec.from_dir(tmp_path)


def test_spec_of_a_json_list(tmp_path):
    (tmp_path / "rbln_config.json").write_text("[1, 2]")
    with pytest.raises(CompilePlanError, match="not a decoder's rbln_config.json"):
        CompiledModelSpec.from_dir(tmp_path)


# ---------------------------------------------------------------------------- scheduler_plan


@pytest.fixture
def flash(tmp_path) -> CompiledModelSpec:
    return CompiledModelSpec.from_dir(_write(tmp_path / "flash", **FLASH))


def test_the_artifact_wins(flash):
    assert scheduler_plan(flash) == SchedulerPlan(max_num_seqs=4, max_model_len=2048, block_size=1024,
                                                  max_num_batched_tokens=128, num_gpu_blocks=9)


def test_matching_or_smaller_user_values_pass(flash):
    plan = scheduler_plan(flash, user_max_num_batched_tokens=128, user_max_model_len=1000,
                          user_max_num_seqs=2, user_block_size=1024)
    assert plan == SchedulerPlan(2, 1000, 1024, 128, 9)
    assert scheduler_plan(flash, user_max_model_len=2048, user_max_num_seqs=4).max_num_seqs == 4


def test_max_num_batched_tokens_conflict_is_the_reference_message(flash):
    with pytest.raises(CompilePlanError) as info:
        scheduler_plan(flash, user_max_num_batched_tokens=2048)
    assert str(info.value) == (
        "max_num_batched_tokens (2048) conflicts with the compiled prefill_chunk_size (128) in "
        "rbln_config.json. Omit max_num_batched_tokens or recompile the model with a matching "
        "prefill chunk size.")


def test_other_conflicts(flash):
    with pytest.raises(CompilePlanError) as info:
        scheduler_plan(flash, user_max_model_len=4096)
    assert str(info.value) == (f"--max-model-len 4096 exceeds the compiled max_seq_len 2048 of {flash.path}; "
                               "pass --max-model-len 2048 or lower")
    with pytest.raises(CompilePlanError) as info:
        scheduler_plan(flash, user_max_num_seqs=5)
    assert str(info.value) == f"--max-num-seqs 5 exceeds the compiled batch_size 4 of {flash.path}"
    with pytest.raises(CompilePlanError) as info:
        scheduler_plan(flash, user_block_size=2048)
    assert str(info.value) == (f"--block-size 2048 differs from the compiled KV block size 1024 of "
                               f"{flash.path}; omit --block-size")


def test_the_batched_tokens_conflict_is_reported_first(flash):
    with pytest.raises(CompilePlanError, match=r"^max_num_batched_tokens \(1\)"):
        scheduler_plan(flash, user_max_num_batched_tokens=1, user_max_model_len=10**6,
                       user_max_num_seqs=99, user_block_size=7)


def test_num_gpu_blocks_is_the_compiled_blocks_plus_the_null_block(tmp_path):
    for n in (1, 3, 17):
        spec = CompiledModelSpec.from_dir(_write(tmp_path / str(n), **dict(FLASH, kvcache_num_blocks=n)))
        assert scheduler_plan(spec).num_gpu_blocks == n + 1


@pytest.mark.parametrize(("fields", "blocks"), [
    (dict(FLASH, kvcache_num_blocks=0), 4 * 2),      # batch 4 x (2048 // 1024)
    (dict(FLASH, kvcache_num_blocks=None), 4 * 2),
    (dict(EAGER, batch_size=3, decoder_batch_sizes=[3, 1], kvcache_num_blocks=0), 3 * 1),
])
def test_no_compiled_block_count_falls_back_to_full_tables(tmp_path, fields, blocks):
    spec = CompiledModelSpec.from_dir(_write(tmp_path, **fields))
    assert spec.kvcache_num_blocks == 0
    assert scheduler_plan(spec).num_gpu_blocks == blocks + 1
