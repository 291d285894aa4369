"""``NPU_HARNESS_TARGET=neuron-sim vllm serve <tiny llama>`` with the Neuron plugin, tested with
the ``openai`` client against the real server (one server per module).

The NEFFs are compiled at warm-up by the simulated compiler (``npusim.neff``) and executed on
the golden decoder; greedy outputs must equal ``npusim.llm`` token for token. Covered:
completions (short, and a prompt segmented over two 512-token prefill steps), chat over the
templated prompt, streaming equal to unstreamed, raw logprobs equal to the golden decoder's
log-softmax (tolerance 1e-4), a parameter on-device sampling refuses (HTTP 400 naming it), and
``/metrics``: the padding histograms and NEFF execution counters move as requests are served.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from _openai_serve import chat_greedy_ids, client_for, start_or_fail  # noqa: E402
from _openai_serve import extra as _extra  # noqa: E402
from _openai_serve import prompt_ids as _prompt  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
        "--block-size", "32", "--num-gpu-blocks-override", "256"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from npusim import tinymodel

    return tinymodel.build("llama", tmp_path_factory.mktemp("neuron-llama") / "m")


@pytest.fixture(scope="module")
def golden(model_dir):
    from npusim.llm import Decoder

    return Decoder.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_or_fail(model_dir, ARGS, tmp_path_factory.mktemp("neuron-serve"), "neuron-sim")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def _counter(server, name: str, bucket: str) -> float:
    text = str(server.request("GET", "/metrics").body)
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and f'bucket_name="{bucket}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completions_equal_golden_short_and_segmented(client, server, golden):
    before = _counter(server, "vllm_neuron:neff_execution_count_total", "prefill_s512_kv512")
    for prompt in (_prompt(7, 1), _prompt(700, 2)):
        res = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert _extra(res.choices[0], "token_ids") == golden.generate_greedy(prompt, 12)
    after = _counter(server, "vllm_neuron:neff_execution_count_total", "prefill_s512_kv512")
    assert after - before == 3, "7 tokens take one prefill segment, 700 tokens two"
    log = server.log_text()
    assert "Segmented prefill auto-enabled" in log and "Model warmup completed: 1 num_batched_tokens_buckets" in log


def test_chat_equals_golden_over_the_templated_prompt(client, server, golden):
    prompt, out = chat_greedy_ids(client, server, "Name three colours.", 10)
    assert out == golden.generate_greedy(prompt, 10)


def test_streamed_completion_and_chat_equal_unstreamed(client, server):
    prompt = _prompt(40, 3)
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0)
    parts = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text
    msgs = [{"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0)
    parts = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0,
                                           stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content


def test_logprobs_equal_golden_log_softmax(client, server, golden):
    prompt = _prompt(20, 4)
    res = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = _extra(res.choices[0], "token_ids")
    cache = golden.new_cache(64)
    logits = golden.prefill(prompt, cache)[-1]
    for step, tok in enumerate(ids):
        x = logits.astype(np.float64)
        lsm = x - (np.log(np.exp(x - x.max()).sum()) + x.max())
        got = res.choices[0].logprobs.token_logprobs[step]
        assert abs(got - lsm[tok]) < 1e-4, (step, got, lsm[tok])
        assert len(res.choices[0].logprobs.top_logprobs[step]) >= 3
        logits = golden.prefill([tok], cache)[-1]


def test_n_samples_are_served_with_on_device_sampling(client, server, golden):
    """vLLM fans ``n`` out into child requests before the worker (it refuses ``n`` > 1 only for
    temperature 0): with ``top_k`` 1 the three children are the golden greedy tokens; three
    seeded samples at temperature 1 come back alike when sent again."""
    prompt = _prompt(12, 5)
    res = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=1.0, top_p=1.0, n=3,
                                    extra_body={"top_k": 1, "return_token_ids": True, "ignore_eos": True})
    want = golden.generate_greedy(prompt, 6)
    assert [_extra(c, "token_ids") for c in res.choices] == [want] * 3

    def sampled():
        res = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=1.0, n=3,
                                        seed=3, extra_body={"return_token_ids": True, "ignore_eos": True})
        return sorted(tuple(_extra(c, "token_ids")) for c in res.choices)

    first = sampled()
    assert len(first) == 3 and all(len(t) == 6 for t in first) and sampled() == first


def test_refused_parameter_is_a_400_naming_it(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=4, presence_penalty=0.5)
    assert "presence_penalty" in str(info.value) and "on-device sampling" in str(info.value)
    assert client.completions.create(model=server.model, prompt="hi", max_tokens=2).choices


def test_metrics_move_as_requests_are_served(client, server):
    before = _counter(server, "vllm_neuron:num_seqs_padding_count", "decode_b1")
    client.completions.create(model=server.model, prompt=_prompt(9, 5), max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _counter(server, "vllm_neuron:num_seqs_padding_count", "decode_b1")
    assert after - before == 5, "6 tokens: one from the prefill, five decode steps of one request"
    text = str(server.request("GET", "/metrics").body)
    assert re.search(r'^vllm_neuron:num_batched_tokens_padding_bucket\{.*le="512.0".*\} [1-9]', text, re.M)
