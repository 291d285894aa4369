"""Start ``vllm serve`` by forking an interpreter that already imported vLLM's third-party
dependencies: each start skips most of its imports (torch, transformers, openai...), about
70 % of a new interpreter's import time.

A *zygote* (:mod:`npu_conformance.prefork_zygote`) is started once per pytest process and
import environment; :func:`launch` asks it for a child and returns a :class:`PreforkProcess`,
a ``subprocess.Popen`` look-alike (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``,
``returncode``). The child runs the ``vllm`` console script exactly as a new interpreter would
(``__main__``, ``sys.argv``, ``sys.path[0]``, the environment, the directory, only the
descriptors asked for) and then imports vLLM, the platform plugins and the vendor runtime
itself, so nothing device- or vLLM-specific is shared between starts. Inside the child,
``multiprocessing``'s spawn start method (vLLM's engine core on every NPU target) goes to the
same zygote through a two-line launcher (:func:`spawn_launcher`), so the engine core starts the
same way.

What a forked child shares with its zygote, and a new interpreter would not have:

- the modules of :data:`PRELOAD`, imported under the zygote's environment: so every variable
  outside :func:`import_key`'s allow-list must equal the zygote's (a start whose environment
  differs there gets its own zygote);
- the hash seed (``PYTHONHASHSEED``) and numpy's legacy global random state;
- ``sys.orig_argv`` and the process's parent (the zygote, not the test or the API server).

``NPU_HARNESS_PREFORK=0`` (in the environment of the process that starts servers) makes every
start a new interpreter again; ``1`` (the default) forks. Standard library only.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_SWITCH = "NPU_HARNESS_PREFORK"

#: What a zygote imports: third-party packages that both a ``vllm serve`` API server and its
#: engine core import anyway (``tests/npu_conformance/test_prefork.py`` checks each against a
#: new interpreter's ``import vllm.entrypoints.cli.main, vllm.v1.engine.core``), so a forked
#: process holds no module a new one would not; the heaviest first.
PRELOAD: tuple[str, ...] = (
    "torch", "torch._dynamo", "transformers", "openai", "fastapi", "uvloop", "starlette",
    "pydantic", "numpy", "sympy", "networkx", "huggingface_hub", "tokenizers", "safetensors", "aiohttp",
    "prometheus_client", "msgspec", "zmq", "psutil", "cbor2", "PIL", "regex", "yaml", "jinja2",
    "requests", "cloudpickle", "cachetools", "partial_json_parser", "tiktoken", "sentencepiece",
)

#: Environment variables no preloaded module reads at import (prefixes): they may differ
#: between a zygote and its children. vLLM itself is never preloaded, so all of ``VLLM_``
#: is here; the rest are this project's, the simulators' and the vendor runtimes'.
LATE_READ_PREFIXES: tuple[str, ...] = (
    "VLLM_", "NPU_", "NPUSIM_", "RBLN_", "NEURON_", "MXQ_", "MBLT_", "IME2_", "PYTEST_CURRENT_TEST",
)

#: Zygotes kept per process (least recently used closed first); each holds ~0.5 GiB.
MAX_ZYGOTES = 2
READY_TIMEOUT_S = 300.0


class PreforkError(RuntimeError):
    """A zygote did not start or could not fork a child (the message carries its log's tail)."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether starts fork (``NPU_HARNESS_PREFORK``: ``1``, the default, or ``0``).

    Raises:
        ValueError: the variable holds anything else (named, with its value).
    """
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: must be 1 (fork vllm serve from a zygote) "
                         "or 0 (a new interpreter per start)")
    return value == "1"


def import_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a preloaded module may read at import: a zygote serves exactly the
    environments with its key."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_READ_PREFIXES)))


class PreforkProcess:
    """A child of a zygote, driven like ``subprocess.Popen``.

    ``returncode`` is None while it runs, then its exit code (negative: the signal that ended
    it). Signals go to ``pid`` directly; the exit code comes from the zygote, which reaps it.
    """

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._buf = b""
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    def _read_exit(self, timeout: float | None) -> bool:
        while len(self._buf) < 4:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return False
            chunk = self._conn.recv(4 - len(self._buf))
            if not chunk:  # the zygote died: its children died with it (SIGKILL)
                self._finish(-signal.SIGKILL)
                return True
            self._buf += chunk
        self._finish(struct.unpack("!i", self._buf)[0])
        return True

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._read_exit(None if deadline is None else max(0.0, deadline - time.monotonic())):
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, sig)
        else:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote process and its socket; :meth:`fork` asks it for a child."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="npu-prefork-"))
        self.socket = str(self.dir / "zygote.sock")
        self.log = self.dir / "zygote.log"
        source = Path(__file__).with_name("prefork_zygote.py").read_text()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", source, self.socket, *PRELOAD],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                         env=dict(env), cwd="/")
        self._ready = False
        self.launcher = self.dir / "spawn"
        self.launcher.write_text(spawn_launcher(self.socket))
        self.launcher.chmod(0o755)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for the zygote's imports.

        Raises:
            PreforkError: it exited or printed nothing within ``timeout`` seconds.
        """
        if self._ready:
            return
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode(errors="replace") if ready else ""
        if not line.startswith("ready "):
            tail = self.log.read_text(errors="replace")[-4000:]
            self.close()
            raise PreforkError(f"the prefork zygote did not start ({line.strip() or 'no answer'}):\n{tail}")
        self._ready = True

    def fork(self, kind: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
             fds: Mapping[int, int], spawn_executable: str | None = None) -> tuple[socket.socket, int]:
        """A new child running ``argv`` (see :mod:`npu_conformance.prefork_zygote`); ``fds``
        maps the child's descriptor numbers to this process's descriptors. Returns the
        connection that will carry the exit code, and the child's pid.

        Raises:
            PreforkError: the zygote refused or is gone.
        """
        self.wait_ready()
        body = json.dumps({"kind": kind, "argv": list(argv), "env": dict(env), "cwd": cwd,
                           "fds": list(fds), "spawn_executable": spawn_executable}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket)
            socket.send_fds(conn, [struct.pack("!I", len(body)) + body], list(fds.values()))
            raw = b""
            while len(raw) < 8:
                chunk = conn.recv(8 - len(raw))
                if not chunk:
                    raise OSError("the zygote closed the connection")
                raw += chunk
        except OSError as exc:
            conn.close()
            raise PreforkError(f"the prefork zygote did not fork {argv[:2]}: {exc}:\n"
                               f"{self.log.read_text(errors='replace')[-4000:]}") from exc
        pid = struct.unpack("!q", raw)[0]
        if pid == 0:
            conn.close()
            raise PreforkError(f"the prefork zygote refused {kind} {list(argv)[:3]}:\n"
                               f"{self.log.read_text(errors='replace')[-2000:]}")
        return conn, pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def spawn_launcher(socket_path: str) -> str:
    """The executable ``multiprocessing.set_executable`` gets inside a forked ``vllm serve``:
    a shell script that runs :mod:`npu_conformance.prefork_spawn` (standard library, no site),
    which hands a spawn start to the zygote at ``socket_path`` and relays its exit code and
    signals; anything that is not a plain spawn start runs the real interpreter."""
    proxy = Path(__file__).with_name("prefork_spawn.py")
    words = " ".join(shlex.quote(w) for w in (sys.executable, "-S", "-E", str(proxy), socket_path, sys.executable))
    return f"#!/bin/sh\nexec {words} \"$@\"\n"


_lock = threading.Lock()
_zygotes: OrderedDict[tuple, Zygote] = OrderedDict()


def _close_all() -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()


atexit.register(_close_all)


def zygote_for(env: Mapping[str, str]) -> Zygote:
    """This process's zygote for ``env``'s :func:`import_key` (started when there is none)."""
    key = import_key(env)
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.proc.poll() is not None:
            zygote.close()
            del _zygotes[key]
            zygote = None
        if zygote is None:
            zygote = Zygote(dict(key))
            _zygotes[key] = zygote
            while len(_zygotes) > MAX_ZYGOTES:
                _zygotes.popitem(last=False)[1].close()
        _zygotes.move_to_end(key)
        return zygote


def run_python(code: str, args: Sequence[str] = (), *, env: Mapping[str, str], timeout: float,
               python: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from this process's zygote for ``env`` when ``python`` is this
    interpreter (the default) and :func:`enabled`; a new interpreter otherwise.

    For the harness's own probes that import vLLM to ask it something (a resolved engine
    config, a Neuron plan): the program runs as ``python -c`` would run it.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed).
        PreforkError: the zygote did not start or fork.
    """
    python = python or sys.executable
    cmd = [python, "-c", code, *args]
    if python != sys.executable or not enabled():
        return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = launch(["-c", code, *args], env=env, stdout=out.fileno(), stderr=err.fileno(), kind="python")
        proc.args = cmd
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(cmd, proc.returncode, texts[0], texts[1])


def launch(argv: Sequence[str], *, env: Mapping[str, str], stdout: int, stderr: int | None = None,
           cwd: str | None = None, kind: str = "serve") -> PreforkProcess:
    """Start ``argv`` as a forked child with ``env``, stdin ``/dev/null``, ``stdout`` (a
    descriptor) as its stdout and ``stderr`` (default: ``stdout``) as its stderr. ``kind``
    ``serve``: ``argv`` is the ``vllm`` console script and its arguments; ``python``: what
    follows the interpreter in a ``python -c`` command line (:mod:`npu_conformance.prefork_zygote`).

    The child's ``multiprocessing`` spawns go to the same zygote (:func:`spawn_launcher`).

    Raises:
        PreforkError: the zygote did not start or fork.
    """
    zygote = zygote_for(env)
    with open(os.devnull, "rb") as devnull:
        conn, pid = zygote.fork(kind, list(argv), env, cwd or os.getcwd(),
                                {0: devnull.fileno(), 1: stdout, 2: stdout if stderr is None else stderr},
                                spawn_executable=str(zygote.launcher))
    return PreforkProcess(conn, pid, argv)
