"""``vllm_npu.neuron.scheduler.NeuronScheduler`` driven in-process on a real vLLM 0.32 setup.

A ``VllmConfig`` of a tiny local llama (``npusim.tinymodel``), a one-group ``FullAttentionSpec``
``KVCacheConfig``, real ``Request`` objects with block hashes (prefix caching); no engine, no
worker: ``schedule()`` and ``update_from_output()`` with fabricated ``ModelRunnerOutput``s until
every request finishes, checking the Neuron invariants on every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vllm_npu.neuron.buckets import get_bucket_for_count  # noqa: E402
from vllm_npu.neuron.scheduler import CHUNKED_PREFILL_WARNING, PLAN_KEY, NeuronScheduler  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 1024
PREFILL_BUCKETS = [128, 256]
MAX_BATCHED = 256


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from npusim import tinymodel
    path = tinymodel.build("llama", tmp_path_factory.mktemp("neuron_sched") / "m")
    init_none_hash(sha256)
    return ModelConfig(model=str(path), max_model_len=MAX_MODEL_LEN, dtype="float32", seed=0,
                       skip_tokenizer_init=True)




def make_scheduler(model_config, *, num_blocks=400, max_num_seqs=8, prefix_caching=True,
                   max_kv_concurrency=None) -> NeuronScheduler:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_BATCHED,
                            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                            is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    plan = {"num_batched_tokens_buckets": PREFILL_BUCKETS, "num_seqs_buckets": [1, 2, 4, 8],
            "model_name": "tiny-llama", "max_kv_concurrency": max_kv_concurrency}
    config = VllmConfig(model_config=model_config, scheduler_config=sched, cache_config=cache,
                        additional_config={PLAN_KEY: plan})
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                         FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                           dtype=torch.float32))])
    return NeuronScheduler(config, kv, StructuredOutputManager(config), block_size=BLOCK, log_stats=True)


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@dataclass
class Trace:
    """What the driver saw: per-request step kinds, preemptions, prefix hits."""

    prefill_steps: dict[str, int] = field(default_factory=dict)
    decode_steps: int = 0
    empty_steps: int = 0
    preemptions: int = 0
    prefix_hits: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    max_running: int = 0
    resumed_tail_segments: int = 0


def _is_prefill(request: Request, computed: int) -> bool:
    return computed < request.num_prompt_tokens or computed < request.num_tokens - 1


def step(s: NeuronScheduler, trace: Trace, max_kv: int | None = None) -> None:
    """One schedule() + update_from_output(), asserting the invariants."""
    before = {r.request_id: r.num_computed_tokens for r in s.running}
    in_progress = [rid for rid, c in before.items() if _is_prefill(s.requests[rid], c)]
    assert len(in_progress) <= 1
    out = s.schedule()
    sched = out.num_scheduled_tokens
    padded = out.num_scheduled_tokens_padded
    assert set(padded) == set(sched)
    trace.preemptions += len(out.preempted_req_ids)
    trace.max_running = max(trace.max_running, len(s.running))
    if max_kv is not None:
        assert len(s.running) <= max_kv
    if not sched:
        trace.empty_steps += 1
    pre = {rid: s.requests[rid].num_computed_tokens - n for rid, n in sched.items()}
    for new in out.scheduled_new_reqs:
        assert new.num_computed_tokens == pre[new.req_id]
        if new.num_computed_tokens > 0:
            trace.prefix_hits[new.req_id] = new.num_computed_tokens
    prefills = [rid for rid in sched if _is_prefill(s.requests[rid], pre[rid])]
    if prefills:
        # Prefill step: exactly one request, padded to its bucket.
        assert len(sched) == 1, f"mixed or multi-prefill step: {sched}"
        (rid,) = prefills
        req = s.requests[rid]
        if pre[rid] >= req.num_prompt_tokens:
            assert req.num_preemptions > 0 and sched[rid] > 1
            trace.resumed_tail_segments += 1
        assert sched[rid] <= MAX_BATCHED
        assert padded[rid] == get_bucket_for_count(sched[rid], PREFILL_BUCKETS) >= sched[rid]
        if in_progress and in_progress[0] in s.requests and \
                s.requests[in_progress[0]].status == RequestStatus.RUNNING:
            assert rid == in_progress[0], "a prompt in progress must continue first"
        trace.prefill_steps[rid] = trace.prefill_steps.get(rid, 0) + 1
    elif sched:
        assert not in_progress or s.requests[in_progress[0]].status != RequestStatus.RUNNING
        for rid, n in sched.items():
            req = s.requests[rid]
            assert n == 1 and padded[rid] == 1
            assert pre[rid] == req.num_tokens - 1 >= req.num_prompt_tokens
        trace.decode_steps += 1
    # Fabricated runner output: a token for each request that reached its end.
    req_ids = list(sched)
    sampled = []
    for rid in req_ids:
        req = s.requests[rid]
        sampled.append([7] if pre[rid] + sched[rid] >= req.num_tokens else [])
    mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                            sampled_token_ids=sampled)
    for outputs in s.update_from_output(out, mro).values():
        for o in outputs.outputs:
            trace.outputs[o.request_id] = trace.outputs.get(o.request_id, 0) + len(o.new_token_ids)


def drive(s: NeuronScheduler, trace: Trace, max_steps: int = 2000, max_kv: int | None = None) -> int:
    n = 0
    while s.has_requests():
        step(s, trace, max_kv)
        n += 1
        assert n < max_steps, "requests did not finish"
    return n


def assert_all_freed(s: NeuronScheduler, num_blocks: int) -> None:
    assert not s.running and not s.waiting and not s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1  # null block
    assert s.get_kv_cache_usage() == 0.0


def test_many_requests_segments_and_prefix_hits(model_config, neuron_caplog):
    s = make_scheduler(model_config)
    rng = random.Random(0)
    shared = [rng.randrange(1, 1000) for _ in range(160)]  # 10 full blocks shared
    lengths, max_tokens = {}, {}
    for i in range(14):
        if i % 3 == 0:
            prompt = shared + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        else:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.choice([5, 60, 200, 300, 700]))]
        rid = f"r{i}"
        lengths[rid], max_tokens[rid] = len(prompt), rng.randrange(1, 30)
        s.add_request(make_request(rid, prompt, max_tokens[rid]))
    trace = Trace()
    steps = drive(s, trace)
    assert steps < 600
    assert trace.outputs == max_tokens
    # Long prompts are segmented into ceil(len / max_num_batched_tokens) prefill steps.
    for rid, n in lengths.items():
        hit = trace.prefix_hits.get(rid, 0)
        assert trace.prefill_steps[rid] == -(-(n - hit) // MAX_BATCHED)
    assert any(lengths[rid] > MAX_BATCHED for rid in lengths)
    assert len(trace.prefix_hits) >= 3 and all(h >= 144 for h in trace.prefix_hits.values())
    assert trace.decode_steps > 0 and trace.max_running > 4 and trace.preemptions == 0
    assert_all_freed(s, 400)
    text = neuron_caplog.text
    assert CHUNKED_PREFILL_WARNING in text
    rid, n = next((r, n) for r, n in lengths.items() if n < 128 and r not in trace.prefix_hits)
    pad = 128 - n
    assert (f"PADDING: Prefill request {rid}: {n} -> 128 tokens (+{pad} padding, "
            f"{100 * pad / n:.1f}% overhead)") in text
    assert "Cumulative padding overhead: " in text


@pytest.mark.parametrize(("prefix_caching", "prompt_lens", "max_tokens"), [
    (True, [40, 100, 150], 60),
    (False, [40, 100, 150], 60),
    # Resumed requests recompute prompt + outputs (> max_num_batched_tokens): a segment
    # starting past the prompt is still a one-request prefill step.
    (False, [230, 250], 150),
])
def test_preemption_when_blocks_run_out(model_config, prefix_caching, prompt_lens, max_tokens):
    # 39 usable blocks (624 tokens) for up to 8 admitted requests.
    s = make_scheduler(model_config, num_blocks=40, max_num_seqs=8, max_kv_concurrency=8,
                       prefix_caching=prefix_caching)
    rng = random.Random(1)
    for i in range(10):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.choice(prompt_lens))]
        s.add_request(make_request(f"p{i}", prompt, max_tokens))
    trace = Trace()
    drive(s, trace, max_steps=3000)
    assert trace.preemptions > 0
    # An admission that finds no blocks costs one empty step, then decodes run until the
    # blocks look sufficient (no alternation of decode and empty steps).
    assert trace.empty_steps <= trace.decode_steps // 10
    assert trace.outputs == {f"p{i}": max_tokens for i in range(10)}
    if max_tokens > 100:
        assert trace.resumed_tail_segments > 0
    assert_all_freed(s, 40)


def test_abort_mid_prefill(model_config):
    s = make_scheduler(model_config)
    s.add_request(make_request("long", list(range(1, 701)), 5))
    s.add_request(make_request("short", list(range(2, 30)), 5))
    trace = Trace()
    step(s, trace)
    assert trace.prefill_steps == {"long": 1}
    step(s, trace)  # the prompt in progress continues before "short" is admitted
    assert trace.prefill_steps == {"long": 2}
    s.finish_requests("long", RequestStatus.FINISHED_ABORTED)
    drive(s, trace)
    assert trace.outputs == {"short": 5}
    assert_all_freed(s, 400)


def test_kv_concurrency_caps_admission(model_config, neuron_caplog):
    s = make_scheduler(model_config, max_num_seqs=8, max_kv_concurrency=2)
    assert "max_num_seqs (8) exceeds worst-case KV cache capacity (2 concurrent requests" in neuron_caplog.text
    for i in range(6):
        s.add_request(make_request(f"k{i}", list(range(1 + i, 50 + i)), 8))
    trace = Trace()
    drive(s, trace, max_kv=2)
    assert trace.max_running == 2
    assert "Prefill deferred: " in neuron_caplog.text
    assert trace.outputs == {f"k{i}": 8 for i in range(6)}


def test_default_kv_concurrency_from_kv_cache_config(model_config, neuron_caplog):
    # 200 blocks of 16 tokens, max_model_len 1024 = 64 blocks per request -> 3 requests.
    s = make_scheduler(model_config, num_blocks=200, max_num_seqs=8)
    assert s.max_kv_concurrency == 3  # 200 // 64
    assert "Effective concurrency will be capped at 3" in neuron_caplog.text


def test_padding_metrics_are_observed(model_config):
    from prometheus_client import REGISTRY
    s = make_scheduler(model_config)
    labels = {"model_name": "tiny-llama", "rank_id": "0"}

    def count(name, bucket):
        return REGISTRY.get_sample_value(f"vllm_neuron:{name}_count", {**labels, "bucket_name": bucket})

    # Pre-created at init for every bucket.
    assert count("num_batched_tokens_padding", "prefill_s256") is not None
    assert count("num_seqs_padding", "decode_b8") is not None
    before_p, before_d = count("num_batched_tokens_padding", "prefill_s128"), count("num_seqs_padding", "decode_b4")
    for i in range(3):
        s.add_request(make_request(f"m{i}", list(range(10 + i, 110 + i)), 3))
    drive(s, Trace())
    assert count("num_batched_tokens_padding", "prefill_s128") == before_p + 3
    # 3 running requests decode on the 4-batch NEFF; the observed value is the real count.
    assert count("num_seqs_padding", "decode_b4") > before_d
