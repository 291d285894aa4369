"""End to end: ``NPU_HARNESS_TARGET=mblt-sim vllm serve <MXQ artifact>`` through the OpenAI API.

Issue 4 §3: completions and chat, streaming and not, with the ``openai`` client against a real
server process; greedy token ids equal the golden decoder (``npusim.llm.Decoder``) and
``transformers``. Also: concurrency, the platform's request refusals (HTTP 400), the KV-capacity
start-up check, bad ``--model-loader-extra-config``, a release kind not served yet (Qwen2-VL),
the scheduler plan log, NPU event tracing
(``VLLM_TORCH_PROFILER_DIR``) and ``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0``.

One healthy server serves every request test (it runs with tracing and penalties-off, which
greedy requests do not notice). Five short-lived ``vllm serve`` processes that must refuse to
start (or only have to print their scheduler plan) run concurrently with its start-up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _openai_serve import client_for  # noqa: E402
from _openai_serve import extra as _extra  # noqa: E402
from npu_conformance import vllm_server  # noqa: E402
from npusim import tinymodel  # noqa: E402
from npusim.llm import Decoder  # noqa: E402
from npusim.mxq.compile import compile_artifact  # noqa: E402

N_NEW = 12
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away there lived",
    "1 2 3 4 5",
    "Mobilint NPUs run quantized language models",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]
CHUNKS = {"single": 64, "global4": 256}
TRACE_NAME = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.mblt_npu_rank0\.(?P<ns>\d+)\.json$")
PENALTY_WARNING = "Sampling penalties are disabled by VLLM_MBLT_ENABLE_SAMPLING_PENALTIES"
SIDE_TIMEOUT_S = 240


# ----------------------------------------------------------------------------- artifacts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mblt-serve")
    hf = tinymodel.build("llama", root / "hf")
    main = compile_artifact(hf, root / "art", max_batch_size=4, prefill_chunk_size=CHUNKS, core_mode="single")
    small = compile_artifact(hf, root / "small", max_batch_size=4, max_cache_size=256,
                             prefill_chunk_size=CHUNKS, core_mode="single")
    k1 = compile_artifact(hf, root / "k1auto", max_batch_size=1, prefill_chunk_size=CHUNKS, core_mode="auto")
    return {"root": root, "hf": Path(hf), "main": main, "small": small, "k1": k1}


@pytest.fixture(scope="module")
def golden(artifacts):
    """``golden(prompt_ids, n)`` -> the golden decoder's greedy continuation (memoized)."""
    dec = Decoder.from_pretrained(artifacts["hf"])
    memo: dict[tuple, list[int]] = {}

    def run(ids, n=N_NEW):
        key = (tuple(ids), n)
        if key not in memo:
            memo[key] = [int(t) for t in dec.generate_greedy(list(ids), n)]
        return memo[key]

    return run


@pytest.fixture(scope="module")
def hf_greedy(artifacts):
    """``hf_greedy(prompt_ids, n)`` -> transformers' greedy continuation (no early EOS stop)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(artifacts["hf"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def run(ids, n=N_NEW):
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, x.shape[1]:].tolist()

    return run


@pytest.fixture(scope="module")
def tokenizer(artifacts):
    # a str: once transformers-mblt is imported in this process (test_transformers_mblt.py), it parses
    # Mobilint configs, and its from_dict keeps a Path argument in the config, which then fails to print
    return transformers.AutoTokenizer.from_pretrained(str(artifacts["main"]))


# ----------------------------------------------------------------------------- servers


class _Side:
    """A ``vllm serve`` expected to exit (or only to log its plan), run in the background."""

    def __init__(self, model: Path, args: list[str], log: Path, until: str | None = None) -> None:
        port = vllm_server.free_port()
        args = ["serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), *args]
        self.log = log
        self.until = until
        self._fh = open(log, "w")  # noqa: SIM115 - closed in wait()
        # its own process group: stop() ends the engine-core child with it
        self.proc = vllm_server.popen_vllm(args, stdout=self._fh.fileno(), new_session=True,
                                           env=vllm_server.vllm_env("mblt-sim"))
        self.seen = threading.Event()
        if until:  # stop it as soon as the line is logged: it need not finish starting
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            if self.until in self.text():
                self.seen.set()
                self.stop_process()
                return
            time.sleep(0.5)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self) -> tuple[int | None, str]:
        """(exit code, log); with ``until``, stop the process once that text is logged (code None)."""
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        try:
            while self.proc.poll() is None and time.monotonic() < deadline and not self.seen.is_set():
                time.sleep(0.5)
            if self.until:
                return (None if self.seen.is_set() else self.proc.poll()), self.text()
            return self.proc.poll(), self.text()
        finally:
            self.stop()

    def stop_process(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s (a server interrupted while its
        engine core is still starting may not exit on SIGTERM)."""
        if self.proc.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        self.stop_process()
        if not self._fh.closed:
            self._fh.close()


