"""The one step engine of the NPU workers: a vLLM ``SchedulerOutput`` in, a ``ModelRunnerOutput`` out.

Every NPU worker answers vLLM's ``execute_model`` / ``sample_tokens`` through a
:class:`StepEngine`. The engine owns what is the same on every device:

* **the request table** (:attr:`StepEngine.reqs`): one :class:`Request` record per request,
  applied from the scheduler output in vLLM's order: finished requests leave, preempted ones
  are told so, new ones are admitted, cached ones get their new KV blocks and computed-token
  count, and resumed ones their token list back;
* **the step plan** (:class:`StepPlan`): per scheduled request, the tokens ``[start, end)`` the
  step computes, and whether the request samples (``end`` reaches its last token: a prompt's
  earlier chunks sample nothing, as in vLLM);
* **prompt logprobs**: a request that asks gets a :class:`vllm_npu.prompt_logprobs.PromptLogprobs`
  (:attr:`Request.prompt_logprobs`), which the device fills as it computes the prompt's
  positions; the step that completes the prompt returns its rows;
* **the output builder**: host sampling with vLLM's sampler and grammar bitmask
  (:class:`vllm_npu.step_output.StepOutputs`), or the tokens the device sampled
  (:func:`vllm_npu.step_output.device_tokens_output`). A device that samples on the device
  gets vLLM's grammar bitmask as one allowed-token mask per sampling row
  (:attr:`StepPlan.token_masks`): a step with a structured-output row waits for vLLM's
  ``sample_tokens(grammar_output)`` before it runs on the device.

A device is a :class:`DeviceRunner`: it builds the record of a new request (with its own
device state, in a subclass of :class:`Request`), hears of finished, preempted and resumed
requests, and runs one planned step on its runtime (:meth:`DeviceRunner.run_step`), returning
logits (or device-sampled tokens) for the plan's sampling rows in plan order. Its runtime calls
go through the device's one retry policy (:class:`vllm_npu.device_retry.DeviceRetry`).

=========================  ==============================================================
device runner              where
=========================  ==============================================================
MBLT text / MoE / VLM/ASR  :class:`vllm_npu.mblt.worker.MbltWorker`
MBLT EAGLE-3               :class:`vllm_npu.mblt.eagle3_serving.Eagle3Runner`
RBLN optimum path          :class:`vllm_npu.rbln.worker.RblnOptimumWorker`
RBLN ``vllm`` path         :class:`vllm_npu.rbln.vllm_worker.RblnVllmWorker`
Neuron                     :class:`vllm_npu.neuron.worker.NeuronWorker`
=========================  ==============================================================

This module imports neither torch nor the device runtimes; vLLM only to build outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["StepStateError", "Request", "ScheduledRow", "StepPlan", "StepResult", "DeviceRunner",
           "RunnerHooks", "StepEngine", "new_request_fields"]


class StepStateError(RuntimeError):
    """vLLM's scheduler and the worker disagree about a request (names it and both views)."""


@dataclass(eq=False)
class Request:
    """One request as every worker tracks it (a device subclasses it to add its own state).

    Attributes:
        req_id: vLLM's request id.
        prompt_ids: the prompt's token ids (placeholder ids where the prompt is embeddings).
        params: vLLM's ``SamplingParams``.
        generator: the request's seeded CPU generator, or None (:func:`vllm_npu.host_sampling.request_generator`).
        blocks: vLLM's KV block ids (KV group 0), in order.
        output_ids: the tokens generated so far.
        num_computed: tokens whose KV the step before this one left computed (vLLM's
            ``num_computed_tokens``).
        penalty_prompt_ids: the prompt ids the sampler's penalties read, when some prompt
            positions are placeholders (prompt embeddings: the vocabulary size, vLLM's padding
            id); None: ``prompt_ids``.
        prompt_logprobs: the prompt-logprob rows the device fills (None: not asked, or already
            returned).
    """

    req_id: str
    prompt_ids: list[int]
    params: Any
    generator: Any = None
    blocks: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    penalty_prompt_ids: list[int] | None = None
    prompt_logprobs: Any = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output ids."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """The token ids at positions ``[start, end)``."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(0, start - n):max(0, end - n)]

    def sample_request(self):
        """What the host sampler needs of this request (:class:`vllm_npu.host_sampling.SampleRequest`)."""
        from vllm_npu.host_sampling import SampleRequest

        return SampleRequest(self.params, self.penalty_prompt_ids or self.prompt_ids, self.output_ids,
                             self.generator)

    def apply_cached(self, new_block_ids: Sequence[int] | None, resumed: bool, num_computed: int,
                     all_token_ids: Sequence[int] | None = None) -> None:
        """A running request's step: its new KV blocks and computed-token count; a resumed one
        (preempted earlier, its blocks freed) gets its blocks anew and its outputs from vLLM's
        token list."""
        if resumed:
            self.blocks = list(new_block_ids or [])
            if all_token_ids is not None:
                self.output_ids = list(all_token_ids[len(self.prompt_ids):])
        elif new_block_ids:
            self.blocks.extend(new_block_ids)
        self.num_computed = int(num_computed)


