"""vllm_npu.neuron.neuron_config: parsing ``additional_config["neuron_config"]`` (neuron.md §5,
§6; features guide)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_npu.neuron.neuron_config import (COMPONENT_DP_FIELDS, EncoderNeuronConfig, NeuronConfig,
                                           NeuronConfigError, OnDeviceSamplingConfig)

P = NeuronConfig.from_additional_config


def err(cfg) -> str:
    with pytest.raises(NeuronConfigError) as info:
        P(cfg)
    assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.parametrize("cfg", [None, {}, {"neuron_config": None}, {"neuron_config": {}},
                                 {"other_plugin": {"x": 1}}])
def test_defaults(cfg):
    c = P(cfg)
    assert c == NeuronConfig()
    assert c.on_device_sampling and c.on_device_sampling_config == OnDeviceSamplingConfig()
    ods = c.on_device_sampling_config
    assert (ods.all_greedy, ods.max_top_k, ods.deterministic, ods.sampling_dp_degree,
            ods.capture_topk, ods.temperature) == (False, 256, False, 1, False, None)
    assert (c.num_batched_tokens_buckets, c.num_seqs_buckets, c.decode_context_length_buckets,
            c.kv_segment_size_buckets) == (None,) * 4
    assert c.ep_degree == 1 and all(getattr(c, f) == 1 for f in COMPONENT_DP_FIELDS)
    assert (c.quantization, c.fp8_packed_kv, c.gk_decode) == (None, False, False)
    assert c.encoder == EncoderNeuronConfig() and c.component_dp == {}


def test_explicit_null_ods_is_cpu_sampling():
    c = P({"neuron_config": {"on_device_sampling_config": None}})
    assert c.on_device_sampling_config is None and not c.on_device_sampling


def test_ods_dict():
    c = P({"neuron_config": {"on_device_sampling_config": {
        "all_greedy": "true", "max_top_k": 64, "deterministic": True, "sampling_dp_degree": 2,
        "capture_topk": 5, "temperature": "0", "top_k": "1", "top_p": 0.9}}})
    ods = c.on_device_sampling_config
    assert ods == OnDeviceSamplingConfig(True, 64, True, 2, 5, 0.0, 1, 0.9)
    assert P({"neuron_config": {"on_device_sampling_config": {}}}).on_device_sampling_config == \
        OnDeviceSamplingConfig()


@pytest.mark.parametrize("ods, text", [
    ({"max_top_k": 0}, "max_top_k must be a positive integer, got 0"),
    ({"sampling_dp_degree": -1}, "sampling_dp_degree must be a positive integer, got -1"),
    ({"all_greedy": "maybe"}, "all_greedy='maybe' is not a switch: expected 1, true, yes, on (on) or 0, false, no, off (off)"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"temperature": -1}, "temperature must be non-negative, got -1.0"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
    ({"capture_topk": -2}, "capture_topk must be a boolean or a non-negative integer, got -2"),
    ({"bogus": 1}, "Unknown on_device_sampling_config key(s) ['bogus']. Known keys: "
                   "['all_greedy', 'max_top_k', 'deterministic', 'sampling_dp_degree', "
                   "'capture_topk', 'temperature', 'top_k', 'top_p']"),
    ("greedy", "on_device_sampling_config must be a dict or null, got str"),
])
def test_ods_errors(ods, text):
    assert err({"neuron_config": {"on_device_sampling_config": ods}}) == text


def test_buckets_parsed_to_tuples():
    c = P({"neuron_config": {"num_batched_tokens_buckets": [128, 1024], "num_seqs_buckets": [1, 4],
                             "decode_context_length_buckets": [1024],
                             "kv_segment_size_buckets": [1024]}})
    assert c.num_batched_tokens_buckets == (128, 1024) and c.num_seqs_buckets == (1, 4)
    assert c.decode_context_length_buckets == (1024,) and c.kv_segment_size_buckets == (1024,)
    hash(c)


@pytest.mark.parametrize("key", ["num_batched_tokens_buckets", "num_seqs_buckets",
                                 "decode_context_length_buckets", "kv_segment_size_buckets"])
def test_bucket_shape_errors(key):
    assert err({"neuron_config": {key: []}}) == f"{key} cannot be empty"
    assert err({"neuron_config": {key: 8}}) == f"{key} must be a list, got int"
    assert err({"neuron_config": {key: [4, 2]}}) == \
        f"{key} must be in strictly ascending order, got [4, 2]"
    assert err({"neuron_config": {key: [0]}}) == f"{key}[0] must be positive, got 0"


@pytest.mark.parametrize("key", ["ep_degree", *COMPONENT_DP_FIELDS])
@pytest.mark.parametrize("bad", [0, -2, "2", 1.5, True])
def test_positive_integers(key, bad):
    assert err({"neuron_config": {key: bad}}) == f"{key} must be a positive integer, got {bad}"


def test_degrees_and_component_dp():
    c = P({"neuron_config": {"ep_degree": 4, "attention_dp_size": 2, "mlp_dp_size": 4}})
    assert c.ep_degree == 4
    assert c.component_dp == {"attention_dp_size": 2, "mlp_dp_size": 4}


def test_quantization_and_switches():
    c = P({"neuron_config": {"quantization": "mxfp4", "fp8_packed_kv": True, "gk_decode": "1"}})
    assert (c.quantization, c.fp8_packed_kv, c.gk_decode) == ("mxfp4", True, True)
    assert err({"neuron_config": {"quantization": 4}}) == "quantization must be a string, got int"
    assert err({"neuron_config": {"gk_decode": "x"}}) == \
        "gk_decode='x' is not a switch: expected 1, true, yes, on (on) or 0, false, no, off (off)"


def test_unknown_key_named_with_known_list():
    text = err({"neuron_config": {"ep_degre": 2, "zz": 1}})
    assert text == ("Unknown neuron_config key(s) ['ep_degre', 'zz']. Known keys: "
                    f"{list(NeuronConfig.KEYS)}")
    assert "encoder" not in NeuronConfig.KEYS


@pytest.mark.parametrize("cfg, text", [
    ({"neuron_config": [1, 2]}, "neuron_config must be a dict, got list"),
    ({"neuron_config": "{}"}, "neuron_config must be a dict, got str"),
    ([("neuron_config", {})], "additional_config must be a dict, got list"),
    ({"encoder_neuron_config": 3}, "encoder_neuron_config must be a dict, got int"),
])
def test_non_dict(cfg, text):
    assert err(cfg) == text


def test_encoder_config():
    c = P({"encoder_neuron_config": {"tp_size": 1, "dp_size": 8, "num_encoder_input_buckets":
                                     [1024, 4096], "encoder_attention_block_size": 2048}})
    assert c.encoder == EncoderNeuronConfig(1, 8, (1024, 4096), 2048)
    assert err({"encoder_neuron_config": {"tp_size": 0}}) == \
        "vision tp_size must be a positive integer, got 0"
    assert err({"encoder_neuron_config": {"dp_size": "2"}}) == \
        "vision dp_size must be a positive integer, got 2"
    assert err({"encoder_neuron_config": {"tp": 2}}).startswith(
        "Unknown encoder_neuron_config key(s) ['tp']. Known keys: ['tp_size', 'dp_size',")


def test_frozen():
    c = NeuronConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ep_degree = 2  # type: ignore[misc]
    # direct construction runs the same checks
    with pytest.raises(NeuronConfigError, match="ep_degree must be a positive integer, got 0"):
        NeuronConfig(ep_degree=0)
    assert NeuronConfig(on_device_sampling_config={"max_top_k": 8}).on_device_sampling_config \
        .max_top_k == 8
