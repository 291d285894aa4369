"""vllm_npu.mblt.models: the release kinds the MBLT plugin refuses before vLLM parses a config."""

from __future__ import annotations

import json

import pytest

from vllm_npu.mblt.models import (
    MULTIMODAL_MODEL_TYPES,
    TEXT_MODEL_TYPES,
    MobilintUnsupportedModelType,
    refuse_unsupported_release,
)


@pytest.mark.parametrize("config", [
    {"model_type": "mobilint-qwen2_5_vl", "vision_config": {"mxq_path": "vision.mxq"}},
    {"model_type": "mobilint-whisper", "audio_config": {}},
    {"model_type": "mobilint-qwen2_audio", "thinker_config": {}},
])
def test_unsupported_multimodal_release_is_refused_naming_it(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MobilintUnsupportedModelType) as err:
        refuse_unsupported_release(tmp_path)
    assert isinstance(err.value, ValueError)
    assert f"{tmp_path}: model_type {config['model_type']!r} is a multimodal release the MBLT plugin does not serve" in str(err.value)
    assert all(t in str(err.value) for t in MULTIMODAL_MODEL_TYPES)


@pytest.mark.parametrize("config", [
    *({"model_type": t} for t in TEXT_MODEL_TYPES),  # the served text releases
    *({"model_type": t, "vision_config": {}, "thinker_config": {}} for t in MULTIMODAL_MODEL_TYPES),  # served
    {"model_type": "qwen3_moe"},  # a plain HF checkpoint: vLLM (or mxq compile) judges it
    {"architectures": ["LlamaForCausalLM"]},  # no model_type
])
def test_other_configs_pass(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    refuse_unsupported_release(tmp_path)


def test_what_cannot_be_read_is_left_to_vllm(tmp_path):
    refuse_unsupported_release(None)
    refuse_unsupported_release("mobilint/Qwen3-30B-A3B")  # a Hub id, not a local directory
    refuse_unsupported_release(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    refuse_unsupported_release(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")  # not an object
    refuse_unsupported_release(tmp_path)
