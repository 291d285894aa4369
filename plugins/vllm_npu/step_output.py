"""One output builder for the NPU workers: a step's rows to sample -> vLLM's ``ModelRunnerOutput``.

A worker runs its step on the device and hands the rows that sample (their logits and
requests) to :meth:`StepOutputs.emit`. Without a structured-output request among them the rows
are sampled at once and the output returned. With one, ``emit`` keeps the step and returns None,
as vLLM's own GPU model runner does: vLLM's engine then computes the grammar bitmask of the
step's structured-output requests and calls the worker's ``sample_tokens(grammar_output)``,
which applies it to the logits (vLLM's ``apply_grammar_bitmask``: the xgrammar or guidance
backend's mask, -inf on every token the grammar forbids) before the host sampler samples.

Each sampled token is appended to the request record's output ids (the list the worker passed),
and the output carries the sampled ids, the logprobs and any prompt logprobs of the step.

A device that samples itself (Neuron's on-device sampling, MBLT's EAGLE-3 rounds) returns its
tokens instead; :func:`device_tokens_output` appends them and reports the logprobs of the
device's logits to the requests that asked, as vLLM's sampler computes them
(:func:`device_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_npu.host_sampling import HostSampler, SampleRequest, scatter_logprobs

__all__ = ["StepOutputs", "StepSample", "needs_grammar", "device_tokens_output", "device_logprobs",
           "grammar_token_masks"]


@dataclass
class StepSample:
    """What a step leaves to sample and report.

    Attributes:
        scheduler_output: vLLM's ``SchedulerOutput`` of the step.
        order: the step's request ids, in the output's order.
        rows: for each logits row, its request's position in ``order``.
        logits: ``[len(rows), vocab]`` float32 logits of the rows' last positions.
        reqs: the rows' sampling requests (params, prompt, outputs so far, generator).
        outputs: per row, the request record's output-id list each sampled token is appended to.
        prompt_logprobs: request id -> vLLM's ``LogprobsTensors`` of a prompt this step completed.
    """

    scheduler_output: Any
    order: list[str]
    rows: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None
    reqs: list[SampleRequest] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_logprobs: Mapping[str, Any] = field(default_factory=dict)


def needs_grammar(reqs: Sequence[Any]) -> bool:
    """Whether a row (anything with ``params``: a :class:`SampleRequest`, a step engine
    ``Request``) samples under a grammar (``structured_outputs`` set: JSON schema, regex,
    choice, grammar, or a tool call vLLM constrains)."""
    return any(getattr(r.params, "structured_outputs", None) is not None for r in reqs)


class StepOutputs:
    """A worker's output builder (see the module docstring).

    Args:
        sampler: the worker's host sampler.
    """

    def __init__(self, sampler: HostSampler) -> None:
        self.sampler = sampler
        self._pending: StepSample | None = None

    def emit(self, step: StepSample):
        """The step's ``ModelRunnerOutput``, or None when a structured-output row waits for
        vLLM's grammar bitmask (then :meth:`sample_tokens` finishes the step).

        Raises:
            RuntimeError: a deferred step was never finished (vLLM calls ``sample_tokens``
                after every ``execute_model`` that returned None).
        """
        if self._pending is not None:
            raise RuntimeError("a step left for sample_tokens was never sampled")
        if needs_grammar(step.reqs):
            self._pending = step
            return None
        return self._finish(step, None)

    def sample_tokens(self, grammar_output: Any):
        """Finish the step :meth:`emit` kept, under ``grammar_output`` (vLLM's
        ``GrammarOutput``, or None when no request of the step has a grammar yet).

        Raises:
            RuntimeError: no step is waiting.
        """
        step, self._pending = self._pending, None
        if step is None:
            raise RuntimeError("sample_tokens called without a step waiting for it")
        return self._finish(step, grammar_output)

    def discard(self) -> None:
        """Forget a step waiting for ``sample_tokens`` (the worker is shutting down)."""
        self._pending = None

    def _finish(self, step: StepSample, grammar_output: Any):
        from vllm.v1.outputs import ModelRunnerOutput

        sampled: list[list[int]] = [[] for _ in step.order]
        logprobs = None
        if step.reqs:
            assert step.logits is not None
            grammar = None
            if grammar_output is not None:
                grammar = (step.scheduler_output, grammar_output, [step.order[i] for i in step.rows])
            toks, lp = self.sampler.sample(step.logits, step.reqs, grammar=grammar)
            for i, out, tok in zip(step.rows, step.outputs, toks):
                sampled[i] = [int(tok)]
                out.append(int(tok))
            logprobs = scatter_logprobs(lp, step.rows, len(step.order))
        return ModelRunnerOutput(req_ids=list(step.order), req_id_to_index={rid: i for i, rid in enumerate(step.order)},
                                 sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs_dict=dict(step.prompt_logprobs))


def device_tokens_output(plan: Any, sampling: Sequence[Any], result: Any,
                         prompt_logprobs: Mapping[str, Any] | None = None, sampler: HostSampler | None = None):
    """The ``ModelRunnerOutput`` of a step whose device chose the tokens.

    Args:
        plan: the step's :class:`vllm_npu.step_engine.StepPlan`.
        sampling: its sampling rows (``plan.sampling``).
        result: the device's :class:`vllm_npu.step_engine.StepResult`; ``result.tokens[k]`` are
            row ``k``'s tokens (appended to its record's outputs); with ``result.logits`` and a
            ``sampler``, the rows that asked for logprobs get them for their (single) token
            (:func:`device_logprobs`).
        prompt_logprobs: request id -> vLLM's ``LogprobsTensors`` of a prompt the step completed.
        sampler: the host sampler whose metadata and ``--logprobs-mode`` the logprobs follow
            (None: no logprobs; the platform refuses them).

    Raises:
        RuntimeError: a token list per sampling row is missing.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    order = plan.order
    index = {rid: i for i, rid in enumerate(order)}
    tokens = list(result.tokens or ())
    if len(tokens) != len(sampling):
        raise RuntimeError(f"the device returned tokens for {len(tokens)} of {len(sampling)} sampling requests")
    sampled: list[list[int]] = [[] for _ in order]
    for row, toks in zip(sampling, tokens):
        toks = [int(t) for t in toks]
        sampled[index[row.req.req_id]] = toks
        row.req.output_ids.extend(toks)
    logprobs = None
    if result.logits is not None and sampling and sampler is not None:
        lp = device_logprobs(sampler, result.logits, [r.req.sample_request() for r in sampling], [t[0] for t in tokens])
        logprobs = scatter_logprobs(lp, [index[r.req.req_id] for r in sampling], len(order))
    return ModelRunnerOutput(req_ids=list(order), req_id_to_index=index, sampled_token_ids=sampled,
                             logprobs=logprobs, prompt_logprobs_dict=dict(prompt_logprobs or {}))


