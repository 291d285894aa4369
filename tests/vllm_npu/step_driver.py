"""vLLM 0.32's scheduler for one NPU worker, driven step by step: :class:`Driver`.

Shared by the worker cases of every device (``mblt_worker_cases.py``, ``rbln_worker_cases.py``,
``neuron_worker_cases.py``). It chunks prompts by a per-request token budget, sends
``NewRequestData`` the first time a request is scheduled and ``CachedRequestData`` afterwards
(``all_token_ids`` for requests not scheduled in the previous step, as vLLM does), hands out
vLLM KV block ids as a request grows (block 0 is vLLM's null block and never given; a
preempted or finished request's blocks return to the pool), advances ``num_computed_tokens``
after each step, feeds back sampled tokens, reports finished requests in the next step's
``finished_req_ids`` and preemptions in ``preempted_req_ids``.

A worker whose step waits for vLLM's grammar bitmask (``execute_model`` returns None) is
finished with ``sample_tokens(None)``, as vLLM's engine does when no request of the step has a
grammar yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DriverRequest:
    rid: str
    prompt: list[int]
    params: object
    computed: int
    out: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    embeds: object = None  # a [T, hidden] torch tensor sent as the prompt (prompt ids: T zeros)
    sent: bool = False
    resumed: bool = False
    preempted: bool = False
    done: bool = False

    @property
    def all_ids(self):
        return self.prompt + self.out


class Driver:
    """vLLM's scheduler for one worker (see the module docstring).

    Args:
        worker: the device worker (its ``execute_model`` / ``sample_tokens``).
        chunk: tokens scheduled per request per step, at most.
        block_size: tokens per vLLM KV block (None: no block ids are handed out, for a worker
            that keeps its KV by slot, as MBLT does).
        num_blocks: vLLM's KV blocks, the null block 0 included.
    """

    def __init__(self, worker, chunk=16, *, block_size: int | None = None, num_blocks: int = 0):
        self.w = worker
        self.chunk = chunk
        self.block_size = block_size
        self.free_blocks = list(range(1, num_blocks))
        self.reqs: dict[str, DriverRequest] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.prev: set[str] = set()

    def add(self, rid, prompt, params, num_computed=0, prompt_embeds=None):
        """A request; ``prompt_embeds`` (a ``[T, hidden]`` tensor): sent as vLLM sends an
        embeddings prompt, with ``T`` placeholder ids 0 (``prompt`` is ignored)."""
        if prompt_embeds is not None:
            prompt = [0] * int(prompt_embeds.shape[0])
        self.reqs[rid] = DriverRequest(rid, list(prompt), params, num_computed, embeds=prompt_embeds)

    def _release(self, r: DriverRequest) -> None:
        self.free_blocks.extend(r.blocks)
        self.free_blocks.sort()
        r.blocks = []

    def preempt(self, rid):
        r = self.reqs[rid]
        r.preempted, r.computed = True, 0
        self._release(r)
        self.preempted.add(rid)

    def resume(self, rid, num_computed=0):
        r = self.reqs[rid]
        r.preempted, r.resumed, r.computed = False, True, num_computed

    def active(self):
        return [r.rid for r in self.reqs.values() if not r.done and not r.preempted]

    def _grow(self, r: DriverRequest, end: int) -> list[int]:
        """The blocks ``r`` needs to hold ``end`` tokens, taken from the pool (vLLM's KV manager)."""
        if self.block_size is None:
            return []
        need = -(-end // self.block_size) - len(r.blocks)
        if need > len(self.free_blocks):
            raise AssertionError(f"{r.rid}: {need} KV blocks needed, {len(self.free_blocks)} free")
        new, self.free_blocks = self.free_blocks[:max(need, 0)], self.free_blocks[max(need, 0):]
        r.blocks.extend(new)
        return new

    def schedule(self, rids=None):
        """The ``SchedulerOutput`` of the next step (the requests in ``rids``, default every
        active one) and its scheduled token counts."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        rids = self.active() if rids is None else list(rids)
        new, cached, cached_new_blocks, nst = [], [], [], {}
        for rid in rids:
            r = self.reqs[rid]
            n = min(self.chunk, len(r.all_ids) - r.computed)
            assert n > 0
            nst[rid] = n
            fresh = r.resumed
            blocks = self._grow(r, r.computed + n)
            if not r.sent:
                new.append(NewRequestData(req_id=rid, prompt_token_ids=list(r.prompt), mm_features=[],
                                          sampling_params=r.params, pooling_params=None, block_ids=(list(r.blocks),),
                                          num_computed_tokens=r.computed, lora_request=None,
                                          prompt_embeds=r.embeds))
            else:
                cached.append(r)
                cached_new_blocks.append((list(r.blocks) if fresh else blocks,) if (blocks or fresh) else None)
        cd = CachedRequestData(
            req_ids=[r.rid for r in cached],
            resumed_req_ids={r.rid for r in cached if r.resumed},
            new_token_ids=[[] for _ in cached],
            all_token_ids={r.rid: list(r.all_ids) for r in cached if r.rid not in self.prev},
            new_block_ids=cached_new_blocks,
            num_computed_tokens=[r.computed for r in cached],
            num_output_tokens=[len(r.out) for r in cached],
        )
        so = SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cd, num_scheduled_tokens=nst,
            total_num_scheduled_tokens=sum(nst.values()), scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(self.finished), free_encoder_mm_hashes=[],
            preempted_req_ids=set(self.preempted),
        )
        self.finished, self.preempted = set(), set()
        return so, nst

    def step(self, rids=None):
        """One step; the worker's ``ModelRunnerOutput``."""
        so, nst = self.schedule(rids)
        out = self.w.execute_model(so)
        if out is None:  # the step waits for vLLM's grammar bitmask; none of these has a grammar
            out = self.w.sample_tokens(None)
        assert list(out.req_ids) == list(nst)
        for rid, n in nst.items():
            r = self.reqs[rid]
            r.sent, r.resumed = True, False
            r.computed += n
            toks = out.sampled_token_ids[out.req_id_to_index[rid]]
            if r.computed < len(r.all_ids):
                assert toks == [], f"{rid}: sampled during a partial prefill"
                continue
            assert len(toks) == 1, f"{rid}: nothing sampled at the end of its tokens"
            r.out.extend(toks)
            if len(r.out) >= r.params.max_tokens:
                r.done = True
                self.finished.add(rid)
                self._release(r)
        self.prev = set(nst)
        return out

    def flush(self):
        """One step with nothing scheduled: delivers pending finished/preempted ids."""
        return self.step([])

    def run(self, rids=None):
        """Step (all active requests, or ``rids``) until those are done; return their outputs."""
        want = list(rids) if rids is not None else self.active()
        while True:
            todo = [rid for rid in want if not self.reqs[rid].done]
            if not todo:
                return {rid: self.reqs[rid].out for rid in want}
            self.step(todo)


def greedy(n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)