@pytest.fixture(scope="module")
def side_runs(artifacts):
    root = artifacts["root"]
    # a Mobilint multimodal release of a model type the plugin does not serve (a Qwen2.5-VL-like
    # config: vision + text MXQs, scaled down)
    vlm = root / "qwen2_5_vl_release"
    vlm.mkdir(exist_ok=True)
    (vlm / "config.json").write_text(json.dumps({
        "model_type": "mobilint-qwen2_5_vl", "architectures": ["MobilintQwen2_5_VLForConditionalGeneration"],
        "vision_config": {"mxq_path": "vision.mxq"}, "text_config": {"mxq_path": "text.mxq", "hidden_size": 128},
    }))
    runs = {
        "unsupported_release": _Side(vlm, [], root / "qwen2_5_vl_release.log"),
        "too_long": _Side(artifacts["small"], ["--max-model-len", "512"], root / "too_long.log"),
        # the seed's quick-start command (no --max-model-len) on an artifact whose config declares
        # more positions (1024) than its MXQ holds (256): it must start, clamped
        "clamped": _Side(artifacts["small"], [], root / "clamped.log", until="MBLT backend:"),
        "bad_loader": _Side(artifacts["main"], ["--model-loader-extra-config", '{"dev_no": "x"}'],
                            root / "bad_loader.log"),
        "global4": _Side(artifacts["k1"], ["--model-loader-extra-config", '{"core_mode": "global4"}'],
                         root / "global4.log", until="MBLT platform: worker"),
    }
    yield runs
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="module")
def server(artifacts, side_runs, tmp_path_factory):  # noqa: ARG001 - side runs start first
    trace_dir = tmp_path_factory.mktemp("traces")
    env = vllm_server.vllm_env("mblt-sim", VLLM_TORCH_PROFILER_DIR=str(trace_dir),
                               VLLM_MBLT_ENABLE_SAMPLING_PENALTIES="0")
    # --max-logprobs -1: the full-vocabulary logprobs=-1 requests of vLLM's own tests
    srv = vllm_server.start(artifacts["main"], ["--max-logprobs", "-1"], env=env, log=artifacts["root"] / "serve.log")
    srv.trace_dir = trace_dir
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)




def _complete_ids(client, server, prompt, n=N_NEW, **kw):
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True}, **kw)
    ch = r.choices[0]
    return list(_extra(ch, "prompt_token_ids")), list(_extra(ch, "token_ids")), ch


def _assert_text(text, decoded):
    """The server's text is the decoded ids, except that vLLM's detokenizer holds back a
    trailing incomplete UTF-8 sequence (decoded as U+FFFD) when generation stops."""
    assert text == decoded or (decoded.endswith("\ufffd") and decoded.rstrip("\ufffd") == text), (text, decoded)


def _assert_greedy(prompt_ids, out_ids, golden, hf_greedy, what):
    gold = golden(prompt_ids, len(out_ids))
    assert out_ids == gold, f"{what}: server {out_ids} != golden decoder {gold}"
    hf = hf_greedy(prompt_ids, len(out_ids))
    assert out_ids == hf, f"{what}: server {out_ids} != transformers {hf}"


# ----------------------------------------------------------------------------- correctness


