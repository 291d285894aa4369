"""``vllm_npu.host_sampling``: vLLM's own ``Sampler`` on device logits, with logprobs as vLLM
reads them (``-1`` = the whole vocabulary; issue 20 §3.1: -1 once reached the sampler as a
top-k of -1 and killed the MBLT engine)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from vllm_npu.host_sampling import (  # noqa: E402
    HostSampler,
    SampleRequest,
    num_logprobs,
    request_generator,
    scatter_logprobs,
)

VOCAB = 50


@pytest.mark.parametrize(("asked", "want"), [(None, None), (0, 0), (3, 3), (-1, VOCAB), (500, VOCAB)])
def test_num_logprobs(asked, want):
    assert num_logprobs(SamplingParams(logprobs=asked), VOCAB) == want


def test_request_generator_repeats_a_seeded_request_and_leaves_others_on_the_shared_stream():
    assert request_generator(None) is None
    assert request_generator(SamplingParams(temperature=1.0)) is None
    draws = [torch.rand(4, generator=request_generator(SamplingParams(temperature=1.0, seed=7))) for _ in range(2)]
    other = torch.rand(4, generator=request_generator(SamplingParams(temperature=1.0, seed=8)))
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], other)


def test_logprobs_minus_one_returns_every_token_equal_to_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
    reqs = [SampleRequest(SamplingParams(temperature=0.0, logprobs=-1), [1, 2], [], None),
            SampleRequest(SamplingParams(temperature=0.0, logprobs=2), [3], [], None)]
    toks, lp = HostSampler(VOCAB, enable_penalties=True).sample(logits, reqs)
    assert toks == [int(np.argmax(row)) for row in logits]
    lists = scatter_logprobs(lp, [0, 1], 2)
    assert lists.logprobs.shape == (2, VOCAB + 1)
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    ids = lists.logprob_token_ids[0]
    assert sorted(ids[1:].tolist()) == list(range(VOCAB))
    assert np.abs(lists.logprobs[0, 1:] - ref[0, ids[1:]]).max() < 1e-5


@pytest.mark.parametrize(("value", "on"), [(None, True), ("", True), ("1", True), ("TRUE", True), ("on", True),
                                           ("yes", True), ("0", False), ("false", False), (" Off ", False),
                                           ("no", False)])
def test_penalties_switch_values(value, on):
    from vllm_npu.mblt.sampling import PENALTIES_ENV, penalties_enabled

    env = {} if value is None else {PENALTIES_ENV: value}
    assert penalties_enabled(env) is on


@pytest.mark.parametrize("value", ["maybe", "2", "disable", "nein"])
def test_penalties_switch_refuses_other_words(value):
    """Once any word but 0/false/no/off meant "on"."""
    from vllm_npu.mblt.sampling import PENALTIES_ENV, SamplingSettingError, penalties_enabled

    with pytest.raises(SamplingSettingError) as info:
        penalties_enabled({PENALTIES_ENV: value})
    assert f"{PENALTIES_ENV}={value!r}" in str(info.value) and "0, false, no, off" in str(info.value)


def test_mblt_s_penalties_switch_never_reaches_another_device_s_sampler(monkeypatch):
    """The RBLN and Neuron workers build the sampler without a switch: MBLT's
    ``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0`` (once read by every sampler) leaves their penalties
    on. A strong repetition penalty then moves greedy decoding off the token already generated."""
    from vllm_npu.mblt.sampling import PENALTIES_ENV

    monkeypatch.setenv(PENALTIES_ENV, "0")
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, 5], logits[0, 6] = 2.0, 1.0
    req = [SampleRequest(SamplingParams(temperature=0.0, repetition_penalty=4.0), [1], [5], None)]
    sampler = HostSampler(VOCAB)
    assert sampler.enable_penalties is True
    assert sampler.sample(logits.copy(), req)[0] == [6]
    off = HostSampler(VOCAB, enable_penalties=False, switch=PENALTIES_ENV)
    assert off.sample(logits.copy(), req)[0] == [5]


def test_penalties_off_needs_the_switch_that_turned_them_off():
    with pytest.raises(ValueError, match="needs the switch"):
        HostSampler(VOCAB, enable_penalties=False)
