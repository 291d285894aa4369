"""Cases of the Neuron worker driven directly, run by ``test_worker_cases.py`` in a fresh interpreter
with ``NPU_HARNESS_TARGET=neuron-sim`` (vLLM resolves its platform once per process).

No fake runtime: the worker is built from a real ``VllmConfig`` (``EngineArgs(...)
.create_engine_config()``, so the Neuron platform makes its plan), compiles its NEFFs with the
simulated compiler (``npusim.neff``) into this module's own ``VLLM_CACHE_ROOT`` at warm-up, and
serves steps from :class:`step_driver.Driver`, which plays vLLM's scheduler with the Neuron
scheduler's rule (a prefill runs alone; decodes run together) and hands out vLLM block ids.
Greedy outputs are compared with the golden ``npusim.llm.Decoder.generate_greedy``, with
on-device sampling (the default) and with CPU sampling (``on_device_sampling_config`` null).
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

BLOCK = 32
BLOCKS = 256
MAX_LEN = 1024
SEGMENT = 512  # --max-num-batched-tokens: one prefill segment
WORKER_CLS = "vllm_npu.neuron.worker.NeuronWorker"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tinymodel.build("llama", tmp_path_factory.mktemp("hf") / "m")


@pytest.fixture(scope="module")
def golden(hf_dir):
    dec = Decoder.from_pretrained(hf_dir)
    return lambda prompt, n: [int(t) for t in dec.generate_greedy(list(prompt), n)]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _worker(hf_dir, cache_root, *, cpu_sampling: bool):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_npu.neuron.worker import NeuronWorker

    os.environ["NPU_HARNESS_TARGET"] = "neuron-sim"
    os.environ["VLLM_CACHE_ROOT"] = cache_root
    extra = {"neuron_config": {"on_device_sampling_config": None}} if cpu_sampling else {}
    cfg = EngineArgs(model=str(hf_dir), max_model_len=MAX_LEN, max_num_batched_tokens=SEGMENT, max_num_seqs=4,
                     block_size=BLOCK, num_gpu_blocks_override=BLOCKS, additional_config=extra,
                     async_scheduling=False if cpu_sampling else None,
                     enable_prompt_embeds=cpu_sampling).create_engine_config()
    assert cfg.parallel_config.worker_cls == WORKER_CLS, "the Neuron platform did not configure vLLM"
    w = NeuronWorker(cfg, 0, 0, "tcp://127.0.0.1:0")
    w.init_device()
    w.load_model()
    w.initialize_from_config(SimpleNamespace(num_blocks=BLOCKS))
    w.compile_or_warm_up_model()
    return w


@pytest.fixture(scope="module")
def worker(hf_dir, cache_root):
    w = _worker(hf_dir, cache_root, cpu_sampling=False)
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def cpu_worker(hf_dir, cache_root):
    w = _worker(hf_dir, cache_root, cpu_sampling=True)
    yield w
    w.shutdown()


def prompts(seed, *lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(5, 1000, n)] for n in lengths]


def serve(d: Driver, rids: list[str]) -> dict[str, list[int]]:
    """The Neuron scheduler's order: each new prompt alone (segment by segment), then every
    running request in one decode step, until all are done."""
    for rid in rids:
        r = d.reqs[rid]
        while not r.out:
            d.step([rid])
    outs = d.run(rids)
    d.flush()
    return outs


@pytest.mark.parametrize("sampling", ["on-device", "cpu"])
def test_prefills_alone_then_padded_decodes_equal_golden(request, golden, sampling):
    """A short prompt, a prompt of two 512-token segments, and a third; their decodes run as one
    batch of 3 on the batch-4 NEFF. The NEFF's tokens (on-device sampling) and vLLM's sampler
    on the NEFF's logits (CPU sampling) both give the golden greedy tokens."""
    w = request.getfixturevalue("worker" if sampling == "on-device" else "cpu_worker")
    d = Driver(w, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    ps = prompts(1, 7, 700, 40)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, greedy(6))
    before = dict(w.stats)
    outs = serve(d, ["r0", "r1", "r2"])
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == golden(p, 6), f"r{i}"
    assert w.stats["prefills"] - before["prefills"] == 4, "7 and 40 tokens take one segment, 700 two"
    assert w.stats["padded_rows"] > before["padded_rows"]
    assert not w.engine.reqs


