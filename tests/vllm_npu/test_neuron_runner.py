"""vllm_npu.neuron.runner: Model Runner V1/V2 selection per the features guide's tables."""

from __future__ import annotations

import logging

import pytest

from vllm_npu.neuron.runner import (V2_LOG_LINE, RunnerChoice, RunnerInputs, parse_v2_env,
                                    select_runner)

LOGGER = "vllm.vllm_npu.neuron"




def logs(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


MODEL_KINDS = {"is_moe": "Mixture-of-Experts", "expert_parallel": "expert parallelism",
               "sliding_window": "sliding-window attention", "multimodal": "multimodal",
               "pooling": "pooling", "encoder_decoder": "encoder-decoder", "hybrid": "hybrid",
               "attention_free": "attention-free", "diffusion": "diffusion"}
DENSE_FEATURES = {
    "speculative_decoding": (True, "speculative decoding"),
    "structured_outputs": (True, "structured outputs (enable_structured_outputs)"),
    "lora": (True, "LoRA"), "prompt_embeds": (True, "prompt embeddings"),
    "custom_logits_processors": (True, "custom logits processors"),
    "logprobs_mode": ("processed_logprobs", "logprobs_mode=processed_logprobs"),
    "decode_context_length_buckets": (True, "decode_context_length_buckets"),
    "component_dp": (True, "component data parallelism"),
    "on_device_sampling": (False, "CPU sampling"),
    "fp8_packed_kv": (True, "fp8_packed_kv"), "gk_decode": (True, "gk_decode"),
    "pipeline_parallel_size": (2, "pipeline parallelism"),
    "decode_context_parallel_size": (2, "decode context parallelism"),
    "prefill_context_parallel_size": (2, "prefill context parallelism"),
    "enforce_eager": (True, "enforce_eager"), "kv_offloading": (True, "KV cache offloading"),
    "ec_transfer": (True, "EPD encoder-cache transfer"),
    "tensor_capture": (True, "tensor capture"), "tensor_replacement": (True, "tensor replacement"),
}


def test_log_line_constant():
    assert V2_LOG_LINE == "Using the standalone V2 Neuron model runner."


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None), ("0", False), ("1", True), ("true", True),
    ("False", False), ("YES", True), ("no", False), ("on", True), ("off", False), (" 1 ", True)])
def test_parse_env(value, expected):
    assert parse_v2_env(value) is expected


@pytest.mark.parametrize("value", ["2", "v2", "enable", "-1"])
def test_parse_env_invalid(value):
    with pytest.raises(ValueError) as info:
        parse_v2_env(value)
    assert repr(value) in str(info.value) and "VLLM_USE_V2_MODEL_RUNNER" in str(info.value)
    with pytest.raises(ValueError):
        select_runner(RunnerInputs(env_value=value))


def test_default_dense_is_v2(neuron_caplog):
    c = select_runner(RunnerInputs())
    assert c == RunnerChoice(True, "supported dense configuration", (), None)
    assert logs(neuron_caplog) == []
    # raw logits is supported too, and so are TP/DP/async (not inputs at all)
    assert select_runner(RunnerInputs(logprobs_mode="raw_logits", data_parallel_size=4)).use_v2


@pytest.mark.parametrize("field, name", MODEL_KINDS.items())
def test_model_kinds_select_v1_silently(field, name, neuron_caplog):
    c = select_runner(RunnerInputs(**{field: True}, lora=True))
    assert not c.use_v2 and c.features == (name,) and c.logged is None
    assert logs(neuron_caplog) == []


@pytest.mark.parametrize("field, value_name", DENSE_FEATURES.items())
def test_dense_features_select_v1_with_log(field, value_name, neuron_caplog):
    value, name = value_name
    c = select_runner(RunnerInputs(**{field: value}))
    text = f"Neuron Model Runner V2 does not yet support {name}; using V1."
    assert c == RunnerChoice(False, "unsupported features", (name,), text)
    assert logs(neuron_caplog) == [(logging.INFO, text)]


def test_several_features_listed():
    c = select_runner(RunnerInputs(lora=True, enforce_eager=True, on_device_sampling=False))
    assert c.logged == ("Neuron Model Runner V2 does not yet support LoRA, CPU sampling, "
                        "enforce_eager; using V1.")


@pytest.mark.parametrize("env", ["0", "false", "off"])
def test_forced_v1(env, neuron_caplog):
    c = select_runner(RunnerInputs(env_value=env))
    assert not c.use_v2 and c.logged is None and logs(neuron_caplog) == []


def test_forced_v2_clean(neuron_caplog):
    c = select_runner(RunnerInputs(env_value="1"))
    assert c.use_v2 and c.logged is None and logs(neuron_caplog) == []


def test_forced_v2_warns_for_unsupported(neuron_caplog):
    c = select_runner(RunnerInputs(env_value="1", lora=True, multimodal=True))
    text = ("VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported features "
            "(multimodal, LoRA); execution may fail.")
    assert c.use_v2 and c.logged == text and c.features == ("multimodal", "LoRA")
    assert logs(neuron_caplog) == [(logging.WARNING, text)]


@pytest.mark.parametrize("kw", [{"is_moe": True}, {"expert_parallel": True},
                                {"sliding_window": True},
                                {"is_moe": True, "expert_parallel": True, "sliding_window": True}])
def test_forced_v2_moe_without_dp_and_sliding_window_no_warning(kw, neuron_caplog):
    c = select_runner(RunnerInputs(env_value="1", **kw))
    assert c.use_v2 and c.logged is None and logs(neuron_caplog) == []


def test_forced_v2_moe_with_dp_warns(neuron_caplog):
    c = select_runner(RunnerInputs(env_value="1", is_moe=True, expert_parallel=True,
                                   sliding_window=True, data_parallel_size=2))
    assert c.use_v2
    assert c.logged == ("VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with "
                        "unsupported features (Mixture-of-Experts with data parallelism, expert "
                        "parallelism with data parallelism); execution may fail.")


def test_model_kind_wins_over_features_when_unset(neuron_caplog):
    c = select_runner(RunnerInputs(pooling=True, speculative_decoding=True))
    assert not c.use_v2 and c.features == ("pooling",) and c.logged is None
