"""Start ``vllm serve`` by forking an interpreter that already imported what the start would
import: a start skips its imports (torch, transformers, openai..., then vLLM and the platform
plugins), about three quarters of a new interpreter's start.

Two levels of *zygote* (:mod:`npu_conformance.prefork_zygote`), per pytest process:

- the plain zygote, one per import environment (:func:`import_key`), imports :data:`PRELOAD`:
  vLLM's third-party dependencies, never vLLM, a plugin or a vendor runtime;
- a vLLM zygote (:func:`vllm_zygote_for`), forked from the plain zygote with one start's whole
  environment, imports :data:`VLLM_PRELOAD` as a new interpreter would (vLLM resolves its
  platform and loads the platform plugins then) and records what those imports read and wrote
  of ``os.environ``; it serves every start whose environment equals its own where they read
  (:meth:`Zygote.serves`), and replays their writes in each child.

:func:`launch` asks a zygote for a child and returns a :class:`PreforkProcess`, a
``subprocess.Popen`` look-alike (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``,
``returncode``). A ``serve`` child runs the ``vllm`` console script exactly as a new
interpreter would (``__main__``, ``sys.argv``, ``sys.path[0]``, the environment, the directory,
only the descriptors asked for). Inside the child, ``multiprocessing``'s spawn start method
(vLLM's engine core on every NPU target) goes to the same zygote through a two-line launcher
(:func:`spawn_launcher`), so the engine core starts the same way; so does vLLM's inspection of
a model class it has not met yet (``python -m vllm.model_executor.models.registry``, about 6 s
in a new interpreter, once per architecture in a new ``~/.cache/vllm``). :func:`run_python` and
:func:`run_script` (probes) fork from the plain zygote.

What a forked child shares with its zygote, and a new interpreter would not have:

- the modules of :data:`PRELOAD`, imported under the plain zygote's environment: so every
  variable outside :func:`import_key`'s allow-list must equal the zygote's (a start whose
  environment differs there gets its own zygote); likewise :data:`VLLM_PRELOAD` and the
  variables their imports read;
- the hash seed (``PYTHONHASHSEED``) and numpy's legacy global random state;
- ``sys.orig_argv`` and the process's parent (the zygote, not the test or the API server);
- ``LD_LIBRARY_PATH`` in an engine core: see :meth:`Zygote.serves`.

A child dies with the zygote that forked it (``PR_SET_PDEATHSIG``: never an orphan that its
client believes dead), so a zygote with a live child (a server a lab keeps, a vLLM zygote) is
never closed to make room (:data:`MAX_ZYGOTES`, :data:`MAX_VLLM_ZYGOTES` are then exceeded
until it is idle).

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
    "requests", "cloudpickle", "cachetools", "partial_json_parser", "tiktoken", "sentencepiece", "cpuinfo",
)

#: Environment variables no preloaded module reads at import (prefixes): they may differ
#: between a zygote and its children. vLLM itself is never preloaded, so all of ``VLLM_``
#: is here; the rest are this project's, the simulators' and the vendor runtimes'.
LATE_READ_PREFIXES: tuple[str, ...] = (
    "VLLM_", "NPU_", "NPUSIM_", "RBLN_", "NEURON_", "MXQ_", "MBLT_", "IME2_", "PYTEST_CURRENT_TEST",
)

#: What a vLLM zygote (forked from a zygote, with one start's whole environment) imports on
#: top: what both a ``vllm serve`` API server and the engine core it spawns import (the engine
#: core runs the ``vllm`` script as ``__mp_main__``), vLLM's platform resolution and platform
#: plugins included, exactly as a new interpreter with that environment would; what these
#: imports read of the environment is recorded (``os.environ``), and a child's environment must
#: equal the zygote's there.
VLLM_PRELOAD: tuple[str, ...] = ("vllm.entrypoints.cli.main", "vllm.v1.engine.core")

#: Read by the start-up hook (``npu_harness_alias.pth``, replayed in a forked child) before a
#: vLLM zygote records: a child's environment must equal the vLLM zygote's there too.
HOOK_VARIABLES: tuple[str, ...] = ("NPU_HARNESS_TARGET", "NPUSIM_ALIAS")

#: Zygotes kept per process (least recently used closed first); each holds ~0.5 GiB.
MAX_ZYGOTES = 2
#: vLLM zygotes kept per process (least recently used closed first); each adds ~0.3 GiB.
MAX_VLLM_ZYGOTES = 3
READY_TIMEOUT_S = 300.0


class PreforkError(RuntimeError):
    """A zygote did not start or could not fork a child (the message carries its log's tail)."""


#: ``NPU_HARNESS_PREFORK`` values: fork from a vLLM zygote (falling back to the plain zygote),
#: fork from the plain zygote only (third-party dependencies preloaded), a new interpreter.
MODES = ("1", "deps", "0")


def mode(environ: Mapping[str, str] | None = None) -> str:
    """``NPU_HARNESS_PREFORK``: ``1`` (the default: a start forks from a vLLM zygote for its
    environment), ``deps`` (from the plain zygote: vLLM's third-party dependencies preloaded,
    vLLM imported by each start) or ``0`` (a new interpreter per start).

    Raises:
        ValueError: the variable holds anything else (named, with its value).
    """
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "1")
    if value not in MODES:
        raise ValueError(f"{ENV_SWITCH}={value!r}: must be 1 (fork vllm serve from a zygote that imported "
                         "vLLM for its environment), deps (from a zygote that imported vLLM's third-party "
                         "dependencies only) or 0 (a new interpreter per start)")
    return value


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether starts fork (:func:`mode` is ``1`` or ``deps``).

    Raises:
        ValueError: ``NPU_HARNESS_PREFORK`` holds anything else (named, with its value).
    """
    return mode(environ) != "0"


def import_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a preloaded module may read at import: a zygote serves exactly the
    environments with its key."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_READ_PREFIXES)))


class PreforkProcess:
    """A child of a zygote, driven like ``subprocess.Popen``.

    ``returncode`` is None while it runs, then its exit code (negative: the signal that ended
    it). Signals go to ``pid`` directly; the exit code comes from the zygote, which reaps it.
    Several threads may poll and wait at once (as with ``Popen``, a ``poll`` while another
    thread is reading the exit code answers the code known so far).
    """

    #: Longest single read of the exit code while waiting (s): other threads get the lock between.
    WAIT_SLICE_S = 0.2

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._buf = b""
        self._lock = threading.Lock()
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
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._read_exit(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = self.WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
            with self._lock:
                if self.returncode is None:
                    self._read_exit(min(left, self.WAIT_SLICE_S))
            if self.returncode is None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:  # as Popen: a child that ended but whose exit code has not arrived yet is no error
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote process and its socket; :meth:`fork` asks it for a child.

    ``parent``: a vLLM zygote, forked from ``parent`` with ``env`` (its whole environment),
    which then imports :data:`VLLM_PRELOAD` recording what those imports read and write of the
    environment (:attr:`reads`, :attr:`writes`, known once ready).
    """

    def __init__(self, env: Mapping[str, str], parent: "Zygote | None" = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="npu-prefork-"))
        self.socket = str(self.dir / "zygote.sock")
        self.log = self.dir / "zygote.log"
        self.env = dict(env)
        #: the plain zygote a vLLM zygote was forked from (None: this is a plain zygote)
        self.base = parent
        self.reads: frozenset[str] | None = frozenset()
        #: what it forked for this process (a vLLM zygote's own among its parent's)
        self.children: list[PreforkProcess] = []
        self.writes: dict[str, str | None] = {}
        source = Path(__file__).with_name("prefork_zygote.py").read_text()
        self.proc: subprocess.Popen | PreforkProcess
        with open(self.log, "wb") as log:
            if parent is None:
                self.proc = subprocess.Popen([sys.executable, "-c", source, self.socket, *PRELOAD],
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                             env=self.env, cwd="/")
                self._ready_pipe = self.proc.stdout
            else:
                rfd, wfd = os.pipe()
                try:
                    with open(os.devnull, "rb") as devnull:
                        conn, pid = parent.fork("python", ["-c", source, self.socket, "--record", *VLLM_PRELOAD],
                                                self.env, "/", {0: devnull.fileno(), 1: wfd, 2: log.fileno()})
                finally:
                    os.close(wfd)
                self.proc = PreforkProcess(conn, pid, ["vllm zygote", self.socket])
                parent.children.append(self.proc)
                self._ready_pipe = os.fdopen(rfd, "rb")
        self._ready = False
        self.launcher = self.dir / "spawn"
        self.launcher.write_text(spawn_launcher(self.socket))
        self.launcher.chmod(0o755)

    def busy(self) -> bool:
        """Whether a child it forked still runs (it dies with the zygote: ``PR_SET_PDEATHSIG``)."""
        self.children = [c for c in self.children if c.poll() is None]
        return bool(self.children)

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` is what a new interpreter with ``env`` would be (a vLLM
        zygote, ready): ``env`` equals the zygote's wherever its vLLM imports or start-up hooks
        read, or holds what those imports wrote there. The second case is the engine core: it
        inherits what its API server's imports set (``TORCHINDUCTOR_CACHE_DIR``, a default set
        when absent, which a new engine core reads back and keeps). One write is not of that
        kind: OpenCV's import prepends its library directory to ``LD_LIBRARY_PATH``, so a new
        engine core's variable holds the directory twice and a forked one's once (the dynamic
        loader reads the variable only when a process starts; the search is the same).
        A zygote whose imports set a variable to a file they created (a temporary directory)
        does not start: every child would share it."""
        if self.reads is None:
            return dict(env) == self.env
        return all(env.get(k) == self.env.get(k) or (k in self.writes and env.get(k) == self.writes[k])
                   for k in (*self.reads, *HOOK_VARIABLES))

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for the zygote's imports.

        Raises:
            PreforkError: it exited or printed nothing within ``timeout`` seconds.
        """
        if self._ready:
            return
        assert self._ready_pipe is not None
        ready, _, _ = select.select([self._ready_pipe], [], [], timeout)
        line = self._ready_pipe.readline().decode(errors="replace") if ready else ""
        if not line.startswith("ready "):
            tail = self.log.read_text(errors="replace")[-4000:]
            self.close()
            raise PreforkError(f"the prefork zygote did not start ({line.strip() or 'no answer'}):\n{tail}")
        _, _, recorded = line.split(" ", 2)
        info = json.loads(recorded)
        self.reads = None if info["reads"] is None else frozenset(info["reads"])
        self.writes = info["writes"]
        self._ready = True

    def fork(self, kind: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
             fds: Mapping[int, int], spawn_executable: str | None = None,
             new_session: bool = False) -> tuple[socket.socket, int]:
        """A new child running ``argv`` (see :mod:`npu_conformance.prefork_zygote`); ``fds``
        maps the child's descriptor numbers to this process's descriptors; ``new_session``:
        the child calls ``os.setsid()`` first. Returns the connection that will carry the exit
        code, and the child's pid.

        Raises:
            PreforkError: the zygote refused or is gone.
        """
        self.wait_ready()
        body = json.dumps({"kind": kind, "argv": list(argv), "env": dict(env), "cwd": cwd,
                           "fds": list(fds), "spawn_executable": spawn_executable,
                           "session": new_session}).encode()
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
        if self._ready_pipe is not None:
            self._ready_pipe.close()
            self._ready_pipe = None
        shutil.rmtree(self.dir, ignore_errors=True)


def spawn_launcher(socket_path: str) -> str:
    """The executable ``multiprocessing.set_executable`` gets inside a forked ``vllm serve``:
    a shell script that runs :mod:`npu_conformance.prefork_spawn` (standard library, no site),
    which hands a spawn start (or vLLM's model-registry run, which the child points here too)
    to the zygote at ``socket_path`` and relays its exit code and signals; anything else runs
    the real interpreter."""
    proxy = Path(__file__).with_name("prefork_spawn.py")
    words = " ".join(shlex.quote(w) for w in (sys.executable, "-S", "-E", str(proxy), socket_path, sys.executable))
    return f"#!/bin/sh\nexec {words} \"$@\"\n"


_lock = threading.Lock()
_zygotes: OrderedDict[tuple, Zygote] = OrderedDict()


def _close_all() -> None:
    while _vllm_zygotes:
        _vllm_zygotes.popitem()[1].close()
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
            _evict(_zygotes, MAX_ZYGOTES)
        _zygotes.move_to_end(key)
        return zygote


def _evict(registry: OrderedDict, limit: int) -> None:
    """Close the least recently used zygotes of ``registry`` beyond ``limit``, but never one
    with a live child (a server a lab keeps, a vLLM zygote): its children would die with it."""
    for key, zygote in list(registry.items()):
        if len(registry) <= limit:
            return
        if zygote is not next(reversed(registry.values())) and not zygote.busy():
            del registry[key]
            zygote.close()


_vllm_zygotes: OrderedDict[int, Zygote] = OrderedDict()
#: the whole environments whose vLLM zygote could not start (their starts fork from the plain zygote)
_vllm_refused: set[tuple] = set()


def vllm_zygote_for(env: Mapping[str, str]) -> Zygote | None:
    """This process's vLLM zygote serving ``env`` (:meth:`Zygote.serves`), forked from
    :func:`zygote_for` ``env``'s when there is none; None when one cannot be made for ``env``
    (its vLLM imports failed or started a thread: the reason is printed once to stderr, and
    ``env``'s starts fork from the plain zygote)."""
    base = zygote_for(env)
    with _lock:
        for ident, zygote in list(_vllm_zygotes.items()):
            if zygote.proc.poll() is not None:  # ended (with its plain zygote, say)
                zygote.close()
                del _vllm_zygotes[ident]
            elif zygote.base is base and zygote.serves(env):
                _vllm_zygotes.move_to_end(ident)
                return zygote
        full = tuple(sorted(env.items()))
        if full in _vllm_refused:
            return None
        zygote = Zygote(env, parent=base)
        try:
            zygote.wait_ready()
        except PreforkError as exc:
            _vllm_refused.add(full)
            print(f"npu-harness prefork: no vLLM zygote for this environment; its starts fork from the plain "
                  f"zygote: {exc}", file=sys.stderr, flush=True)
            return None
        _vllm_zygotes[id(zygote)] = zygote
        _evict(_vllm_zygotes, MAX_VLLM_ZYGOTES)
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
    return _run_forked(cmd, ["-c", code, *args], "python", env, timeout)


def run_script(script: str | os.PathLike, args: Sequence[str] = (), *, env: Mapping[str, str],
               timeout: float, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
    text=True, timeout=timeout, cwd=cwd)``, forked from this process's zygote for ``env`` when
    :func:`enabled`; a new interpreter otherwise. For tests' probe scripts that start a
    ``vllm.LLM``: the script runs as ``python SCRIPT ARGS`` would run it.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed).
        PreforkError: the zygote did not start or fork.
    """
    cmd = [sys.executable, str(script), *args]
    if not enabled():
        return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return _run_forked(cmd, [os.path.abspath(script), *args], "script", env, timeout,
                       None if cwd is None else str(cwd))


def _run_forked(cmd: list[str], argv: list[str], kind: str, env: Mapping[str, str],
                timeout: float, cwd: str | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = launch(argv, env=env, stdout=out.fileno(), stderr=err.fileno(), kind=kind, cwd=cwd)
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
           cwd: str | None = None, kind: str = "serve", new_session: bool = False) -> PreforkProcess:
    """Start ``argv`` as a forked child with ``env``, stdin ``/dev/null``, ``stdout`` (a
    descriptor) as its stdout and ``stderr`` (default: ``stdout``) as its stderr. ``kind``
    ``serve`` or ``script``: ``argv`` is a Python script (the ``vllm`` console script) and its
    arguments; ``python``: what follows the interpreter in a ``python -c`` command line
    (:mod:`npu_conformance.prefork_zygote`). ``new_session``: as ``subprocess.Popen``'s
    ``start_new_session`` (``os.killpg(proc.pid, ...)`` then reaches the child and whatever it
    started, its engine core included: the zygote kills a spawned child whose launcher died).

    The child's ``multiprocessing`` spawns go to the same zygote (:func:`spawn_launcher`).

    Raises:
        PreforkError: the zygote did not start or fork.
    """
    zygote = (vllm_zygote_for(env) if kind == "serve" and mode() == "1" else None) or zygote_for(env)
    with open(os.devnull, "rb") as devnull:
        conn, pid = zygote.fork(kind, list(argv), env, cwd or os.getcwd(),
                                {0: devnull.fileno(), 1: stdout, 2: stdout if stderr is None else stderr},
                                spawn_executable=str(zygote.launcher), new_session=new_session)
    child = PreforkProcess(conn, pid, argv)
    zygote.children.append(child)
    return child
