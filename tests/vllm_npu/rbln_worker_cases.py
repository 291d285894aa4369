"""Cases of the RBLN optimum-path worker driven directly, run by ``test_worker_cases.py`` in a fresh
interpreter with ``NPU_HARNESS_TARGET=rbln-sim`` (vLLM resolves its platform once per process).

No fake runtime: the worker is built from a real ``VllmConfig`` (``EngineArgs(...)
.create_engine_config()``, so the RBLN platform plans the compile), compiles the tiny llama with
the vendor's optimum-rbln on our ``rebel`` (``npusim.rbln``) into this module's own
``VLLM_CACHE_ROOT``, and serves steps from :class:`step_driver.Driver`, which plays vLLM's
scheduler and hands out vLLM block ids. Every greedy output is compared with the golden
``npusim.llm.Decoder.generate_greedy``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from npusim import tinymodel  # noqa: E402
from npusim.llm import Decoder  # noqa: E402
from step_driver import Driver, greedy  # noqa: E402

BLOCK = 1024
MAX_LEN = 2048
MAX_SEQS = 4
WORKER_CLS = "vllm_npu.rbln.worker.RblnOptimumWorker"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tinymodel.build("llama", tmp_path_factory.mktemp("hf") / "m", head_dim=64, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def golden(hf_dir):
    dec = Decoder.from_pretrained(hf_dir)
    return lambda prompt, n: [int(t) for t in dec.generate_greedy(list(prompt), n)]


@pytest.fixture(scope="module")
def worker(hf_dir, tmp_path_factory):
    """One loaded worker for the module (the compile runs once, into a module cache root), with
    ``--enable-prompt-embeds``: optimum-rbln compiles the graphs to take ``inputs_embeds``."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_npu.rbln.worker import RblnOptimumWorker

    os.environ["NPU_HARNESS_TARGET"] = "rbln-sim"
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("cache"))
    cfg = EngineArgs(model=str(hf_dir), max_model_len=MAX_LEN, block_size=BLOCK, max_num_seqs=MAX_SEQS,
                     enable_prompt_embeds=True).create_engine_config()
    assert cfg.parallel_config.worker_cls == WORKER_CLS, "the RBLN platform did not configure vLLM"
    w = RblnOptimumWorker(cfg, 0, 0, "tcp://127.0.0.1:0")
    w.init_device()
    w.load_model()
    n = w._num_blocks()
    w.initialize_cache(n, 0)
    w.initialize_from_config(SimpleNamespace(num_blocks=n))
    w.compile_or_warm_up_model()
    yield w
    w.shutdown()


def driver(w, chunk=BLOCK):
    return Driver(w, chunk, block_size=BLOCK, num_blocks=w._num_blocks())


def prompts(seed, *lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(5, 1000, n)] for n in lengths]


def test_chunked_batched_greedy_equals_golden(worker, golden):
    """Prompts scheduled in chunks (the table defers each prefill to its last chunk), requests
    joining while others decode, decodes padded to the compiled batch."""
    d = driver(worker, chunk=7)
    ps = prompts(1, 37, 23, 50)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, greedy(6))
    before = dict(worker.stats)
    d.step(["r0", "r1"])
    outs = d.run(["r0", "r1", "r2"])
    d.flush()
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == golden(p, 6), f"r{i}"
    assert worker.stats["prefills"] - before["prefills"] == 3
    assert worker.stats["padded_rows"] > before["padded_rows"], "3 rows run on the batch-4 decoder"
    assert not worker.engine.reqs and not worker.table.seqs


def test_preempted_request_resumes_equal_golden(worker, golden):
    """A request preempted mid-decode loses its blocks; resumed from vLLM's token list on new
    blocks it prefills again and continues as if never stopped."""
    d = driver(worker)
    a, b = prompts(2, 30, 19)
    d.add("a", a, greedy(8))
    d.add("b", b, greedy(8))
    for _ in range(4):
        d.step(["a", "b"])
    d.preempt("a")
    d.step(["b"])
    d.resume("a")
    outs = d.run(["a", "b"])
    d.flush()
    assert outs["a"] == golden(a, 8) and outs["b"] == golden(b, 8)


