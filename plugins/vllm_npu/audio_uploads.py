"""An ASGI middleware that refuses malformed or truncated audio uploads with HTTP 400 before vLLM
decodes them.

vLLM 0.32 decodes an upload to ``/v1/audio/transcriptions`` or ``/v1/audio/translations`` with
libsndfile, which is lenient: a WAV cut short (its header still declaring the whole length), or
whose header declares 4 GiB of samples, is read as far as it goes and transcribed, so the client
gets a ``200`` with the text of part of the audio and no sign anything was lost. A file that is
not audio at all vLLM already refuses (``400 Invalid or unsupported audio file.``).

:class:`AudioUploadCheckMiddleware` reads such a request's ``file`` part (and a chat request's
inline audio clips: ``input_audio``, ``data:`` ``audio_url``) and checks it with
:func:`audio_file_problem`; a problem is answered ``400`` with vLLM's error body naming the file,
the rule and the numbers, and the request never reaches vLLM. Anything else is passed on
unchanged (the body replayed as it came).

The MBLT platform installs it (``--middleware`` default; a user's ``--middleware`` adds to it).
This module imports nothing from vLLM.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
from collections.abc import Awaitable, Callable, MutableMapping
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

__all__ = ["MIDDLEWARE", "AudioUploadCheckMiddleware", "audio_file_problem", "chat_audio_problem", "multipart_file",
           "request_problem"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Import path for ``--middleware``.
MIDDLEWARE = "vllm_npu.audio_uploads.AudioUploadCheckMiddleware"
#: Paths whose ``file`` upload is checked.
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
#: Paths whose JSON messages' inline audio (``input_audio``, ``data:`` ``audio_url``) is checked.
CHAT_PATHS = ("/v1/chat/completions",)


def _wav_problem(data: bytes) -> str | None:
    """The first structural problem of a RIFF/WAVE file, or None."""
    declared = struct.unpack_from("<I", data, 4)[0] + 8
    if declared != len(data):
        return (f"malformed or truncated WAV: its RIFF header declares {declared} bytes and the file has "
                f"{len(data)}")
    pos, found = 12, set()
    while pos + 8 <= len(data):
        cid = data[pos:pos + 4]
        size = struct.unpack_from("<I", data, pos + 4)[0]
        if pos + 8 + size > len(data):
            return (f"truncated WAV: its {cid.decode('latin-1')!r} chunk declares {size} bytes and "
                    f"{len(data) - pos - 8} follow")
        found.add(cid)
        pos += 8 + size + (size & 1)
    missing = [c.decode() for c in (b"fmt ", b"data") if c not in found]
    if missing:
        return f"malformed WAV: no {' or '.join(repr(m) for m in missing)} chunk"
    return None


def audio_file_problem(data: bytes) -> str | None:
    """Why an uploaded audio file must be refused, or None when it may be decoded.

    - RIFF/WAVE: the RIFF size must be the file's size, every chunk must fit in the file, and
      ``fmt `` and ``data`` chunks must be present.
    - Other formats libsndfile knows (FLAC, OGG...): fewer frames decode than the header declares.
    - Anything libsndfile does not recognise: None (vLLM refuses it, or another decoder reads it).
    """
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _wav_problem(data)
    try:
        import soundfile
    except ImportError:
        return None
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not a format libsndfile knows: vLLM's own decoder judges it
        return None
    try:
        frames = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)[0].shape[0]
    except Exception as exc:  # noqa: BLE001 - libsndfile stopped inside the stream
        return f"malformed or truncated {info.format} audio: decoding stopped ({exc})"
    if info.frames > 0 and frames < info.frames:
        return f"truncated {info.format} audio: its header declares {info.frames} frames and {frames} decode"
    return None


def multipart_file(body: bytes, content_type: str, name: str = "file") -> bytes | None:
    """The content of the ``name`` part of a ``multipart/form-data`` body, or None when absent
    (or the body is not multipart)."""
    if not content_type.lower().startswith("multipart/form-data"):
        return None
    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        return None
    for part in msg.iter_parts():
        if part.get_param("name", header="content-disposition") == name:
            return part.get_payload(decode=True) or b""
    return None


def chat_audio_problem(body: bytes) -> tuple[str, str] | None:
    """``(where, problem)`` of the first inline audio clip of a chat request that
    :func:`audio_file_problem` refuses (``where`` like ``messages[1].content[0]``), or None (also
    for a body that is not JSON: vLLM answers that)."""
    import base64
    import binascii

    try:
        messages = json.loads(body).get("messages")
    except (ValueError, AttributeError):
        return None
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            raw = None
            if part.get("type") == "input_audio" and isinstance(part.get("input_audio"), dict):
                raw = part["input_audio"].get("data")
            elif part.get("type") == "audio_url" and isinstance(part.get("audio_url"), dict):
                url = part["audio_url"].get("url")
                raw = url.split(",", 1)[1] if isinstance(url, str) and url.startswith("data:") and "," in url else None
            if not isinstance(raw, str):
                continue
            try:
                data = base64.b64decode(raw, validate=False)
            except (binascii.Error, ValueError):
                continue  # vLLM refuses bad base64 itself
            problem = audio_file_problem(data)
            if problem is not None:
                return f"messages[{i}].content[{j}]", problem
    return None


def request_problem(path: str, body: bytes, content_type: str) -> tuple[str, str] | None:
    """``(where, problem)`` of a request to ``path`` whose audio must be refused: the ``file``
    part of an audio endpoint's upload (:func:`audio_file_problem`), or a chat request's inline
    clip (:func:`chat_audio_problem`); None when there is nothing to refuse."""
    if path in AUDIO_PATHS:
        data = multipart_file(body, content_type)
        problem = audio_file_problem(data) if data else None
        return ("file", problem) if problem is not None else None
    return chat_audio_problem(body)


class AudioUploadCheckMiddleware:
    """ASGI middleware: refuse a bad audio upload with 400 (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in AUDIO_PATHS + CHAT_PATHS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        found: tuple[str, str] | None = None
        if path in AUDIO_PATHS or b"input_audio" in body or b"audio_url" in body:
            # parsing and decoding off the event loop: a long FLAC takes seconds to decode
            found = await asyncio.to_thread(request_problem, path, bytes(body), headers.get("content-type", ""))
        if found is not None:
            payload = json.dumps({"error": {"message": f"{found[0]}: {found[1]}", "type": "BadRequestError",
                                            "param": found[0], "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replay = iter(messages)

        async def replayed() -> Message:
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        await self.app(scope, replayed, send)
