"""vllm_npu.rbln.options: the ``--rbln-*`` config classes, flags, resolution and the optimum
compile-cache key (rbln.md §4, §5.1)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os

import pytest

from vllm_npu.rbln import options as O
from vllm_npu.rbln.options import OptimumRBLNConfig, RBLNConfig, RBLNConfigBase, RBLNConfigError

# field -> (owning class, type, default, deprecated env vars)
BASE_FIELDS = {
    "num_devices_per_local_rank": (int, 1, ("VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK",
                                            "VLLM_RBLN_TP_SIZE")),
    "use_custom_sampler": (bool, True, ("VLLM_RBLN_SAMPLER",)),
    "sub_block_size": (int | None, None, ("VLLM_RBLN_SUB_BLOCK_SIZE",)),
}
VLLM_FIELDS = {
    "enforce_model_fp32": (bool, False, ("VLLM_RBLN_ENFORCE_MODEL_FP32",)),
    "use_batch_attn_opt": (bool, False, ("VLLM_RBLN_BATCH_ATTN_OPT",)),
    "use_custom_kernel": (bool, False, ("RBLN_USE_CUSTOM_KERNEL",)),
    "use_dynamic_kv_cache": (bool | None, None, ("VLLM_RBLN_USE_DYNAMIC_KV_CACHE",)),
    "enable_sub_block_cache": (bool, True, ("VLLM_RBLN_SUB_BLOCK_CACHE",)),
    "specialize_moe_decode": (bool, True, ("VLLM_RBLN_SPECIALIZE_MOE_DECODE",)),
    "use_moe_tokens_mask": (bool, True, ("VLLM_RBLN_USE_MOE_TOKENS_MASK",)),
    "use_all2all_dispatch": (bool, False, ("VLLM_RBLN_DISPATCH_ALL2ALL",)),
    "use_all2all_combine": (bool, False, ("VLLM_RBLN_COMBINE_ALL2ALL",)),
    "decode_batch_bucket_strategy": (str, "exponential",
                                     ("VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY",)),
    "decode_batch_bucket_min": (int, 1, ("VLLM_RBLN_DECODE_BATCH_BUCKET_MIN",)),
    "decode_batch_bucket_step": (int, 2, ("VLLM_RBLN_DECODE_BATCH_BUCKET_STEP",)),
    "decode_batch_bucket_limit": (int, 1, ("VLLM_RBLN_DECODE_BATCH_BUCKET_LIMIT",)),
    "decode_batch_bucket_manual_buckets": (list[int], [],
                                           ("VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS",)),
    "use_w8a8": (bool, False, ("VLLM_RBLN_USE_W8A8",)),
    "compile_dtype": (str, "", ()),
}
OPTIMUM_FIELDS = {
    "optimum_overrides": (dict[str, object], {}, ()),
    "user_max_num_batched_tokens": (int | None, None, ()),
    "num_blocks_override": (int | None, None, ()),
    "attn_block_size": (int | None, None, ()),
    "image_prefill_chunk_size": (int | None, None, ()),
    "cached_model_path": (str | None, None, ()),
    "num_blocks_synced": (int | None, None, ()),
}
NO_FLAG = {"user_max_num_batched_tokens", "num_blocks_override"}
DERIVED = {"attn_block_size", "image_prefill_chunk_size", "cached_model_path", "num_blocks_synced"}
ALL_ENV_VARS = sorted({v for table in (BASE_FIELDS, VLLM_FIELDS) for *_, env in table.values()
                       for v in env})
DEPRECATION_HEAD = (
    "These environment variables are deprecated and will be removed in 0.14.0. Use the flag "
    "instead, or the additional_config key it writes, which is the flag without the --rbln- "
    "prefix: ")
# A value different from the default, per field, as an env string and as the parsed value.
ENV_SAMPLES = {
    "num_devices_per_local_rank": ("4", 4), "use_custom_sampler": ("0", False),
    "sub_block_size": ("256", 256), "enforce_model_fp32": ("1", True),
    "use_batch_attn_opt": ("true", True), "use_custom_kernel": ("1", True),
    "use_dynamic_kv_cache": ("False", False), "enable_sub_block_cache": ("false", False),
    "specialize_moe_decode": ("0", False), "use_moe_tokens_mask": ("0", False),
    "use_all2all_dispatch": ("1", True), "use_all2all_combine": ("1", True),
    "decode_batch_bucket_strategy": ("linear", "linear"), "decode_batch_bucket_min": ("2", 2),
    "decode_batch_bucket_step": ("4", 4), "decode_batch_bucket_limit": ("8", 8),
    "decode_batch_bucket_manual_buckets": ("1,4,16", [1, 4, 16]), "use_w8a8": ("1", True),
}


def _fields(cls):
    return {f.name: f for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------------------------
# The classes


def test_field_table():
    assert list(_fields(RBLNConfigBase)) == list(BASE_FIELDS)
    assert list(_fields(RBLNConfig)) == [*BASE_FIELDS, *VLLM_FIELDS]
    assert list(_fields(OptimumRBLNConfig)) == [*BASE_FIELDS, *OPTIMUM_FIELDS]
    hints = {**O._hints(RBLNConfig), **O._hints(OptimumRBLNConfig)}
    for cls, table in ((RBLNConfig, {**BASE_FIELDS, **VLLM_FIELDS}),
                       (OptimumRBLNConfig, {**BASE_FIELDS, **OPTIMUM_FIELDS})):
        config = cls()
        for name, (hint, default, env) in table.items():
            f = _fields(cls)[name]
            assert getattr(config, name) == default, name
            assert O.env_vars(f) == env, name
            assert f.metadata["doc"].strip(), name
            assert f.metadata["no_flag"] is (name in NO_FLAG | DERIVED), name
            assert f.metadata["derived"] is (name in DERIVED), name
            if hint == dict[str, object]:
                assert hints[name] == dict[str, O.Any]
            else:
                assert hints[name] == hint, name


def test_classes_are_frozen_and_name_their_path():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RBLNConfig().use_w8a8 = True  # type: ignore[misc]
    assert (RBLNConfig.MODEL_PATH, OptimumRBLNConfig.MODEL_PATH) == ("vllm", "optimum")
    assert RBLNConfig().decode_batch_bucket_manual_buckets is not \
        RBLNConfig().decode_batch_bucket_manual_buckets


def test_json_values_are_coerced():
    config = RBLNConfig(use_w8a8="false", decode_batch_bucket_limit="8", sub_block_size="64",
                        decode_batch_bucket_manual_buckets="1, 2", use_dynamic_kv_cache="1")
    assert (config.use_w8a8, config.decode_batch_bucket_limit, config.sub_block_size) == \
        (False, 8, 64)
    assert config.decode_batch_bucket_manual_buckets == [1, 2]
    assert config.use_dynamic_kv_cache is True
    assert OptimumRBLNConfig(optimum_overrides='{"a": 1}').optimum_overrides == {"a": 1}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"use_w8a8": "junk"},
     "RBLNConfig.use_w8a8 must be bool, got 'junk': expected a switch: 1, true, yes, on (on) or 0, false, no, off (off)"),
    ({"decode_batch_bucket_limit": True},
     "RBLNConfig.decode_batch_bucket_limit must be int, got True: expected an integer, not a "
     "boolean"),
    ({"decode_batch_bucket_strategy": "garbage"},
     "RBLNConfig.decode_batch_bucket_strategy must be one of ['exponential', 'linear', "
     "'manual'], got 'garbage'"),
    ({"decode_batch_bucket_strategy": "exp"},
     "RBLNConfig.decode_batch_bucket_strategy must be one of ['exponential', 'linear', "
     "'manual'], got 'exp'"),
    ({"compile_dtype": "float32"},
     "RBLNConfig.compile_dtype must be one of ['', 'float16', 'bfloat16'], got 'float32'"),
    ({"sub_block_size": 0}, "RBLNConfig.sub_block_size must be >= 1, got 0"),
    ({"sub_block_size": -1}, "RBLNConfig.sub_block_size must be >= 1, got -1"),
    ({"num_devices_per_local_rank": 0}, "RBLNConfig.num_devices_per_local_rank must be >= 1, got 0"),
    ({"decode_batch_bucket_manual_buckets": [4, 0]},
     "RBLNConfig.decode_batch_bucket_manual_buckets must be >= 1, got [4, 0]"),
    ({"decode_batch_bucket_manual_buckets": [4, 2, 4]},
     "decode_batch_bucket_manual_buckets must be unique, got [4, 2, 4]"),
    ({"decode_batch_bucket_strategy": "manual"},
     "decode_batch_bucket_strategy='manual' needs at least one entry in "
     "decode_batch_bucket_manual_buckets"),
])
def test_invalid_values_are_refused(kwargs, message):
    with pytest.raises(RBLNConfigError) as err:
        RBLNConfig(**kwargs)
    assert isinstance(err.value, ValueError)
    assert str(err.value) == message


def test_manual_buckets_in_post_init():
    config = RBLNConfig(decode_batch_bucket_strategy="manual",
                        decode_batch_bucket_manual_buckets=[16, 4, 1])
    assert config.decode_batch_bucket_manual_buckets == [16, 4, 1]


def test_compute_hash_covers_only_compile_fields():
    base = RBLNConfig().compute_hash()
    assert RBLNConfig().compute_hash() == base and len(base) == 64
    assert RBLNConfig(use_custom_sampler=False).compute_hash() == base
    assert RBLNConfig(enable_sub_block_cache=False).compute_hash() == base
    assert RBLNConfig(sub_block_size=64).compute_hash() == base
    assert RBLNConfig(use_dynamic_kv_cache=True).compute_hash() == base
    for changed in ({"use_dynamic_kv_cache": False}, {"use_w8a8": True},
                    {"compile_dtype": "float16"}, {"decode_batch_bucket_strategy": "linear"},
                    {"decode_batch_bucket_manual_buckets": [1, 2, 4]},
                    {"num_devices_per_local_rank": 2}):
        assert RBLNConfig(**changed).compute_hash() != base, changed
    opt = OptimumRBLNConfig().compute_hash()
    assert opt != base
    assert OptimumRBLNConfig(cached_model_path="/x", num_blocks_synced=3).compute_hash() == opt
    assert OptimumRBLNConfig(optimum_overrides={"a": 1}).compute_hash() != opt


# --------------------------------------------------------------------------------------------
# Flags on a plain argparse parser


def expected_flags() -> set[str]:
    names = [*BASE_FIELDS, *VLLM_FIELDS, *(n for n in OPTIMUM_FIELDS if n not in NO_FLAG | DERIVED)]
    return {"--rbln-" + n.replace("_", "-") for n in names}


def plain_parser(with_additional_config: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    if with_additional_config:
        parser.add_argument("--additional-config", type=json.loads, default={})
    return O.add_cli_args(parser)


def rbln_option_strings(parser: argparse.ArgumentParser) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == O.GROUP_TITLE)
    return {s for a in group._group_actions for s in a.option_strings}


def test_every_flag_field_gets_a_flag():
    parser = plain_parser()
    bools = {n for n, (hint, *_) in {**BASE_FIELDS, **VLLM_FIELDS}.items()
             if hint in (bool, bool | None)}
    assert rbln_option_strings(parser) == expected_flags() | {
        "--no-rbln-" + n.replace("_", "-") for n in bools}
    group = next(g for g in parser._action_groups if g.title == O.GROUP_TITLE)
    for action in group._group_actions:
        assert action.dest == "rbln_" + action.option_strings[0].removeprefix("--rbln-") \
            .replace("-", "_")
        assert action.help and action.default is argparse.SUPPRESS
    helps = {a.option_strings[0]: a.help for a in group._group_actions}
    assert "VLLM_RBLN_SAMPLER" in helps["--rbln-use-custom-sampler"]
    assert "Default: True." in helps["--rbln-use-custom-sampler"]
    parser.format_help()  # every help string formats


def test_add_cli_args_is_idempotent():
    parser = plain_parser()
    before = list(parser._actions)
    assert O.add_cli_args(parser) is parser
    assert list(parser._actions) == before
    assert sum(g.title == O.GROUP_TITLE for g in parser._action_groups) == 1
    ns = parser.parse_args(["--rbln-use-w8a8", "--additional-config", '{"x": 1}'])
    assert ns.additional_config == {"use_w8a8": True, "x": 1}


def test_flags_write_additional_config():
    ns = plain_parser().parse_args([
        "--no-rbln-use-custom-sampler", "--rbln-num-devices-per-local-rank", "4",
        "--rbln-decode-batch-bucket-strategy", "manual",
        "--rbln-decode-batch-bucket-manual-buckets", "1", "4,16",
        "--rbln-sub-block-size", "128", "--rbln-compile-dtype", "bfloat16",
        "--rbln-use-dynamic-kv-cache",
        "--rbln-optimum-overrides", '{"device": [0, 1]}',
    ])
    assert ns.additional_config == {
        "use_custom_sampler": False, "num_devices_per_local_rank": 4,
        "decode_batch_bucket_strategy": "manual",
        "decode_batch_bucket_manual_buckets": [1, 4, 16], "sub_block_size": 128,
        "compile_dtype": "bfloat16", "use_dynamic_kv_cache": True,
        "optimum_overrides": {"device": [0, 1]},
    }
    assert not [k for k in vars(ns) if k.startswith("rbln_")]


def test_no_flag_and_derived_fields_have_no_flag():
    parser = plain_parser()
    for name in NO_FLAG | DERIVED:
        with pytest.raises(SystemExit):
            parser.parse_args(["--rbln-" + name.replace("_", "-"), "1"])


def test_a_namespace_without_additional_config_gets_one():
    parser = plain_parser(with_additional_config=False)
    assert not hasattr(parser.parse_args([]), "additional_config")
    assert parser.parse_args(["--rbln-use-w8a8"]).additional_config == {"use_w8a8": True}
    parser.set_defaults(additional_config=None)
    assert parser.parse_args(["--no-rbln-use-w8a8"]).additional_config == {"use_w8a8": False}


@pytest.mark.parametrize("order", ["flag-first", "json-first"])
def test_json_additional_config_merges_in_either_order(order):
    parser = plain_parser()
    flag, js = ["--rbln-use-w8a8"], ["--additional-config", '{"x": 1}']
    ns = parser.parse_args(flag + js if order == "flag-first" else js + flag)
    assert ns.additional_config == {"use_w8a8": True, "x": 1}
    assert parser.get_default("additional_config") == {}  # the shared default is untouched
    assert parser.parse_args([]).additional_config == {}


def test_later_value_of_a_key_wins():
    parser = plain_parser()
    ns = parser.parse_args(["--additional-config", '{"use_w8a8": false}', "--rbln-use-w8a8"])
    assert ns.additional_config == {"use_w8a8": True}
    ns = parser.parse_args(["--rbln-use-w8a8", "--additional-config", '{"use_w8a8": false}'])
    assert ns.additional_config == {"use_w8a8": False}


@pytest.mark.parametrize(("argv", "message"), [
    (["--rbln-decode-batch-bucket-min", "x"], "expected an integer, got 'x'"),
    (["--rbln-optimum-overrides", "[1]"], "expected a JSON object, got '[1]'"),
    (["--rbln-decode-batch-bucket-strategy", "exp"], "invalid choice: 'exp'"),
])
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        plain_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_flags_round_trip_into_the_config():
    ns = plain_parser().parse_args(["--rbln-use-w8a8", "--rbln-decode-batch-bucket-limit", "2",
                                    "--additional-config", '{"enforce_model_fp32": true}'])
    config, warnings = O.resolve(RBLNConfig, ns.additional_config, environ={})
    assert config == RBLNConfig(use_w8a8=True, decode_batch_bucket_limit=2,
                                enforce_model_fp32=True)
    assert warnings == []


# --------------------------------------------------------------------------------------------
# Flags on vLLM's own parser


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NPU_HARNESS_TARGET", raising=False)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        O.add_cli_args(parser)
        O.add_cli_args(parser)  # idempotent on vLLM's parser too
    return parser


@pytest.mark.parametrize("order", ["flag-first", "json-first"])
def test_vllm_parser_merges_in_either_order(vllm_parser, order):
    flag, js = ["--rbln-use-w8a8"], ["--additional-config", '{"x":1}']
    ns = vllm_parser.parse_args(flag + js if order == "flag-first" else js + flag)
    assert ns.additional_config == {"use_w8a8": True, "x": 1}
    assert vllm_parser.parse_args([]).additional_config == {}


def test_vllm_parser_dotted_form_merges(vllm_parser):
    # vLLM appends the dotted form at the end of argv as one JSON --additional-config, and
    # spells underscores in a flag name as dashes.
    ns = vllm_parser.parse_args(["--rbln-use-w8a8", "--additional-config.decode_batch_bucket_limit",
                                 "2", "--no-rbln_use_custom_sampler"])
    assert ns.additional_config == {"use_w8a8": True, "decode_batch_bucket_limit": 2,
                                    "use_custom_sampler": False}


def test_vllm_parser_round_trips_into_engine_args(vllm_parser):
    from vllm.engine.arg_utils import EngineArgs

    ns = vllm_parser.parse_args(["--rbln-num-devices-per-local-rank", "2",
                                 "--rbln-decode-batch-bucket-manual-buckets", "1", "2",
                                 "--rbln-decode-batch-bucket-strategy", "manual",
                                 "--additional-config", '{"use_w8a8": true}'])
    engine_args = EngineArgs.from_cli_args(ns)
    config, _ = O.resolve(RBLNConfig, engine_args.additional_config, environ={})
    assert config == RBLNConfig(num_devices_per_local_rank=2, use_w8a8=True,
                                decode_batch_bucket_strategy="manual",
                                decode_batch_bucket_manual_buckets=[1, 2])
    assert O.GROUP_TITLE in {g.title for g in vllm_parser._action_groups}
    assert expected_flags() <= set(vllm_parser._option_string_actions)


# --------------------------------------------------------------------------------------------
# resolve(): precedence, env deprecations, renamed keys, rejections


def test_defaults_when_nothing_is_given():
    for given in (None, {}):
        assert O.resolve(RBLNConfig, given, environ={}) == (RBLNConfig(), [])
        assert O.resolve(OptimumRBLNConfig, given, environ={}) == (OptimumRBLNConfig(), [])


def test_an_instance_passes_through_unchanged():
    given = RBLNConfig(use_w8a8=True)
    config, warnings = O.resolve(RBLNConfig, given, environ={"VLLM_RBLN_USE_W8A8": "0"})
    assert config is given
    assert warnings == [
        DEPRECATION_HEAD + "VLLM_RBLN_USE_W8A8 -> --rbln-use-w8a8",
        "Both the environment and additional_config set VLLM_RBLN_USE_W8A8; use_w8a8 takes the "
        "additional_config value."]


@pytest.mark.parametrize("name", sorted(ENV_SAMPLES))
def test_each_deprecated_env_var_sets_its_field(name):
    cls = RBLNConfig
    raw, value = ENV_SAMPLES[name]
    if name == "decode_batch_bucket_manual_buckets":
        extra = {"decode_batch_bucket_strategy": "manual"}
    else:
        extra = {}
    for var in {**BASE_FIELDS, **VLLM_FIELDS}[name][2]:
        config, warnings = O.resolve(cls, extra, environ={var: raw})
        assert getattr(config, name) == value
        assert warnings == [DEPRECATION_HEAD + f"{var} -> --rbln-{name.replace('_', '-')}"]


def test_base_env_vars_also_reach_the_optimum_config():
    config, warnings = O.resolve(OptimumRBLNConfig, {}, environ={
        "VLLM_RBLN_TP_SIZE": "8", "VLLM_RBLN_SAMPLER": "0", "VLLM_RBLN_USE_W8A8": "1"})
    assert (config.num_devices_per_local_rank, config.use_custom_sampler) == (8, False)
    # VLLM_RBLN_USE_W8A8 belongs to the vllm path's class: not read, not reported.
    assert warnings == [DEPRECATION_HEAD + "VLLM_RBLN_TP_SIZE -> --rbln-num-devices-per-local-rank"
                        ", VLLM_RBLN_SAMPLER -> --rbln-use-custom-sampler"]


def test_one_deprecation_warning_lists_every_variable_in_field_order():
    env = {"VLLM_RBLN_USE_W8A8": "1", "RBLN_USE_CUSTOM_KERNEL": "1", "VLLM_RBLN_SAMPLER": "0",
           "VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK": "2", "VLLM_RBLN_TP_SIZE": "4",
           "VLLM_RBLN_SUB_BLOCK_CACHE": "0", "VLLM_RBLN_BATCH_ATTN_OPT": "1",
           "VLLM_RBLN_DISPATCH_ALL2ALL": "1", "VLLM_RBLN_COMBINE_ALL2ALL": "1",
           "VLLM_RBLN_COMPILE_ONLY": "1"}
    config, warnings = O.resolve(RBLNConfig, {}, environ=env)
    assert warnings == [DEPRECATION_HEAD + ", ".join([
        "VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK -> --rbln-num-devices-per-local-rank",
        "VLLM_RBLN_TP_SIZE -> --rbln-num-devices-per-local-rank",
        "VLLM_RBLN_SAMPLER -> --rbln-use-custom-sampler",
        "VLLM_RBLN_BATCH_ATTN_OPT -> --rbln-use-batch-attn-opt",
        "RBLN_USE_CUSTOM_KERNEL -> --rbln-use-custom-kernel",
        "VLLM_RBLN_SUB_BLOCK_CACHE -> --rbln-enable-sub-block-cache",
        "VLLM_RBLN_DISPATCH_ALL2ALL -> --rbln-use-all2all-dispatch",
        "VLLM_RBLN_COMBINE_ALL2ALL -> --rbln-use-all2all-combine",
        "VLLM_RBLN_USE_W8A8 -> --rbln-use-w8a8"])]
    assert config.num_devices_per_local_rank == 2  # the primary name wins over the alias
    assert (config.use_batch_attn_opt, config.use_custom_kernel, config.enable_sub_block_cache,
            config.use_all2all_dispatch, config.use_all2all_combine) == (True, True, False, True,
                                                                         True)


def test_env_exp_and_comma_buckets():
    config, _ = O.resolve(RBLNConfig, {}, environ={
        "VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "exp"})
    assert config.decode_batch_bucket_strategy == "exponential"
    config, _ = O.resolve(RBLNConfig, {}, environ={
        "VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "manual",
        "VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS": " 8, 4 ,1 "})
    assert (config.decode_batch_bucket_strategy, config.decode_batch_bucket_manual_buckets) == \
        ("manual", [8, 4, 1])


def test_empty_env_values_are_unset():
    assert O.resolve(RBLNConfig, {}, environ={"VLLM_RBLN_USE_W8A8": "", "VLLM_RBLN_SAMPLER": " "}) \
        == (RBLNConfig(), [])


@pytest.mark.parametrize(("env", "message"), [
    ({"VLLM_RBLN_USE_W8A8": "maybe"},
     "VLLM_RBLN_USE_W8A8='maybe' is not a valid use_w8a8: expected a switch: 1, true (on) or 0, false (off)"),
    ({"VLLM_RBLN_TP_SIZE": "four"},
     "VLLM_RBLN_TP_SIZE='four' is not a valid num_devices_per_local_rank: expected an integer (an int or "
     "a decimal digit string)"),
    # vllm-rbln reads these words as off (its envs.py: value.lower() in ("true", "1")); read as on
    # here they would test another configuration than the board runs, so they are refused
    ({"VLLM_RBLN_SAMPLER": "yes"},
     "VLLM_RBLN_SAMPLER='yes' is not a valid use_custom_sampler: expected a switch: 1, true (on) or 0, false (off)"),
    ({"VLLM_RBLN_USE_W8A8": "on"},
     "VLLM_RBLN_USE_W8A8='on' is not a valid use_w8a8: expected a switch: 1, true (on) or 0, false (off)"),
])
def test_bad_env_values_name_the_variable(env, message):
    with pytest.raises(RBLNConfigError) as err:
        O.resolve(RBLNConfig, {}, environ=env)
    assert str(err.value) == message


def test_additional_config_wins_over_the_environment(rbln_caplog):
    caplog = rbln_caplog
    config, warnings = O.resolve(RBLNConfig, {"use_w8a8": False, "use_custom_sampler": True},
                                 environ={"VLLM_RBLN_USE_W8A8": "1", "VLLM_RBLN_SAMPLER": "0",
                                          "VLLM_RBLN_BATCH_ATTN_OPT": "1"})
    assert (config.use_w8a8, config.use_custom_sampler, config.use_batch_attn_opt) == \
        (False, True, True)
    assert warnings == [
        DEPRECATION_HEAD + "VLLM_RBLN_SAMPLER -> --rbln-use-custom-sampler, "
        "VLLM_RBLN_BATCH_ATTN_OPT -> --rbln-use-batch-attn-opt, "
        "VLLM_RBLN_USE_W8A8 -> --rbln-use-w8a8",
        "Both the environment and additional_config set VLLM_RBLN_SAMPLER; use_custom_sampler "
        "takes the additional_config value.",
        "Both the environment and additional_config set VLLM_RBLN_USE_W8A8; use_w8a8 takes the "
        "additional_config value.",
    ]
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.vllm_npu.rbln"]
    assert logged == [(logging.WARNING, w) for w in warnings] + [
        (logging.INFO, "RBLN config: {'use_batch_attn_opt': True}")]


def test_the_info_line_names_the_changed_fields(rbln_caplog):
    caplog = rbln_caplog
    O.resolve(OptimumRBLNConfig, {"optimum_overrides": {"a": 1}, "sub_block_size": 128},
              environ={})
    assert [r.getMessage() for r in caplog.records] == [
        "RBLN config: {'sub_block_size': 128, 'optimum_overrides': {'a': 1}}"]
    caplog.clear()
    O.resolve(OptimumRBLNConfig, {}, environ={})
    assert caplog.records == []


def test_default_environment_is_os_environ(monkeypatch):
    monkeypatch.setenv("VLLM_RBLN_USE_W8A8", "1")
    assert O.resolve(RBLNConfig, {})[0].use_w8a8 is True
    assert os.environ["VLLM_RBLN_USE_W8A8"] == "1"


@pytest.mark.parametrize(("cls", "old", "new", "value"), [
    (OptimumRBLNConfig, "rbln_config", "optimum_overrides", {"device": [0]}),
    (OptimumRBLNConfig, "prefix_block_size", "sub_block_size", 256),
    (RBLNConfig, "prefix_block_size", "sub_block_size", 256),
])
def test_renamed_keys_still_work(cls, old, new, value):
    config, warnings = O.resolve(cls, {old: value}, environ={})
    assert getattr(config, new) == value
    assert warnings == [f"additional_config[{old!r}] is deprecated and will be removed in 0.14.0;"
                        f" use {new!r}."]


def test_a_renamed_key_with_its_new_name_too_is_refused():
    with pytest.raises(RBLNConfigError) as err:
        O.resolve(RBLNConfig, {"prefix_block_size": 64, "sub_block_size": 64}, environ={})
    assert str(err.value) == ("additional_config sets both 'prefix_block_size' and "
                              "'sub_block_size', its new name; keep 'sub_block_size'.")


def _fields_message(cls, unknown):
    known = sorted(f.name for f in dataclasses.fields(cls))
    return (f"additional_config takes only {cls.__name__} fields, and {unknown} are not fields. "
            f"The fields are {known}.")


@pytest.mark.parametrize(("cls", "given", "unknown"), [
    (OptimumRBLNConfig, {"use_w8a8": True}, ["use_w8a8"]),  # --rbln-use-w8a8 on optimum
    (RBLNConfig, {"optimum_overrides": {}}, ["optimum_overrides"]),
    (RBLNConfig, {"rbln_config": {}}, ["rbln_config"]),  # a rename into the other class
    (RBLNConfig, {"gdn_prefill_backend": "auto"}, ["gdn_prefill_backend"]),  # upstream's key
    (RBLNConfig, {"user_max_num_batched_tokens": 8}, ["user_max_num_batched_tokens"]),
    (RBLNConfig, {"use_custom_samplerr": False, "b": 1, "a": 2},
     ["a", "b", "use_custom_samplerr"]),
])
def test_foreign_fields_are_refused(cls, given, unknown):
    with pytest.raises(RBLNConfigError) as err:
        O.resolve(cls, given, environ={})
    assert str(err.value) == _fields_message(cls, unknown)
    assert "are not fields" in str(err.value)


def test_no_flag_and_derived_fields_are_accepted_from_additional_config():
    config, _ = O.resolve(OptimumRBLNConfig, {"user_max_num_batched_tokens": 512,
                                              "num_blocks_override": 64,
                                              "cached_model_path": "/c", "attn_block_size": 4096},
                          environ={})
    assert (config.user_max_num_batched_tokens, config.num_blocks_override,
            config.cached_model_path, config.attn_block_size) == (512, 64, "/c", 4096)


@pytest.mark.parametrize(("cls", "given"), [
    (OptimumRBLNConfig, RBLNConfig()), (RBLNConfig, OptimumRBLNConfig())])
def test_a_config_of_the_other_path_is_refused(cls, given):
    with pytest.raises(RBLNConfigError) as err:
        O.resolve(cls, given, environ={})
    assert str(err.value) == (
        f"additional_config is an {type(given).__name__}, and the {cls.__name__} path is the "
        "one being resolved. A config class belongs to one model path.")


@pytest.mark.parametrize(("given", "type_name"), [
    ('{"use_w8a8": true}', "str"), ([("use_w8a8", True)], "list"), (3, "int")])
def test_other_types_are_refused(given, type_name):
    with pytest.raises(RBLNConfigError) as err:
        O.resolve(RBLNConfig, given, environ={})
    assert str(err.value) == (
        f"additional_config must be a RBLNConfig or a mapping of its field names, got {type_name}")


def test_field_values_are_checked_after_resolution():
    with pytest.raises(RBLNConfigError, match="needs at least one entry"):
        O.resolve(RBLNConfig, {"decode_batch_bucket_strategy": "manual"}, environ={})
    with pytest.raises(RBLNConfigError, match="must be >= 1, got 0"):
        O.resolve(RBLNConfig, {}, environ={"VLLM_RBLN_SUB_BLOCK_SIZE": "0"})


def test_resolve_does_not_mutate_its_input():
    given = {"prefix_block_size": 64}
    O.resolve(RBLNConfig, given, environ={})
    assert given == {"prefix_block_size": 64}


# --------------------------------------------------------------------------------------------
# The compile-cache key


KEY_ARGS = dict(model_name="meta-llama/Llama-3.1-8B:main", batch_size=4, block_size=4096,
                max_model_len=8192, num_devices=2, dtype="torch.bfloat16",
                max_num_batched_tokens=None, memory_budget=0.93,
                optimum_overrides={"kvcache_partition_len": 4096, "device": [0, 1]},
                compiler_version="0.12.0", optimum_rbln_version="0.12.0")


def test_cache_key_formula():
    key = O.cache_key(**KEY_ARGS)
    factors = {"model_name": "meta-llama/Llama-3.1-8B:main", "batch_size": 4, "block_size": 4096,
               "max_model_len": 8192, "num_devices": 2, "dtype": "torch.bfloat16",
               "max_num_batched_tokens": None, "memory_budget": 0.93,
               "rbln_config": {"kvcache_partition_len": 4096},
               "compiler": "0.12.0", "optimum_rbln": "0.12.0"}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()) \
        .hexdigest()[:16]
    assert dict(key.factors) == factors
    assert key.digest == digest and len(digest) == 16
    assert key.dirname == f"meta-llama_Llama-3.1-8B_main_{digest}"
    assert O.cache_key(**KEY_ARGS) == key  # stable
    assert O.cached_model_path("/root/.cache/vllm", key) == \
        f"/root/.cache/vllm/compiled_models/{key.dirname}"


def test_dtype_and_model_name_are_stringified():
    class Dtype:
        def __str__(self):
            return "torch.bfloat16"

    assert O.cache_key(**{**KEY_ARGS, "dtype": Dtype()}) == O.cache_key(**KEY_ARGS)


@pytest.mark.parametrize(("name", "other"), [
    ("model_name", "Qwen/Qwen3-8B"), ("batch_size", 8), ("block_size", 1024),
    ("max_model_len", 4096), ("num_devices", 4), ("dtype", "torch.float16"),
    ("max_num_batched_tokens", 512), ("memory_budget", 0.9),
    ("optimum_overrides", {"kvcache_partition_len": 8192}),
    ("compiler_version", "0.12.1"), ("optimum_rbln_version", "0.12.1"),
    ("compiler_version", None),
])
def test_every_factor_changes_the_key(name, other):
    assert O.cache_key(**{**KEY_ARGS, name: other}).digest != O.cache_key(**KEY_ARGS).digest


@pytest.mark.parametrize("overrides", [
    {"kvcache_partition_len": 4096},
    {"kvcache_partition_len": 4096, "device": 3, "create_runtimes": False,
     "kvcache_num_blocks": 100},
    {"kvcache_partition_len": 4096, "language_model": {"device": [2, 3]}},
])
def test_runtime_only_keys_do_not_change_the_key(overrides):
    assert O.cache_key(**{**KEY_ARGS, "optimum_overrides": overrides}) == O.cache_key(**KEY_ARGS)


def test_rbln_config_is_hashed_only_when_non_empty():
    none = O.cache_key(**{**KEY_ARGS, "optimum_overrides": None})
    assert "rbln_config" not in none.factors
    for empty in ({}, {"device": [0]}, {"vision_tower": {"device": 1, "create_runtimes": True}}):
        assert O.cache_key(**{**KEY_ARGS, "optimum_overrides": empty}) == none
    nested = O.cache_key(**{**KEY_ARGS, "optimum_overrides": {
        "language_model": {"device": [0], "batch_size": 2}}})
    assert nested.factors["rbln_config"] == {"language_model": {"batch_size": 2}}


def test_compile_overrides_strips_recursively():
    assert O.compile_overrides({"a": {"b": {"kvcache_num_blocks": 1, "c": 1}},
                                "l": [{"device": 0, "x": 1}], "e": {}}) == \
        {"a": {"b": {"c": 1}}, "l": [{"x": 1}], "e": {}}
    assert O.compile_overrides(None) == {}
