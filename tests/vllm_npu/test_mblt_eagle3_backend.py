"""The plugin's EAGLE-3 backend and round (``vllm_npu.mblt.eagle3_backend``, ``eagle3_round``,
``eagle3_serving``) on the simulated release, and the platform's EAGLE-3 rules.

Greedy rounds equal the golden base decoder's plain greedy continuation token for token (prompts
shorter and longer than the 16-token chunk, budgets that cut a round, a stop id inside a round);
the capacity check names both numbers; a sequence whose KV another displaced restarts; sampling
gives valid tokens. The vLLM-facing runner is driven with scheduler outputs as vLLM 0.32 builds
them: chunked prompts, several tokens per step, partial scheduling of a round's tokens,
``max_tokens`` to the token, preemption.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_npu.mblt.eagle3_backend import (Eagle3Backend, Eagle3CapacityError, Eagle3Release, Eagle3ReleaseError,
                                          is_eagle3_release)
from vllm_npu.mblt.eagle3_round import Eagle3Sequence, KvDisplaced
from vllm_npu.mblt.eagle3_tree import SamplingSpec
from vllm_npu.mblt.settings import MbltConfigError

PROMPTS = [[1, 5, 9, 33, 70, 2, 11], [(13 * i + 7) % 1000 + 1 for i in range(40)], [42]]


@pytest.fixture(scope="module")
def release(eagle3_release) -> Path:
    return eagle3_release()


@pytest.fixture(scope="module")
def backend(release):
    import npusim.mxq as runtime

    artifact = json.loads((release / "config.json").read_text())
    b = Eagle3Backend.create(runtime, Eagle3Release.read(release, artifact))
    yield b
    b.dispose()
    from npusim.mxq import machine

    machine.reset()


def _generate(backend, prompt, n, spec=SamplingSpec(), stops=()):
    """``n`` tokens at most, as the runner asks for them; (tokens, per-round counts, sequence)."""
    seq = Eagle3Sequence(backend, spec, frozenset(stops))
    out = [seq.prefill(prompt, n)]
    per = []
    while len(out) < n and out[-1] not in stops:
        res = seq.round(n - len(out) + 1)
        new = res.tokens[1:] + ([] if res.stopped else [res.next_token])
        per.append(len(new))
        out += new
        if res.stopped:
            break
    return out, per, seq


def test_release_reads_the_contract(release, backend):
    artifact = json.loads((release / "config.json").read_text())
    assert is_eagle3_release(artifact)
    r = backend.release
    assert (r.num_assistant_tokens, r.depth, r.top_k) == (64, 5, 8)
    assert r.chunk == 16 and r.draft_vocab_size <= r.vocab_size
    assert backend.base_capacity == backend.draft_capacity == 256
    assert backend.d2t is None or backend.d2t.shape == (r.draft_vocab_size,)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_plain_base_decoding(backend, eagle3_golden, prompt):
    want = list(eagle3_golden.base.generate_greedy(prompt, 30))
    got, per, seq = _generate(backend, prompt, 30)
    assert got == want
    assert sum(per) == 29 and seq.rounds == len(per)
    assert 0 < seq.accepted_total <= seq.drafted_total <= 63 * seq.rounds


@pytest.mark.parametrize("n", [1, 2, 3, 7, 12])
def test_budget_cuts_a_round_exactly(backend, eagle3_golden, n):
    want = list(eagle3_golden.base.generate_greedy(PROMPTS[1], n))
    got, _, seq = _generate(backend, PROMPTS[1], n)
    assert got == want and len(got) == n
    assert not seq.has_tree  # a spent budget grows no tree


def test_stop_id_ends_the_round(backend, eagle3_golden):
    want = list(eagle3_golden.base.generate_greedy(PROMPTS[0], 30))
    stop = want[9]
    first = want.index(stop)
    got, _, seq = _generate(backend, PROMPTS[0], 30, stops={stop})
    assert got == want[: first + 1]
    assert not seq.has_tree


def test_capacity_is_checked_before_every_infer(backend):
    seq = Eagle3Sequence(backend, SamplingSpec())
    with pytest.raises(Eagle3CapacityError, match=r"max_cache_size=256") as err:
        seq.prefill([3] * 250, 10)  # the draft's tree levels would write 250 + 4 x 8 positions
    assert err.value.role == "draft" and err.value.end > 256 and err.value.capacity == 256
    with pytest.raises(Eagle3CapacityError, match=r"base MXQ.*257 tokens.*max_cache_size=256"):
        Eagle3Sequence(backend, SamplingSpec()).prefill([3] * 257, 1)


def test_displaced_kv_is_detected(backend):
    a = Eagle3Sequence(backend, SamplingSpec())
    a.prefill(PROMPTS[0], 20)
    Eagle3Sequence(backend, SamplingSpec()).prefill(PROMPTS[1], 20)
    with pytest.raises(KvDisplaced):
        a.round(10)


@pytest.mark.parametrize("spec", [SamplingSpec(0.8), SamplingSpec(1.0, top_k=20), SamplingSpec(0.7, top_p=0.9),
                                  SamplingSpec(1.2, top_k=5, top_p=0.5)])
def test_sampling_gives_valid_tokens(backend, spec):
    got, per, _ = _generate(backend, PROMPTS[1], 25, spec)
    assert len(got) == 25 and all(0 <= t < backend.vocab_size for t in got)


# ------------------------------------------------------------------------------------ the runner
def _new(req_id, prompt, max_tokens, computed=0, temperature=0.0, eos=None, stop_ids=None):
    params = SimpleNamespace(max_tokens=max_tokens, temperature=temperature, top_k=0, top_p=1.0,
                             eos_token_id=eos, stop_token_ids=stop_ids or [])
    return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, sampling_params=params, num_computed_tokens=computed,
                           prompt_embeds=None, mm_features=[], block_ids=([],))


def _so(new=(), cached=(), sched=None, finished=(), resumed=(), all_ids=None):
    return SimpleNamespace(
        finished_req_ids=set(finished), preempted_req_ids=set(), scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                                              new_block_ids=[None for _ in cached],
                                              resumed_req_ids=set(resumed), all_token_ids=all_ids or {}),
        num_scheduled_tokens=dict(sched or {}))


class _VllmView:
    """What vLLM's scheduler does with a step's tokens: append until max_tokens, schedule the new
    ones (at most ``budget`` per step), through the step engine over ``runner``."""

    def __init__(self, runner, req_id, prompt, max_tokens, budget=16):
        from vllm_npu.step_engine import StepEngine

        self.runner = StepEngine(runner)
        self.rid, self.prompt, self.max_tokens, self.budget = req_id, prompt, max_tokens, budget
        self.out: list[int] = []
        self.computed = 0
        self.chunks: list[int] = []

    def run(self, resume_at: int | None = None) -> list[int]:
        first = True
        while len(self.out) < self.max_tokens:
            tokens = self.prompt + self.out
            n = min(self.budget, len(tokens) - self.computed)
            if first:
                so = _so(new=[_new(self.rid, self.prompt, self.max_tokens)], sched={self.rid: n})
                first = False
            else:
                so = _so(cached=[(self.rid, self.computed)], sched={self.rid: n})
            result = self.runner.execute(so)
            self.computed += n
            new = list(result.sampled_token_ids[0])
            if new:
                self.chunks.append(len(new))
            for t in new:  # vLLM's check_stop, token by token
                self.out.append(t)
                if len(self.out) >= self.max_tokens:
                    break
            if resume_at is not None and len(self.out) >= resume_at:
                resume_at = None
                self.computed = 0
                so = _so(cached=[(self.rid, 0)], sched={self.rid: min(self.budget, len(self.prompt + self.out))},
                         resumed={self.rid}, all_ids={self.rid: self.prompt + self.out})
                self.computed = min(self.budget, len(self.prompt + self.out))
                result = self.runner.execute(so)
                new = list(result.sampled_token_ids[0])
                if new:
                    self.chunks.append(len(new))
                self.out += new
        self.runner.execute(_so(finished=[self.rid]))
        return self.out


@pytest.mark.parametrize("max_tokens,budget", [(30, 16), (9, 16), (30, 3), (1, 16)])
def test_runner_steps_as_vllm_schedules_them(backend, eagle3_golden, max_tokens, budget):
    pytest.importorskip("vllm")
    from vllm_npu.mblt.eagle3_serving import Eagle3Runner

    runner = Eagle3Runner(backend, 256)
    view = _VllmView(runner, "r1", PROMPTS[1], max_tokens, budget)
    out = view.run()
    assert out == list(eagle3_golden.base.generate_greedy(PROMPTS[1], max_tokens))
    assert len(out) == max_tokens  # the runner never returned more than the budget left
    if max_tokens > 1:
        assert max(view.chunks) > 1
    assert runner.totals["requests"] == 1 and not view.runner.reqs


def test_runner_restarts_a_preempted_request(backend, eagle3_golden):
    pytest.importorskip("vllm")
    from vllm_npu.mblt.eagle3_serving import Eagle3Runner

    runner = Eagle3Runner(backend, 256)
    view = _VllmView(runner, "r2", PROMPTS[0], 25, 64)
    assert view.run(resume_at=8) == list(eagle3_golden.base.generate_greedy(PROMPTS[0], 25))


def test_runner_refuses_prompt_embeddings(backend):
    pytest.importorskip("vllm")
    from vllm_npu.mblt.eagle3_serving import Eagle3Runner
    from vllm_npu.step_engine import StepEngine

    req = _new("r3", [1, 2], 4)
    req.prompt_embeds = np.zeros((2, 4))
    with pytest.raises(ValueError, match="token prompts only"):
        StepEngine(Eagle3Runner(backend, 256)).execute(_so(new=[req], sched={"r3": 2}))


# ------------------------------------------------------------------------------------ release rules
def _copy(release: Path, tmp_path: Path, **changes) -> tuple[Path, dict]:
    d = tmp_path / "rel"
    shutil.copytree(release, d)
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    for k, v in changes.items():
        (gen if k == "num_assistant_tokens" else cfg)[k] = v
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d, cfg


@pytest.mark.parametrize("changes,error,match", [
    ({"num_assistant_tokens": 1}, Eagle3ReleaseError, "num_assistant_tokens must be >= 2"),
    ({"base_mxq_path": "mxq/none.mxq"}, Eagle3ReleaseError, "base_mxq_path='mxq/none.mxq' names no file"),
    ({"draft_core_mode": "multi"}, MbltConfigError, "draft_core_mode='multi'"),
    ({"fc_dev_no": -1}, MbltConfigError, "fc_dev_no=-1"),
    ({"npu_prefill_chunk_size": 0}, Eagle3ReleaseError, "npu_prefill_chunk_size=0"),
    ({"draft_config": None}, Eagle3ReleaseError, "draft_config=None"),
])
def test_release_rules(release, tmp_path, changes, error, match):
    d, cfg = _copy(release, tmp_path, **changes)
    with pytest.raises(error, match=match):
        Eagle3Release.read(d, cfg)


def test_unprefixed_layout_keys_fan_out(release, tmp_path):
    d, cfg = _copy(release, tmp_path)
    for role in ("base", "draft", "fc"):
        cfg.pop(f"{role}_dev_no", None)
    cfg["dev_no"] = 1
    cfg["fc_dev_no"] = 0
    r = Eagle3Release.read(d, cfg)
    assert (r.placement["base"].dev, r.placement["draft"].dev, r.placement["fc"].dev) == (1, 1, 0)
    # the loader extra config's unprefixed keys fan out too, and its prefixed ones win
    from vllm_npu.mblt.eagle3_backend import loader_layout
    from vllm_npu.mblt.settings import parse_loader_extra_config

    extra = loader_layout(parse_loader_extra_config({"dev_no": 2, "target_cores": ["2:1:3"], "draft_dev_no": 0,
                                                     "draft_target_cores": ["0:0:1"]}))
    r = Eagle3Release.read(d, cfg, extra)
    assert r.placement["base"] == r.placement["fc"] and r.placement["base"].dev == 2
    assert r.placement["base"].cores == ((1, 3),) and r.placement["draft"].cores == ((0, 1),)
    with pytest.raises(MbltConfigError, match="base_target_clusters"):
        Eagle3Release.read(d, cfg, {"target_clusters": ["0:1"]})


def test_max_model_len_rule():
    pytest.importorskip("vllm")
    from vllm_npu.mblt.platform import eagle3_max_model_len

    assert eagle3_max_model_len(256, 256, 5, 8) == 226  # the draft's 4 levels of 8 need 32 - 2 positions
    assert eagle3_max_model_len(100, 4096, 5, 8) == 100


def test_request_refusals_name_each_parameter():
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams

    from vllm_npu.mblt.platform import MbltPlatform, MbltRequestError

    MbltPlatform._validate_eagle3({"type": "token"}, SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                                    max_tokens=4, stop=["x"], stop_token_ids=[3]))
    cases = {"logprobs": {"logprobs": 2}, "prompt_logprobs": {"prompt_logprobs": 1},
             "presence_penalty": {"presence_penalty": 0.5}, "frequency_penalty": {"frequency_penalty": 0.5},
             "repetition_penalty": {"repetition_penalty": 1.2}, "min_p": {"min_p": 0.1}, "min_tokens": {"min_tokens": 2},
             "seed": {"seed": 1}, "logit_bias": {"logit_bias": {1: 1.0}}, "allowed_token_ids": {"allowed_token_ids": [1]},
             "bad_words": {"bad_words": ["x"]}, "n": {"n": 2}}
    for name, kw in cases.items():
        with pytest.raises(MbltRequestError, match=rf"unsupported here: {name}\.") as err:
            MbltPlatform._validate_eagle3({"type": "token"}, SamplingParams(**kw))
        assert err.value.parameter == name
    with pytest.raises(MbltRequestError, match="seed, logit_bias") as err:
        MbltPlatform._validate_eagle3({"type": "token"}, SamplingParams(seed=2, logit_bias={1: 1.0}))
    assert err.value.parameter == "seed"
    with pytest.raises(MbltRequestError, match="token prompts only") as err:
        MbltPlatform._validate_eagle3({"type": "embeds", "prompt_embeds": object()}, SamplingParams())
    assert err.value.parameter == "prompt_embeds"


# ------------------------------------------------------------------------------------ the vendor's loop
def test_rounds_equal_transformers_mblt_on_the_same_mxqs(release, backend):
    """transformers-mblt 0.6.1's own ``eagle3_prefill`` / ``eagle3_decode_step`` (unpatched, on the
    simulator as its ``qbruntime``) settle the same tokens per round as ours, greedy."""
    import sys
    import warnings

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers_mblt")
    from npusim import alias

    if alias.status("qbruntime").state == "real":
        pytest.skip("a real qbruntime is installed")
    alias.activate("qbruntime")
    try:
        import transformers_mblt
        from transformers import AutoModelForCausalLM
        from transformers_mblt.utils.cache_utils import MobilintEagle3Cache

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers_mblt.register()
        model = AutoModelForCausalLM.from_pretrained(str(release))
        model.configure_eagle3_tree()
        for prompt in PROMPTS:
            n = 30
            cache = MobilintEagle3Cache(*model.get_cache_mxq_models())
            cache.reset()
            theirs = [[int(model.eagle3_prefill(torch.tensor([prompt]), cache, logits_processor=None,
                                                max_new_tokens=n))]]
            while sum(map(len, theirs)) < n:
                step = model.eagle3_decode_step(cache, logits_processor=None,
                                                max_new_tokens=n - sum(map(len, theirs)) + 1, eos_token_id=None)
                theirs.append(step.tokens[0, 1:].tolist() + ([] if step.next_token is None else [int(step.next_token)]))
                if step.next_token is None:
                    break
            seq = Eagle3Sequence(backend, SamplingSpec())
            ours = [[seq.prefill(prompt, n)]]
            while sum(map(len, ours)) < n:
                res = seq.round(n - sum(map(len, ours)) + 1)
                ours.append(res.tokens[1:] + ([] if res.stopped else [res.next_token]))
                if res.stopped:
                    break
            assert ours == theirs
    finally:
        alias.deactivate("qbruntime")
        for name in [m for m in sys.modules if m.split(".")[0] in ("qbruntime", "transformers_mblt", "mblt_npu")]:
            del sys.modules[name]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_bases_serve_greedy_equal_to_plain_decoding(arch, tmp_path):
    """The Qwen2 (q/k/v biases, tied head) and Qwen3 (q/k norms) families of EAGLE-3 release:
    ``make-model --eagle3`` of that base, ``mxq compile --eagle3`` (tree 3/4/16), the plugin's rounds
    on the simulator give the base's plain greedy decoding, with some draft tokens accepted."""
    import npusim.mxq as runtime
    from npusim.llm import Decoder
    from npusim.mxq.compile import compile_artifact
    from npusim.tinymodel.eagle3 import build_eagle3

    hf = build_eagle3(tmp_path / "hf", base_arch=arch)
    rel = compile_artifact(hf, tmp_path / "rel", max_cache_size=128, prefill_chunk_size=16,
                           eagle3={"tree_depth": 3, "tree_top_k": 4, "num_assistant_tokens": 16})
    artifact = json.loads((rel / "config.json").read_text())
    assert artifact["model_type"] == f"mobilint-{arch}-eagle3"
    b = Eagle3Backend.create(runtime, Eagle3Release.read(rel, artifact))
    try:
        golden = Decoder.from_pretrained(hf)
        accepted = 0
        for prompt in PROMPTS[:2]:
            got, _, seq = _generate(b, prompt, 24)
            assert got == list(golden.generate_greedy(prompt, 24))
            accepted += seq.accepted_total
        assert accepted > 0
    finally:
        b.dispose()
