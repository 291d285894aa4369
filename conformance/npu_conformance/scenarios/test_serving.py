"""The device-neutral serving suite: every serving target runs these scenarios against a real
``vllm serve`` with the target's plugin, through the OpenAI-compatible HTTP API.

Nothing here is device-specific. A device joins by supplying a lab
(``npu_conformance.devices.<device>``: its artifact and server, the golden decoder on a
simulator, the parameters its plugin refuses, the faults it can inject); see
``docs/conformance.md``. On a ``-hw`` target there is no golden decoder: outputs are compared
with the same request sent alone.

* ``completions_greedy`` / ``chat_greedy``: greedy token ids equal the golden decoder's
  continuation of the prompt's token ids (as the server tokenized them; chat through the
  model's chat template), ``ignore_eos`` so that exactly ``max_tokens`` tokens come back.
* ``completions_streamed`` / ``chat_streamed``: the streamed deltas, concatenated, equal the
  unstreamed text, token ids and finish reason.
* ``load``: :data:`LOAD_REQUESTS` requests of :data:`LOAD_PROMPT_TOKENS` random token ids and
  :data:`LOAD_OUTPUT_TOKENS` greedy tokens from :data:`LOAD_CLIENTS` concurrent clients on
  127.0.0.1. Every request completes, each output equals its solo run (the golden decoder;
  on hardware, the same request re-sent alone for a sample of :data:`LOAD_SOLO_SAMPLE`), and
  the server is healthy after. Figures: requests/s and output tok/s.
* ``hostile_input``: :data:`HOSTILE_CASES` (malformed bodies, out-of-range parameters, bad
  token ids, unknown model, over-length prompts...) plus the device's refused parameters, the
  JSON ones also streamed. Each must be answered within :data:`HOSTILE_TIMEOUT_S` with the
  expected 4xx whose message names the rule, never a 5xx, a ``200`` or a hang, and the server
  must stay healthy after each (a request left unanswered ends the scenario: the rest would only
  time out). Then the same greedy request gives the same tokens as before.
  Figures: cases tried and answered correctly.
* ``logits_processors``: ``logit_bias`` (+100 forces the token), ``min_tokens`` (a forced stop
  token held back for :data:`MIN_TOKENS` tokens), ``allowed_token_ids`` (every token among
  them) and ``min_p`` (1.0 turns seeded random sampling into greedy) take effect on the
  server that samples on the host (``lab.sampler_server``: Neuron's CPU sampling), or are
  refused with a 400 naming them where the lab's plugin refuses them. Figures: served, refused.
* ``structured_outputs``: regex, choice and JSON-schema completions obey their grammar and
  equal the golden decoder's greedy tokens under the same xgrammar mask on a simulator; the
  chat API's ``response_format`` json_schema and a ``tool_choice`` ``required`` tool call are
  valid. On the lab's grammar server (the host sampler's, or Neuron's on-device sampling
  without async scheduling); a 400 naming ``response_format`` where the host-sampling server
  refuses them (Neuron's CPU sampling). Figures: answers, compared with the golden decoder,
  refused.
* ``prompt_embeds``: a prompt sent as its token embeddings decodes the same greedy tokens as
  the prompt sent as ids and as the golden decoder where the lab's plugin takes embeddings
  (MBLT); elsewhere a 400 naming ``prompt_embeds``. Figures: prompts compared, or refused.
* ``prompt_logprobs``: lm-eval's loglikelihood request (``echo`` with ``logprobs``) and
  ``prompt_logprobs``: every target scores every prompt position, equal to the golden decoder's
  log-softmax within :data:`PROMPT_LOGPROBS_TOLERANCE` on a simulator, equal to the same request
  sent alone on hardware, also with greedy requests running beside. Figures: positions compared.
* ``fault_once_retried``: a one-off injected device fault is retried invisibly: concurrent
  requests all equal the golden decoder, and the server log shows the fault struck.
* ``fault_persistent_fails_in_flight``: a persistent device fault gives every request in
  flight an error (streamed: an error event or a cut stream) and never a wrong token.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from npu_conformance import devices
from npu_conformance import vllm_server as vs
from npu_conformance.devices.base import DeviceLab, FaultsUnsupported
from npu_conformance.devices.base import golden_ids as _golden_ids

pytestmark = pytest.mark.scenario(devices=devices.SERVING_DEVICES)

#: Token ids of generated prompts lie in [PROMPT_ID_LOW, PROMPT_ID_HIGH): inside every real
#: vocabulary and the tiny models' 1024, above their special tokens.
PROMPT_ID_LOW, PROMPT_ID_HIGH = 10, 1000
GREEDY_TOKENS = 16
TEXT_PROMPTS = ("The quick brown fox", "Once upon a time in a land far away there lived")
CHATS = (
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
)
LOAD_CLIENTS = 64
LOAD_REQUESTS = 256
LOAD_PROMPT_TOKENS = 64
LOAD_OUTPUT_TOKENS = 32
LOAD_SOLO_SAMPLE = 8
#: Seconds each request of the load may take (queued behind the others included).
LOAD_TIMEOUT_S = 900.0
#: Seconds a hostile request may take before it counts as a hang.
HOSTILE_TIMEOUT_S = 60.0
FAULT_REQUESTS = 4
#: Nats: prompt logprobs against the golden decoder's log-softmax (float32 logits, two softmaxes).
PROMPT_LOGPROBS_TOLERANCE = 2e-4
PROMPT_LOGPROBS_REQUESTS = 4
#: Long enough that no request can finish before the persistent fault strikes at the 10th infer.
FAULT_TOKENS = 200


# ----------------------------------------------------------------------------- helpers


def _lab(device_labs, target) -> DeviceLab:
    try:
        return device_labs(target.name)
    except devices.NoDeviceLab as exc:
        pytest.skip(str(exc))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(PROMPT_ID_LOW, PROMPT_ID_HIGH, size=length).tolist() for _ in range(n)]


def _ok(result: vs.HttpResult) -> dict:
    assert result.status == 200, f"HTTP {result.status}: {result.body}"
    assert isinstance(result.body, dict), result.body
    return result.body


@dataclass(frozen=True)
class Answer:
    """One choice of an answer, streamed or not."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None


