"""vllm_npu.mblt.models: the release kinds the MBLT plugin refuses before vLLM parses a config."""

from __future__ import annotations

import json

import pytest

from vllm_npu.mblt.models import NOT_BUILT_MODEL_TYPES, TEXT_MODEL_TYPES, MobilintReleaseNotBuilt, refuse_unbuilt_release


@pytest.mark.parametrize("model_type", sorted(NOT_BUILT_MODEL_TYPES))
def test_unbuilt_release_kinds_are_refused_naming_the_issue(model_type, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    what, issue = NOT_BUILT_MODEL_TYPES[model_type]
    with pytest.raises(MobilintReleaseNotBuilt) as err:
        refuse_unbuilt_release(tmp_path)
    assert isinstance(err.value, NotImplementedError)
    assert f"{tmp_path}: model_type {model_type!r} is {what}" in str(err.value)
    assert f"(issue {issue})" in str(err.value) and issue in (13, 14)


@pytest.mark.parametrize("config", [
    *({"model_type": t} for t in TEXT_MODEL_TYPES),  # the served text releases
    {"model_type": "qwen3_moe"},  # a plain HF checkpoint: vLLM (or mxq compile) judges it
    {"architectures": ["LlamaForCausalLM"]},  # no model_type
])
def test_other_configs_pass(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    refuse_unbuilt_release(tmp_path)


def test_what_cannot_be_read_is_left_to_vllm(tmp_path):
    refuse_unbuilt_release(None)
    refuse_unbuilt_release("mobilint/Qwen3-30B-A3B")  # a Hub id, not a local directory
    refuse_unbuilt_release(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    refuse_unbuilt_release(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")  # not an object
    refuse_unbuilt_release(tmp_path)