def test_a_step_mixing_prefill_and_decode_is_the_vendors_error(worker):
    d = Driver(worker, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    a, b = prompts(2, 9, 11)
    d.add("a", a, greedy(4))
    d.add("b", b, greedy(4))
    d.step(["a"])
    with pytest.raises(RuntimeError, match=r"Mixed prefill \(1\) and decode \(1\) in the same batch"):
        d.step(["a", "b"])
    worker.engine.clear()


def test_preempted_request_resumes_equal_golden(cpu_worker, golden):
    """A preempted request's blocks return to vLLM; resumed on new blocks from its token list, it
    prefills again and continues as if never stopped."""
    d = Driver(cpu_worker, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    a, b = prompts(3, 33, 20)
    d.add("a", a, greedy(8))
    d.add("b", b, greedy(8))
    d.step(["a"])
    d.step(["b"])
    for _ in range(3):
        d.step(["a", "b"])
    d.preempt("a")
    d.step(["b"])
    d.resume("a")
    d.step(["a"])  # the resumed prefill, alone
    outs = d.run(["a", "b"])
    d.flush()
    assert outs["a"] == golden(a, 8) and outs["b"] == golden(b, 8)


def test_cpu_sampling_parameters_take_effect(cpu_worker):
    """With CPU sampling the worker samples with vLLM's sampler: a +100 ``logit_bias`` forces
    its token."""
    from vllm import SamplingParams

    d = Driver(cpu_worker, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    (p,) = prompts(4, 15)
    d.add("bias", p, SamplingParams(temperature=0.0, max_tokens=4, logit_bias={77: 100.0}))
    assert serve(d, ["bias"])["bias"] == [77] * 4


def golden_prompt_logprobs(hf_dir, prompt):
    """log P(prompt[i] | prompt[:i]) for i >= 1 from the golden decoder (float64)."""
    dec = Decoder.from_pretrained(hf_dir)
    logits = np.asarray(dec.prefill(prompt, dec.new_cache(len(prompt))), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return np.array([logits[i - 1, prompt[i]] - logz[i - 1] for i in range(1, len(prompt))])


@pytest.mark.parametrize("sampling", ["on-device", "cpu"])
def test_prompt_logprobs_equal_golden(request, hf_dir, golden, sampling):
    """The NEFFs return the logits at ``last_token_index`` only: each prompt token is one 1-token
    prefill, scored; the request's greedy output stays golden."""
    from vllm import SamplingParams

    w = request.getfixturevalue("worker" if sampling == "on-device" else "cpu_worker")
    d = Driver(w, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    (p,) = prompts(6, 17)
    d.add("p", p, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))
    out = d.step(["p"])
    t = out.prompt_logprobs_dict["p"]
    ids, values = t.logprob_token_ids, t.logprobs
    assert ids.shape == (16, 2) and ids[:, 0].tolist() == p[1:]
    assert np.abs(values[:, 0].numpy() - golden_prompt_logprobs(hf_dir, p)).max() <= 2e-4
    assert serve(d, ["p"])["p"] == golden(p, 3)


def test_prompt_embeds_equal_their_tokens_and_the_golden_decoder(hf_dir, cpu_worker, golden):
    """``--enable-prompt-embeds``: a prompt sent as its token embeddings decodes the tokens' greedy
    output; other embeddings decode what the golden decoder does on them (the prefill NEFF takes
    ``inputs_embeds``)."""
    import torch

    assert cpu_worker.plan["prompt_embeds"], "the cases' CPU-sampling worker runs with --enable-prompt-embeds"
    dec = Decoder.from_pretrained(hf_dir)
    d = Driver(cpu_worker, SEGMENT, block_size=BLOCK, num_blocks=BLOCKS)
    (p,) = prompts(7, 19)
    d.add("tok", None, greedy(6), prompt_embeds=torch.from_numpy(np.asarray(dec.embed(p), np.float32)))
    free = np.random.default_rng(8).normal(0.0, 0.05, (11, dec.config.hidden_size)).astype(np.float32)
    d.add("free", None, greedy(6), prompt_embeds=torch.from_numpy(free))
    outs = serve(d, ["tok", "free"])
    assert outs["tok"] == golden(p, 6)
    cache = dec.new_cache(len(free) + 6)
    want = dec.continue_greedy(dec.forward_embeddings(free, cache), cache, 6, set())
    assert outs["free"] == [int(t) for t in want]