def test_scheduler_plan_logged(server):
    """The artifact (K=4, chunk single=64) plans max_num_seqs 4 and 4 x 64 batched tokens."""
    log = server.log_text()
    assert "max_num_seqs 4, max_num_batched_tokens 256" in log, log[-3000:]
    assert "chunk=64 tokens, max_num_batched_tokens=256" in log
    # vllm serve's default max_num_seqs (256) is not the user's: no clamp warning (issue 20 §2.3)
    assert "Clamping scheduler max_num_seqs" not in log
    assert "Setting scheduler max_num_seqs to model-configured max batch size 4." in log


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completion_greedy_matches_golden_and_transformers(client, server, tokenizer, golden, hf_greedy, prompt):
    prompt_ids, out_ids, ch = _complete_ids(client, server, prompt)
    assert prompt_ids == tokenizer(prompt)["input_ids"]
    assert len(out_ids) == N_NEW and ch.finish_reason == "length"
    _assert_text(ch.text, tokenizer.decode(out_ids))
    _assert_greedy(prompt_ids, out_ids, golden, hf_greedy, f"completion {prompt!r}")


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completion_stream_greedy_matches(client, server, golden, hf_greedy, prompt):
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                       stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids, out_ids, text, finish = None, [], "", None
    for chunk in stream:
        ch = chunk.choices[0]
        prompt_ids = prompt_ids or _extra(ch, "prompt_token_ids")
        out_ids += list(_extra(ch, "token_ids") or [])
        text += ch.text
        finish = ch.finish_reason or finish
    assert finish == "length" and len(out_ids) == N_NEW
    _assert_greedy(list(prompt_ids), out_ids, golden, hf_greedy, f"stream completion {prompt!r}")
    # the streamed text equals the non-streamed one
    _p, solo_ids, solo = _complete_ids(client, server, prompt)
    assert solo_ids == out_ids and solo.text == text


@pytest.mark.parametrize("messages", CHATS)
def test_chat_greedy_matches_golden_and_transformers(client, server, tokenizer, golden, hf_greedy, messages):
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=N_NEW, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = list(_extra(r, "prompt_token_ids"))
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(templated, dict) or hasattr(templated, "input_ids"):
        templated = templated["input_ids"]
    assert prompt_ids == list(templated), "server's chat prompt differs from the tokenizer's chat template"
    out_ids = list(_extra(r.choices[0], "token_ids"))
    assert len(out_ids) == N_NEW
    _assert_text(r.choices[0].message.content, tokenizer.decode(out_ids, skip_special_tokens=True))
    _assert_greedy(prompt_ids, out_ids, golden, hf_greedy, f"chat {messages!r}")


@pytest.mark.parametrize("messages", CHATS)
def test_chat_stream_greedy_matches(client, server, golden, hf_greedy, messages):
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=N_NEW,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids, out_ids, text, finish = None, [], "", None
    for chunk in stream:
        prompt_ids = prompt_ids or _extra(chunk, "prompt_token_ids")
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        out_ids += list(_extra(ch, "token_ids") or [])
        text += ch.delta.content or ""
        finish = ch.finish_reason or finish
    assert finish == "length" and len(out_ids) == N_NEW
    assert prompt_ids, "the stream carried no prompt_token_ids"
    _assert_greedy(list(prompt_ids), out_ids, golden, hf_greedy, f"stream chat {messages!r}")


def test_concurrent_requests_equal_solo(client, server, golden):
    """8 threads at once (twice max_num_seqs: batching, queueing and chunked prefill interleave);
    each answer equals the same prompt served alone, and the golden decoder."""
    prompts = [f"{p} #{i}" + " and so on" * (i * 7) for i, p in enumerate(PROMPTS * 2)]
    solo = {p: _complete_ids(client, server, p)[1:] for p in prompts}
    barrier = threading.Barrier(len(prompts))

    def one(p):
        barrier.wait()
        return _complete_ids(client, server, p)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    assert max(len(r[0]) for r in results) > 64, "some prompt should need several prefill chunks"
    for p, (prompt_ids, out_ids, ch) in zip(prompts, results):
        assert ch.finish_reason == "length"
        assert out_ids == solo[p][0], f"concurrent {p!r}: {out_ids} != solo {solo[p][0]}"
        assert out_ids == golden(prompt_ids)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_logprob_token_ids_are_served_as_the_golden_log_softmax(client, server, golden_log_softmax, stream):
    """``logprob_token_ids`` (once refused): vLLM's sampler gathers the named tokens' logprobs;
    they equal the golden decoder's log-softmax at the first generated position."""
    prompt = list(range(40, 60))
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1,
                                    stream=stream, extra_body={"logprob_token_ids": [5, 6]})
    chunks = list(out) if stream else [out]
    tops = [t for c in chunks for ch in c.choices if ch.logprobs for t in (ch.logprobs.top_logprobs or [])]
    got = sorted(tops[0].values())
    want = golden_log_softmax(prompt)[-1]
    for tok in (5, 6):
        assert any(abs(v - want[tok]) < 2e-4 for v in got), (tok, want[tok], got)