def new_request_fields(new: Any) -> dict[str, Any]:
    """The :class:`Request` fields of vLLM's ``NewRequestData`` ``new`` (a device's record adds
    its own)."""
    from vllm_npu.host_sampling import request_generator

    params = new.sampling_params
    return {"req_id": new.req_id, "prompt_ids": list(new.prompt_token_ids or []), "params": params,
            "generator": request_generator(params), "blocks": list(new.block_ids[0]) if new.block_ids else [],
            "num_computed": int(new.num_computed_tokens)}


@dataclass(frozen=True)
class ScheduledRow:
    """One scheduled request of a step: it computes its tokens ``[start, end)``."""

    req: Request
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The step reaches the request's last token, so it samples the next one."""
        return self.end >= self.req.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    """A step: its scheduled requests in vLLM's order.

    Attributes:
        scheduler_output: vLLM's ``SchedulerOutput``.
        rows: the scheduled requests, in the output's order.
        token_masks: for a device that samples: bool ``[len(sampling), vocab]``, True where a
            sampling row's grammar allows the token (vLLM's bitmask unpacked); None when no row
            of the step has a grammar.
    """

    scheduler_output: Any
    rows: tuple[ScheduledRow, ...]
    token_masks: np.ndarray | None = None

    @property
    def order(self) -> list[str]:
        return [r.req.req_id for r in self.rows]

    @property
    def sampling(self) -> list[ScheduledRow]:
        """The rows that sample, in order (a :class:`StepResult` answers these)."""
        return [r for r in self.rows if r.samples]

    @property
    def num_scheduled(self) -> dict[str, int]:
        return {r.req.req_id: r.num_tokens for r in self.rows}


@dataclass
class StepResult:
    """What a device returns for a :class:`StepPlan`.

    Attributes:
        logits: ``[len(plan.sampling), vocab]`` float32 last-position logits of the sampling
            rows, in plan order (None when no row samples). With ``tokens`` None the host
            samples them.
        tokens: the tokens the device chose per sampling row (on-device sampling: one each;
            speculative rounds: several), or None for host sampling.
    """

    logits: np.ndarray | None = None
    tokens: Sequence[Sequence[int]] | None = None


