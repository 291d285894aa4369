"""vllm_npu.step_output: the one output builder of the NPU workers, sampling at once or, with a
structured-output request in the step, after vLLM's grammar bitmask (``sample_tokens``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402
from vllm.v1.core.sched.output import GrammarOutput  # noqa: E402

from vllm_npu.host_sampling import HostSampler, SampleRequest  # noqa: E402
from vllm_npu.step_output import StepOutputs, StepSample, needs_grammar  # noqa: E402

VOCAB = 64
SO = SimpleNamespace(scheduled_spec_decode_tokens={})


def _logits(n: int) -> np.ndarray:
    logits = np.zeros((n, VOCAB), np.float32)
    logits[:, 9] = 5.0  # every row's greedy token is 9
    return logits


def _bitmask(allowed: list[list[int]]) -> np.ndarray:
    """xgrammar's layout: int32 words, bit ``t % 32`` of word ``t // 32`` set = token t allowed."""
    mask = np.zeros((len(allowed), (VOCAB + 31) // 32), np.int32)
    for row, toks in enumerate(allowed):
        for t in toks:
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


def _step(structured: list[bool], outputs: list[list[int]]) -> StepSample:
    order = [f"r{i}" for i in range(len(structured))]
    reqs = [SampleRequest(SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a+")
                                         if s else None), [1, 2], out, None)
            for s, out in zip(structured, outputs)]
    return StepSample(SO, order, rows=list(range(len(order))), logits=_logits(len(order)), reqs=reqs, outputs=outputs)


def test_a_step_without_grammar_is_sampled_at_once():
    outputs = [[], [4]]
    out = StepOutputs(HostSampler(VOCAB)).emit(_step([False, False], outputs))
    assert out.sampled_token_ids == [[9], [9]] and outputs == [[9], [4, 9]]
    assert out.req_ids == ["r0", "r1"] and out.req_id_to_index == {"r0": 0, "r1": 1}


def test_a_structured_row_waits_for_the_bitmask_which_masks_only_its_rows():
    outputs: list[list[int]] = [[], []]
    builder = StepOutputs(HostSampler(VOCAB))
    assert builder.emit(_step([False, True], outputs)) is None  # vLLM then calls sample_tokens
    assert outputs == [[], []]
    grammar = GrammarOutput(structured_output_request_ids=["r1"], grammar_bitmask=_bitmask([[40, 41]]))
    out = builder.sample_tokens(grammar)
    assert out.sampled_token_ids == [[9], [40]] and outputs == [[9], [40]]  # r0 unmasked; r1: 40 (ties: lowest)
    with pytest.raises(RuntimeError, match="without a step waiting"):
        builder.sample_tokens(grammar)


def test_the_bitmask_reaches_tokens_of_its_second_word():
    outputs: list[list[int]] = [[]]
    builder = StepOutputs(HostSampler(VOCAB))
    step = _step([True], outputs)
    step.logits[0, 50] = 4.0  # second best, in the second bitmask word
    builder.emit(step)
    out = builder.sample_tokens(GrammarOutput(["r0"], _bitmask([list(range(32, VOCAB))])))
    assert out.sampled_token_ids == [[50]]


def test_no_grammar_yet_samples_unmasked():
    builder = StepOutputs(HostSampler(VOCAB))
    builder.emit(_step([True], [[]]))
    assert builder.sample_tokens(None).sampled_token_ids == [[9]]


def test_an_unfinished_deferred_step_is_an_error_not_a_lost_step():
    builder = StepOutputs(HostSampler(VOCAB))
    builder.emit(_step([True], [[]]))
    with pytest.raises(RuntimeError, match="never sampled"):
        builder.emit(_step([False], [[]]))
    builder.discard()
    assert builder.emit(_step([False], [[]])) is not None


def test_a_step_with_nothing_to_sample():
    out = StepOutputs(HostSampler(VOCAB)).emit(StepSample(SO, ["a", "b"], prompt_logprobs={"a": "lp"}))
    assert out.sampled_token_ids == [[], []] and out.logprobs is None and out.prompt_logprobs_dict == {"a": "lp"}


def test_needs_grammar():
    assert not needs_grammar([SampleRequest(SamplingParams(), [1], [], None)])
    assert needs_grammar([SampleRequest(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x"])),
                                        [1], [], None)])