def test_prompt_over_max_model_len_is_http_400(client, server, golden):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=list(range(5, 5 + 1025)), max_tokens=4, temperature=0)
    assert "maximum context length is 1024" in str(info.value)
    _assert_healthy(client, server, golden)


def _assert_healthy(client, server, golden):
    assert server.alive()
    assert server.request("GET", "/health").status == 200
    prompt_ids, out_ids, _ = _complete_ids(client, server, PROMPTS[3], n=6)
    assert out_ids == golden(prompt_ids, 6)


# ----------------------------------------------------------------------------- logprobs


@pytest.fixture(scope="module")
def golden_log_softmax(artifacts):
    """``golden_log_softmax(ids)`` -> the golden decoder's log-softmax after each position
    ``[len(ids), vocab]`` (float64)."""
    import numpy as np

    dec = Decoder.from_pretrained(artifacts["hf"])

    def run(ids):
        x = dec.prefill(list(ids), dec.new_cache(len(ids))).astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))

    return run


#: |served - golden| bound on a logprob (nats): float32 forward passes of the same weights, fed
#: in chunks (served) or whole (golden).
LOGPROB_ATOL = 2e-4


def _echo(client, server, prompt, n=2, logprobs=1):
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0, echo=True,
                                  logprobs=logprobs, extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0]


def test_echo_logprobs_equal_golden_for_every_prompt_position(client, server, golden, golden_log_softmax):
    """lm-eval's loglikelihood request (``echo`` + ``logprobs``): the first prompt token has no
    logprob, every other one is the golden decoder's log-softmax of it given the tokens before,
    and the generated tokens are golden. Served by the 1-token microstep path (the MXQ emits
    the last position's logits), which the server log names."""
    prompt = PROMPTS[1] + " and then" * 30  # longer than the 64-token prefill chunk
    ch = _echo(client, server, prompt, n=3, logprobs=2)
    prompt_ids = list(_extra(ch, "prompt_token_ids"))
    out_ids = list(_extra(ch, "token_ids"))
    assert len(prompt_ids) > 64 and out_ids == golden(prompt_ids, 3)
    lp = ch.logprobs.token_logprobs
    assert len(lp) == len(prompt_ids) + 3 and lp[0] is None
    gold = golden_log_softmax(prompt_ids + out_ids)
    for p in range(1, len(prompt_ids) + 3):
        tok = (prompt_ids + out_ids)[p]
        assert abs(lp[p] - gold[p - 1, tok]) <= LOGPROB_ATOL, (p, lp[p], gold[p - 1, tok])
        assert len(ch.logprobs.top_logprobs[p]) >= 2
    log = server.log_text()
    assert "Prompt logprobs on last-logit MBLT/MXQ outputs use a slower 1-token microstep path." in log
    assert re.search(rf"MBLT prompt logprobs for req_id=\S+ \({len(prompt_ids) - 1} positions, top 2\): "
                     r"1-token microsteps", log), log[-3000:]


