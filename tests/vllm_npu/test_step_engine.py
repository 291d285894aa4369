"""The one step engine (:mod:`vllm_npu.step_engine`) with a tiny device runner beside the real ones:
``CountingRunner``'s logits make the next token ``last + 1`` (mod the vocabulary), so every
output is known in advance. The scheduler is the shared :class:`step_driver.Driver`, which the
device workers' cases use too.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from step_driver import Driver, greedy  # noqa: E402

from vllm_npu.host_sampling import HostSampler  # noqa: E402
from vllm_npu.step_engine import Request, RunnerHooks, StepEngine, StepPlan, StepResult, StepStateError  # noqa: E402
from vllm_npu.step_output import StepOutputs, device_logprobs  # noqa: E402

VOCAB = 64


class CountingRunner(RunnerHooks):
    """Logits whose argmax is the row's last token + 1; records every hook and plan."""

    def __init__(self, device_samples: bool = False) -> None:
        self.device_samples = device_samples
        self.events: list[tuple[str, str]] = []
        self.plans: list[list[tuple[str, int, int, bool]]] = []

    def admit(self, new):
        self.events.append(("admit", new.req_id))
        return super().admit(new)

    def finish(self, req):
        self.events.append(("finish", req.req_id))

    def preempt(self, req):
        self.events.append(("preempt", req.req_id))

    def resume(self, req):
        self.events.append(("resume", req.req_id))

    def run_step(self, plan: StepPlan) -> StepResult:
        self.plans.append([(r.req.req_id, r.start, r.end, r.samples) for r in plan.rows])
        rows = plan.sampling
        if not rows:
            return StepResult()
        logits = np.zeros((len(rows), VOCAB), np.float32)
        nxt = [(r.req.all_ids[r.end - 1] + 1) % VOCAB for r in rows]
        logits[np.arange(len(rows)), nxt] = 10.0
        if self.device_samples:
            return StepResult(logits=logits, tokens=[[t] for t in nxt])
        return StepResult(logits=logits)


def counted(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % VOCAB
        out.append(last)
    return out


def engine_and_driver(device_samples=False, chunk=4, block_size=4, num_blocks=64):
    runner = CountingRunner(device_samples)
    outputs = None if device_samples else StepOutputs(HostSampler(VOCAB))
    engine = StepEngine(runner, outputs)
    worker = SimpleNamespace(execute_model=engine.execute, sample_tokens=engine.sample_tokens)
    return runner, engine, Driver(worker, chunk, block_size=block_size, num_blocks=num_blocks)


@pytest.mark.parametrize("device_samples", [False, True])
def test_chunked_prompts_sample_only_at_their_end(device_samples):
    runner, engine, d = engine_and_driver(device_samples)
    d.add("a", [5, 6, 7, 8, 9, 10], greedy(3))
    d.add("b", [20, 21], greedy(3))
    outs = d.run()
    assert outs == {"a": counted([10], 3), "b": counted([21], 3)}
    # step 1: a computes [0, 4) (no sample), b its whole prompt; step 2: a [4, 6) samples
    assert runner.plans[0] == [("a", 0, 4, False), ("b", 0, 2, True)]
    assert runner.plans[1] == [("a", 4, 6, True), ("b", 2, 3, True)]
    assert engine.reqs["a"].output_ids == outs["a"] and engine.reqs["a"].blocks == [1, 3], "b took block 2 in step 1"
    d.flush()
    assert not engine.reqs and ("finish", "a") in runner.events


def test_events_apply_in_vllms_order_and_a_resumed_request_gets_its_tokens_back():
    runner, engine, d = engine_and_driver()
    d.add("a", [1, 2, 3], greedy(5))
    d.add("b", [30, 31], greedy(5))
    d.step()
    d.step()
    d.preempt("a")
    d.add("c", [40], greedy(1))
    d.step(["b", "c"])
    assert runner.events[-2:] == [("preempt", "a"), ("admit", "c")]
    assert engine.reqs["a"].blocks == [1], "a keeps its stale record until it resumes"
    d.resume("a")
    runner.events.clear()
    d.step(["a", "b"])
    assert runner.events == [("finish", "c"), ("resume", "a")]
    a = engine.reqs["a"]
    # its outputs came back from vLLM's token list; 4 of its 5 tokens recomputed, no sample yet
    assert a.output_ids == counted([3], 2) and a.num_computed == 4
    assert runner.plans[-1][0] == ("a", 0, 4, False)
    assert a.blocks == d.reqs["a"].blocks, "resumed on the blocks vLLM handed it anew"
    assert d.run(["a", "b"]) == {"a": counted([3], 5), "b": counted([31], 5)}


def test_scheduler_and_table_disagreeing_is_a_step_state_error():
    _runner, engine, d = engine_and_driver()
    d.add("a", [1, 2, 3], greedy(2))
    so, _ = d.schedule()
    so.num_scheduled_tokens["a"] = 4
    with pytest.raises(StepStateError, match="scheduled up to 4, but it has 3 tokens"):
        engine.execute(so)
    d2 = engine_and_driver()[2]
    d2.add("ghost", [1, 2], greedy(1))
    so, _ = d2.schedule()
    so.scheduled_new_reqs.clear()
    with pytest.raises(StepStateError, match="req_id=ghost is scheduled but was never added"):
        engine.execute(so)


def test_a_device_answering_the_wrong_rows_is_a_step_state_error():
    class Short(CountingRunner):
        def run_step(self, plan):
            return StepResult(logits=np.zeros((0, VOCAB), np.float32))

    engine = StepEngine(Short(), StepOutputs(HostSampler(VOCAB)))
    d = Driver(SimpleNamespace(execute_model=engine.execute, sample_tokens=engine.sample_tokens), 8)
    d.add("a", [1, 2], greedy(1))
    with pytest.raises(StepStateError, match="0 logits rows for 1 sampling requests"):
        d.step()


def test_sample_tokens_without_a_waiting_step_is_an_error():
    engine = StepEngine(CountingRunner(device_samples=True))
    with pytest.raises(RuntimeError, match="without a step waiting for it"):
        engine.sample_tokens(None)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_device_tokens_get_the_logprobs_vllms_sampler_gives_the_same_tokens(mode):
    """The logprobs of tokens a device chose are vLLM's own (``Sampler`` pieces) in the server's
    ``--logprobs-mode``: for the tokens vLLM's sampler picks itself (greedy), equal to what the
    host sampler returns; ``logprob_token_ids`` gathers the named tokens."""
    from vllm.sampling_params import SamplingParams

    from vllm_npu.host_sampling import SampleRequest

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8), speculative_config=None,
                             model_config=SimpleNamespace(logits_processors=None, logprobs_mode=mode))
    sampler = HostSampler(VOCAB, vllm_config=config)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=1, logprob_token_ids=[7, 9])]
    reqs = [SampleRequest(p, [1, 2], [], None) for p in params]
    tokens, want = sampler.sample(logits, reqs)
    got = device_logprobs(sampler, logits, reqs, tokens)
    assert got.logprob_token_ids.tolist() == want.logprob_token_ids.tolist()
    assert np.allclose(got.logprobs.numpy(), want.logprobs.numpy(), atol=1e-6, equal_nan=True)
    assert got.selected_token_ranks.tolist() == want.selected_token_ranks.tolist()
    if mode == "raw_logprobs":
        x = logits.astype(np.float64)
        ref = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        assert np.isclose(got.logprobs[0, 0].item(), ref[0, tokens[0]], atol=1e-5)
    assert got.logprob_token_ids[2, 1:3].tolist() == [7, 9], "vLLM prefers the named tokens when both are asked"
    assert device_logprobs(sampler, logits, reqs[1:2], tokens[1:2]) is None


