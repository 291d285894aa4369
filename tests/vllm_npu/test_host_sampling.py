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


# --------------------------------------------------------------------------------------------
# vLLM's logits processors and allowed-token mask (issue 41)


def _req(**params) -> SampleRequest:
    output = params.pop("output", [])
    p = SamplingParams(**{"temperature": 0.0, **params})
    return SampleRequest(p, [1, 2], output, None)


def _stopping(token: int, **params) -> SampleRequest:
    """A request whose stop tokens include ``token`` (the engine's processor sets them)."""
    r = _req(stop_token_ids=[token], **params)
    r.params._all_stop_token_ids.add(token)
    return r


def test_logit_bias_min_tokens_and_allowed_token_ids_take_effect_per_row():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    top = [int(np.argmax(row)) for row in logits]
    sampler = HostSampler(VOCAB)
    reqs = [_req(), _req(logit_bias={7: 100.0}), _stopping(top[2], min_tokens=2),
            _req(allowed_token_ids=[3, 4])]
    toks, _ = sampler.sample(logits, reqs)
    assert toks[0] == top[0] and toks[1] == 7
    assert toks[2] == int(np.argsort(-logits[2])[1])  # the stop token is held back below min_tokens
    assert toks[3] == (3 if logits[3, 3] > logits[3, 4] else 4)
    # once min_tokens outputs exist, the stop token may come; the caller's logits were not touched
    assert sampler.sample(logits[2:3], [_stopping(top[2], min_tokens=2, output=[5, 6])])[0] == [top[2]]


def test_rows_of_a_smaller_step_keep_no_state_of_the_last():
    logits = np.zeros((2, VOCAB), np.float32)
    logits[:, 9] = 1.0
    sampler = HostSampler(VOCAB)
    assert sampler.sample(logits, [_req(), _req(logit_bias={7: 100.0})])[0] == [9, 7]
    assert sampler.sample(logits[:1], [_req()])[0] == [9]
    assert sampler.sample(logits, [_req(), _req()])[0] == [9, 9]


def test_min_p_one_makes_random_sampling_greedy():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(1, VOCAB)).astype(np.float32)
    sampler = HostSampler(VOCAB)
    draws = {sampler.sample(logits, [SampleRequest(SamplingParams(temperature=2.0, min_p=1.0, seed=s), [1], [],
                                                   request_generator(SamplingParams(seed=s)))])[0][0]
             for s in range(8)}
    assert draws == {int(np.argmax(logits))}


def test_a_step_past_max_num_seqs_grows_the_processors():
    sampler = HostSampler(VOCAB)
    sampler._build_logitsprocs(1)
    logits = np.zeros((3, VOCAB), np.float32)
    assert sampler.sample(logits, [_req(logit_bias={t: 50.0}) for t in (1, 2, 3)])[0] == [1, 2, 3]
    assert sampler.max_rows == 3


def test_the_server_s_logprobs_mode_is_the_sampler_s():
    from types import SimpleNamespace

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4), speculative_config=None,
                             model_config=SimpleNamespace(logits_processors=None, logprobs_mode="processed_logits"))
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, 5] = 1.0
    sampler = HostSampler(VOCAB, vllm_config=config)
    assert sampler.logprobs_mode == "processed_logits"
    _, lp = sampler.sample(logits, [_req(logprobs=1, logit_bias={6: 10.0})])
    lists = lp.tolists()
    assert lists.logprob_token_ids[0][0] == 6 and lists.logprobs[0][0] == pytest.approx(10.0)  # after the bias
    _, raw = HostSampler(VOCAB).sample(logits, [_req(logprobs=1, logit_bias={6: 10.0})])
    assert raw.tolists().logprobs[0][0] < 0  # raw_logprobs: before the bias, a log-probability


def test_logprob_token_ids_are_the_named_tokens_raw_logprobs():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
    toks, lp = HostSampler(VOCAB).sample(logits, [_req(logprobs=1, logprob_token_ids=[5, 6]), _req(logprobs=1)])
    lists = lp.tolists()
    x = logits.astype(np.float64)
    ref = x - (np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) + x.max(1, keepdims=True))
    assert list(lists.logprob_token_ids[0][:3]) == [toks[0], 5, 6]  # the sampled token, then the named ones
    assert np.allclose(lists.logprobs[0][:3], ref[0, [toks[0], 5, 6]], atol=1e-5)


class _ForceSeven:
    """A custom logits processor (vLLM's interface) that forces token 7 on every row."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = 0

    @classmethod
    def validate_params(cls, sampling_params):
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        if batch_update is not None:
            self.rows = batch_update.batch_size

    def apply(self, logits):
        logits[: self.rows, 7] += 1000.0
        return logits


def test_the_server_s_logits_processors_join_vllm_s_built_ins():
    """``--logits-processors`` (``model_config.logits_processors``) takes effect: the sampler
    builds it with vLLM's own ones and tells it each step's rows."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessor

    custom = type("ForceSeven", (_ForceSeven, LogitsProcessor), {})
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4), speculative_config=None,
                             model_config=SimpleNamespace(logits_processors=[custom], logprobs_mode="raw_logprobs"))
    logits = np.zeros((2, VOCAB), np.float32)
    logits[:, 9] = 1.0
    assert HostSampler(VOCAB, vllm_config=config).sample(logits, [_req(), _req()])[0] == [7, 7]
    assert HostSampler(VOCAB).sample(logits, [_req(), _req()])[0] == [9, 9]
