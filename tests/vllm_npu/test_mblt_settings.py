"""vllm_npu.mblt.settings: loader-extra-config validation, core-mode keyed ints and the
scheduler plan (cases from the vllm-mblt README and docs/reference mobilint.md §4, §6)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_npu.mblt.settings import (
    BATCH_MODEL_MAX_PREFILL_CHUNK,
    CORE_MODES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PREFILL_CHUNK,
    LayoutOverrides,
    MbltConfigError,
    SchedulerPlan,
    parse_dev_no,
    parse_loader_extra_config,
    plan_scheduler,
    resolve_core_mode,
    resolve_max_batch_size,
    resolve_positive_int,
    resolve_prefill_chunk,
)

NO_USER = dict(user_max_num_seqs=None, user_max_num_batched_tokens=None, user_block_size=None,
               user_enable_prefix_caching=None)
README_CHUNKS = {"single": 64, "global4": 256, "global8": 512}


def plan(hf_config, overrides=None, **user):
    return plan_scheduler(hf_config, parse_loader_extra_config(overrides), **{**NO_USER, **user})


def test_constants():
    assert CORE_MODES == ("auto", "single", "multi", "global4", "global8")
    assert (DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_CHUNK, BATCH_MODEL_MAX_PREFILL_CHUNK) == (128, 128, 128)
    assert issubclass(MbltConfigError, ValueError)


def test_modules_import_no_vllm_torch_or_simulator():
    code = ("import sys, vllm_npu.mblt.settings, vllm_npu.mblt.prefix_cache; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'torch', 'npusim', 'numpy', 'qbruntime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- parse_loader_extra_config: accepted forms ------------------------------------------------


def test_none_and_empty_give_no_overrides():
    assert parse_loader_extra_config(None) == LayoutOverrides()
    assert parse_loader_extra_config({}) == LayoutOverrides()
    assert parse_loader_extra_config("{}") == LayoutOverrides()


def test_readme_example_legacy_core_target_uses_dev_no():
    o = parse_loader_extra_config('{"dev_no": 1, "target_cores": ["1:0"]}')
    assert o.dev_no == (1,)
    assert o.target_cores == ("1:1:0",)
    assert o.target_clusters is None and o.core_mode is None


def test_legacy_targets_without_dev_no_go_to_device_0():
    assert parse_loader_extra_config({"target_cores": ["1:3"]}).target_cores == ("0:1:3",)
    assert parse_loader_extra_config({"target_clusters": [1, "0:0"]}).target_clusters == ("0:1", "0:0")


def test_readme_global4_example():
    o = parse_loader_extra_config('{"dev_no": 0, "core_mode": "global4", "target_clusters": [0]}')
    assert (o.dev_no, o.core_mode, o.target_clusters) == ((0,), "global4", ("0:0",))


def test_multi_card_canonical_targets():
    o = parse_loader_extra_config({"dev_no": [0, 1], "target_cores": ["0:0:0", "1:0:0"],
                                   "max_batch_size": 2})
    assert o.dev_no == (0, 1)
    assert o.target_cores == ("0:0:0", "1:0:0")
    assert o.max_batch_size == 2


def test_canonical_strings_drop_leading_zeros():
    assert parse_loader_extra_config({"target_cores": ["01:1:03"]}).target_cores == ("1:1:3",)


def test_global8_with_both_clusters_is_accepted():
    o = parse_loader_extra_config({"dev_no": [0, 1], "core_mode": "global8",
                                   "target_clusters": ["0:0", "0:1", "1:1", "1:0"]})
    assert o.target_clusters == ("0:0", "0:1", "1:1", "1:0")


def test_target_cores_allowed_with_single_and_auto():
    for mode in ("single", "auto"):
        assert parse_loader_extra_config({"core_mode": mode, "target_cores": ["0:0:1"]}).core_mode == mode


def test_max_batch_size_forms():
    assert parse_loader_extra_config({"max_batch_size": "32"}).max_batch_size == 32
    o = parse_loader_extra_config({"max_batch_size": {"single": "16", "DEFAULT": 4}})
    assert o.max_batch_size == {"single": 16, "DEFAULT": 4}


def test_prefix_cache_and_passthrough_keys_are_sorted_out_verbatim():
    raw = {"prefix_cache_auto_threshold": "false", "prefix_cache_load_margin": 0.5,
           "vision_core_mode": "single", "text_max_batch_size": 16, "mxq_path": "m.mxq",
           "num_expert_workers": 16, "lm_head_target_cores": ["2:0:1"], "core_mode": "global4"}
    o = parse_loader_extra_config(raw)
    assert dict(o.prefix_cache) == {"prefix_cache_auto_threshold": "false",
                                    "prefix_cache_load_margin": 0.5}
    assert dict(o.extra) == {"vision_core_mode": "single", "text_max_batch_size": 16,
                             "mxq_path": "m.mxq", "num_expert_workers": 16,
                             "lm_head_target_cores": ["2:0:1"]}
    assert o.core_mode == "global4"
    with pytest.raises(TypeError):
        o.extra["x"] = 1  # read-only


def test_overrides_are_frozen():
    o = parse_loader_extra_config({"dev_no": 0})
    with pytest.raises(AttributeError):
        o.dev_no = (1,)


@given(dev=st.integers(0, 64), cluster=st.integers(0, 1), core=st.integers(0, 3))
def test_core_targets_round_trip(dev, cluster, core):
    text = f"{dev}:{cluster}:{core}"
    o = parse_loader_extra_config({"dev_no": dev, "target_cores": [text]})
    assert o.target_cores == (text,)
    legacy = parse_loader_extra_config({"dev_no": dev, "target_cores": [f"{cluster}:{core}"]})
    assert legacy.target_cores == (text,)


# --- parse_loader_extra_config: rejected forms ------------------------------------------------


@pytest.mark.parametrize("raw, words", [
    ("[1, 2]", ["must be a JSON object", "list"]),
    ("{not json", ["not valid JSON"]),
    (7, ["must be a JSON object", "int"]),
    ({"dev_no": True}, ["dev_no=True"]),
    ({"dev_no": -1}, ["dev_no=-1", ">= 0"]),
    ({"dev_no": "0"}, ["dev_no='0'"]),
    ({"dev_no": []}, ["dev_no=[]", "at least one"]),
    ({"dev_no": [0, 0]}, ["dev_no=[0, 0]", "more than once"]),
    ({"dev_no": [0, False]}, ["dev_no entry=False"]),
    ({"target_cores": "0:0:0"}, ["target_cores='0:0:0'", "non-empty list"]),
    ({"target_cores": []}, ["target_cores=[]"]),
    ({"target_cores": [0]}, ["target_cores entry 0", "string"]),
    ({"target_cores": ["0:2:0"]}, ["'0:2:0'", "cluster 2", "0..1"]),
    ({"target_cores": ["0:0:4"]}, ["'0:0:4'", "core 4", "0..3"]),
    ({"target_cores": ["0:0:0:0"]}, ["'0:0:0:0'", "d:c:k"]),
    ({"target_cores": ["a:0:0"]}, ["'a:0:0'", "device 'a'"]),
    ({"target_cores": ["-1:0:0"]}, ["'-1:0:0'", "device '-1'"]),
    ({"target_cores": ["\u0661:0:0"]}, ["device '\u0661'"]),
    ({"target_cores": ["0:0", "0:0:0"]}, ["more than once"]),
    ({"target_clusters": [2]}, ["target_clusters entry 2", "cluster 2"]),
    ({"target_clusters": [True]}, ["target_clusters entry True"]),
    ({"target_clusters": ["0:0:0"]}, ["'0:0:0'", "'d:c'"]),
    ({"target_clusters": [0, "0:0"]}, ["more than once"]),
    ({"target_cores": ["0:0:0"], "target_clusters": [0]}, ["not both"]),
    ({"core_mode": "Global4"}, ["core_mode='Global4'", "global4"]),
    ({"core_mode": "multi", "target_cores": ["0:0:0"]}, ["target_cores=['0:0:0']", "core_mode='multi'"]),
    ({"core_mode": "global8", "target_cores": ["0:0:0"]}, ["core_mode='global8'"]),
    ({"core_mode": "single", "target_clusters": ["0:0"]}, ["target_clusters=['0:0']", "core_mode='single'"]),
    ({"dev_no": [0], "target_cores": ["1:0:0"]}, ["target device set [1] does not match dev_no [0]"]),
    ({"dev_no": [0, 1], "target_clusters": ["1:0"]},
     ["target device set [1] does not match dev_no [0, 1]"]),
    ({"dev_no": 1, "target_clusters": ["0:0", 1]},
     ["target device set [0, 1] does not match dev_no [1]"]),
    ({"core_mode": "global8", "target_clusters": ["0:0", "0:1", "1:1"]},
     ["core_mode='global8' requires both clusters for device 1; got clusters [1]"]),
    ({"core_mode": "global8", "target_clusters": [0]},
     ["core_mode='global8' requires both clusters for device 0; got clusters [0]"]),
    ({"max_batch_size": 0}, ["max_batch_size=0", ">= 1"]),
    ({"max_batch_size": -3}, ["max_batch_size=-3"]),
    ({"max_batch_size": True}, ["max_batch_size=True"]),
    ({"max_batch_size": 2.0}, ["max_batch_size=2.0"]),
    ({"max_batch_size": "x"}, ["max_batch_size='x'"]),
    ({"max_batch_size": {}}, ["max_batch_size={}", "at least one"]),
    ({"max_batch_size": {"global2": 4}}, ["max_batch_size key 'global2'", "core mode"]),
    ({"max_batch_size": {"single": 0}}, ["max_batch_size['single']=0"]),
    ({"prefix_cache_auto_threshold": "maybe"}, ["prefix_cache_auto_threshold='maybe'", "switch"]),
    ({"prefix_cache_auto_threshold": 2}, ["prefix_cache_auto_threshold=2"]),
    ({"prefix_cache_min_hit_tokens": -1}, ["prefix_cache_min_hit_tokens=-1", ">= 0"]),
    ({"prefix_cache_min_hit_tokens": 1.5}, ["prefix_cache_min_hit_tokens=1.5"]),
    ({"prefix_cache_load_margin": 0}, ["prefix_cache_load_margin=0", "> 0"]),
    ({"prefix_cache_load_margin": "nan"}, ["prefix_cache_load_margin='nan'", "finite"]),
    ({"prefix_cache_max_host_mib": True}, ["prefix_cache_max_host_mib=True"]),
    ({"prefix_cache_calibrate": "2"}, ["prefix_cache_calibrate='2'"]),
    ({"prefix_cache_size": 3}, ["unknown", "'prefix_cache_size'", "prefix_cache_calibrate"]),
    ({"dev_num": 0}, ["unknown model loader extra config key 'dev_num'", "accepted keys",
                      "dev_no", "target_clusters", "vision_*"]),
])
def test_rejected_configs_name_key_value_and_rule(raw, words):
    with pytest.raises(MbltConfigError) as info:
        parse_loader_extra_config(raw)
    for word in words:
        assert word in str(info.value)


# --- resolve_positive_int ---------------------------------------------------------------------


@pytest.mark.parametrize("raw, mode, expected", [
    (README_CHUNKS, "global4", 256),
    (README_CHUNKS, "global8", 512),
    ({"single": 64, "global4": 256}, "global4", 256),
    ({"default": 160}, "global4", 160),
    ({"DEFAULT": 96}, None, 96),
    ({"single": 64, "default": 32}, "global4", 32),
    ({"single": 64}, "global4", None),
    ({"single": 64}, "auto", 64),
    ({"global8": 512}, None, 64 * 8),
    ({"single": 64, "global4": 256}, "auto", None),
    ({"single": 64, "global4": 256}, None, None),
    ({"auto": 48, "single": 64}, "auto", 64),  # auto is never a key: the one usable entry
    ({"auto": 48}, "auto", None),
    ({"single": "x", "global4": 256}, "auto", 256),  # an unusable value is skipped
    ({"single": 0, "default": 32}, "single", 32),
    ({"turbo": 9, "single": 64}, "single", 64),
    (200, "global8", 200),
    ("200", None, 200),
    (None, "single", None),
])
def test_resolve_positive_int_cases(raw, mode, expected):
    assert resolve_positive_int(raw, name="npu_prefill_chunk_size", core_mode=mode) == expected


def test_unresolved_dict_warns_with_the_reference_text(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        assert resolve_positive_int({"single": 64}, name="npu_prefill_chunk_size", core_mode="global4") is None
    assert caplog.records[-1].getMessage() == (
        "Could not resolve npu_prefill_chunk_size from model config for core_mode=global4: {'single': 64}"
    )
    assert caplog.records[-1].name == "vllm.vllm_npu.mblt"


def test_single_entry_under_auto_is_logged_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.vllm_npu.mblt"):
        resolve_positive_int({"global4": 256}, name="npu_prefill_chunk_size", core_mode="auto")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "'global4'=256" in caplog.records[0].getMessage()


@pytest.mark.parametrize("raw", [0, -1, True, False, 1.0, "", "abc", "-5", "0", "\u0663", [64]])
def test_resolve_positive_int_rejects(raw):
    with pytest.raises(MbltConfigError, match="npu_prefill_chunk_size"):
        resolve_positive_int(raw, name="npu_prefill_chunk_size", core_mode="single")


def test_resolve_positive_int_rejects_unknown_core_mode():
    with pytest.raises(MbltConfigError, match="core_mode='turbo'"):
        resolve_positive_int(4, name="max_batch_size", core_mode="turbo")


@given(value=st.integers(1, 10**9), mode=st.sampled_from((None,) + CORE_MODES),
       as_text=st.booleans())
def test_positive_int_passes_through_for_every_mode(value, mode, as_text):
    raw = str(value) if as_text else value
    assert resolve_positive_int(raw, name="max_batch_size", core_mode=mode) == value


@given(table=st.dictionaries(st.sampled_from([m for m in CORE_MODES if m != "auto"]), st.integers(1, 4096),
                             min_size=1),
       mode=st.sampled_from(CORE_MODES))
def test_own_core_mode_entry_always_wins(table, mode):
    with_default = {**table, "default": 7}
    expected = 7 if mode == "auto" else table.get(mode, 7)  # auto is never a key
    assert resolve_positive_int(with_default, name="n", core_mode=mode) == expected


# --- core mode / max batch size / chunk -------------------------------------------------------


def test_core_mode_override_beats_config():
    assert resolve_core_mode(parse_loader_extra_config({"core_mode": "single"}),
                             {"core_mode": "global4"}) == "single"
    assert resolve_core_mode(LayoutOverrides(), {"core_mode": "global4"}) == "global4"
    assert resolve_core_mode(LayoutOverrides(), {}) is None
    with pytest.raises(MbltConfigError, match="config.json core_mode='fast'"):
        resolve_core_mode(LayoutOverrides(), {"core_mode": "fast"})


def test_max_batch_size_sources_in_order():
    none = LayoutOverrides()
    assert resolve_max_batch_size(none, {}) is None
    assert resolve_max_batch_size(none, {"npu_max_batch_size": 8}) == 8
    assert resolve_max_batch_size(none, {"max_batch_size": 32, "npu_max_batch_size": 8}) == 32
    override = parse_loader_extra_config({"max_batch_size": 4})
    assert resolve_max_batch_size(override, {"max_batch_size": 32}) == 4


def test_max_batch_size_dict_uses_resolved_core_mode():
    cfg = {"core_mode": "single", "max_batch_size": {"single": 16, "global4": 2}}
    assert resolve_max_batch_size(LayoutOverrides(), cfg) == 16
    assert resolve_max_batch_size(parse_loader_extra_config({"core_mode": "global4"}), cfg) == 2
    # An override dict that does not resolve falls through to the config.
    o = parse_loader_extra_config({"core_mode": "global4", "max_batch_size": {"single": 8}})
    assert resolve_max_batch_size(o, {"max_batch_size": 3}) == 3


def test_prefill_chunk_default_and_clamp(caplog):
    assert resolve_prefill_chunk({}, None, None) == (128, [])
    assert resolve_prefill_chunk({"npu_prefill_chunk_size": {"single": 64}}, "global4", 1) == (128, [])
    assert resolve_prefill_chunk({"npu_prefill_chunk_size": 512}, "global8", 1) == (512, [])
    assert resolve_prefill_chunk({"npu_prefill_chunk_size": 64}, None, 32) == (64, [])
    line = "Clamping model-configured chunked prefill size from 256 to 128 for batch execution."
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        assert resolve_prefill_chunk({"npu_prefill_chunk_size": 256}, None, 2) == (128, [line])
    assert caplog.records[-1].getMessage() == line


# --- plan_scheduler ---------------------------------------------------------------------------


def test_plain_model_defaults():
    assert plan({}) == SchedulerPlan(
        max_num_seqs=1, max_num_batched_tokens=128, long_prefill_token_threshold=128,
        block_size=128,
        enable_prefix_caching=True, max_batch_size=1, core_mode=None, prefill_chunk=128)


def test_readme_global4_selects_256():
    p = plan({"npu_prefill_chunk_size": README_CHUNKS},
             '{"dev_no": 0, "core_mode": "global4", "target_clusters": [0]}')
    assert (p.core_mode, p.prefill_chunk, p.max_num_batched_tokens) == ("global4", 256, 256)
    assert p.long_prefill_token_threshold == 256


def test_config_core_mode_selects_chunk():
    p = plan({"npu_prefill_chunk_size": README_CHUNKS, "core_mode": "global8"})
    assert p.prefill_chunk == 512
    assert plan({"npu_prefill_chunk_size": {"default": 160}}).prefill_chunk == 160
    assert plan({"npu_prefill_chunk_size": {"single": 64}, "core_mode": "global4"}).prefill_chunk == 128
    assert plan({"npu_prefill_chunk_size": {"single": 64}, "core_mode": "auto"}).prefill_chunk == 64
    two = {"npu_prefill_chunk_size": {"single": 64, "global4": 256}, "core_mode": "auto"}
    assert plan(two).prefill_chunk == 128


def test_batch32_reference_case():
    p = plan({"max_batch_size": 32, "npu_prefill_chunk_size": {"single": 256}})
    assert (p.max_num_seqs, p.max_num_batched_tokens, p.long_prefill_token_threshold) == (32, 4096, 128)
    assert p.prefill_chunk == 128 and p.max_batch_size == 32


def test_user_max_num_batched_tokens_lowers_the_chunk_of_one_sequence():
    assert plan({"npu_prefill_chunk_size": 256}, user_max_num_batched_tokens=100).max_num_batched_tokens == 100
    assert plan({"npu_prefill_chunk_size": 256}, user_max_num_batched_tokens=8192).max_num_batched_tokens == 256


def test_batch_models_replace_the_user_max_num_batched_tokens(caplog):
    """Reference rule 8 (vllm-mblt, measured: K=4 with {"single": 256} -> "Clamping ... 256 to
    128" and 512): with several sequences per step, chunk x max_num_seqs wins, with a warning."""
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        p = plan({"max_batch_size": 4, "npu_prefill_chunk_size": {"single": 256}}, user_max_num_batched_tokens=100)
    assert (p.prefill_chunk, p.max_num_batched_tokens, p.long_prefill_token_threshold) == (128, 512, 128)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Replacing --max-num-batched-tokens 100 with chunked prefill size 128 x max_num_seqs 4 = 512" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        plan({"max_batch_size": 4}, user_max_num_batched_tokens=512)  # equal: nothing to say
    assert "Replacing" not in "\n".join(r.getMessage() for r in caplog.records)


def test_max_num_seqs_clamped_kept_or_taken(caplog):
    cfg = {"max_batch_size": 8}
    assert plan(cfg).max_num_seqs == 8
    assert plan(cfg, user_max_num_seqs=3).max_num_seqs == 3
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        p = plan(cfg, user_max_num_seqs=64)
    assert p.max_num_seqs == 8 and p.max_num_batched_tokens == 8 * 128
    assert ("Clamping scheduler max_num_seqs from 64 to model-configured max batch size 8."
            in [r.getMessage() for r in caplog.records])
    # No max_batch_size in the config: the scheduler keeps its cap; requests share one slot.
    unresolved = plan({}, user_max_num_seqs=256)
    assert (unresolved.max_num_seqs, unresolved.max_batch_size) == (256, 1)
    assert plan({}).max_num_seqs == 1


def test_smaller_user_max_num_seqs_of_one_runs_non_batch_sizing():
    p = plan({"max_batch_size": 8, "npu_prefill_chunk_size": 64}, user_max_num_seqs=1)
    assert (p.max_num_seqs, p.max_num_batched_tokens) == (1, 64)


def test_max_batch_size_override_beats_config_and_dict_form():
    assert plan({"max_batch_size": 32}, {"max_batch_size": 2}).max_num_seqs == 2
    cfg = {"max_batch_size": {"single": 16, "global4": 4}}
    assert plan(cfg, {"core_mode": "single"}).max_num_seqs == 16
    assert plan(cfg, {"core_mode": "global4"}).max_num_seqs == 4
    assert plan(cfg, {"max_batch_size": {"default": 6}}).max_num_seqs == 6


def test_user_block_size_and_prefix_caching_are_kept():
    p = plan({}, user_block_size=64, user_enable_prefix_caching=False)
    assert (p.block_size, p.enable_prefix_caching) == (64, False)


@pytest.mark.parametrize("user, word", [
    (dict(user_max_num_seqs=0), "max_num_seqs=0"),
    (dict(user_max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
    (dict(user_block_size=True), "block_size=True"),
    (dict(user_enable_prefix_caching="yes"), "enable_prefix_caching='yes'"),
])
def test_bad_user_values_are_rejected(user, word):
    with pytest.raises(MbltConfigError, match=word):
        plan({}, **user)


def test_plan_logs_its_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.vllm_npu.mblt"):
        plan({"max_batch_size": 32, "npu_prefill_chunk_size": 64})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "max_num_batched_tokens=2048" in text
    assert "partial_prefills" not in text, "vLLM 0.32 has no partial-prefill settings"
    assert "max_batch_size=32" in text


@given(batch=st.integers(1, 64), chunk=st.integers(1, 1024), user_seqs=st.none() | st.integers(1, 128),
       user_tokens=st.none() | st.integers(1, 4096))
def test_plan_invariants(batch, chunk, user_seqs, user_tokens):
    p = plan({"max_batch_size": batch, "npu_prefill_chunk_size": chunk},
             user_max_num_seqs=user_seqs, user_max_num_batched_tokens=user_tokens)
    assert p.max_num_seqs == (batch if user_seqs is None else min(user_seqs, batch))
    expected_chunk = min(chunk, 128) if batch > 1 else chunk
    if user_tokens is not None and p.max_num_seqs == 1:
        expected_chunk = min(expected_chunk, user_tokens)
    assert p.prefill_chunk == p.long_prefill_token_threshold == expected_chunk
    assert p.max_num_batched_tokens == expected_chunk * p.max_num_seqs


def test_json_string_and_mapping_give_the_same_overrides():
    raw = {"dev_no": [0, 1], "core_mode": "global8", "target_clusters": ["0:0", "0:1", "1:0", "1:1"],
           "max_batch_size": {"global8": 2}}
    assert parse_loader_extra_config(json.dumps(raw)) == parse_loader_extra_config(raw)


@pytest.mark.parametrize("raw", [True, "1", 1.0, [], [0, 0], [-1]])
def test_config_dev_no_is_parsed_strictly_naming_the_file(raw):
    """``dev_no`` from an artifact's config.json once went through a bare ``int()`` (``true``
    became device 1)."""
    with pytest.raises(MbltConfigError) as info:
        parse_dev_no(raw, source="/m/config.json")
    assert str(info.value).startswith("/m/config.json: dev_no")


def test_config_dev_no_forms():
    assert parse_dev_no(2, source="x") == (2,)
    assert parse_dev_no([0, 1], source="x") == (0, 1)


def test_unusable_dict_entries_are_skipped_with_a_warning_naming_them(caplog):
    """Issue 20 §2.6: an unusable entry once aborted start-up; vllm-mblt skips it."""
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        got = resolve_positive_int({"auto": 48, "single": "x", "global4": 256}, name="npu_prefill_chunk_size",
                                   core_mode="global4")
    assert got == 256
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Skipping npu_prefill_chunk_size entry 'auto'=48: the key is not a core mode (auto is never a key" in text
    assert "Skipping npu_prefill_chunk_size entry 'single'='x'" in text
