"""``NPU_HARNESS_TARGET=rbln-sim vllm serve <tiny llama> --model-impl vllm`` on a Rebel100
(``RBLN-CR13``): vLLM's own ``LlamaForCausalLM`` compiled with ``rebel``'s torch.compile backend
(the simulator's), tested with the ``openai`` client against the real server (one server for
the module).

Greedy outputs must equal the golden decoder (``npusim.llm``), which equals vLLM's own CPU
output for these models. The server runs a prefill chunk of 128 tokens, KV blocks of 128, decode
buckets [1, 2, 4] and vLLM's prefix caching, so the tests also see the chunked prefill, the
padded decode buckets and a prefix hit, and that no graph is compiled after warm-up.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest

openai = pytest.importorskip("openai")

from npu_conformance import vllm_server as vs  # noqa: E402

from _openai_serve import chat_greedy_ids, client_for, start_or_fail  # noqa: E402
from _openai_serve import extra as _extra  # noqa: E402
from _openai_serve import prompt_ids as _prompt  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ["--model-impl", "vllm", "--max-model-len", "1024", "--block-size", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--rbln-decode-batch-bucket-limit", "3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from npusim import tinymodel

    return tinymodel.build("llama", tmp_path_factory.mktemp("llama") / "m", head_dim=64)


@pytest.fixture(scope="module")
def golden(model_dir):
    from npusim.llm import Decoder

    return Decoder.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_or_fail(model_dir, ARGS, tmp_path_factory.mktemp("rbln-vllm"), "rbln-sim",
                        RBLN_FORCE_NPU_NAME="RBLN-CR13", NPUSIM_RBLN=json.dumps({"devices": ["RBLN-CR13"]}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def _ids(client, server, prompt, n=12):
    res = client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    return _extra(res.choices[0], "token_ids")


def test_the_vllm_path_was_taken_and_warmed_up(server):
    log = server.log_text()
    assert "RBLN model path: vllm" in log
    assert "RBLN vllm model path: LlamaForCausalLM loaded" in log
    assert "prefill chunk 128, decode buckets [1, 2, 4], KV blocks" in log
    assert re.search(r"RBLN warm-up: 4 graphs compiled in [\d.]+ s", log), "prefill + 3 decode buckets"


def test_completions_equal_golden_with_a_chunked_prompt(client, server, golden):
    for prompt in (_prompt(7, 1), _prompt(600, 2)):
        assert _ids(client, server, prompt) == golden.generate_greedy(prompt, 12)
    assert "RBLN prefill: 600 tokens in 5 chunks of 128" in server.log_text()


def test_chat_equals_golden_over_the_templated_prompt(client, server, golden):
    prompt, out = chat_greedy_ids(client, server, "Name three colours.", 10)
    assert out == golden.generate_greedy(prompt, 10)


def test_concurrent_requests_run_on_padded_buckets(client, server, golden):
    prompts = [_prompt(20 + i, 10 + i) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda p: _ids(client, server, p, 24), prompts))
    for p, g in zip(prompts, got):
        assert g == golden.generate_greedy(p, 24)
    layouts = {(int(r), int(b)) for r, b in
               re.findall(r"RBLN decode: (\d+) rows on the batch-(\d+) graph", server.log_text())}
    for rows, batch in layouts:
        assert batch == min(b for b in (1, 2, 4) if b >= rows), f"{rows} rows ran on batch {batch}"
    assert any(r < b for r, b in layouts), f"no padded decode among {sorted(layouts)}"


def test_streamed_completion_equals_golden(server, golden):
    prompt = _prompt(40, 3)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    streamed = []
    for event in vs.stream_lines(server, "/v1/completions", body):
        for choice in event.get("choices", []):
            streamed.extend(choice.get("token_ids") or [])
    assert streamed == golden.generate_greedy(prompt, 16)


def test_a_prefix_hit_reads_vllms_shared_blocks(client, server, golden):
    base = _prompt(300, 17)
    before = server.log_text()
    first = _ids(client, server, base, 8)
    second_prompt = base[:256] + _prompt(30, 18)
    second = _ids(client, server, second_prompt, 8)
    assert first == golden.generate_greedy(base, 8)
    assert second == golden.generate_greedy(second_prompt, 8)
    log = server.log_text()[len(before):]
    assert re.search(r"RBLN prefix cache: req \S+ reuses 256 of 286 tokens", log), log[-2000:]


def test_host_sampling_and_prompt_logprobs_compile_no_graph_after_warm_up(client, server):
    # prompt logprobs: the LM head of every row of each prefill chunk (the graphs are the same)
    scored = client.completions.create(model=server.model, prompt="hi there, you", max_tokens=1, temperature=0,
                                       echo=True, logprobs=1)
    token_logprobs = scored.choices[0].logprobs.token_logprobs
    assert token_logprobs[0] is None and all(isinstance(x, float) for x in token_logprobs[1:])
    # vLLM's logits processors run in the vllm path's host sampler too: +100 forces the token
    forced = client.completions.create(model=server.model, prompt="hi", max_tokens=4, temperature=0,
                                       logit_bias={"123": 100}, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
    assert forced.choices[0].token_ids == [123] * 4
    assert client.completions.create(model=server.model, prompt="hi", max_tokens=2).choices
    log = server.log_text()
    assert "RBLN recompile" not in log and "RblnRecompileError" not in log