def _greedy_body(server: vs.Server, n: int, **fields: Any) -> dict:
    return {"model": server.model, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **fields}


def _plain(server: vs.Server, prompt: str | list[int], n: int, **fields: Any) -> Answer:
    """A greedy completion of ``n`` tokens with ``fields`` (``ignore_eos`` off unless given)."""
    body = _ok(server.request("POST", "/v1/completions",
                              _greedy_body(server, n, prompt=prompt, **{"ignore_eos": False, **fields})))
    choice = body["choices"][0]
    return Answer(choice["text"], list(choice["token_ids"]), list(choice["prompt_token_ids"]), choice["finish_reason"])


def _completion(server: vs.Server, prompt: str | list[int], n: int = GREEDY_TOKENS) -> Answer:
    return _plain(server, prompt, n, ignore_eos=True)


def _chat(server: vs.Server, messages: list[dict], n: int = GREEDY_TOKENS) -> Answer:
    body = _ok(server.request("POST", "/v1/chat/completions", _greedy_body(server, n, messages=messages)))
    choice = body["choices"][0]
    return Answer(choice["message"]["content"] or "", list(choice["token_ids"]), list(body["prompt_token_ids"]),
                  choice["finish_reason"])


def _streamed(server: vs.Server, path: str, body: dict) -> Answer:
    """Concatenate a stream's deltas (text and token ids) into one :class:`Answer`."""
    text, ids, prompt_ids, finish = [], [], [], None
    for event in vs.stream_lines(server, path, body):
        assert "error" not in event, f"error event in a valid stream: {event}"
        if event.get("prompt_token_ids"):
            prompt_ids = list(event["prompt_token_ids"])
        for choice in event.get("choices", []):
            delta = choice.get("delta")
            text.append((delta.get("content") or "") if delta is not None else choice.get("text", ""))
            ids.extend(choice.get("token_ids") or [])
            if choice.get("prompt_token_ids"):
                prompt_ids = list(choice["prompt_token_ids"])
            finish = choice.get("finish_reason") or finish
    return Answer("".join(text), ids, prompt_ids, finish)


def _check_greedy(lab: DeviceLab, answers: list[Answer], record) -> None:
    for a in answers:
        assert a.finish_reason == "length" and len(a.token_ids) == GREEDY_TOKENS, a
        want = _golden_ids(lab, a.prompt_token_ids, GREEDY_TOKENS)
        if want is not None:
            assert a.token_ids == want, f"prompt {a.prompt_token_ids[:6]}...: {a.token_ids} != golden {want}"
    record.figure("requests_compared", len(answers))


# ----------------------------------------------------------------------------- greedy and streaming


def _completion_prompts() -> list[str | list[int]]:
    return [*_prompts(3, 40, seed=1), *TEXT_PROMPTS]


