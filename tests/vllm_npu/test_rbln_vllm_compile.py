"""Static shapes on the RBLN ``vllm`` model path: what is compiled when, counted.

``vllm.LLM`` (vLLM's own ``Qwen3ForCausalLM``, ``--model-impl vllm`` on ``RBLN-CR13``, manual
decode buckets [1, 3]) runs in a child process (the ``rebel`` alias is chosen at interpreter
start); the child reaches the worker through ``LLM.collective_rpc`` and prints what it saw:

* with warm-up (the default), exactly the prefill graph and one graph per bucket compile
  before the first request, greedy outputs equal the golden decoder (with one injected device
  fault on the way, retried), and nothing compiles while serving;
* a shape warm-up did not compile (a decode of 2 rows) is refused under
  ``VLLM_RBLN_COMPILE_STRICT_MODE`` (the default) with :class:`RblnRecompileError` naming the
  shape and the compiled ones; with strict mode off it compiles once, counted as a recompile;
* with ``VLLM_RBLN_ENABLE_WARM_UP=0`` each shape compiles at its first use, counted;
* the compile cache: the first run writes the configuration's mega-cache bundle after warm-up,
  the second start of the same configuration loads it and every compile is a hit (the
  simulator's ``compiled_graphs()`` records say so).
"""

from __future__ import annotations

import json
import re

import pytest

from npu_conformance import prefork
from npu_conformance import vllm_server as vs

pytestmark = pytest.mark.slow

CHILD = r'''
import json, sys
import numpy as np

def worker(w):
    return getattr(w, "worker", w)

def stats(w):
    return dict(worker(w).stats)

def decode2(w):
    try:
        worker(w)._call("decode", np.zeros(2, np.int64), np.zeros(2, np.int64), [[], []])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"

def cached(w):
    from npusim.rbln.core import torch_compile
    return [r.from_cache for r in torch_compile.compiled_graphs()]

def lax(w):
    worker(w).strict = False
    return decode2(w)

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, model_impl="vllm", max_model_len=512, block_size=64, max_num_seqs=3,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3,
              additional_config={"decode_batch_bucket_strategy": "manual",
                                 "decode_batch_bucket_manual_buckets": [1, 3]})
    out = {"after_start": llm.collective_rpc(stats)[0]}
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10,
                                                                                   ignore_eos=True))
    out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
    out["after_generate"] = llm.collective_rpc(stats)[0]
    out["from_cache"] = llm.collective_rpc(cached)[0]
    if sys.argv[3] == "warm":
        out["strict"] = llm.collective_rpc(decode2)[0]
        out["lax"] = llm.collective_rpc(lax)[0]
        out["lax_again"] = llm.collective_rpc(decode2)[0]
        out["after_lax"] = llm.collective_rpc(stats)[0]
    print("NPU_HARNESS_RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from npusim import tinymodel
    from npusim.llm import Decoder

    d = tinymodel.build("qwen3", tmp_path_factory.mktemp("qwen3") / "m", head_dim=64)
    return d, Decoder.from_pretrained(d)


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 150)), [11, 12, 13]]


def _run(model_dir, mode, tmp_path, cache, fault=None, **env):
    sim = {"devices": ["RBLN-CR13"], **({"fault": fault} if fault else {})}
    env = vs.vllm_env("rbln-sim", VLLM_CACHE_ROOT=str(cache), RBLN_FORCE_NPU_NAME="RBLN-CR13",
                      NPUSIM_RBLN=json.dumps(sim), VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # as ``python child.py ...`` would run, forked from the prefork zygote (npu_conformance.prefork)
    proc = prefork.run_script(script, [str(model_dir), json.dumps(PROMPTS), mode], env=env, timeout=600,
                              cwd=tmp_path)
    mark = "NPU_HARNESS_RESULT "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(lines[-1][len(mark):]), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def warm_run(model, tmp_path_factory):
    """The warm-up run, on a fresh compile cache (kept for the next start of the module)."""
    work = tmp_path_factory.mktemp("warm")
    cache = tmp_path_factory.mktemp("vllm-cache")
    # the 6th device call (the 3rd after the 3 of warm-up) fails once: the worker retries it
    out, log = _run(model[0], "warm", work, cache, fault={"after_calls": 5, "times": 1})
    return out, log, cache


def test_warm_up_compiles_every_bucket_and_strict_mode_refuses_a_new_shape(model, warm_run):
    _model_dir, golden = model
    out, log, _cache = warm_run
    assert out["tokens"] == [golden.generate_greedy(p, 10) for p in PROMPTS]
    assert out["after_start"]["compiles"] == 3, "the prefill graph and buckets 1 and 3"
    assert out["after_generate"]["compiles"] == 3 and out["after_generate"]["recompiles"] == 0
    assert out["after_generate"]["padded_rows"] > 0, "3 prompts finishing apart leave 2 rows on bucket 3"
    assert out["after_generate"]["retries"] == 1 and re.search(r"RBLN (prefill|decode) of \d+ tokens failed; "
                                                               r"retrying once: .*injected fault", log)
    assert out["strict"].startswith("RblnRecompileError: RBLN: a decode of 2 tokens needs a graph warm-up did "
                                    "not compile (compiled: [('decode', 1), ('decode', 3), ('prefill', 64)]); "
                                    "VLLM_RBLN_COMPILE_STRICT_MODE forbids recompiles after warm-up"), out["strict"]
    assert out["lax"] == "ok" and out["lax_again"] == "ok"
    assert out["after_lax"]["compiles"] == 4 and out["after_lax"]["recompiles"] == 1
    assert "RBLN recompile #1 after warm-up: decode of 2 tokens" in log
    # a fresh compile cache: every program compiled, then the bundle written after warm-up
    assert out["from_cache"] == [False] * 3
    assert "RBLN compile cache: no mega-cache bundle at" in log and "Saved rbln mega-cache bundle to" in log


def test_without_warm_up_each_shape_compiles_at_first_use_from_the_cache(model, warm_run, tmp_path):
    model_dir, golden = model
    _out, _log, cache = warm_run
    out, log = _run(model_dir, "cold", tmp_path, cache, VLLM_RBLN_ENABLE_WARM_UP="0")
    assert out["tokens"] == [golden.generate_greedy(p, 10) for p in PROMPTS]
    assert out["after_start"]["compiles"] == 0
    # the same configuration: the warm run's bundle is loaded and every program is a hit
    assert re.search(r"Loaded rbln mega-cache bundle from \S+ \(\{'programs': 3", log), log[-3000:]
    assert out["from_cache"] and all(out["from_cache"]), out["from_cache"]
    # the prefill chunk, and the decode buckets the batch used (3, then 1 as requests finish
    # together: ignore_eos makes them finish in the same step, so bucket 1 is never needed)
    assert 2 <= out["after_generate"]["compiles"] <= 3 and out["after_generate"]["recompiles"] == 0
    assert "RBLN recompile" not in log