def test_prompt_logprobs_top_k_equal_golden(server, golden_log_softmax, tokenizer):
    """``prompt_logprobs=3`` (vLLM's field): per position the prompt token and the golden top 3,
    with their ranks."""
    import numpy as np

    res = server.request("POST", "/v1/completions", {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 1,
                                                      "temperature": 0, "prompt_logprobs": 3})
    assert res.status == 200, res
    plp = res.body["choices"][0]["prompt_logprobs"]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    gold = golden_log_softmax(ids)
    for p in range(1, len(ids)):
        entry = {int(k): v for k, v in plp[p].items()}
        top = [int(t) for t in np.argsort(-gold[p - 1], kind="stable")[:3]]
        assert set(top) <= set(entry), (p, top, entry)
        for tok in {ids[p], *top}:
            assert abs(entry[tok]["logprob"] - gold[p - 1, tok]) <= LOGPROB_ATOL
            assert entry[tok]["rank"] == int((gold[p - 1] > gold[p - 1, tok]).sum()) + 1


def test_concurrent_echo_and_ordinary_requests_do_not_disturb_each_other(client, server, golden):
    """4 echo+logprobs requests and 4 ordinary ones at once (K=4 slots: queueing, batching and
    microsteps interleave): every echo answer equals the same request alone, every ordinary
    answer is golden."""
    echo_prompts = [f"{p} echo {i}" + " again" * (i * 9) for i, p in enumerate(PROMPTS)]
    plain_prompts = [f"{p} plain {i}" + " more" * (i * 11) for i, p in enumerate(PROMPTS)]
    solo = {p: _echo(client, server, p) for p in echo_prompts}
    barrier = threading.Barrier(8)

    def echo(p):
        barrier.wait()
        return _echo(client, server, p)

    def plain(p):
        barrier.wait()
        return _complete_ids(client, server, p)

    with ThreadPoolExecutor(8) as pool:
        echoes = [pool.submit(echo, p) for p in echo_prompts]
        plains = [pool.submit(plain, p) for p in plain_prompts]
        for p, fut in zip(echo_prompts, echoes):
            ch = fut.result()
            assert ch.logprobs.token_logprobs == solo[p].logprobs.token_logprobs, p
            assert list(_extra(ch, "token_ids")) == list(_extra(solo[p], "token_ids"))
        for fut in plains:
            prompt_ids, out_ids, _ch = fut.result()
            assert out_ids == golden(prompt_ids)
    _assert_healthy(client, server, golden)


def test_chat_echo_without_logprobs_is_served(client, server, golden):
    """vLLM's chat protocol turns ``echo`` into ``prompt_logprobs = top_logprobs`` (0): once
    refused as "prompt_logprobs=0", a parameter the client never sent. Now it is served: the
    answer echoes the last message and its generated tokens are golden."""
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, I am"}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"echo": True, "return_token_ids": True, "ignore_eos": True,
                                                   "add_generation_prompt": False, "continue_final_message": True})
    prompt_ids = list(_extra(r, "prompt_token_ids"))
    out_ids = list(_extra(r.choices[0], "token_ids"))
    assert out_ids == golden(prompt_ids, 6)
    # vLLM echoes a final assistant message, and (as on its native backend) returns the
    # prompt's logprobs that echo implied
    assert r.choices[0].message.content.startswith(messages[-1]["content"]), r.choices[0].message.content
    plp = _extra(r, "prompt_logprobs")
    assert plp is not None and len(plp) == len(prompt_ids) and plp[0] is None


def test_logprobs_minus_one_is_the_full_vocabulary(client, server, golden, golden_log_softmax, tokenizer):
    """``logprobs=-1`` (completions) and ``top_logprobs=-1`` (chat) mean the whole vocabulary in
    vLLM. They once killed the engine (``IndexError`` in the worker); now chat returns every
    token's logprob, completions the golden values, and the server stays healthy."""
    r = client.chat.completions.create(model=server.model, messages=CHATS[0], max_tokens=2, temperature=0,
                                       logprobs=True, top_logprobs=-1,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    vocab = len(golden_log_softmax([5])[0])
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == vocab for c in content), [len(c.top_logprobs) for c in content]
    ch = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=3, temperature=0, logprobs=-1,
                                   extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    prompt_ids, out_ids = list(_extra(ch, "prompt_token_ids")), list(_extra(ch, "token_ids"))
    assert out_ids == golden(prompt_ids, 3)
    gold = golden_log_softmax(prompt_ids + out_ids)
    for i, tok in enumerate(out_ids):
        assert abs(ch.logprobs.token_logprobs[i] - gold[len(prompt_ids) - 1 + i, tok]) <= LOGPROB_ATOL
    _assert_healthy(client, server, golden)