def test_completions_greedy(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    answers = [_completion(server, p) for p in _completion_prompts()]
    _check_greedy(lab, answers, record)
    if lab.golden() is None:  # hardware: the same requests again answer the same
        assert [_completion(server, p) for p in _completion_prompts()] == answers


def test_completions_streamed(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    for prompt in _completion_prompts():
        plain = _completion(server, prompt)
        streamed = _streamed(server, "/v1/completions", _greedy_body(server, GREEDY_TOKENS, prompt=prompt))
        assert streamed.text == plain.text, (streamed.text, plain.text)
        assert streamed.token_ids == plain.token_ids
        assert streamed.finish_reason == plain.finish_reason
    record.figure("streams_compared", len(_completion_prompts()))


def test_chat_greedy(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    answers = [_chat(server, list(m)) for m in CHATS]
    for a in answers:
        assert a.prompt_token_ids, "the chat answer carries no prompt_token_ids"
    _check_greedy(lab, answers, record)


def test_chat_streamed(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    for messages in CHATS:
        plain = _chat(server, list(messages))
        streamed = _streamed(server, "/v1/chat/completions",
                             _greedy_body(server, GREEDY_TOKENS, messages=list(messages)))
        assert streamed == plain, (streamed, plain)
    record.figure("streams_compared", len(CHATS))


# ----------------------------------------------------------------------------- load


def test_load(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    prompts = _prompts(LOAD_REQUESTS, LOAD_PROMPT_TOKENS, seed=100)

    def one(prompt: list[int]) -> list[int] | str:
        body = _greedy_body(server, LOAD_OUTPUT_TOKENS, prompt=prompt)
        try:
            res = server.request("POST", "/v1/completions", body, timeout=LOAD_TIMEOUT_S)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        if res.status != 200:
            return f"HTTP {res.status}: {str(res.body)[:300]}"
        return list(res.body["choices"][0]["token_ids"])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(LOAD_CLIENTS) as ex:
        got = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    failed = [(i, g) for i, g in enumerate(got) if isinstance(g, str)]
    record.figure("requests_completed", LOAD_REQUESTS - len(failed))
    assert not failed, f"{len(failed)} of {LOAD_REQUESTS} requests failed, first: {failed[0]}"
    record.figure("requests_per_s", LOAD_REQUESTS / wall, "req/s")
    record.figure("output_tok_per_s", LOAD_REQUESTS * LOAD_OUTPUT_TOKENS / wall, "tok/s")
    assert all(len(g) == LOAD_OUTPUT_TOKENS for g in got)
    if lab.golden() is not None:
        wrong = [i for i, (p, g) in enumerate(zip(prompts, got)) if g != _golden_ids(lab, p, LOAD_OUTPUT_TOKENS)]
        assert not wrong, f"{len(wrong)} of {LOAD_REQUESTS} outputs differ from the golden decoder, first #{wrong[0]}"
    step = LOAD_REQUESTS // LOAD_SOLO_SAMPLE
    for i in range(0, LOAD_REQUESTS, step):  # the same request alone
        assert one(prompts[i]) == got[i], f"request #{i}: under load {got[i]} != alone"
    assert server.request("GET", "/health").status == 200


# ----------------------------------------------------------------------------- hostile input


@dataclass(frozen=True)
class Hostile:
    """One malformed or abusive request.

    Attributes:
        name: what it is.
        endpoint: ``completions`` or ``chat/completions``.
        body: the JSON body's fields (added to a valid greedy request: ``model``, a prompt or
            messages, ``max_tokens`` 4), or raw bytes sent as they are.
        rule: a regular expression the error message must match (the rule it breaks).
        status: the expected HTTP status.
        content_type: the request's ``Content-Type``.
    """

    name: str
    endpoint: str
    body: Mapping[str, Any] | bytes | Callable[[vs.Server, DeviceLab], Mapping[str, Any] | bytes]
    rule: str
    status: int = 400
    content_type: str = "application/json"


def _over_length(server: vs.Server, lab: DeviceLab) -> dict:
    return {"prompt": _prompts(1, lab.max_model_len + 1, seed=4)[0]}


def _nested(server: vs.Server, lab: DeviceLab) -> bytes:
    depth = 100_000
    return ('{"model": %s, "prompt": %s%s, "max_tokens": 4}' % (json.dumps(server.model), "[" * depth,
                                                                 "]" * depth)).encode()


def _invalid_utf8(server: vs.Server, lab: DeviceLab) -> bytes:
    return b'{"model": ' + json.dumps(server.model).encode() + b', "prompt": "\xff\xfe\xfa", "max_tokens": 4}'


HOSTILE_CASES: tuple[Hostile, ...] = (
    Hostile("malformed JSON", "completions", b'{"model": ', r"JSON decode error"),
    Hostile("empty body", "completions", b"", r"Field required"),
    Hostile("invalid UTF-8", "completions", _invalid_utf8, r"error parsing the body|utf-8|UTF-8"),
    Hostile("deeply nested arrays", "completions", _nested, r"error parsing the body|nest|recursion"),
    Hostile("not JSON content type", "completions", {}, r"application/json", content_type="text/plain"),
    Hostile("negative max_tokens", "completions", {"max_tokens": -1}, r"max_tokens must be at least 1"),
    Hostile("huge max_tokens", "completions", {"max_tokens": 10**12}, r"max_tokens=1000000000000 cannot be greater"),
    Hostile("max_tokens not an integer", "completions", {"max_tokens": "abc"}, r"max_tokens"),
    Hostile("n = 10**6", "completions", {"n": 10**6, "temperature": 1.0}, r"n must be at most"),
    Hostile("NaN temperature", "completions", {"temperature": float("nan")}, r"temperature must be a finite number"),
    Hostile("negative temperature", "completions", {"temperature": -1.0}, r"temperature must be non-negative"),
    Hostile("top_p above 1", "completions", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    Hostile("frequency_penalty out of range", "completions", {"frequency_penalty": 5.0},
            r"frequency_penalty must be in \[-2, 2\]"),
    Hostile("token id out of the vocabulary", "completions", {"prompt": [5, 10**6]},
            r"Token id 1000000 is out of vocabulary"),
    Hostile("negative token id", "completions", {"prompt": [5, -1]}, r"greater than or equal to 0"),
    Hostile("empty prompt", "completions", {"prompt": ""}, r"prompt"),
    Hostile("empty token list", "completions", {"prompt": []}, r"at least one prompt"),
    Hostile("unknown model", "completions", {"model": "no-such-model"}, r"does not exist", status=404),
    Hostile("10,000-entry stop list", "completions", {"stop": [f"s{i}" for i in range(10_000)]},
            r"at most 4 items"),
    Hostile("stop_token_ids out of the vocabulary", "completions", {"stop_token_ids": [10**6]},
            r"stop_token_ids contain out-of-vocab token ids"),
    Hostile("logprobs = 1000", "completions", {"logprobs": 1000}, r"logprobs of 1000.*max allowed"),
    Hostile("over-length prompt", "completions", _over_length, r"maximum context length is"),
    Hostile("2,000 prompts in one request", "completions", {"prompt": ["hi"] * 2000},
            r"exceeds the maximum allowed count"),
    Hostile("chat with no messages", "chat/completions", {"messages": []}, r"empty conversation"),
    Hostile("chat messages not a list", "chat/completions", {"messages": "hi"}, r"valid list"),
    Hostile("chat top_logprobs = 1000", "chat/completions", {"logprobs": True, "top_logprobs": 1000},
            r"logprobs of 1000.*max allowed"),
)


def _body(case_body: Any, server: vs.Server, lab: DeviceLab, endpoint: str) -> dict | bytes:
    raw = case_body(server, lab) if callable(case_body) else case_body
    if isinstance(raw, bytes):
        return raw
    base: dict[str, Any] = {"model": server.model, "max_tokens": 4, "temperature": 0.0}
    if endpoint == "completions":
        base["prompt"] = "hello"
    else:
        base["messages"] = [{"role": "user", "content": "hello"}]
    base.update(raw)
    return base


def _send(server: vs.Server, endpoint: str, body: dict | bytes, content_type: str) -> tuple[int | str, str]:
    """(status, error message) of one request; a timeout or a dropped connection is the status text."""
    try:
        res = server.request("POST", f"/v1/{endpoint}", body, timeout=HOSTILE_TIMEOUT_S, content_type=content_type)
    except OSError as exc:  # socket timeouts and dropped connections (urllib's URLError too)
        return f"{type(exc).__name__}: {exc}", ""
    return res.status, _error_message(res.body)


def _error_message(body: Any) -> str:
    """The error text of an answer's parsed body (vLLM's ``{"error": {...}}``, FastAPI's
    ``{"detail": ...}``, or whatever else it is, as text)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return f"{err.get('message', '')} (param={err.get('param')})"
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return body if isinstance(body, str) else json.dumps(body)


def test_hostile_input(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    probe = _prompts(1, 24, seed=77)[0]
    before = _completion(server, probe)

    attempts: list[tuple[str, str, dict | bytes, str, int, str]] = []  # name, endpoint, body, rule, status, ctype
    for case in HOSTILE_CASES:
        body = _body(case.body, server, lab, case.endpoint)
        attempts.append((case.name, case.endpoint, body, case.rule, case.status, case.content_type))
        if isinstance(body, dict) and case.content_type == "application/json":  # the same, streamed
            attempts.append((case.name + " (streamed)", case.endpoint, dict(body, stream=True), case.rule,
                             case.status, case.content_type))
    for refusal in lab.refusals:
        body = _body(refusal.body, server, lab, refusal.endpoint)
        rule = re.escape(refusal.param)
        name = f"refused {refusal.param} {json.dumps(dict(refusal.body))}"
        attempts.append((name, refusal.endpoint, body, rule, 400, "application/json"))
        attempts.append((name + " (streamed)", refusal.endpoint, dict(body, stream=True), rule, 400,
                         "application/json"))

    wrong: list[str] = []
    for i, (name, endpoint, body, rule, status, ctype) in enumerate(attempts):
        got, message = _send(server, endpoint, body, ctype)
        if isinstance(got, str):  # no answer within HOSTILE_TIMEOUT_S, or the connection dropped
            wrong.append(f"{name}: no answer ({got}); the server stopped answering, so the other "
                         f"{len(attempts) - i - 1} cases were not tried")
            server.stop()  # wedged: the lab starts a new one for the next scenario
            break
        if got != status:
            wrong.append(f"{name}: HTTP {got} (expected {status}): {message[:300]}")
        elif not re.search(rule, message):
            wrong.append(f"{name}: HTTP {got} but the message does not match {rule!r}: {message[:300]}")
        health = server.request("GET", "/health", timeout=HOSTILE_TIMEOUT_S).status
        if health != 200:
            wrong.append(f"{name}: /health is {health} afterwards")
            break
    record.figure("hostile_tried", len(attempts))
    record.figure("hostile_answered_correctly", len(attempts) - len(wrong))
    assert not wrong, f"{len(wrong)} of {len(attempts)} hostile requests mishandled:\n" + "\n".join(wrong)
    assert _completion(server, probe) == before, "the same greedy request answers differently after hostile input"


# ----------------------------------------------------------------------------- vLLM's logits processors

#: The token ``logit_bias`` pushes (inside every vocabulary, above special tokens), and the three
#: ``allowed_token_ids`` offers (none of them the prompt's greedy continuation).
BIAS_TOKEN = 123
ALLOWED_TOKENS = (321, 322, 323)
MIN_TOKENS = 5


def test_logits_processors(target, record, device_labs):
    """``logit_bias``, ``min_tokens``, ``allowed_token_ids`` and ``min_p`` take effect on the
    server that samples on the host (vLLM's own logits processors and mask), each with a request
    whose answer differs when it is ignored; a parameter the server refuses is answered 400
    naming it (the refusal is the device's, ``lab.sampler_refusals``)."""
    lab = _lab(device_labs, target)
    server = lab.sampler_server()
    refused = {r.param for r in lab.sampler_refusals()}
    prompt = _prompts(1, 24, seed=31)[0]
    greedy = _plain(server, prompt, 8, ignore_eos=True).token_ids
    assert BIAS_TOKEN not in greedy and not set(ALLOWED_TOKENS) & set(greedy), "pick other probe tokens"
    bias = {str(BIAS_TOKEN): 100}

    def logit_bias() -> None:  # +100 forces the token at every step
        assert _plain(server, prompt, 6, ignore_eos=True, logit_bias=bias).token_ids == [BIAS_TOKEN] * 6

    def min_tokens() -> None:  # the forced token is a stop token: without min_tokens it stops at once
        stop = {"logit_bias": bias, "stop_token_ids": [BIAS_TOKEN]}
        at_once = _plain(server, prompt, 16, **stop)
        assert at_once.finish_reason == "stop" and at_once.token_ids in ([], [BIAS_TOKEN]), at_once
        held = _plain(server, prompt, 16, min_tokens=MIN_TOKENS, **stop)
        assert held.finish_reason == "stop" and held.token_ids[MIN_TOKENS:] in ([], [BIAS_TOKEN]), held
        assert len(held.token_ids[:MIN_TOKENS]) == MIN_TOKENS and BIAS_TOKEN not in held.token_ids[:MIN_TOKENS], held

    def allowed_token_ids() -> None:
        got = _plain(server, prompt, 6, ignore_eos=True, allowed_token_ids=list(ALLOWED_TOKENS)).token_ids
        assert len(got) == 6 and set(got) <= set(ALLOWED_TOKENS), got

    def min_p() -> None:  # min_p 1 keeps only the most likely token: random sampling becomes greedy
        got = _plain(server, prompt, 8, ignore_eos=True, temperature=1.0, seed=5, min_p=1.0).token_ids
        assert got == greedy, (got, greedy)

    cases: dict[str, Callable[[], None]] = {"logit_bias": logit_bias, "min_tokens": min_tokens, "allowed_token_ids": allowed_token_ids,
             "min_p": min_p}
    served = [name for name in cases if name not in refused and not (name == "min_tokens" and "logit_bias" in refused)]
    for name in served:
        cases[name]()
    for name in sorted(set(cases) - set(served)):  # refused: a 400 that names it
        body = _body({r.param: r.body for r in lab.sampler_refusals()}.get(name, {name: 1}), server, lab, "completions")
        status, message = _send(server, "completions", body, "application/json")
        assert status == 400 and name in message, (name, status, message)
    record.figure("logits_processors_served", len(served))
    record.figure("logits_processors_refused", len(cases) - len(served))


# ----------------------------------------------------------------------------- structured outputs

#: ``structured_outputs`` of the completions the scenario sends, and each answer's check.
STRUCTURED: tuple[tuple[str, dict[str, Any], Callable[[str], bool]], ...] = (
    ("regex", {"regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text) is not None),
    ("choice", {"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ("json", {"json": {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]},
                                                       "ok": {"type": "boolean"}},
                       "required": ["n", "ok"], "additionalProperties": False}},
     lambda text: _json_or_none(text) is not None and set(_json_or_none(text)) == {"n", "ok"}
     and _json_or_none(text)["n"] in (1, 2, 3) and type(_json_or_none(text)["ok"]) is bool),
)
STRUCTURED_TOKENS = 48
#: A tool whose arguments are bounded (an enum): its call always closes.
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                          "parameters": {"type": "object", "additionalProperties": False,
                                                         "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                                                         "required": ["city"]}}}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _check_golden_grammar(golden: Any, prompt_ids: list[int], spec: dict[str, Any], got: list[int], what: str) -> None:
    """``got`` equals the golden decoder's greedy tokens under ``spec``'s xgrammar mask (a final
    stop token on either side not compared)."""
    want = golden.greedy(prompt_ids, spec, STRUCTURED_TOKENS)
    stops = set(golden.info.stop_token_ids)

    def without_stop(ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] in stops else ids

    assert without_stop(got) == without_stop(want), f"{what}: {got} != golden {want}"


def test_structured_outputs(target, record, device_labs):
    """Structured outputs (regex, choice, JSON schema through ``structured_outputs``; the OpenAI
    ``response_format`` json_schema and a tool call with ``tool_choice`` ``required`` on the chat
    API) on the lab's grammar server (``lab.grammar_server``: where the bitmask is applied,
    on the host or on the device): every answer obeys its grammar, and on a simulator equals the
    golden decoder's greedy tokens under the same xgrammar mask
    (:mod:`npu_conformance.grammar_golden`). Where the host-sampling server refuses them (Neuron's
    CPU sampling, in the guide's words), each is a 400 naming ``response_format`` there."""
    lab = _lab(device_labs, target)
    if "response_format" in {r.param for r in lab.sampler_refusals()}:
        sampler = lab.sampler_server()
        for _kind, spec, _ok_text in STRUCTURED:
            status, message = _send(sampler, "completions", _body({"structured_outputs": spec}, sampler, lab,
                                                                  "completions"), "application/json")
            assert status == 400 and "response_format" in message, (status, message)
        record.figure("structured_refused", len(STRUCTURED))
    server = lab.grammar_server()
    if server is None:
        return
    golden = None
    if lab.golden() is not None:
        from npu_conformance.grammar_golden import GrammarGolden

        golden = GrammarGolden(lab.golden(), server.model, any_whitespace=False)  # the servers' HOST_SERVING_ARGS
    prompts = _prompts(2, 16, seed=41)
    compared = 0
    answers: list[list[int]] = []
    for kind, spec, ok_text in STRUCTURED:
        for prompt in prompts:
            a = _plain(server, prompt, STRUCTURED_TOKENS, structured_outputs=spec)
            assert a.finish_reason == "stop" and ok_text(a.text), f"{kind}: {a}"
            answers.append(list(a.token_ids))
            if golden is not None:
                _check_golden_grammar(golden, a.prompt_token_ids, spec, a.token_ids, kind)
                compared += 1
    # the OpenAI forms on the chat API: response_format json_schema, and tool calls (required, named)
    schema = STRUCTURED[2][1]["json"]
    chat = _ok(server.request("POST", "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "Count."}], "max_tokens": STRUCTURED_TOKENS,
        "temperature": 0.0, "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "count", "schema": schema}}}))
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "stop" and STRUCTURED[2][2](choice["message"]["content"]), chat
    if golden is not None:
        _check_golden_grammar(golden, chat["prompt_token_ids"], {"json": schema}, list(choice["token_ids"]),
                              "response_format")
        compared += 1
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        tool = _ok(server.request("POST", "/v1/chat/completions", {
            "model": server.model, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": STRUCTURED_TOKENS, "temperature": 0.0, "tools": [TOOL], "tool_choice": tool_choice,
            "parallel_tool_calls": False}))
        calls = tool["choices"][0]["message"].get("tool_calls") or []
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", (tool_choice, tool["choices"])
        assert _json_or_none(calls[0]["function"]["arguments"]) in ({"city": c} for c in ("Paris", "Oslo", "Lima")), calls
    record.figure("structured_answers", len(STRUCTURED) * len(prompts) + 3)
    record.figure("structured_compared_to_golden", compared)
    # the answers' token ids, hashed: every simulated lab serves one checkpoint
    # (STANDARD_TINY_OVERRIDES), so the report shows one value on every simulator target
    digest = hashlib.sha256(json.dumps(answers + [list(choice["token_ids"])]).encode()).hexdigest()
    record.figure("structured_text_digest", int(digest[:12], 16))


# ----------------------------------------------------------------------------- prompt embeddings

EMBEDS_TOKENS = 8


def _embeds_b64(rows: np.ndarray) -> str:
    """vLLM's ``prompt_embeds`` field: base64 of ``torch.save`` of a ``[T, hidden]`` tensor."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)), buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_prompt_embeds(target, record, device_labs):
    """``prompt_embeds`` (the servers run with ``--enable-prompt-embeds``): a prompt sent as its
    token embeddings (the golden decoder's table) decodes the same greedy tokens as the prompt
    sent as ids, and as the golden decoder, where the lab's plugin takes embeddings
    (``DeviceLab.serves_prompt_embeds``: MBLT, whose MXQs take embeddings from the host); elsewhere
    a 400 naming ``prompt_embeds``."""
    lab = _lab(device_labs, target)
    golden = lab.golden()
    if golden is None:
        pytest.skip("the embeddings sent are the golden decoder's table rows: simulator targets only")
    server = lab.sampler_server()
    body = {"model": server.model, "max_tokens": EMBEDS_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if not lab.serves_prompt_embeds:
        rows = np.asarray(golden.embed(_prompts(1, 8, seed=52)[0]), np.float32)
        status, message = _send(server, "completions", dict(body, prompt_embeds=_embeds_b64(rows)), "application/json")
        assert status == 400 and "prompt_embeds" in message, (status, message)
        record.figure("prompt_embeds_refused", 1)
        return
    compared = 0
    for prompt in _prompts(2, 20, seed=51):
        rows = np.asarray(golden.embed(prompt), np.float32)
        got = _ok(server.request("POST", "/v1/completions", dict(body, prompt_embeds=_embeds_b64(rows))))
        ids = list(got["choices"][0]["token_ids"])
        assert ids == _plain(server, prompt, EMBEDS_TOKENS, ignore_eos=True).token_ids, "embeddings != token ids"
        assert ids == _golden_ids(lab, prompt, EMBEDS_TOKENS), "embeddings != golden decoder"
        compared += 1
    # embeddings that are no token's: the golden decoder run on the same embeddings
    rows = np.asarray(golden.embed(_prompts(1, 12, seed=53)[0]), np.float32)
    rows = rows * 0.5 + np.random.default_rng(54).normal(0.0, float(rows.std()), rows.shape).astype(np.float32)
    got = _ok(server.request("POST", "/v1/completions", dict(body, prompt_embeds=_embeds_b64(rows))))
    cache = golden.new_cache(len(rows) + EMBEDS_TOKENS)
    want = golden.continue_greedy(golden.forward_embeddings(rows, cache), cache, EMBEDS_TOKENS, set())
    assert list(got["choices"][0]["token_ids"]) == [int(t) for t in want], "free embeddings != golden decoder"
    record.figure("prompt_embeds_compared", compared + 1)


# ----------------------------------------------------------------------------- prompt logprobs


def _echo_logprobs(server: vs.Server, prompt: list[int]) -> list[float | None]:
    """The ``token_logprobs`` of the prompt positions of an ``echo`` + ``logprobs=1`` completion
    (lm-eval's loglikelihood request; position 0 has none)."""
    body = _ok(server.request("POST", "/v1/completions",
                              dict(_greedy_body(server, 1, prompt=prompt), echo=True, logprobs=1)))
    logprobs = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(prompt) + 1, f"{len(logprobs)} logprobs for {len(prompt)} prompt tokens + 1"
    return logprobs[: len(prompt)]


def _golden_prompt_logprobs(lab: DeviceLab, prompt: list[int]) -> list[float] | None:
    """log P(prompt[i] | prompt[:i]) for i >= 1 from the golden decoder; None on hardware."""
    golden = lab.golden()
    if golden is None:
        return None
    logits = np.asarray(golden.prefill(prompt, golden.new_cache(len(prompt))), dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(axis=-1, keepdims=True)).sum(axis=-1)) + logits.max(axis=-1)
    return [float(logits[i - 1, prompt[i]] - logz[i - 1]) for i in range(1, len(prompt))]


def test_prompt_logprobs(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = lab.serving_server()
    prompts = _prompts(PROMPT_LOGPROBS_REQUESTS, 20, seed=55)
    beside = _prompts(PROMPT_LOGPROBS_REQUESTS, 30, seed=56)
    with cf.ThreadPoolExecutor(2 * PROMPT_LOGPROBS_REQUESTS) as ex:  # echo and greedy requests together
        echoes = [ex.submit(_echo_logprobs, server, p) for p in prompts]
        greedy = [ex.submit(_completion, server, p) for p in beside]
        got, answers = [f.result() for f in echoes], [f.result() for f in greedy]
    _check_greedy(lab, answers, record)
    compared = 0
    for prompt, logprobs in zip(prompts, got):
        assert logprobs[0] is None and all(isinstance(x, float) for x in logprobs[1:]), logprobs
        want = _golden_prompt_logprobs(lab, prompt)
        if want is None:  # hardware: the same request alone
            want = _echo_logprobs(server, prompt)[1:]
        worst = max(abs(a - b) for a, b in zip(logprobs[1:], want))
        assert worst <= PROMPT_LOGPROBS_TOLERANCE, f"prompt {prompt[:6]}...: |logprob - reference| = {worst:.2e}"
        compared += len(want)
    record.figure("prompt_positions_compared", compared)


# ----------------------------------------------------------------------------- faults


def _fault_server(lab: DeviceLab, kind: str):
    # a server of its own: the fault is armed in the device from its start (NPUSIM_* variables)
    try:
        return lab.fault_server(kind)
    except FaultsUnsupported as exc:
        pytest.skip(str(exc))


def test_fault_once_retried(target, record, device_labs):
    lab = _lab(device_labs, target)
    server, plan = _fault_server(lab, "once")
    prompts = _prompts(FAULT_REQUESTS, 30, seed=21)
    with cf.ThreadPoolExecutor(FAULT_REQUESTS) as ex:
        got = list(ex.map(lambda p: _completion(server, p), prompts))
    assert re.search(plan.evidence, server.log_text()), f"the fault did not strike ({plan.evidence!r} not logged)"
    _check_greedy(lab, got, record)
    golden = lab.golden()
    if golden is None:  # hardware: equal to the same requests sent alone
        assert [_completion(server, p) for p in prompts] == got


def _outcome(server: vs.Server, prompt: list[int], stream: bool) -> tuple[str, list[int]]:
    """``("ok" | "error", token ids received)`` of one request during a persistent fault."""
    body = _greedy_body(server, FAULT_TOKENS, prompt=prompt)
    try:
        if not stream:
            res = server.request("POST", "/v1/completions", body)
            if res.status == 200:
                return "ok", list(res.body["choices"][0]["token_ids"])
            return "error", []
        ids: list[int] = []
        finished = False
        for event in vs.stream_lines(server, "/v1/completions", body):
            if "error" in event:
                return "error", ids
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
                finished = finished or choice.get("finish_reason") is not None
        return ("ok" if finished else "error"), ids
    except (OSError, ValueError):  # the engine stopped: the connection dropped or the stream was cut
        return "error", []


def test_fault_persistent_fails_in_flight(target, record, device_labs):
    lab = _lab(device_labs, target)
    server, plan = _fault_server(lab, "persistent")
    prompts = _prompts(FAULT_REQUESTS, 30, seed=22)
    streams = [i % 2 == 1 for i in range(FAULT_REQUESTS)]  # half of them streamed
    start = threading.Barrier(FAULT_REQUESTS)

    def run(i: int) -> tuple[str, list[int]]:
        start.wait()
        return _outcome(server, prompts[i], streams[i])

    with cf.ThreadPoolExecutor(FAULT_REQUESTS) as ex:
        outcomes = list(ex.map(run, range(FAULT_REQUESTS)))
    assert re.search(plan.evidence, server.log_text()), f"the fault did not strike ({plan.evidence!r} not logged)"
    for i, (status, ids) in enumerate(outcomes):
        assert status == "error", f"request #{i} {'streamed ' if streams[i] else ''}completed during a persistent fault"
        want = _golden_ids(lab, prompts[i], FAULT_TOKENS)
        if want is not None:
            assert ids == want[:len(ids)], f"request #{i}: a wrong token before the error: {ids} vs {want[:len(ids)]}"
    record.figure("failed_requests", len(outcomes))
    record.figure("tokens_before_error", sum(len(ids) for _, ids in outcomes))
