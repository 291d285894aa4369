"""An ASGI middleware that answers a streamed request refused before its first token with
the HTTP status of the refusal, not with ``200`` and an error event.

vLLM 0.32's OpenAI server validates part of a request only when the engine takes it: the
platform's ``validate_request`` (every parameter an NPU plugin refuses), token ids out of the
vocabulary, more sample logprobs than ``--max-logprobs``, out-of-vocabulary
``stop_token_ids``. Without streaming those are HTTP 400. With ``"stream": true`` the server
has already answered ``200 OK`` with ``text/event-stream`` by then, so the client gets
``200`` and one event ``data: {"error": {..., "code": 400}}`` followed by ``data: [DONE]``.

:class:`StreamErrorStatusMiddleware` holds a ``200`` event-stream response's start until its
first body bytes. When those are exactly one error event (the request was refused before it
produced anything), the client gets the error's own status code (``400``...) with the
error as a JSON body, the same body vLLM sends for the unstreamed request, and the rest of
that stream is dropped. Any other first chunk (a token, a role delta) releases the held start
unchanged, so a valid stream is untouched (its headers leave with its first event, which is
when the first token is ready anyway).

Limits: an error that comes after the first event (one prompt of a multi-prompt stream
refused after another prompt's first token, a device fault mid-stream) stays an error event
inside the ``200`` stream, as vLLM sends it: its status line is already on the wire.

Every NPU platform installs it (``vllm_npu._platform.NpuPlatform.pre_register_and_update``
makes it the default of ``--middleware``; a user's ``--middleware`` adds to it). On vLLM's
CPU backend it can be added by hand: ``--middleware vllm_npu.stream_errors.StreamErrorStatusMiddleware``.
This module imports nothing from vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Import path for ``--middleware``.
MIDDLEWARE = "vllm_npu.stream_errors.StreamErrorStatusMiddleware"

_EVENT_STREAM = b"text/event-stream"


def refusal_of(first_body: bytes) -> tuple[int, bytes] | None:
    """``(status, JSON body)`` when ``first_body`` is a single ``data: {"error": ...}`` event
    whose ``code`` is an HTTP error status (400-599); else None.

    The body returned is the event's JSON object (``{"error": {"message", "type", "param",
    "code"}}``), vLLM's error body for unstreamed requests.
    """
    text = first_body.strip()
    if not text.startswith(b"data:") or b"\n\n" in text:
        return None
    try:
        payload = json.loads(text[len(b"data:"):])
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(code, int) or isinstance(code, bool) or not 400 <= code <= 599:
        return None
    return code, json.dumps(payload).encode()


class StreamErrorStatusMiddleware:
    """See the module docstring. ``app`` is the ASGI app it wraps (vLLM's FastAPI app)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        state = "undecided"  # -> "passing" (forward everything) or "dropping" (refusal sent)

        async def guarded_send(message: Message) -> None:
            nonlocal held, state
            if state == "passing":
                await send(message)
                return
            if state == "dropping":
                return
            kind = message.get("type")
            if kind == "http.response.start":
                headers = dict(message.get("headers") or [])
                if message.get("status") == 200 and headers.get(b"content-type", b"").startswith(_EVENT_STREAM):
                    held = message
                    return
                state = "passing"
                await send(message)
                return
            if kind == "http.response.body" and held is not None:
                body = bytes(message.get("body", b""))
                if not body and message.get("more_body", False):
                    return  # nothing yet: keep holding
                refused = refusal_of(body)
                if refused is not None:
                    status, payload = refused
                    state = "dropping"
                    keep = [(k, v) for k, v in held.get("headers") or []
                            if k.lower() not in (b"content-type", b"content-length")]
                    await send({"type": "http.response.start", "status": status, "headers": keep + [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode())]})
                    await send({"type": "http.response.body", "body": payload, "more_body": False})
                    return
                state = "passing"
                await send(held)
                await send(message)
                return
            state = "passing"
            await send(message)

        await self.app(scope, receive, guarded_send)