def device_logprobs(sampler: HostSampler, logits: np.ndarray, reqs: Sequence[SampleRequest], tokens: Sequence[int]):
    """vLLM's ``LogprobsTensors`` of tokens a device chose, computed as vLLM's own sampler does
    (``Sampler.forward``), in the server's ``--logprobs-mode``: the raw log-softmax (or raw
    logits) of the device's logits; the processed modes from vLLM's processing of them with each
    request's sampling parameters (temperature, top-k, top-p), on the host. The top ``k`` (or
    the whole vocabulary for ``-1``) and ``logprob_token_ids`` (the named tokens, preferred when
    both are asked, as vLLM does) are gathered around the device's token. None when no row
    asked."""
    import torch

    meta = sampler.metadata(reqs)
    num = meta.max_num_logprobs
    if num is None and not meta.logprob_token_ids:
        return None
    vllm_sampler = sampler._sampler
    t = torch.from_numpy(np.array(logits, dtype=np.float32, order="C", copy=True))
    mode = sampler.logprobs_mode
    if mode == "raw_logprobs":
        lp = vllm_sampler.compute_logprobs(t)
    elif mode == "raw_logits":
        lp = t.clone()
    else:  # processed_logprobs / processed_logits: after vLLM's processing of the request's parameters
        x = vllm_sampler.apply_logits_processors(t.clone(), meta, False)
        _sampled, lp = vllm_sampler.sample(x, meta)
    sampled = torch.as_tensor(list(tokens), dtype=torch.long)
    if meta.logprob_token_ids:
        return vllm_sampler.gather_specific_token_logprobs(lp, meta.logprob_token_ids, sampled)
    return vllm_sampler.gather_logprobs(lp, num, token_ids=sampled)


def grammar_token_masks(scheduler_output: Any, grammar_output: Any, row_req_ids: Sequence[str],
                        vocab_size: int) -> np.ndarray:
    """vLLM's grammar bitmask of a step, unpacked for a device that samples: bool
    ``[len(row_req_ids), vocab_size]``, True where row ``i``'s grammar allows the token (every
    token for a row without a grammar). Unpacked by vLLM's own ``apply_grammar_bitmask`` on zero
    logits, so the rows and tokens are exactly those vLLM's GPU runner masks."""
    import torch
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    logits = torch.zeros((len(row_req_ids), int(vocab_size)), dtype=torch.float32)
    apply_grammar_bitmask(scheduler_output, grammar_output, SimpleNamespace(req_ids=list(row_req_ids)), logits)
    return torch.isfinite(logits).numpy()