def test_a_request_record_reads_its_tokens():
    r = Request("r", [1, 2, 3], None, output_ids=[4, 5])
    assert r.all_ids == [1, 2, 3, 4, 5] and r.num_tokens == 5 and r.token_ids(2, 4) == [3, 4]
    r.apply_cached([7], resumed=False, num_computed=4)
    assert r.blocks == [7] and r.num_computed == 4
    r.apply_cached([9, 10], resumed=True, num_computed=0, all_token_ids=[1, 2, 3, 4])
    assert r.blocks == [9, 10] and r.output_ids == [4]


def test_a_device_sampled_step_under_a_grammar_waits_for_the_bitmask_and_gets_it_unpacked():
    """With the device sampling, a step with a structured-output row returns None and runs in
    ``sample_tokens``, its plan carrying vLLM's bitmask unpacked (True = allowed) per sampling row
    (a row without a grammar allows every token)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.core.sched.output import GrammarOutput

    class MaskedRunner(CountingRunner):
        def run_step(self, plan):
            self.masks = plan.token_masks
            result = super().run_step(plan)
            if plan.token_masks is not None:  # the best allowed token, as a device sampler would
                result.tokens = [[int(np.argmax(np.where(m, lg, -np.inf)))]
                                 for m, lg in zip(plan.token_masks, result.logits)]
            return result

    runner = MaskedRunner(device_samples=True)
    engine = StepEngine(runner, vocab_size=VOCAB)
    d = Driver(SimpleNamespace(execute_model=engine.execute, sample_tokens=engine.sample_tokens), 8)
    d.add("g", [1, 2], SamplingParams(temperature=0.0, max_tokens=1,
                                      structured_outputs=StructuredOutputsParams(choice=["x"])))
    d.add("p", [9], greedy(1))
    so, _ = d.schedule()
    assert engine.execute(so) is None and runner.plans == [], "the device waits for the bitmask"
    allowed = [5, 40]
    bits = np.zeros((1, VOCAB // 32), np.int32)
    for t in allowed:
        bits[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    out = engine.sample_tokens(GrammarOutput(structured_output_request_ids=["g"], grammar_bitmask=bits))
    assert np.flatnonzero(runner.masks[0]).tolist() == allowed and runner.masks[1].all()
    assert out.sampled_token_ids == [[5], [10]], "g: the best allowed token (5 or 40); p: unconstrained"
    with pytest.raises(RuntimeError, match="without a step waiting"):
        engine.sample_tokens(None)
