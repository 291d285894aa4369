"""End to end: ``NPU_HARNESS_TARGET=mblt-sim vllm serve <Mixture-of-Experts release>`` (issue 13 §1).

The tiny Qwen3-MoE release of ``npu-harness mxq compile`` (2 layers, 8 experts, top-2; packs and
index; placed on 3 simulated cards as the release is; chunk and width 16) served by a real vLLM
server through the MBLT plugin. Greedy output equals the golden decoder's token for token (the
experts are summed in finish order, the default, which moves logits by < 1e-5). Also: streaming,
concurrent requests (run one at a time), prompt logprobs on the 1-token microstep path, repeated
prefixes (snapshots of every layer's KV), the ``max_model_len`` clamp, an over-long prompt
(HTTP 400, the server lives on), and start-up rules in short-lived side runs: the batch refusal,
an explicit ``--max-model-len`` above the shared MXQs' capacity, placement overrides (and the
log line saying unprefixed layout keys are not used).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("vllm")

from _side_serve import SideServe  # noqa: E402
from npu_conformance import vllm_server  # noqa: E402
from vllm_npu.mblt.moe_backend import BATCH_REFUSAL  # noqa: E402
from vllm_npu.mblt.worker import MICROSTEP_WARNING  # noqa: E402

N_NEW = 10
PROMPTS = [[1, 5, 9, 33, 70, 2, 11], [(13 * i + 7) % 1000 + 1 for i in range(40)],
           [(7 * i + 3) % 1000 + 1 for i in range(100)]]
MACHINE = json.dumps({"devices": 3})
CAPACITY = 4096  # the shared MXQs' KV capacity, as the release's (its config declares 40960)
DECLARED = 40960


@pytest.fixture(scope="module")
def side_runs(moe_release, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-side")
    release = moe_release()
    env = {"NPUSIM_MXQ": MACHINE}
    runs = {
        "batch": SideServe(release, ["--model-loader-extra-config", '{"max_batch_size": 2}'], root / "batch.log",
                           env=env),
        "too_long": SideServe(release, ["--max-model-len", "8192"], root / "too_long.log", env=env),
        "placed": SideServe(release, ["--model-loader-extra-config",
                                      json.dumps({"lm_head_target_cores": ["1:0:1"], "num_expert_workers": 4,
                                                  "expert_sum_order": "expert", "dev_no": 0})],
                            root / "placed.log", until="MBLT MoE release:", env=env),
    }
    yield runs
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="module")
def server(moe_release, side_runs, tmp_path_factory):  # noqa: ARG001 - the side runs start first
    env = vllm_server.vllm_env("mblt-sim", NPUSIM_MXQ=MACHINE)
    srv = vllm_server.start(moe_release(), [], env=env, log=tmp_path_factory.mktemp("moe-log") / "serve.log")
    yield srv
    srv.stop()


def test_greedy_equals_golden(server, moe_golden):
    for ids in PROMPTS:
        assert vllm_server.greedy_ids(server, ids, N_NEW) == moe_golden.generate_greedy(ids, N_NEW)


def test_streaming_equals_the_whole_answer(server):
    payload = {"model": server.model, "prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    whole = server.request("POST", "/v1/completions", payload)
    assert whole.status == 200, whole
    pieces = [c["choices"][0]["text"] for c in vllm_server.stream_lines(server, "/v1/completions", payload)
              if c.get("choices")]
    assert len(pieces) >= N_NEW // 2 and "".join(pieces) == whole.body["choices"][0]["text"]


def test_concurrent_requests_run_one_at_a_time_and_stay_golden(server, moe_golden):
    prompts = [PROMPTS[1][i:] + [i + 50] for i in range(4)]
    barrier = threading.Barrier(len(prompts))

    def run(ids):
        barrier.wait()
        return vllm_server.greedy_ids(server, ids, N_NEW)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(run, prompts))
    assert got == [moe_golden.generate_greedy(p, N_NEW) for p in prompts]


def test_prompt_logprobs_take_the_microstep_path(server, moe_golden):
    """The release emits only the last position's logits, so each prompt position is scored by a
    1-token step (the plugin says so once in its log); values equal the golden log-softmax."""
    ids = PROMPTS[1][:24]
    res = server.request("POST", "/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": 1,
                                                     "temperature": 0, "prompt_logprobs": 1})
    assert res.status == 200, res
    plp = res.body["choices"][0]["prompt_logprobs"]
    logits = moe_golden.prefill(ids, moe_golden.new_cache(64)).astype(np.float64)
    logsm = logits - logits.max(-1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = {int(k): v for k, v in plp[p].items()}
        assert abs(entry[ids[p]]["logprob"] - logsm[p - 1, ids[p]]) <= 1e-4, p
    assert MICROSTEP_WARNING in server.log_text()


def test_repeated_prefixes_stay_golden_and_snapshots_count_every_layer(server, moe_golden):
    """A snapshot holds both layers' KV: 2 x 2 MiB (float32 KV of 2 heads x 4096 x 32, K and V)."""
    base = PROMPTS[2][:64]
    for ids in (base, base + [5, 6, 7], base[:48] + [9] * 20, base):
        assert vllm_server.greedy_ids(server, ids, 4) == moe_golden.generate_greedy(ids, 4)
    assert "finished prefix snapshots (4 MiB each" in server.log_text()


def test_max_model_len_is_clamped_to_the_shared_kv_capacity(server):
    models = server.request("GET", "/v1/models")
    assert models.status == 200 and models.body["data"][0]["max_model_len"] == CAPACITY
    assert f"max_model_len clamped from {DECLARED} (the release's config) to {CAPACITY}" in server.log_text()


def test_an_over_long_prompt_is_refused_and_the_server_lives_on(server, moe_golden):
    res = server.request("POST", "/v1/completions", {"model": server.model, "prompt": [5] * (CAPACITY + 8),
                                                     "max_tokens": 1})
    assert res.status == 400 and str(CAPACITY) in json.dumps(res.body), res
    assert vllm_server.greedy_ids(server, PROMPTS[0], 3) == moe_golden.generate_greedy(PROMPTS[0], 3)


def test_batch_serving_is_refused(side_runs):
    code, log = side_runs["batch"].result()
    assert code not in (None, 0), log[-3000:]
    assert BATCH_REFUSAL.format(n=2) in log, log[-3000:]


def test_an_explicit_max_model_len_above_the_capacity_is_refused(side_runs):
    code, log = side_runs["too_long"].result()
    assert code not in (None, 0), log[-3000:]
    assert (f"max_model_len=8192 exceeds the KV capacity of the Mixture-of-Experts release's shared MXQs "
            f"({CAPACITY} tokens per cache id). Pass --max-model-len {CAPACITY} or lower.") in log, log[-3000:]


def test_placement_overrides_and_the_unprefixed_key_notice(side_runs):
    code, log = side_runs["placed"].result()
    assert code is None, log[-3000:]
    assert "lm_head on device 1; 4 expert workers, expert outputs summed in expert order" in log, log[-3000:]
    assert "unprefixed layout keys ['dev_no'] are not used for Mixture-of-Experts releases" in log, log[-3000:]
