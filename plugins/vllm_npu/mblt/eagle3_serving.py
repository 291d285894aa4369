"""vLLM steps on an EAGLE-3 release: :class:`Eagle3Runner`, the step engine's device runner
(:mod:`vllm_npu.step_engine`), turns each step's scheduled requests into speculative rounds and
returns their tokens.

vLLM 0.32 schedules a decoding request its new tokens and appends what the step returns, token by
token, stopping (and trimming the rest) at its ``eos_token_id``, a ``stop_token_ids`` entry,
``max_tokens`` or ``max_model_len`` (``Scheduler._update_request_with_output`` / ``check_stop``).
So a step may return several tokens for a request outside spec decoding, and the next step
schedules them all as the request's new tokens (``num_computed_tokens`` advances by what it
scheduled, never rolled back). Here:

- a request's prompt is fed once the scheduler has scheduled all of it (earlier chunks return no
  token); that step returns ``[root]``;
- each later step runs one round (:meth:`Eagle3Sequence.round`) and returns its tokens after the
  root (which the previous step returned) and the next root, so a stream arrives a few tokens per
  chunk; the round has already fed them, so the step that schedules them runs the next round
  directly (a step that schedules only part of them, under the token budget, returns nothing);
- the budget is ``min(max_tokens - outputs, max_model_len - tokens)``: a step never returns more,
  so vLLM trims nothing for length (it trims after a stop string, and finishes the request);
- a stop id ends the round (vLLM finishes the request on it), and so does the budget;
- a preempted request, or one whose KV another request displaced, restarts from vLLM's token list
  (a prefill of every token, whose root is the next token).

At a request's end a log line gives its figures: rounds, draft tokens accepted and verified, and
tokens per round (``MBLT EAGLE-3 req_id=...``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_npu.mblt.eagle3_backend import Eagle3Backend
from vllm_npu.mblt.eagle3_round import Eagle3Sequence, KvDisplaced
from vllm_npu.mblt.eagle3_tree import SamplingSpec
from vllm_npu.step_engine import Request, StepPlan, StepResult, new_request_fields

__all__ = ["Eagle3Runner", "sampling_spec", "stop_ids"]

logger = logging.getLogger("vllm.vllm_npu.mblt")


def stop_ids(params: Any) -> frozenset[int]:
    """The ids on which vLLM's scheduler finishes the request: its ``eos_token_id`` (None under
    ``ignore_eos``) and ``stop_token_ids``."""
    ids = set(getattr(params, "stop_token_ids", None) or ())
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return frozenset(int(i) for i in ids)


def sampling_spec(params: Any) -> SamplingSpec:
    """temperature, top_k (``<= 0``: off) and top_p of a request."""
    return SamplingSpec(temperature=float(params.temperature or 0.0), top_k=max(0, int(params.top_k or 0)),
                        top_p=float(params.top_p if params.top_p is not None else 1.0))


@dataclass(eq=False)
class _Request(Request):
    """A request (:class:`vllm_npu.step_engine.Request`) with its speculative state."""

    max_tokens: int = 0
    spec: SamplingSpec | None = None
    stops: frozenset[int] = frozenset()
    seq: Eagle3Sequence | None = None
    exhausted: bool = False
    round_tokens: int = 0
    restarts: int = 0
    rounds_before: list[tuple[int, int, int]] = field(default_factory=list)

    def figures(self) -> tuple[int, int, int]:
        """(rounds, accepted draft tokens, verified draft tokens) over every restart."""
        cur = (self.seq.rounds, self.seq.accepted_total, self.seq.drafted_total) if self.seq else (0, 0, 0)
        return tuple(sum(f[i] for f in [*self.rounds_before, cur]) for i in range(3))  # type: ignore[return-value]


class Eagle3Runner:
    """Per-request EAGLE-3 state on one :class:`Eagle3Backend` (see the module docstring).

    Attributes:
        totals: over finished requests: ``rounds``, ``accepted``, ``drafted``, ``round_tokens``.
    """

    def __init__(self, backend: Eagle3Backend, max_model_len: int) -> None:
        self.backend = backend
        self.max_model_len = int(max_model_len)
        self.totals = {"rounds": 0, "accepted": 0, "drafted": 0, "round_tokens": 0, "requests": 0}

    # ---------------------------------------------------------------- requests
    def admit(self, new: Any) -> _Request:
        """A new request's record.

        Raises:
            ValueError: prompt embeddings or multimodal data (validate_request refuses them first).
        """
        if getattr(new, "prompt_embeds", None) is not None or getattr(new, "mm_features", None):
            raise ValueError("EAGLE-3 models take token prompts only, without prompt embeddings or multimodal data.")
        fields = new_request_fields(new)
        params = new.sampling_params
        max_tokens = params.max_tokens
        return _Request(**fields, max_tokens=self.max_model_len - len(fields["prompt_ids"]) if max_tokens is None
                        else int(max_tokens), spec=sampling_spec(params), stops=stop_ids(params))

    def _drop_state(self, req: _Request) -> None:
        if req.seq is not None:
            req.rounds_before.append((req.seq.rounds, req.seq.accepted_total, req.seq.drafted_total))
            if self.backend.owner is req.seq:
                self.backend.owner = None
            req.seq = None
        req.exhausted = False

    def finish(self, req: _Request) -> None:
        """A finished request: its figures join :attr:`totals` and are logged."""
        req_id = req.req_id
        rounds, accepted, drafted = req.figures()
        if req.seq is not None and self.backend.owner is req.seq:
            self.backend.owner = None
        outputs = len(req.output_ids)
        for key, v in (("rounds", rounds), ("accepted", accepted), ("drafted", drafted),
                       ("round_tokens", req.round_tokens), ("requests", 1)):
            self.totals[key] += v
        logger.info(
            "MBLT EAGLE-3 req_id=%s: %d tokens, %d rounds, %d draft tokens accepted of %d verified (%.1f%%), "
            "%.2f tokens per round, %d restarts", req_id, outputs, rounds, accepted, drafted,
            100.0 * accepted / drafted if drafted else 0.0, req.round_tokens / rounds if rounds else 0.0, req.restarts)

    def _remaining(self, req: _Request) -> int:
        return min(req.max_tokens - len(req.output_ids), self.max_model_len - req.num_tokens)

    def _prefill(self, req: _Request) -> list[int]:
        req.seq = Eagle3Sequence(self.backend, req.spec, req.stops)
        return [req.seq.prefill(req.all_ids, max(1, self._remaining(req)))]

    def _run(self, req: _Request) -> list[int]:
        """Feed the prompt, or run the next round; the tokens to return.

        Raises:
            RuntimeError: the request was scheduled after a round ended it.
        """
        if req.exhausted:
            raise RuntimeError(f"EAGLE-3 request {req.req_id} was scheduled after it reached its token limit.")
        if req.seq is None:
            return self._prefill(req)
        remaining = self._remaining(req)
        if remaining < 1 or not req.seq.has_tree:
            raise RuntimeError(f"EAGLE-3 request {req.req_id} was scheduled after it reached its token limit "
                               f"(remaining={remaining}).")
        try:
            result = req.seq.round(remaining + 1)
        except KvDisplaced:
            req.restarts += 1
            self._drop_state(req)
            return self._prefill(req)
        tokens = result.tokens[1:]
        if result.stopped:
            req.exhausted = True
        else:
            tokens.append(int(result.next_token))  # type: ignore[arg-type]
        req.round_tokens += len(tokens)
        return tokens

    # ---------------------------------------------------------------- the step
    def preempt(self, req: _Request) -> None:
        """A preempted request loses its speculative state (its KV is gone)."""
        self._drop_state(req)

    def resume(self, req: _Request) -> None:
        """A resumed request restarts from vLLM's token list (a prefill of every token)."""
        req.restarts += 1
        self._drop_state(req)

    def run_step(self, plan: StepPlan) -> StepResult:
        """Feed the prompt, or run a round, for each scheduled request that reached its last
        token; their new tokens (the engine appends them)."""
        return StepResult(tokens=[self._run(row.req) for row in plan.sampling])  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Release the backend's KV owner (the engine forgets the requests)."""
        self.backend.owner = None
