"""``vllm_npu.stream_errors``: a streamed request refused before its first event gets the
refusal's status; every other response passes unchanged. Driven with tiny ASGI apps (the
real server is the serving suite's ``hostile_input`` scenario)."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_npu.stream_errors import MIDDLEWARE, StreamErrorStatusMiddleware, refusal_of

ERROR = {"error": {"message": "refused: min_tokens=2", "type": "BadRequestError", "param": "min_tokens",
                   "code": 400}}
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _app(status: int, headers: list, chunks: list[bytes]):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": True})  # as starlette may
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    return app


def _run(app, method: str = "POST", scope_type: str = "http") -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(dict(message))

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": scope_type, "method": method, "path": "/v1/completions"}
    asyncio.run(StreamErrorStatusMiddleware(app)(scope, receive, send))
    return sent


def test_a_refused_stream_becomes_its_status_with_the_error_body():
    events = [b"data: " + json.dumps(ERROR).encode() + b"\n\n", b"data: [DONE]\n\n"]
    sent = _run(_app(200, SSE + [(b"x-request-id", b"abc")], events))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    start, body = sent
    assert start["status"] == 400
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"x-request-id"] == b"abc"
    assert json.loads(body["body"]) == ERROR and int(headers[b"content-length"]) == len(body["body"])
    assert body["more_body"] is False


def test_a_valid_stream_passes_unchanged():
    events = [b'data: {"choices": [{"text": "hi"}]}\n\n', b"data: [DONE]\n\n"]
    sent = _run(_app(200, SSE, events))
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": SSE}
    assert [m["body"] for m in sent[1:]] == events


def test_an_error_after_the_first_event_stays_in_the_stream():
    events = [b'data: {"choices": [{"text": "hi"}]}\n\n', b"data: " + json.dumps(ERROR).encode() + b"\n\n"]
    sent = _run(_app(200, SSE, events))
    assert sent[0]["status"] == 200 and [m["body"] for m in sent[1:]] == events


@pytest.mark.parametrize(("status", "headers"), [
    (200, [(b"content-type", b"application/json")]),
    (400, [(b"content-type", b"application/json")]),
])
def test_responses_that_are_not_streams_pass_unchanged(status, headers):
    chunks = [json.dumps(ERROR).encode()]
    sent = _run(_app(status, headers, chunks))
    assert sent[0]["status"] == status and sent[-1]["body"] == chunks[0]


def test_get_requests_and_other_scopes_are_not_touched():
    events = [b"data: " + json.dumps(ERROR).encode() + b"\n\n"]
    assert _run(_app(200, SSE, events), method="GET")[0]["status"] == 200


@pytest.mark.parametrize("first", [
    b"data: [DONE]\n\n",
    b'data: {"error": {"message": "x", "code": 200}}\n\n',
    b'data: {"error": {"message": "x", "code": true}}\n\n',
    b'data: {"error": "plain"}\n\n',
    b"data: not json\n\n",
    b'event: x\ndata: {"error": {"code": 400}}\n\n',
    b'data: {"error": {"code": 400}}\n\ndata: [DONE]\n\n',
])
def test_only_a_lone_error_event_with_an_http_error_code_is_a_refusal(first):
    assert refusal_of(first) is None


def test_refusal_of_reads_the_code():
    status, body = refusal_of(b'data: {"error": {"message": "gone", "code": 503}}\n\n')
    assert status == 503 and json.loads(body) == {"error": {"message": "gone", "code": 503}}


def test_the_npu_platforms_make_it_the_default_middleware():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # pragma: no cover - older vLLM
        from vllm.utils import FlexibleArgumentParser
    from vllm_npu.mblt.platform import MbltPlatform

    parser = make_arg_parser(FlexibleArgumentParser())
    MbltPlatform.pre_register_and_update(parser)
    MbltPlatform.pre_register_and_update(parser)  # idempotent
    from vllm_npu.audio_uploads import MIDDLEWARE as AUDIO_MIDDLEWARE  # MBLT's own: bad audio uploads get 400

    assert parser.parse_args([]).middleware == [MIDDLEWARE, AUDIO_MIDDLEWARE]
    assert parser.parse_args(["--middleware", "my.Mw"]).middleware == [MIDDLEWARE, AUDIO_MIDDLEWARE, "my.Mw"]
    MbltPlatform.pre_register_and_update(None)  # the offline LLM passes no parser
