"""End to end: ``NPU_HARNESS_TARGET=mblt-sim vllm serve <EAGLE-3 release>`` (issue 13 §2).

The tiny EAGLE-3 release (llama base, one-block draft; base and draft KV 256 tokens, chunk 16,
the vendor's tree 5/8/64) served by a real vLLM server through the MBLT plugin's speculative
rounds. Greedy output equals the golden base decoder's plain greedy continuation token for token
(several prompts, ``max_tokens`` cuts inside a round, an EOS and a stop id); a stream arrives
with chunks of several tokens; every refused sampling parameter gets HTTP 400 naming it and the
server serves on; prefix caching is off (log line); ``max_model_len`` is clamped to what the base
and draft capacities serve; sampled requests complete with valid tokens; each request logs its
figures. Start-up rules in short side runs: the batch refusal, an explicit ``--max-model-len``
above the limit.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _side_serve import SideServe  # noqa: E402
from npu_conformance import vllm_server  # noqa: E402
from vllm_npu.mblt.eagle3_backend import BATCH_REFUSAL  # noqa: E402
from vllm_npu.mblt.platform import EAGLE3_PREFIX_CACHE_OFF, eagle3_max_model_len  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 70, 2, 11], [(13 * i + 7) % 1000 + 1 for i in range(40)], [42, 17]]
LIMIT = eagle3_max_model_len(256, 256, 5, 8)  # 226


@pytest.fixture(scope="module")
def server(eagle3_release, tmp_path_factory):
    env = vllm_server.vllm_env("mblt-sim")
    # --enable-prompt-embeds: vLLM then passes prompt embeddings on, so their refusal is the plugin's
    srv = vllm_server.start(eagle3_release(), ["--enable-prompt-embeds"], env=env,
                            log=tmp_path_factory.mktemp("eagle3-log") / "serve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def side_runs(eagle3_release, server, tmp_path_factory):  # noqa: ARG001 - after the main server is up
    root = tmp_path_factory.mktemp("eagle3-side")
    release = eagle3_release()
    runs = {
        "batch": SideServe(release, ["--model-loader-extra-config", '{"max_batch_size": 2}'], root / "batch.log"),
        "too_long": SideServe(release, ["--max-model-len", "256"], root / "too_long.log"),
    }
    yield runs
    for run in runs.values():
        run.stop()


def _ids(server, prompt, n, **params):
    res = server.complete(prompt, n, return_token_ids=True, **params)
    return vllm_server.completion_ids(res), res


def test_greedy_equals_plain_base_decoding(server, eagle3_golden):
    for ids in PROMPTS:
        assert vllm_server.greedy_ids(server, ids, 24) == list(eagle3_golden.base.generate_greedy(ids, 24))


@pytest.mark.parametrize("n", [1, 2, 5, 11])
def test_max_tokens_cut_inside_a_round(server, eagle3_golden, n):
    got, res = _ids(server, PROMPTS[1], n, ignore_eos=True, temperature=0)
    assert got == list(eagle3_golden.base.generate_greedy(PROMPTS[1], n))
    assert res.body["choices"][0]["finish_reason"] == "length"


def test_stop_ids_end_the_request(server, eagle3_golden):
    want = list(eagle3_golden.base.generate_greedy(PROMPTS[0], 24))
    stop = want[7]
    got, res = _ids(server, PROMPTS[0], 24, ignore_eos=True, temperature=0, stop_token_ids=[stop])
    assert got == want[: want.index(stop) + 1]
    assert res.body["choices"][0]["finish_reason"] == "stop"
    # the model's EOS (id 0 in the tiny release) through eos_token_id, when the continuation has it
    eos = json.loads((Path(server.model) / "generation_config.json").read_text())["eos_token_id"]
    ref = list(eagle3_golden.base.generate_greedy(PROMPTS[2], 40))
    got, _ = _ids(server, PROMPTS[2], 40, temperature=0)
    assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def test_stream_arrives_several_tokens_per_chunk(server, eagle3_golden):
    payload = {"model": server.model, "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}
    chunks = [c["choices"][0].get("token_ids") or [] for c in vllm_server.stream_lines(server, "/v1/completions",
                                                                                          payload) if c.get("choices")]
    tokens = [t for c in chunks for t in c]
    assert tokens == list(eagle3_golden.base.generate_greedy(PROMPTS[1], 30))
    assert max(len(c) for c in chunks) > 1, chunks


@pytest.mark.parametrize("name,params", [
    ("logprobs", {"logprobs": 2}), ("prompt_logprobs", {"prompt_logprobs": 1}),
    ("presence_penalty", {"presence_penalty": 0.5}), ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.2}), ("min_p", {"min_p": 0.1}), ("min_tokens", {"min_tokens": 2}),
    ("seed", {"seed": 3}), ("logit_bias", {"logit_bias": {"5": 1.0}}), ("allowed_token_ids", {"allowed_token_ids": [5]}),
    ("bad_words", {"bad_words": ["a"]}), ("structured_outputs", {"response_format": {"type": "json_object"}}),
])
def test_refusals_name_the_parameter_and_the_server_serves_on(server, eagle3_golden, name, params):
    res = server.request("POST", "/v1/completions", {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 3,
                                                     **params})
    assert res.status == 400, res
    assert name in json.dumps(res.body), res.body
    assert vllm_server.greedy_ids(server, PROMPTS[0], 3) == list(eagle3_golden.base.generate_greedy(PROMPTS[0], 3))


def test_prompt_embeddings_are_refused(server):
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(3, 128), buf)
    res = server.request("POST", "/v1/completions", {"model": server.model, "prompt_embeds":
                                                     base64.b64encode(buf.getvalue()).decode(), "max_tokens": 2})
    assert res.status == 400, res
    assert "EAGLE-3 models take token prompts only, without prompt embeddings or multimodal data." in str(res.body), res
    assert server.healthy()


def test_sampled_requests_complete_with_valid_tokens(server):
    for params in ({"temperature": 0.8}, {"temperature": 1.0, "top_k": 20}, {"temperature": 0.7, "top_p": 0.9}):
        got, res = _ids(server, PROMPTS[1], 20, ignore_eos=True, **params)
        assert len(got) == 20 and all(0 <= t < 1024 for t in got), res.body


def test_prefix_caching_is_off_and_max_model_len_clamped(server):
    log = server.log_text()
    assert EAGLE3_PREFIX_CACHE_OFF in log
    assert "prefix caching off" in log
    models = server.request("GET", "/v1/models")
    assert models.status == 200 and models.body["data"][0]["max_model_len"] == LIMIT
    assert f"max_model_len clamped from 1024 (the release's config) to {LIMIT}" in log


def test_each_request_logs_its_figures(server):
    vllm_server.greedy_ids(server, PROMPTS[0], 12)
    time.sleep(1)
    lines = re.findall(r"MBLT EAGLE-3 req_id=\S+: (\d+) tokens, (\d+) rounds, (\d+) draft tokens accepted of (\d+) "
                       r"verified \(([\d.]+)%\), ([\d.]+) tokens per round", server.log_text())
    assert lines
    tokens, rounds, accepted, verified, _pct, per_round = lines[-1]
    assert int(rounds) >= 1 and int(accepted) <= int(verified) and float(per_round) >= 1.0


def test_batch_serving_is_refused(side_runs):
    code, log = side_runs["batch"].result()
    assert code not in (None, 0), log[-3000:]
    assert BATCH_REFUSAL.format(n=2) in log, log[-3000:]


def test_an_explicit_max_model_len_above_the_limit_is_refused(side_runs):
    code, log = side_runs["too_long"].result()
    assert code not in (None, 0), log[-3000:]
    assert f"max_model_len=256 exceeds what the EAGLE-3 release serves: {LIMIT} tokens" in log, log[-3000:]
