"""Start a real ``vllm serve`` process and talk to it over HTTP (stdlib only).

Used by the serving scenarios and by the tests: one place knows how to launch vLLM offline
on this machine, wait for ``/health``, read its log and stop it. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npu_conformance import prefork

#: How long a ``vllm serve`` may take to become healthy (engine start-up is ~35-65 s here).
START_TIMEOUT_S = 600.0
#: Seconds between two looks at a starting server (``/health`` and the process): a refused
#: connection costs microseconds, and a server is used as soon as it listens.
POLL_S = 0.2


class ServerError(RuntimeError):
    """The server exited or did not become healthy (the message carries its log's tail).

    Attributes:
        returncode: the exit code, or None when it was stopped for not becoming healthy.
    """

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def vllm_command() -> list[str]:
    """The command that runs this environment's ``vllm`` CLI, as an argument list.

    The ``vllm`` console script beside this interpreter when there is one (a virtual
    environment's ``bin/``), else this interpreter running vLLM's CLI module (an environment
    whose vLLM came without the script, e.g. one that reaches vLLM through a ``.pth``). Never a
    ``vllm`` found elsewhere on ``PATH``: that one would run another environment's Python,
    plugins and vLLM.
    """
    script = Path(sys.executable).with_name("vllm")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def default_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """vLLM's cache root for ``environ`` (default ``os.environ``), as ``vllm.envs`` resolves it:
    ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``."""
    environ = os.environ if environ is None else environ
    if environ.get("VLLM_CACHE_ROOT"):
        return Path(environ["VLLM_CACHE_ROOT"]).expanduser()
    xdg = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(xdg).expanduser() / "vllm"


def share_model_infos(cache_root: Path, shared_root: Path | None = None) -> None:
    """Make ``cache_root/modelinfos`` a link to ``shared_root/modelinfos`` (default: the cache
    root of this process's environment) unless ``cache_root`` already has one.

    ``modelinfos`` is vLLM's cache of what its model registry learnt by importing a model class
    in a subprocess (~15 CPU-seconds per start with a cold cache); each entry is keyed by a hash
    of the model module's source and written atomically, so every cache root may share one.
    The rest of a private cache root (compiled graphs, NEFFs, RBLN bundles) stays private.
    """
    shared = (shared_root or default_cache_root()) / "modelinfos"
    link = cache_root / "modelinfos"
    if shared.resolve() == link.resolve() or link.exists() or link.is_symlink():
        return
    try:
        shared.mkdir(parents=True, exist_ok=True)
        cache_root.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)
    except FileExistsError:  # another process linked it first
        pass


def vllm_env(target: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for a vLLM child: ``NPU_HARNESS_TARGET=target`` (unset when None), 1 GiB
    CPU KV cache, offline, no usage stats.

    A ``VLLM_CACHE_ROOT`` in ``extra`` (a private cache of a test or lab session) shares vLLM's
    model-info cache with this environment's cache root (:func:`share_model_infos`)."""
    env = {k: v for k, v in os.environ.items() if k != "NPU_HARNESS_TARGET"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               TOKENIZERS_PARALLELISM="false")
    if target:
        env["NPU_HARNESS_TARGET"] = target
    env.update(extra)
    if extra.get("VLLM_CACHE_ROOT"):
        share_model_infos(Path(extra["VLLM_CACHE_ROOT"]))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HttpResult:
    status: int
    body: Any  # parsed JSON when the body is JSON, else text


def multipart(fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body and its content type (boundary chosen so it occurs in no
    part)."""
    import secrets

    parts = [*(v.encode() for v in fields.values()), *(f[1] for f in files.values())]
    boundary = "npuharness" + secrets.token_hex(12)
    while any(boundary.encode() in p for p in parts):
        boundary = "npuharness" + secrets.token_hex(12)
    out = bytearray()
    for name, value in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n").encode()
        out += value.encode() + b"\r\n"
    for name, (filename, data, ctype) in files.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n"
                f"Content-Type: {ctype}\r\n\r\n").encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


@dataclass
class Server:
    """A running ``vllm serve``. ``base`` is ``http://127.0.0.1:PORT``."""

    proc: subprocess.Popen | prefork.PreforkProcess
    base: str
    model: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def request(self, method: str, path: str, payload: Mapping[str, Any] | bytes | None = None,
                timeout: float = 300.0, content_type: str = "application/json") -> HttpResult:
        """One HTTP request; non-2xx statuses are returned, not raised. ``payload`` is sent
        as JSON, or as it is when it is bytes (malformed bodies for hostile-input tests)."""
        data = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        text = raw.decode(errors="replace")
        try:
            return HttpResult(status, json.loads(text))
        except ValueError:
            return HttpResult(status, text)

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **params: Any) -> HttpResult:
        """``POST /v1/completions`` (greedy unless ``temperature`` is given)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(params)
        return self.request("POST", "/v1/completions", body)

    def upload(self, path: str, fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes, str]],
               timeout: float = 300.0) -> HttpResult:
        """``POST`` a ``multipart/form-data`` body (the OpenAI audio endpoints): ``fields`` as
        text parts, ``files`` as ``{name: (filename, bytes, content type)}``."""
        body, ctype = multipart(fields, files)
        return self.request("POST", path, body, timeout=timeout, content_type=ctype)

    def transcribe(self, audio: bytes, filename: str = "clip.wav", path: str = "/v1/audio/transcriptions",
                   timeout: float = 300.0, **fields: Any) -> HttpResult:
        """``POST /v1/audio/transcriptions`` (or ``path``) with one audio file and ``fields``
        (``language``, ``prompt``, ``temperature``...; the model name is added)."""
        form = {"model": self.model, **{k: str(v) for k, v in fields.items()}}
        return self.upload(path, form, {"file": (filename, audio, "audio/wav")}, timeout=timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """The process runs and ``/health`` answers 200 within ``timeout`` seconds (a server
        whose engine died answers 503, or exits shortly after)."""
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def popen_vllm(args: Sequence[str], *, env: Mapping[str, str], stdout: int,
               command: Sequence[str] | None = None,
               new_session: bool = False) -> subprocess.Popen | prefork.PreforkProcess:
    """``vllm ARGS`` in the background, its stdout and stderr to the descriptor ``stdout``:
    forked from a prefork zygote (a :class:`prefork.PreforkProcess`) unless
    ``NPU_HARNESS_PREFORK=0`` or ``command`` (which replaces the console script) is given, a
    ``subprocess.Popen`` then. ``new_session``: as ``Popen``'s ``start_new_session``.

    Raises:
        prefork.PreforkError: the zygote did not start or fork.
        ValueError: ``NPU_HARNESS_PREFORK`` is not ``1``, ``deps`` or ``0``.
    """
    base = list(command or vllm_command())
    cmd = [*base, *args]
    if command is None and len(base) == 1 and prefork.enabled():
        return prefork.launch(cmd, env=env, stdout=stdout, new_session=new_session)
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=dict(env),
                            start_new_session=new_session)


def start(model: str | os.PathLike, args: Sequence[str] = (), *, env: Mapping[str, str],
          log: Path, timeout_s: float = START_TIMEOUT_S, command: Sequence[str] | None = None) -> Server:
    """Start ``vllm serve MODEL ARGS`` on a free port and wait for ``/health``.

    The ``vllm`` console script is forked from a prefork zygote (:mod:`npu_conformance.prefork`:
    the same program, without re-importing torch and transformers) unless
    ``NPU_HARNESS_PREFORK=0``; ``command`` replaces the console script (e.g. ``[python, "-m",
    "vllm.entrypoints.cli.main"]`` to run it under another interpreter) and always starts a
    new process.

    Raises:
        ServerError: the process exited, or was not healthy within ``timeout_s`` (it is
            stopped; the message carries the log's last 4000 characters).
        prefork.PreforkError: the zygote did not start or fork.
        ValueError: ``NPU_HARNESS_PREFORK`` is not ``1``, ``deps`` or ``0``.
    """
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = popen_vllm(["serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args],
                          env=env, stdout=fh.fileno(), command=command)
    server = Server(proc, f"http://127.0.0.1:{port}", str(model), log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"vllm serve exited {proc.returncode}:\n{server.log_text()[-4000:]}",
                              proc.returncode)
        try:
            with urllib.request.urlopen(server.base + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise ServerError(f"vllm serve not healthy after {timeout_s:.0f} s:\n{server.log_text()[-4000:]}")
        time.sleep(POLL_S)


def stream_lines(server: Server, path: str, payload: Mapping[str, Any], timeout: float = 300.0) -> Iterator[dict]:
    """POST with ``stream: true`` and yield each SSE ``data:`` JSON object until ``[DONE]``."""
    body = dict(payload, stream=True)
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def completion_ids(result: HttpResult) -> list[int]:
    """Generated token ids of a ``/v1/completions`` answer made with ``return_token_ids``.

    Raises:
        AssertionError: the answer is not a 200 with token ids (its body is shown).
    """
    assert result.status == 200, f"HTTP {result.status}: {result.body}"
    ids = result.body["choices"][0].get("token_ids")
    assert ids is not None, f"no token_ids in {result.body}"
    return list(ids)


def greedy_ids(server: Server, prompt: str | list[int], n: int = 16) -> list[int]:
    """The ``n`` token ids a greedy completion of ``prompt`` returns (``ignore_eos``)."""
    return completion_ids(server.complete(prompt, n, return_token_ids=True, ignore_eos=True))
