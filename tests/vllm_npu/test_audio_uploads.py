"""``vllm_npu.audio_uploads``: which audio files are refused before vLLM decodes them, the
multipart and chat-body readers, and the middleware's answer (a stand-in ASGI app behind it).
The same files against a real server: the ``asr_hostile_uploads`` scenario."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct

import numpy as np
import pytest

from npu_conformance.audio import hostile_uploads, wav_bytes
from npu_conformance.vllm_server import multipart
from vllm_npu.audio_uploads import AudioUploadCheckMiddleware, audio_file_problem, chat_audio_problem, multipart_file

VALID = wav_bytes(0.3 * np.sin(np.arange(8000) * 0.05))


def test_valid_wav_passes():
    assert audio_file_problem(VALID) is None


@pytest.mark.parametrize(("kind", "words"), [
    ("header_only", "RIFF header declares 16044 bytes and the file has 44"),
    ("truncated", "RIFF header declares 16044 bytes and the file has 8022"),
    ("huge_declared_length", "declares 4294967303 bytes"),
])
def test_bad_wavs_are_named(kind, words):
    assert words in audio_file_problem(hostile_uploads(VALID)[kind])


def test_a_chunk_past_the_end_and_a_missing_data_chunk():
    cut = bytearray(VALID[:1000])
    cut[4:8] = struct.pack("<I", len(cut) - 8)  # RIFF size made consistent: only the data chunk is short
    assert "'data' chunk declares 16000 bytes and 956 follow" in audio_file_problem(bytes(cut))
    no_data = bytearray(VALID[:36])
    no_data[4:8] = struct.pack("<I", 28)
    assert audio_file_problem(bytes(no_data)) == "malformed WAV: no 'data' chunk"


def test_truncated_flac():
    pytest.importorskip("soundfile")
    assert "truncated" in audio_file_problem(hostile_uploads(VALID)["truncated_flac"]) or \
        "decoding stopped" in audio_file_problem(hostile_uploads(VALID)["truncated_flac"])


@pytest.mark.parametrize("kind", ["empty", "garbage", "riff_not_wave", "text"])
def test_unknown_formats_are_left_to_vllm(kind):
    """Not audio libsndfile knows: vLLM answers 400 'Invalid or unsupported audio file.' itself."""
    assert audio_file_problem(hostile_uploads(VALID)[kind]) is None


def test_multipart_and_chat_readers():
    body, ctype = multipart({"model": "m", "language": "en"}, {"file": ("a.wav", VALID, "audio/wav")})
    assert multipart_file(body, ctype) == VALID
    assert multipart_file(body, "application/json") is None
    bad = base64.b64encode(hostile_uploads(VALID)["truncated"]).decode()
    chat = {"messages": [{"role": "system", "content": "x"},
                         {"role": "user", "content": [{"type": "text", "text": "t"},
                                                      {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{bad}"}}]}]}
    where, problem = chat_audio_problem(json.dumps(chat).encode())
    assert where == "messages[1].content[1]" and "RIFF header" in problem
    ok = {"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                     "input_audio": {"data": base64.b64encode(VALID).decode()}}]}]}
    assert chat_audio_problem(json.dumps(ok).encode()) is None
    assert chat_audio_problem(b"not json") is None


def _call(path: str, body: bytes, ctype: str) -> tuple[int, bytes, list[bytes]]:
    """Run the middleware over a stand-in app; (status, body sent, bodies the app received)."""
    seen: list[bytes] = []

    async def app(scope, receive, send):
        got = b""
        while True:
            msg = await receive()
            got += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        seen.append(got)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    chunks = [body[i:i + 4096] for i in range(0, len(body), 4096)] or [b""]
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return queue.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", ctype.encode())]}
    asyncio.run(AudioUploadCheckMiddleware(app)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen


def test_middleware_refuses_and_passes():
    body, ctype = multipart({"model": "m"}, {"file": ("a.wav", hostile_uploads(VALID)["truncated"], "audio/wav")})
    status, out, seen = _call("/v1/audio/transcriptions", body, ctype)
    assert status == 400 and not seen
    err = json.loads(out)["error"]
    assert err["param"] == "file" and err["message"].startswith("file: malformed or truncated WAV") and err["code"] == 400
    body, ctype = multipart({"model": "m"}, {"file": ("a.wav", VALID, "audio/wav")})
    status, out, seen = _call("/v1/audio/transcriptions", body, ctype)
    assert status == 200 and seen == [body]  # replayed whole
    status, _out, seen = _call("/v1/completions", b'{"prompt": "x"}', "application/json")
    assert status == 200 and seen == [b'{"prompt": "x"}']