class DeviceRunner(Protocol):
    """A device's part of a step (see the module docstring)."""

    def admit(self, new: Any) -> Request:
        """The record of vLLM's ``NewRequestData`` ``new``, with the device's state."""

    def finish(self, req: Request) -> None:
        """``req`` finished (or was aborted): release what the device holds for it."""

    def preempt(self, req: Request) -> None:
        """vLLM preempted ``req``: its KV blocks are freed."""

    def resume(self, req: Request) -> None:
        """``req`` resumes after a preemption (:meth:`Request.apply_cached` has run)."""

    def run_step(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` on the device (see :class:`StepResult`)."""


class RunnerHooks:
    """The do-nothing request hooks, and a plain :class:`Request` record, for a runner to
    inherit (it then implements only :meth:`run_step` and what its device needs)."""

    def admit(self, new: Any) -> Request:
        return Request(**new_request_fields(new))

    def finish(self, req: Request) -> None:  # noqa: ARG002
        return None

    def preempt(self, req: Request) -> None:  # noqa: ARG002
        return None

    def resume(self, req: Request) -> None:  # noqa: ARG002
        return None


class StepEngine:
    """The step loop of every NPU worker (see the module docstring).

    Args:
        runner: the device runner.
        outputs: the host sampler's output builder (:class:`vllm_npu.step_output.StepOutputs`);
            None when the device samples (its :class:`StepResult` carries tokens).
        vocab_size: the logits width (top-``k`` of prompt logprobs is capped at it); None: no
            request is given prompt-logprob rows (a runner whose platform refuses them).
        logprobs_sampler: for a device that samples: the host sampler whose metadata and
            ``--logprobs-mode`` its tokens' logprobs follow
            (:func:`vllm_npu.step_output.device_logprobs`); None: no logprobs.

    Attributes:
        reqs: request id -> record, for every request vLLM has admitted and not finished.
        steps: steps that scheduled at least one request.
    """

    def __init__(self, runner: DeviceRunner, outputs: Any = None, vocab_size: int | None = None,
                 logprobs_sampler: Any = None) -> None:
        self.runner = runner
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.logprobs_sampler = logprobs_sampler
        self.reqs: dict[str, Request] = {}
        self.steps = 0
        self._waiting: StepPlan | None = None  # a device-sampled step waiting for the bitmask

    def apply(self, so: Any) -> None:
        """Apply the scheduler output's request events to the table and tell the runner.

        Raises:
            StepStateError: a cached request the table does not know.
        """
        for rid in so.finished_req_ids:
            req = self.reqs.pop(rid, None)
            if req is not None:
                self.runner.finish(req)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            req = self.reqs.get(rid)
            if req is not None:
                self.runner.preempt(req)
        for new in so.scheduled_new_reqs:
            req = self.runner.admit(new)
            if self.vocab_size is not None:
                from vllm_npu.prompt_logprobs import prompt_logprobs_of

                req.prompt_logprobs = prompt_logprobs_of(req.req_id, req.params, req.prompt_ids, self.vocab_size)
            self.reqs[new.req_id] = req
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self.reqs.get(rid)
            if req is None:
                raise StepStateError(f"vLLM scheduled request {rid}, which the worker does not know")
            blocks = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            all_ids = cached.all_token_ids.get(rid) if resumed and cached.all_token_ids else None
            req.apply_cached(blocks[0] if blocks else None, resumed, cached.num_computed_tokens[i], all_ids)
            if resumed:
                self.runner.resume(req)

    def plan(self, so: Any) -> StepPlan:
        """The step's :class:`StepPlan`.

        Raises:
            StepStateError: a scheduled request the table does not know, or one scheduled past
                its last token.
        """
        rows = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs.get(rid)
            if req is None:
                raise StepStateError(f"req_id={rid} is scheduled but was never added")
            start = req.num_computed
            end = start + int(n)
            if end > req.num_tokens:
                raise StepStateError(f"req_id={rid}: scheduled up to {end}, but it has {req.num_tokens} tokens")
            rows.append(ScheduledRow(req, start, end))
        return StepPlan(so, tuple(rows))

    def execute(self, so: Any):
        """vLLM's ``execute_model``: the step's ``ModelRunnerOutput``, or None when it waits
        for the grammar bitmask (then :meth:`sample_tokens`).

        Raises:
            StepStateError: the scheduler's view and the table's disagree.
            whatever the device runner raises.
        """
        from vllm.v1.outputs import ModelRunnerOutput

        if self._waiting is not None:
            raise RuntimeError("a step left for sample_tokens was never sampled")
        self.apply(so)
        plan = self.plan(so)
        if not plan.rows:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={})
        self.steps += 1
        from vllm_npu.step_output import needs_grammar

        if self.outputs is None and needs_grammar([r.req for r in plan.sampling]):
            self._waiting = plan  # the device samples under the grammar: run it with the bitmask
            return None
        return self._run(plan)

    def _run(self, plan: StepPlan):
        result = self.runner.run_step(plan)
        for row in plan.rows:
            row.req.num_computed = row.end
        return self._output(plan, result)

    def sample_tokens(self, grammar_output: Any):
        """vLLM's ``sample_tokens``: the step :meth:`execute` left, sampled under the bitmask
        (``grammar_output``: vLLM's ``GrammarOutput``, or None when no request of the step has a
        grammar yet). A device-sampled step runs now, with the bitmask as
        :attr:`StepPlan.token_masks`.

        Raises:
            RuntimeError: no step is waiting.
        """
        if self.outputs is not None:
            return self.outputs.sample_tokens(grammar_output)
        plan, self._waiting = self._waiting, None
        if plan is None:
            raise RuntimeError("sample_tokens called without a step waiting for it")
        if grammar_output is not None:
            from vllm_npu.step_output import grammar_token_masks

            if self.vocab_size is None:
                raise RuntimeError("a device-sampled step under a grammar needs the engine's vocab_size")
            masks = grammar_token_masks(plan.scheduler_output, grammar_output,
                                        [r.req.req_id for r in plan.sampling], self.vocab_size)
            plan = StepPlan(plan.scheduler_output, plan.rows, masks)
        return self._run(plan)

    def _output(self, plan: StepPlan, result: StepResult):
        from vllm_npu.step_output import StepSample, device_tokens_output

        sampling = plan.sampling
        index = {rid: i for i, rid in enumerate(plan.order)}
        prompt_logprobs = {}
        for row in plan.rows:  # the step that completes a prompt returns its prompt logprobs
            req = row.req
            if req.prompt_logprobs is not None and row.end >= len(req.prompt_ids):
                prompt_logprobs[req.req_id] = req.prompt_logprobs.tensors()
                req.prompt_logprobs = None
        if result.tokens is not None or self.outputs is None:
            return device_tokens_output(plan, sampling, result, prompt_logprobs, self.logprobs_sampler)
        logits = result.logits
        if sampling and (logits is None or len(logits) != len(sampling)):
            got = None if logits is None else len(logits)
            raise StepStateError(f"the device returned {got} logits rows for {len(sampling)} sampling requests")
        return self.outputs.emit(StepSample(
            plan.scheduler_output, plan.order, rows=[index[r.req.req_id] for r in sampling],
            logits=logits if sampling else None, reqs=[r.req.sample_request() for r in sampling],
            outputs=[r.req.output_ids for r in sampling], prompt_logprobs=prompt_logprobs))

    def clear(self) -> None:
        """Forget every request and any step waiting for a bitmask (the worker shuts down)."""
        self.reqs.clear()
        self._waiting = None
        if self.outputs is not None:
            self.outputs.discard()
