"""vllm_npu.neuron.sampling: on-device sampling rows, refusals and async rules (neuron.md §6)."""

from __future__ import annotations

import logging

import pytest

from vllm_npu.neuron import sampling as S

LOGGER = "vllm.vllm_npu.neuron"




def test_row_defaults():
    assert S.on_device_row() == (256.0, 1.0, 0.0)
    assert all(isinstance(v, float) for v in S.on_device_row(0.7, 5, 0.9))


@pytest.mark.parametrize("args, row", [
    ((0.7, 5, 0.9), (5.0, 0.9, 0.7)),
    ((1.0, -1, 1.0), (256.0, 1.0, 1.0)),
    ((1.0, 0, 1.0), (256.0, 1.0, 1.0)),
    ((1.0, 1000, 1.0), (256.0, 1.0, 1.0)),
    ((0.0, 1, 1.0), (1.0, 1.0, 0.0)),
])
def test_rows(args, row):
    assert S.on_device_row(*args) == row


def test_row_max_top_k_and_greedy():
    assert S.on_device_row(1.0, -1, 1.0, max_top_k=64) == (64.0, 1.0, 1.0)
    assert S.is_greedy(S.on_device_row(0.0))
    assert S.is_greedy(S.on_device_row(5e-6))
    assert S.is_greedy(S.on_device_row(1.0, 1))
    assert not S.is_greedy(S.on_device_row(0.8, 50))


def test_refusals_none_for_supported():
    fields = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7, "max_tokens": 16,
              "stop": ["\n"], "ignore_eos": True, "n": 1, "logprobs": 5,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
              "min_p": 0.0, "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
              "min_tokens": 0, "prompt_logprobs": 3, "structured_outputs": {"json": {}}}
    assert S.ods_refusals(fields) == []
    assert S.ods_refusals({}) == []


@pytest.mark.parametrize("param, value, why", [
    ("presence_penalty", 0.5, "penalties are not applied on device"),
    ("frequency_penalty", -0.2, "penalties are not applied on device"),
    ("repetition_penalty", 1.1, "penalties are not applied on device"),
    ("min_p", 0.05, "no min-p filter on device"),
    ("logit_bias", {"42": 5.0}, "logits are not modified on device"),
    ("allowed_token_ids", [1, 2], "logits are not masked on device"),
    ("bad_words", ["x"], "logits are not masked on device"),
    ("logits_processors", ["p"], "logits never reach the host"),
    ("min_tokens", 3, "EOS is not suppressed on device"),
])
def test_each_refusal(param, value, why):
    assert S.ods_refusals({param: value}) == [(param, (
        f"{param}={value!r} is not supported with Neuron on-device sampling ({why}); it "
        "supports temperature, top_k and top_p."))]


def test_structured_outputs_with_async_refused():
    assert S.ods_refusals({"structured_outputs": {"json": {}}}, async_scheduling=True) == [
        ("structured_outputs", S.ASYNC_STRUCTURED_OUTPUTS)]
    assert S.ods_refusals({"guided_decoding": {"regex": "a"}}, async_scheduling=True) == [
        ("guided_decoding", S.ASYNC_STRUCTURED_OUTPUTS)]
    assert S.ods_refusals({"structured_outputs": None}, async_scheduling=True) == []


def test_several_refusals_in_order():
    got = [p for p, _ in S.ods_refusals({"min_tokens": 2, "min_p": 0.1, "presence_penalty": 1.0})]
    assert got == ["presence_penalty", "min_p", "min_tokens"]


@pytest.mark.parametrize("n", [2, 3, 16])
def test_n_is_never_refused(n):
    """vLLM fans ``n`` out into independent child requests (each ``n=1``) before a worker sees
    them, so no device limit applies (it once was refused as "one sample per request")."""
    assert S.ods_refusals({"n": n, "temperature": 0.8}) == []


def test_check_async(neuron_caplog):
    assert S.check_async(False, False, True, True) is False
    assert S.check_async(True, True, False, False) is True
    with pytest.raises(RuntimeError) as info:
        S.check_async(True, False, False, False)
    assert str(info.value) == "On-device sampling must be enabled for async execution"
    with pytest.raises(AssertionError) as info:
        S.check_async(True, True, True, False)
    assert str(info.value) == ("Structured outputs with async scheduling is not supported. "
                               "Disable async scheduling with: --no-async-scheduling")
    assert [r.getMessage() for r in neuron_caplog.records] == []
    assert S.check_async(True, False, True, True) is False
    assert [(r.levelno, r.getMessage()) for r in neuron_caplog.records] == [
        (logging.WARNING, S.SPECULATIVE_DISABLES_ASYNC)]