# ----------------------------------------------------------------------------- lm-eval as the client

LM_EVAL_TASK_DIR = Path(__file__).with_name("lm_eval_tiny")


def _lm_eval_reference(tokenizer, golden_log_softmax, doc: dict) -> list[float]:
    """Per choice, the summed logprob of ``" " + choice`` after ``context``, tokenized as lm-eval
    does for a causal API model (no special tokens; continuation = whole[len(context):])."""
    sums = []
    for choice in doc["choices"]:
        ctx = tokenizer(doc["context"], add_special_tokens=False).input_ids
        whole = tokenizer(doc["context"] + " " + choice, add_special_tokens=False).input_ids
        lsm = golden_log_softmax(whole)
        sums.append(float(sum(lsm[i - 1, whole[i]] for i in range(len(ctx), len(whole)))))
    return sums


def test_lm_eval_local_completions_scores_equal_the_golden_decoder(server, artifacts, tokenizer, golden_log_softmax,
                                                                   tmp_path):
    """lm-evaluation-harness (pinned) with its ``local-completions`` model against this server: a
    24-item multiple-choice loglikelihood task from local files (``lm_eval_tiny/``). Every
    choice's loglikelihood equals the golden decoder's within 24 x LOGPROB_ATOL, and ``acc``
    equals the golden decoder's accuracy exactly."""
    import subprocess
    import sys

    data = LM_EVAL_TASK_DIR / "tiny_choice.jsonl"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(
        (LM_EVAL_TASK_DIR / "tiny_choice.yaml.in").read_text(encoding="utf-8").replace("DATA_FILE", str(data)),
        encoding="utf-8")
    out = tmp_path / "out"
    model_args = ",".join([f"model={server.model}", f"base_url={server.base}/v1/completions",
                           "tokenizer_backend=huggingface", f"tokenizer={artifacts['main']}",
                           "tokenized_requests=True", "num_concurrent=4", "max_retries=1"])
    # lm-eval and the packages only it needs live off sys.path (requirements/lm-eval.txt), so that
    # no vLLM process of the suite imports scikit-learn/SciPy/pandas; its client process adds them.
    extras = Path(sys.prefix) / "extras" / "lm-eval"
    assert (extras / "lm_eval").is_dir(), f"lm-eval is not in {extras} (ci/setup.sh installs requirements/lm-eval.txt)"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(extras), os.environ.get("PYTHONPATH", "")])))
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                           "--tasks", "tiny_choice", "--include_path", str(tasks), "--output_path", str(out),
                           "--log_samples"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    [results] = list(out.rglob("results_*.json"))
    [samples] = list(out.rglob("samples_tiny_choice_*.jsonl"))
    acc = json.loads(results.read_text())["results"]["tiny_choice"]["acc,none"]
    docs = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    rows = {r["doc_id"]: r for r in map(json.loads, samples.read_text(encoding="utf-8").splitlines())}
    assert sorted(rows) == list(range(len(docs)))
    correct = 0
    for i, doc in enumerate(docs):
        want = _lm_eval_reference(tokenizer, golden_log_softmax, doc)
        got = [float(r[0][0]) for r in rows[i]["resps"]]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 24 * LOGPROB_ATOL, (i, got, want)
        correct += int(max(range(len(want)), key=want.__getitem__) == doc["gold"])
    assert acc == correct / len(docs)


# ----------------------------------------------------------------------------- penalties switch


def test_penalties_disabled_warns_once_and_is_ignored(client, server, golden):
    for _ in range(2):
        prompt_ids, out_ids, _ch = _complete_ids_penalty(client, server, PROMPTS[0])
        assert out_ids == golden(prompt_ids), "with penalties off, repetition_penalty must not change greedy output"
    log = server.log_text()
    assert log.count(PENALTY_WARNING) == 1, log[-3000:]
    assert "repetition_penalty" in log[log.index(PENALTY_WARNING):][:400]


def _complete_ids_penalty(client, server, prompt):
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              "repetition_penalty": 1.3})
    ch = r.choices[0]
    return list(_extra(ch, "prompt_token_ids")), list(_extra(ch, "token_ids")), ch


