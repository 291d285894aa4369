"""``NPU_HARNESS_TARGET=rbln-sim vllm serve <tiny model>`` with the RBLN plugin's ``transformers``
(optimum) model path, tested with the ``openai`` client against the real server.

The servers compile at engine start with the vendor's optimum-rbln on ``npusim.rbln`` (one
server per model, per module). Greedy outputs must equal the golden decoder (``npusim.llm``).

* llama, flash attention: ``--max-model-len 2048 --block-size 1024`` (two KV partitions per
  sequence, automatic KV blocks), prompts that cross the partition boundary, chat, streaming,
  a refused parameter;
* qwen3, eager attention (``--block-size`` = ``--max-model-len``): completions.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from _openai_serve import chat_greedy_ids, client_for, start_or_fail  # noqa: E402
from _openai_serve import extra as _extra  # noqa: E402
from _openai_serve import prompt_ids as _prompt  # noqa: E402

pytestmark = pytest.mark.slow


def _start(model, args, tmp_path_factory, name):
    return start_or_fail(model, args, tmp_path_factory.mktemp(name), "rbln-sim")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from npusim import tinymodel

    return tinymodel.build("llama", tmp_path_factory.mktemp("llama") / "m", head_dim=64,
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def llama_server(llama_dir, tmp_path_factory):
    srv = _start(llama_dir, ["--max-model-len", "2048", "--block-size", "1024", "--max-num-seqs", "2"],
                 tmp_path_factory, "rbln-llama")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llama_golden(llama_dir):
    from npusim.llm import Decoder

    return Decoder.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def client(llama_server):
    return client_for(llama_server)


def test_flash_attention_completions_equal_golden(client, llama_server, llama_golden):
    for prompt in (_prompt(7, 1), _prompt(1030, 2)):  # the second crosses the 1024 partition
        res = client.completions.create(model=llama_server.model, prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        got = _extra(res.choices[0], "token_ids")
        assert got == llama_golden.generate_greedy(prompt, 12)
    log = llama_server.log_text()
    assert "attention flash_attn" in log and "KV blocks of 1024 tokens" in log


def test_chat_equals_golden_over_the_templated_prompt(client, llama_server, llama_golden):
    prompt, out = chat_greedy_ids(client, llama_server, "Name three colours.", 10)
    assert out == llama_golden.generate_greedy(prompt, 10)


def test_streamed_completion_equals_unstreamed(client, llama_server):
    prompt = _prompt(40, 3)
    whole = client.completions.create(model=llama_server.model, prompt=prompt, max_tokens=16, temperature=0)
    parts = client.completions.create(model=llama_server.model, prompt=prompt, max_tokens=16, temperature=0,
                                      stream=True)
    text = "".join(c.choices[0].text for c in parts if c.choices)
    assert text == whole.choices[0].text


def test_prompt_logprobs_equal_golden(client, llama_server, llama_golden):
    """The compiled prefill returns the last position's logits: the worker prefills the first
    prompt token and feeds each later one through the batch-1 decoder, scoring each."""
    import numpy as np

    prompt = _prompt(12, 9)
    res = client.completions.create(model=llama_server.model, prompt=prompt, max_tokens=1, temperature=0,
                                    echo=True, logprobs=1)
    got = res.choices[0].logprobs.token_logprobs[1:len(prompt)]
    logits = np.asarray(llama_golden.prefill(prompt, llama_golden.new_cache(len(prompt))), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = [logits[i - 1, prompt[i]] - logz[i - 1] for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from npusim import tinymodel
    from npusim.llm import Decoder

    d = tinymodel.build("qwen3", tmp_path_factory.mktemp("qwen3") / "m", head_dim=64)
    srv = _start(d, ["--max-model-len", "512", "--block-size", "512", "--max-num-seqs", "2",
                     "--rbln-optimum-overrides", json.dumps({"decoder_batch_sizes": [2, 1]})],
                 tmp_path_factory, "rbln-qwen3")
    yield srv, Decoder.from_pretrained(d)
    srv.stop()


def test_qwen3_eager_completions_equal_golden(qwen3):
    srv, golden = qwen3
    c = client_for(srv)
    for prompt in (_prompt(5, 4), _prompt(300, 5)):
        res = c.completions.create(model=srv.model, prompt=prompt, max_tokens=10, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
        assert _extra(res.choices[0], "token_ids") == golden.generate_greedy(prompt, 10)
    assert "attention eager" in srv.log_text()