def test_host_sampler_parameters_take_effect(worker):
    """The worker samples with vLLM's sampler: a +100 ``logit_bias`` forces its token, and
    ``min_tokens`` holds back the EOS the bias would otherwise force."""
    from vllm import SamplingParams

    d = driver(worker)
    (p,) = prompts(3, 12)
    d.add("bias", p, SamplingParams(temperature=0.0, max_tokens=5, logit_bias={77: 100.0}))
    d.add("min", p, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, logit_bias={2: 100.0},
                                   stop_token_ids=[2]))
    outs = d.run(["bias", "min"])
    d.flush()
    assert outs["bias"] == [77] * 5
    assert 2 not in outs["min"], "min_tokens masks the stop token for its first 5 tokens"


def test_a_request_the_worker_never_saw_is_a_step_state_error(worker):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from vllm_npu.step_engine import StepStateError

    cd = CachedRequestData(req_ids=["ghost"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                           new_block_ids=[None], num_computed_tokens=[3], num_output_tokens=[0])
    so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cd, num_scheduled_tokens={"ghost": 1},
                         total_num_scheduled_tokens=1, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                         finished_req_ids=set(), free_encoder_mm_hashes=[])
    with pytest.raises(StepStateError, match="ghost"):
        worker.execute_model(so)


def golden_prompt_logprobs(hf_dir, prompt):
    """log P(prompt[i] | prompt[:i]) for i >= 1 from the golden decoder (float64)."""
    dec = Decoder.from_pretrained(hf_dir)
    logits = np.asarray(dec.prefill(prompt, dec.new_cache(len(prompt))), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return np.array([logits[i - 1, prompt[i]] - logz[i - 1] for i in range(1, len(prompt))])


def test_prompt_logprobs_equal_golden_beside_a_decoding_request(worker, hf_dir, golden):
    """The compiled prefill returns the last position's logits: the worker prefills the first
    token and feeds each later one through the batch-1 decoder, scoring every position, while
    another request decodes; both outputs stay golden."""
    from vllm import SamplingParams

    d = driver(worker, chunk=9)
    p, q = prompts(5, 21, 13)
    d.add("q", q, greedy(6))
    d.step(["q"])
    d.add("p", p, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    rows = {}
    while not d.reqs["p"].done or not d.reqs["q"].done:
        out = d.step([r for r in ("p", "q") if not d.reqs[r].done])
        rows.update(out.prompt_logprobs_dict)
    d.flush()
    assert d.reqs["p"].out == golden(p, 3) and d.reqs["q"].out == golden(q, 6)
    t = rows["p"]
    ids, values = t.logprob_token_ids, t.logprobs
    assert ids.shape == (20, 3) and ids[:, 0].tolist() == p[1:]
    assert np.abs(values[:, 0].numpy() - golden_prompt_logprobs(hf_dir, p)).max() <= 2e-4
    assert worker.stats["prompt_logprob_microsteps"] >= 21


def test_prompt_embeds_equal_their_tokens_and_the_golden_decoder(worker, hf_dir, golden):
    """A prompt sent as its token embeddings decodes the tokens' greedy output, beside a token
    request; other embeddings decode what the golden decoder does on them."""
    import torch

    assert worker.spec.use_inputs_embeds
    dec = Decoder.from_pretrained(hf_dir)
    d = driver(worker, chunk=9)
    p, q = prompts(9, 23, 14)
    d.add("tok", None, greedy(6), prompt_embeds=torch.from_numpy(np.asarray(dec.embed(p), np.float32)))
    d.add("ids", q, greedy(6))
    free = np.random.default_rng(8).normal(0.0, 0.05, (11, dec.config.hidden_size)).astype(np.float32)
    d.add("free", None, greedy(6), prompt_embeds=torch.from_numpy(free))
    outs = d.run(["tok", "ids", "free"])
    d.flush()
    assert outs["tok"] == golden(p, 6) and outs["ids"] == golden(q, 6)
    cache = dec.new_cache(len(free) + 6)
    want = dec.continue_greedy(dec.forward_embeddings(free, cache), cache, 6, set())
    assert outs["free"] == [int(t) for t in want]