# ----------------------------------------------------------------------------- tracing


def test_npu_trace_via_profile_endpoints(client, server, golden):
    trace_dir: Path = server.trace_dir
    assert server.request("POST", "/start_profile").status == 200
    # vLLM 0.32's front end refuses a second start while a session is active (409 Conflict,
    # ProfilerAlreadyActiveError) before it reaches the worker; the MBLT tracer's own refusal
    # (one qbruntime trace per process) is unit-tested in test_mblt_tracing.py.
    second = server.request("POST", "/start_profile")
    assert second.status == 409, second
    assert server.alive() and server.request("GET", "/health").status == 200
    prompt_ids, out_ids, _ = _complete_ids(client, server, PROMPTS[1], n=4)
    assert out_ids == golden(prompt_ids, 4)
    assert server.request("POST", "/stop_profile").status == 200

    files = [p for p in trace_dir.iterdir() if TRACE_NAME.match(p.name)]
    assert len(files) == 1, sorted(p.name for p in trace_dir.iterdir())
    m = TRACE_NAME.match(files[0].name)
    assert int(m["pid"]) != server.proc.pid, "the trace is written by the engine-core (worker) process"
    events = json.loads(files[0].read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"infer", "run npu"} <= names, names
    assert all({"name", "ph", "ts", "pid", "tid"} <= set(e) for e in events)
    log = server.log_text()
    assert f"Wrote MBLT NPU trace: {files[0]}" in log

    # /stop_profile with nothing running: vLLM 0.32 answers 200 (the seed's vllm-mblt notes
    # a 500 from the front-end profiler); the MBLT worker only logs, and the server stays up.
    again = server.request("POST", "/stop_profile")
    assert again.status == 200, again
    assert "No MBLT NPU trace of rank 0 is recording; nothing to stop." in server.log_text()
    _assert_healthy(client, server, golden)


# ----------------------------------------------------------------------------- start-up checks


def test_max_model_len_over_kv_capacity_refuses_to_start(side_runs):
    code, log = side_runs["too_long"].wait()
    assert code is not None and code != 0, log[-3000:]
    line = next((ln for ln in log.splitlines() if "exceeds the KV capacity" in ln), "")
    assert "512" in line and "256" in line, log[-3000:]


def test_max_model_len_is_clamped_to_kv_capacity_when_not_given(side_runs):
    code, log = side_runs["clamped"].wait()
    assert code is None, log[-3000:]  # the worker loaded the MXQ: no refusal
    assert "max_model_len clamped from 1024 (the artifact's config) to 256, the KV capacity of" in log, log[-3000:]
    assert "KV capacity 256 tokens" in log and "exceeds the KV capacity" not in log, log[-3000:]


def test_bad_loader_extra_config_refuses_to_start(side_runs):
    code, log = side_runs["bad_loader"].wait()
    assert code is not None and code != 0, log[-3000:]
    assert re.search(r"dev_no=.?'x'", log), log[-3000:]


def test_unsupported_multimodal_release_refuses_to_start_naming_it(side_runs):
    """A Mobilint multimodal release of a model type the plugin does not serve stops before vLLM
    parses its config (and before any inference), naming the type and the served ones, not with
    an unknown-model error."""
    code, log = side_runs["unsupported_release"].wait()
    assert code is not None and code != 0, log[-3000:]
    assert "MobilintUnsupportedModelType" in log, log[-3000:]
    assert ("model_type 'mobilint-qwen2_5_vl' is a multimodal release the MBLT plugin does not serve; its "
            "multimodal releases are mobilint-qwen3_asr, mobilint-qwen2_vl, mobilint-qwen3_vl") in log, log[-3000:]


def test_core_mode_override_picks_its_chunk(side_runs):
    """K=1 artifact compiled core_mode auto: ``{"core_mode": "global4"}`` → chunk 256."""
    code, log = side_runs["global4"].wait()
    assert code is None, log[-3000:]
    assert "core_mode=global4" in log, log[-3000:]
    assert "chunk=256 tokens, max_num_batched_tokens=256" in log, log[-3000:]
