"""The platforms' ``validate_request`` on vLLM ``SamplingParams`` (HTTP 400 at the API): what
each worker refuses, named, and what it serves (prompt logprobs, MBLT's since issue 20 §3.2,
RBLN's and Neuron's since issue 41; vLLM's logits processors on every host-sampling worker,
issue 41)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402

from vllm_npu.mblt.platform import MbltPlatform, MbltRequestError  # noqa: E402
from vllm_npu.rbln.errors import RblnRequestError  # noqa: E402
from vllm_npu.rbln.platform import RblnPlatform  # noqa: E402


def _refusal(platform, error, **params) -> tuple[str, str]:
    with pytest.raises(error) as info:
        platform.validate_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(**params))
    return getattr(info.value, "parameter", None), str(info.value)


@pytest.mark.parametrize("params", [{"prompt_logprobs": 0}, {"prompt_logprobs": 3}, {"prompt_logprobs": -1},
                                    {"prompt_logprobs": 1, "logprobs": 1}])
@pytest.mark.parametrize("platform", [MbltPlatform, RblnPlatform], ids=["mblt", "rbln"])
def test_prompt_logprobs_are_served(platform, params):
    """(Their values: the neutral scenario ``prompt_logprobs`` on every serving target.)"""
    platform.validate_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(**params))


@pytest.mark.parametrize(("field", "value"), [
    ("thinking_token_budget", 8),
    ("prompt_logprob_token_ids", [[1, 2]]),
])
@pytest.mark.parametrize(("platform", "error"), [(MbltPlatform, MbltRequestError), (RblnPlatform, RblnRequestError)],
                         ids=["mblt", "rbln"])
def test_unhonoured_parameters_are_named(platform, error, field, value):
    extra = {"temperature": 0.8} if field == "min_p" else {}
    if field == "prompt_logprob_token_ids":
        extra["prompt_logprobs"] = 1
    param, text = _refusal(platform, error, **{field: value}, **extra)
    assert param == field and field in text, (param, text)


@pytest.mark.parametrize("params", [{"min_p": 0.2, "temperature": 0.8}, {"min_tokens": 3}, {"logit_bias": {5: 2.0}},
                                    {"allowed_token_ids": [5, 6]}, {"logprobs": 1, "logprob_token_ids": [5, 6]}])
@pytest.mark.parametrize("platform", [MbltPlatform, RblnPlatform], ids=["mblt", "rbln"])
def test_vllm_s_logits_processors_are_served(platform, params):
    """The host sampler runs vLLM's own logits processors and allowed-token mask (their effect:
    tests/vllm_npu/test_host_sampling.py and the neutral scenario ``logits_processors``)."""
    platform.validate_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(**params))


def test_unlimited_thinking_budget_is_not_refused():
    MbltPlatform.validate_request({"prompt_token_ids": [1]}, SamplingParams(thinking_token_budget=-1))


def test_prompt_embeds_served_by_mblt_text_releases_and_refused_elsewhere(monkeypatch):
    """MBLT's MXQs take embeddings from the host: a text (or MoE) release serves prompt_embeds;
    a VLM or ASR release, whose prompt positions are also an encoder's, refuses them, and so do
    prompt logprobs of an embeddings prompt (no token ids to score). RBLN refuses them unless its
    model was compiled to take ``inputs_embeds`` (``--enable-prompt-embeds``; not configured here)."""
    from vllm_npu.mblt.platform import PROMPT_EMBEDS_MM_REFUSAL

    MbltPlatform.validate_request({"prompt_embeds": object()}, SamplingParams())
    with pytest.raises(MbltRequestError) as info:
        MbltPlatform.validate_request({"prompt_embeds": object()}, SamplingParams(prompt_logprobs=1))
    assert info.value.parameter == "prompt_logprobs"
    monkeypatch.setattr(MbltPlatform, "_serving_asr", True)
    with pytest.raises(MbltRequestError) as info:
        MbltPlatform.validate_request({"prompt_embeds": object()}, SamplingParams())
    assert info.value.parameter == "prompt_embeds" and PROMPT_EMBEDS_MM_REFUSAL in str(info.value)
    with pytest.raises(RblnRequestError) as info:
        RblnPlatform.validate_request({"prompt_embeds": object()}, SamplingParams())
    assert info.value.parameter == "prompt_embeds"


def test_neuron_cpu_sampling_refuses_grammars_with_the_guide_s_words(monkeypatch):
    """The AWS Neuron guide: with CPU sampling the board applies no grammar mask, so structured
    outputs (and required/named tool calls, which vLLM turns into them) are refused, not served
    under the host's bitmask where the board would break the grammar."""
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_npu.neuron.errors import NeuronRequestError
    from vllm_npu.neuron.platform import CPU_SAMPLING_GRAMMAR_REFUSAL, NeuronPlatform

    monkeypatch.setattr(NeuronPlatform, "_ods", False, raising=False)
    with pytest.raises(NeuronRequestError) as info:
        NeuronPlatform.validate_request({"prompt_token_ids": [1, 2]},
                                        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])))
    assert info.value.parameter == "response_format" and CPU_SAMPLING_GRAMMAR_REFUSAL in str(info.value)
    assert "logit_mask is not applied" in CPU_SAMPLING_GRAMMAR_REFUSAL
    NeuronPlatform.validate_request({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={5: 1.0}, min_tokens=2))
