"""The Neuron scheduler: vLLM 0.32's v1 ``Scheduler`` steered so every step fits a NEFF.

Neuron runs static-shape programs, one per bucket, and never mixes prefill and decode in one
program (reference neuron.md §2.4, §3 "Scheduler admission", §6 "Segmented prefill
scheduling"). Every :class:`~vllm.v1.core.sched.output.SchedulerOutput` of
:class:`NeuronScheduler` is therefore one of:

* **prefill**: exactly one request, scheduled from ``num_computed_tokens < num_prompt_tokens``
  (a new request, possibly after a prefix-cache hit; a resumed one; or the next segment of a
  prompt longer than ``max_num_batched_tokens``: segmented prefill). A resumed (preempted)
  request recomputes its prompt *and* its output tokens, so its last segment may start past
  the prompt; it is still a one-request prefill step (more than one token);
* **decode**: every scheduled request is past its prompt and gets one token.

``scheduler_output.num_scheduled_tokens_padded`` (an extra attribute, as the vendor's) maps each
request to its padded token count: the prefill bucket (:func:`get_bucket_for_count` over
``num_batched_tokens_buckets``) for a prefill, the unpadded count for a decode (the runner pads
the decode *batch*). ``num_scheduled_tokens`` stays unpadded.

Step choice (states IDLE / ACTIVE_PREFILL / ACTIVE_DECODE of the vendor's design), in order:

1. a running request whose prompt is in progress (partly prefilled) continues, alone;
2. else, when a request is waiting and fewer than ``max_kv_concurrency`` (and vLLM's
   ``max_num_seqs``) requests run, one new prefill is admitted, alone (debug
   "Prefill deferred: ..." when the KV limit stops it);
3. else a decode step of all running requests.

A prefill step that schedules nothing (no KV blocks for the admission, or the prompt in
progress preempted itself) is always followed by a decode step, then by decode steps until the
free blocks look enough for the next admission (or nothing runs): decodes cannot starve
behind a prefill that waits for memory (at least every other step decodes even if the
estimate is wrong), and empty steps stay rare.

How the base class is steered, and why that is sound
------------------------------------------------------
``Scheduler.schedule()`` first walks ``self.running`` (allocating, and preempting
``running[-1]`` when blocks run out), then admits from ``kv_holding_waiting``/``waiting``
while ``len(running) < self.max_num_active_reqs``. :meth:`NeuronScheduler.schedule` calls it
once per step, around two temporary, per-call changes restored in ``finally``:

* the **holdback** of running requests that must not run this step is done with the base
  loop's own skip, ``request.next_decode_eligible_step`` (``if self.current_step <
  request.next_decode_eligible_step: continue``; used otherwise only by V2+PP async
  scheduling, whose values are saved and restored). Held requests stay in ``self.running``,
  so nothing else in the base class sees a difference: ``finish_requests``/aborts,
  ``update_from_output``, stats (``get_request_counts``, KV usage), the
  ``len(running) <= max_num_seqs`` assertion, and, importantly, **preemption**, which may
  still choose a held decode as its victim to make room for the prefill (a request removed
  from ``running`` could not be);
* **admission** is capped through ``self.max_num_active_reqs``: the number of active
  requests (or that plus one, to admit exactly one prefill). The base loop reads it only at
  that one check. Everything an admission does (prefix-cache lookup at
  ``num_computed_tokens == 0``, block allocation, connector state, prefix-cache stats, the
  RUNNING status change) is the base class's own code; a failed allocation ``break``s
  without side effects, as upstream.

Nothing is removed from or re-inserted into the base class's queues, so KV-block accounting
and request states are exactly upstream's; the scheduler only withholds work for a step.
Not covered (refused by the Neuron platform, or not exercised): speculative decoding
(decodes of more than one token) and the async scheduler's output placeholders.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_npu.neuron.buckets import (get_bucket_for_count, get_default_num_batched_tokens_buckets,
                                     get_default_num_seqs_buckets)
from vllm_npu.neuron.metrics import NeuronMetrics

__all__ = ["PLAN_KEY", "CHUNKED_PREFILL_WARNING", "NeuronScheduler", "is_prefill"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: ``vllm_config.additional_config`` key of the platform's resolved bucket plan.
PLAN_KEY = "npu_harness_neuron_plan"
CHUNKED_PREFILL_WARNING = (
    "Chunked prefill is enabled on Neuron platform. Currently Neuron only supports chunking "
    "prefills with batch size of 1. Mixing prefill and decode in the same batch is not supported")
MIXED_BATCH_ERROR = ("Neuron constraint violated: Mixed prefill ({p}) and decode ({d}) in the same "
                     "batch. This indicates a bug in the scheduling logic.")

_PREFILL, _CONTINUE, _DECODE = "prefill", "continue", "decode"


def is_prefill(request: Request, num_computed_tokens: int) -> bool:
    """Whether scheduling ``request`` from ``num_computed_tokens`` is prefill work.

    True before the end of the prompt, and for a resumed request still recomputing its output
    tokens (more than the one next token left); a request at its next token is a decode.
    """
    return (num_computed_tokens < request.num_prompt_tokens
            or num_computed_tokens < request.num_tokens - 1)


class NeuronScheduler(Scheduler):
    """vLLM's v1 scheduler, one prefill request or one decode batch per step (module doc).

    Reads the platform's plan from ``vllm_config.additional_config["npu_harness_neuron_plan"]``:
    ``num_batched_tokens_buckets`` (tokens, ascending), ``num_seqs_buckets`` (sequences,
    ascending), ``model_name`` (metric label), ``max_kv_concurrency`` (requests at
    ``max_model_len`` the KV cache holds; None: computed from ``kv_cache_config``). Without a
    plan the vendor's default ladders are used.

    Raises:
        ValueError: (at init) the plan has an empty bucket list.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        plan: Mapping[str, Any] = (vllm_config.additional_config or {}).get(PLAN_KEY) or {}
        sched = self.scheduler_config
        if plan.get("num_batched_tokens_buckets"):
            self.num_batched_tokens_buckets = [int(b) for b in plan["num_batched_tokens_buckets"]]
            logger.info("Scheduling with num_batched_tokens_buckets: %s",
                        self.num_batched_tokens_buckets)
        else:
            self.num_batched_tokens_buckets = get_default_num_batched_tokens_buckets(
                min(sched.max_num_batched_tokens, self.max_model_len))
            logger.info("Using default num_batched_tokens_buckets: %s", self.num_batched_tokens_buckets)
        if plan.get("num_seqs_buckets"):
            self.num_seqs_buckets = [int(b) for b in plan["num_seqs_buckets"]]
        else:
            self.num_seqs_buckets = get_default_num_seqs_buckets(sched.max_num_seqs)
            logger.info("Using default num_seqs_buckets: %s", self.num_seqs_buckets)
        model_name = plan.get("model_name") or vllm_config.model_config.served_model_name
        if isinstance(model_name, (list, tuple)):
            model_name = model_name[0]

        kv_concurrency = plan.get("max_kv_concurrency")
        if kv_concurrency is None:
            kv_concurrency = int(get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config))
        self.max_kv_concurrency = max(1, int(kv_concurrency))
        if sched.max_num_seqs > self.max_kv_concurrency:
            logger.warning(
                "max_num_seqs (%d) exceeds worst-case KV cache capacity (%d concurrent requests at "
                "max_model_len=%d with %d blocks of %d tokens). Effective concurrency will be "
                "capped at %d running requests; raise num_gpu_blocks_override or lower "
                "max_num_seqs.", sched.max_num_seqs, self.max_kv_concurrency, self.max_model_len,
                kv_cache_config.num_blocks, self.block_size, self.max_kv_concurrency)
        if sched.enable_chunked_prefill:
            logger.warning(CHUNKED_PREFILL_WARNING)

        rank = getattr(vllm_config.parallel_config, "data_parallel_rank_local", None) or 0
        self.neuron_metrics = NeuronMetrics(str(model_name), rank)
        self.neuron_metrics.precreate([f"prefill_s{b}" for b in self.num_batched_tokens_buckets],
                                      [f"decode_b{b}" for b in self.num_seqs_buckets])
        self._prefill_backoff = False     # a prefill step ran nothing: admit when blocks look enough
        self._decode_next = False         # ... and the step after it decodes regardless
        self._real_prefill_tokens = 0     # cumulative, for the padding-overhead debug line
        self._padding_tokens = 0

    # ------------------------------------------------------------------ step choice

    def _choose_step(self) -> tuple[str, Request | None]:
        for request in self.running:
            if is_prefill(request, request.num_computed_tokens):
                return _CONTINUE, request
        if not (self.waiting or self.kv_holding_waiting):
            return _DECODE, None
        if self.running and (self._decode_next or (self._prefill_backoff
                                                   and not self._admission_may_fit())):
            return _DECODE, None
        num_active = len(self.running) + self.num_waiting_for_streaming_input
        if num_active >= self.max_kv_concurrency:
            logger.debug("Prefill deferred: %d running requests reached the KV cache concurrency "
                         "limit of %d (%d waiting)", num_active, self.max_kv_concurrency,
                         len(self.waiting) + len(self.kv_holding_waiting))
            return _DECODE, None
        if num_active >= self.max_num_active_reqs:
            return _DECODE, None
        return _PREFILL, None

    def _admission_may_fit(self) -> bool:
        """After a failed prefill: whether the free KV blocks (less vLLM's watermark) hold the
        next admission (its whole sequence under vLLM's default ``scheduler_reserve_full_isl``,
        else its first segment). Prefix hits are ignored, so a conservative guess, used
        only while backing off (the first attempt is optimistic, so a hit on blocks running
        requests hold is not missed); a request already holding blocks is always tried. Keeps
        decode steps from alternating with empty ones while memory is full."""
        if self.kv_holding_waiting:
            return True
        request = self.waiting.peek_request()
        if self.scheduler_reserve_full_isl:  # vLLM admits only if the whole sequence fits
            end = request.num_tokens
        else:
            end = request.num_computed_tokens + min(request.num_tokens - request.num_computed_tokens,
                                                    self.max_num_scheduled_tokens)
        need = cdiv(min(end + self.num_lookahead_tokens, self.max_model_len), self.block_size)
        need += getattr(self.kv_cache_manager, "watermark_blocks", 0)
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= need

    @contextmanager
    def _steer(self, mode: str, target: Request | None) -> Iterator[None]:
        """Hold back the running requests other than ``target`` (all of them for an admission,
        none for a decode) and cap admissions, for one base ``schedule()`` call."""
        held = [] if mode == _DECODE else [r for r in self.running if r is not target]
        saved_steps = [(r, r.next_decode_eligible_step) for r in held]
        saved_active = self.max_num_active_reqs
        num_active = len(self.running) + self.num_waiting_for_streaming_input
        self.max_num_active_reqs = num_active + 1 if mode == _PREFILL else 0
        for request in held:
            request.next_decode_eligible_step = sys.maxsize
        try:
            yield
        finally:
            self.max_num_active_reqs = saved_active
            for request, step in saved_steps:
                request.next_decode_eligible_step = step

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """One step: a single prefill request, or a decode of all running requests, with
        ``num_scheduled_tokens_padded`` set and the padding metrics observed.

        Raises:
            RuntimeError: the step mixes prefill and decode, or has several prefills (a bug
                here; the vendor's runner raises the same mixed-batch text).
        """
        mode, target = self._choose_step()
        with self._steer(mode, target):
            output = super().schedule(*args, **kwargs)
        if mode == _DECODE:
            self._decode_next = False
        else:
            # Back off after a prefill step that ran nothing (no blocks for the admission,
            # or the prompt in progress preempted itself): the next step decodes, whatever
            # the estimate says (progress of the running requests), and later admissions wait
            # until the blocks look sufficient.
            failed = not output.num_scheduled_tokens or (
                target is not None and target.status != RequestStatus.RUNNING)
            self._prefill_backoff = self._decode_next = failed
        self._apply_padding_and_log_stats(output)
        return output

    # ------------------------------------------------------------------ padding, stats

    def _skip_prefill_padding(self, output: SchedulerOutput, request: Request) -> bool:
        """Decode node of disaggregated inference: the prefill ran remotely (vendor rule)."""
        if getattr(output, "kv_connector_metadata", None) is None:
            return False
        return not (request.kv_transfer_params or {}).get("do_remote_decode", False)

    def _apply_padding_and_log_stats(self, output: SchedulerOutput) -> None:
        padded: dict[str, int] = {}
        prefills: list[str] = []
        decodes: list[str] = []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # _update_after_schedule already advanced num_computed_tokens by this step.
            if is_prefill(request, request.num_computed_tokens - num_tokens):
                prefills.append(req_id)
                if self._skip_prefill_padding(output, request):
                    padded[req_id] = num_tokens
                else:
                    padded[req_id] = get_bucket_for_count(num_tokens, self.num_batched_tokens_buckets)
            else:
                decodes.append(req_id)
                padded[req_id] = num_tokens
        output.num_scheduled_tokens_padded = padded  # type: ignore[attr-defined]
        if prefills and decodes:
            raise RuntimeError(MIXED_BATCH_ERROR.format(p=len(prefills), d=len(decodes)))
        if len(prefills) > 1:
            raise RuntimeError(f"Neuron constraint violated: {len(prefills)} prefill requests in "
                               "one batch (at most 1). This indicates a bug in the scheduling logic.")
        if prefills:
            req_id = prefills[0]
            real, pad_to = output.num_scheduled_tokens[req_id], padded[req_id]
            extra = max(pad_to - real, 0)
            logger.debug("PADDING: Prefill request %s: %d -> %d tokens (+%d padding, %.1f%% overhead)",
                         req_id, real, pad_to, extra, 100.0 * extra / real)
            self._real_prefill_tokens += real
            self._padding_tokens += extra
            logger.debug("Cumulative padding overhead: %d / %d = %.2f%%", self._padding_tokens,
                         self._real_prefill_tokens,
                         100.0 * self._padding_tokens / self._real_prefill_tokens)
            self.neuron_metrics.observe_prefill(pad_to)
        elif decodes:
            batch = get_bucket_for_count(len(decodes), self.num_seqs_buckets)
            self.neuron_metrics.observe_decode(len(decodes), batch)
