"""The prefork zygote: an interpreter that imported vLLM's third-party dependencies once and
forks a ``vllm serve`` (or the engine core it spawns, or a harness probe's ``python -c``) on
request.

A zygote started with ``SOCKET PRELOAD... --record MODULE...`` (a vLLM zygote, itself forked
from a plain zygote with the environment of one start) imports the ``--record`` modules last,
recording every read and write of ``os.environ`` they make (its ``ready`` line carries both),
refuses a request whose environment differs where they read (unless it holds what they wrote
there), and replays their writes in each child; it does not start when they set a variable
to a file they created.

This file is the zygote's whole program. :mod:`npu_conformance.prefork` starts it as
``python -c <this file's source> SOCKET PRELOAD...`` (so nothing of ``npu_conformance`` is
imported into it, and ``sys.path[0]`` is the same ``''`` a ``python -c`` has) with the
environment its children will be started with, minus the variables :func:`prefork.import_key`
shows that no preloaded module reads at import. Standard library only until :func:`main`
imports ``PRELOAD``.

Protocol (one Unix stream connection per child): the client sends one length-prefixed JSON
request (``kind``, ``argv``, ``env``, ``cwd``, ``fds``: the descriptor numbers the child gets)
with the descriptors themselves attached (``SCM_RIGHTS``); the zygote answers the child's pid
(8 bytes), then its exit code (4 bytes, :func:`os.waitstatus_to_exitcode`: negative for a
signal) when it ends. A connection that closes before that kills the child (``SIGKILL``):
whoever asked for it is gone.

What a child is (what a new interpreter running the same command would be, except what the
docstring of :mod:`npu_conformance.prefork` lists):

- ``kind == "serve"`` (or ``"script"``): ``argv[0]`` is a Python script (the ``vllm`` console
  script, a test's probe); it runs as ``__main__`` (``runpy.run_path``) with ``sys.argv = argv``
  and ``sys.path[0]`` its directory, as ``python SCRIPT ARGS`` would run it;
- ``kind == "python"``: ``argv`` is ``[*FLAGS, "-c", PROGRAM, *ARGS]``, what follows the
  interpreter in a ``python -c`` command line, where ``FLAGS`` must be none or this
  interpreter's own (else the answer is pid 0: refused); ``PROGRAM`` runs as a ``python -c``
  would run it (``sys.argv == ["-c", *ARGS]``, a new ``__main__``, ``sys.path[0] == ""``);
- ``kind == "spawn"``: the same, for :mod:`multiprocessing`'s spawn start method: ``PROGRAM``
  must be its ``spawn_main`` call and ``ARGS`` ``["--multiprocessing-fork"]``;
- ``kind == "module"``: ``argv`` is ``["-m", MODULE]`` with ``MODULE`` in :data:`MODULES`; it
  runs as ``python -m MODULE`` would run it (``runpy.run_module`` as ``__main__``,
  ``sys.argv[0]`` its file, ``sys.path[0]`` the directory);
- with ``spawn_executable`` in the request, :func:`multiprocessing.set_executable` gets it
  first (a launcher of ``npu_conformance/prefork_spawn.py``: the child's spawns come back here),
  and so does vLLM's model-registry run (:func:`_route_module_runs`);
- with ``"session": true``, it starts a new session (``os.setsid``, as ``subprocess.Popen``'s
  ``start_new_session``): its pid is its process group's id;
- its descriptors are exactly ``fds`` (every other one is closed), its environment exactly
  ``env``, its directory ``cwd``; the interpreter's exit (non-daemon threads joined, ``atexit``
  handlers run, stdio flushed) follows the program's end, with its exit code.
"""

import ctypes
import importlib
import json
import os
import re
import select
import signal
import socket
import struct
import sys
import threading
import traceback

PR_SET_PDEATHSIG = 1
SPAWN_PROGRAM = re.compile(r"from multiprocessing\.spawn import spawn_main; "
                           r"spawn_main\(tracker_fd=\d+, pipe_handle=\d+\)")
MAX_FDS = 250
#: Modules a child may run as ``python -m MODULE`` (``kind == "module"``; the same tuple as
#: ``prefork_spawn.MODULES``). vLLM inspects a model class it has not met (no entry in its
#: ``modelinfos`` cache) in a new interpreter running its registry module, which imports vLLM,
#: torch and the model's module again: about 6 s per architecture on 2 cores.
REGISTRY = "vllm.model_executor.models.registry"
MODULES = (REGISTRY,)
#: Set by ``main`` in a zygote that imported ``--record`` modules (a "vLLM zygote", itself forked
#: from a zygote for its environment): which variables those imports read (``None``: all, the
#: environment was iterated), and what they wrote (``None``: deleted), replayed in every child.
_IMPORT_READS: "set[str] | None" = set()
_IMPORT_WRITES: dict = {}
_RECORDED = False


def _die_with_parent(parent: "int | None" = None) -> None:
    """Ask the kernel for SIGKILL when this process's parent ends (the process that started
    the zygote; in a child, the zygote: a child never outlives it as an orphan). ``parent``:
    the pid it must still have, else it ends now (its parent ended before the request)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    if len(data) < 4:
        raise ValueError("short request")
    size = struct.unpack("!I", data[:4])[0]
    body = bytearray(data[4:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return json.loads(bytes(body)), list(fds)


def _interpreter_exit(code: object) -> "NoReturn":  # noqa: F821
    """End the child as an interpreter ends: join non-daemon threads, run ``atexit``, flush."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        status = 1
    try:
        threading._shutdown()  # what Py_FinalizeEx does first
    except Exception:
        traceback.print_exc()
    try:
        import atexit

        atexit._run_exitfuncs()
    except Exception:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)  # as the interpreter's exit(): sys.exit(-1) ends with 255


def _become(request: dict, fds: list[int]) -> "NoReturn":  # noqa: F821
    """In the forked child: take the requested descriptors, environment and directory, then
    run the program. Never returns."""
    targets = [int(n) for n in request["fds"]]
    floor = max([*targets, *fds, 2]) + 1
    moved = [_dup_at_least(fd, floor) for fd in fds]
    keep = set()
    for src, dst in zip(moved, targets):
        os.dup2(src, dst, inheritable=True)
        keep.add(dst)
    for fd in _open_fds():
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in _IMPORT_WRITES.items():  # what the zygote's vLLM imports wrote, as they would
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.chdir(request["cwd"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if not _RECORDED:  # a vLLM zygote ran them for itself, with the variables they read
        _activate_env_hooks()
    argv = list(request["argv"])
    _fresh_process_state([sys.executable, *argv])
    code: object = 0
    try:
        if request.get("spawn_executable"):
            import multiprocessing

            multiprocessing.set_executable(request["spawn_executable"])
            _route_module_runs(request["spawn_executable"])
        if request["kind"] == "module":
            import runpy

            sys.argv = list(argv[1:])  # run_module puts the module's file first (alter_sys)
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif request["kind"] in ("serve", "script"):
            import runpy

            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            import types

            i = argv.index("-c")
            program = argv[i + 1]
            sys.argv = ["-c", *argv[i + 2:]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            sys.path[0] = ""
            exec(compile(program, "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # an uncaught exception: what the interpreter prints, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    _interpreter_exit(code)


def _route_module_runs(launcher: str) -> None:
    """Point vLLM's model-registry run at ``launcher`` (which hands ``-m`` runs of
    :data:`MODULES` to this zygote): vLLM documents its ``_SUBPROCESS_COMMAND`` as the value to
    change when ``sys.executable`` is not what should run it. Set now when the child already
    imported the registry (a vLLM zygote's child), else the moment its import finishes."""
    command = [launcher, "-m", REGISTRY]
    module = sys.modules.get(REGISTRY)
    if module is not None:
        module._SUBPROCESS_COMMAND = command
    else:
        sys.meta_path.insert(0, _AfterImport(REGISTRY, lambda m: setattr(m, "_SUBPROCESS_COMMAND", command)))


class _AfterImport:
    """A meta path finder that runs ``then(module)`` once ``name``'s import has executed it
    (found by the finders after this one), then leaves ``sys.meta_path``."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def run(module):
            exec_module(module)
            then(module)

        loader.exec_module = run
        return spec


def _fresh_process_state(cmdline: list) -> None:
    """What a new process would have that a fork inherits: its own command line in ``ps`` and
    ``/proc/PID/cmdline`` (``setproctitle``, a vLLM dependency; the zygote's own would show
    otherwise) and numpy's legacy global random state seeded afresh (the import seeded it once,
    in the zygote)."""
    try:
        import setproctitle

        setproctitle.setproctitle(" ".join(cmdline))
    except ImportError:
        pass
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _dup_at_least(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def _open_fds() -> list[int]:
    names = os.listdir("/proc/self/fd")
    return sorted(int(n) for n in names)


def _activate_env_hooks() -> None:
    """Run what this environment's start-up hooks would have run for the child's environment.

    The one hook that reads the environment at interpreter start is ours
    (``npu_harness_alias.pth``: ``NPU_HARNESS_TARGET`` maps vendor module names to the
    simulators); the zygote started without those variables, so it runs here, once."""
    if os.environ.get("NPUSIM_ALIAS") or os.environ.get("NPU_HARNESS_TARGET"):
        try:
            from npusim.alias import activate_from_env
        except ImportError:
            return
        activate_from_env()


def _serve(listener: socket.socket) -> None:
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (its client's connection, pid)
    watched: dict[socket.socket, int] = {}  # a client's open connection -> its child's pid
    while True:
        readable, _, _ = select.select([listener, *watched, *children], [], [])
        for r in readable:
            if r is listener:
                _start_child(listener, children, watched)
            elif isinstance(r, int):  # a child ended: reap it, tell its client
                conn, pid = children.pop(r)
                watched.pop(conn, None)
                _, status = os.waitpid(pid, 0)
                os.close(r)
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()
            else:  # a client's connection is readable only when the client closed it
                try:
                    data = r.recv(1)
                except OSError:
                    data = b""
                pid = watched.pop(r, None)  # None: its child's end, just handled, closed it
                if not data and pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _acceptable(request: dict) -> bool:
    """``serve`` / ``script``; ``module`` running one of :data:`MODULES`; or ``python`` / ``spawn`` whose argv is ``[*FLAGS, "-c", PROGRAM, *ARGS]``
    with FLAGS none or this interpreter's own (``-B``, ``-X``, ``-W``... as ``multiprocessing``
    derives them; a child forked from here has exactly these, and a new interpreter with the
    zygote's environment and no flags would too); ``spawn`` also needs PROGRAM to be
    ``multiprocessing``'s ``spawn_main`` call and ARGS ``["--multiprocessing-fork"]``."""
    kind = request.get("kind")
    if _RECORDED and not _same_import_env(request.get("env", {})):
        return False
    if kind in ("serve", "script"):
        return True
    if kind == "module":
        return list(request.get("argv", ())) in (["-m", m] for m in MODULES)
    if kind not in ("python", "spawn"):
        return False
    import subprocess

    argv = list(request.get("argv", ()))
    if "-c" not in argv:
        return False
    i = argv.index("-c")
    if argv[:i] not in ([], subprocess._args_from_interpreter_flags()) or len(argv) < i + 2:
        return False
    return kind == "python" or (bool(SPAWN_PROGRAM.fullmatch(argv[i + 1]))
                                and argv[i + 2:] == ["--multiprocessing-fork"])


#: Variables read before a vLLM zygote's recording starts (its start-up hook, ``_activate_env_hooks``).
HOOK_VARIABLES = ("NPU_HARNESS_TARGET", "NPUSIM_ALIAS")


def _same_import_env(env: dict) -> bool:
    """Whether ``env`` equals this (vLLM) zygote's environment wherever its recorded imports,
    or its start-up hooks, read it."""
    return not _import_env_differs(env)


def _import_env_differs(env: dict) -> "list[str]":
    """The variables where ``env`` differs from this (vLLM) zygote's environment as far as its
    recorded imports and start-up hooks read it (every variable when the imports iterated the
    environment)."""
    if _IMPORT_READS is None:
        return sorted(k for k in _ZYGOTE_ENV.keys() | env.keys() if env.get(k) != _ZYGOTE_ENV.get(k))
    return sorted({k for k in (*_IMPORT_READS, *HOOK_VARIABLES) if not _same_value(env, k)})


def _same_value(env: dict, key: str) -> bool:
    """``env[key]`` is what the imports read, or what they wrote there (a process they started
    inherits it: a default set when absent is then read back as set; see ``prefork.Zygote.serves``)."""
    value = env.get(key)
    return value == _ZYGOTE_ENV.get(key) or (key in _IMPORT_WRITES and value == _IMPORT_WRITES[key])


def _created_during(since: float) -> "list[str]":
    """Variables the recorded imports set to a file or directory they created (a temporary
    directory of the process, say): shared by every child, which a new process would not."""
    made = []
    for key, value in _IMPORT_WRITES.items():
        try:
            if value and os.path.isabs(value) and os.stat(value).st_ctime >= since:
                made.append(f"{key}={value}")
        except OSError:
            pass
    return made


_ZYGOTE_ENV: dict = {}


def _import_recorded(names: list) -> None:
    """Import ``names`` while recording every read and write of ``os.environ``."""
    global _IMPORT_READS
    cls = os._Environ
    saved = {name: cls.__dict__[name] for name in ("__getitem__", "__setitem__", "__delitem__", "__iter__")}
    reads: "set[str] | None" = set()

    def getitem(self, key):
        if reads is not None:
            reads.add(key)
        return saved["__getitem__"](self, key)

    def setitem(self, key, value):
        _IMPORT_WRITES[key] = value
        saved["__setitem__"](self, key, value)

    def delitem(self, key):
        _IMPORT_WRITES[key] = None
        saved["__delitem__"](self, key)

    def iterate(self):
        nonlocal reads
        reads = None
        return saved["__iter__"](self)

    _ZYGOTE_ENV.update(os.environ)
    cls.__getitem__, cls.__setitem__, cls.__delitem__, cls.__iter__ = getitem, setitem, delitem, iterate
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
    _IMPORT_READS = reads


def _start_child(listener: socket.socket, children: dict, watched: dict) -> None:
    conn, _ = listener.accept()
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError) as exc:
        print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return
    if not _acceptable(request):
        differ = _import_env_differs(request.get("env", {})) if _RECORDED else []
        why = f" (its environment differs where the imports read: {', '.join(differ)})" if differ else ""
        print(f"zygote: refused {request.get('kind')!r} argv {request.get('argv')!r}{why}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(struct.pack("!q", 0))  # pid 0: refused (the spawn launcher execs instead)
        except OSError:
            pass
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # a new session is made before the client learns the pid (as Popen's start_new_session is
    # before Popen returns): the child says so on this pipe
    session_r, session_w = os.pipe() if request.get("session") else (-1, -1)
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _die_with_parent(zygote_pid)
            listener.detach()
            conn.detach()
            for c in watched:
                c.detach()
            for c, _ in children.values():
                c.detach()
            if session_w >= 0:
                os.close(session_r)
                os.setsid()
                os.write(session_w, b"s")
                os.close(session_w)
            _become(request, fds)
        finally:
            os._exit(70)
    if session_w >= 0:
        os.close(session_w)
        os.read(session_r, 1)  # b"" if the child died first
        os.close(session_r)
    for fd in fds:
        os.close(fd)
    children[os.pidfd_open(pid)] = (conn, pid)
    watched[conn] = pid
    try:
        conn.sendall(struct.pack("!q", pid))
    except OSError:
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    _die_with_parent()
    global _RECORDED
    sock_path, *preload = argv
    recorded = []
    if "--record" in preload:
        i = preload.index("--record")
        preload, recorded = preload[:i], preload[i + 1:]
    os.chdir("/")
    for name in preload:
        importlib.import_module(name)
    if recorded:
        import time

        since = time.time() - 1.0  # st_ctime has the file system's granularity
        _import_recorded(recorded)
        _RECORDED = True
        made = _created_during(since)
        if made:
            print(f"zygote: the imports created {', '.join(made)}: every child would share it, a new "
                  "process makes its own; refusing to fork", file=sys.stderr, flush=True)
            sys.exit(3)
    # fork() copies the calling thread only. A Python thread would be lost mid-work: refuse.
    # torch's import leaves one idle native thread (a pool waiting on a futex); forking after
    # ``import torch`` is what vLLM's own ``fork`` start method and torch's DataLoader do.
    if threading.active_count() != 1:
        print(f"zygote: Python threads after the imports: {threading.enumerate()}; refusing to fork",
              file=sys.stderr, flush=True)
        sys.exit(3)
    print(f"zygote: pid {os.getpid()}, {len(os.listdir('/proc/self/task'))} native threads, "
          f"{len(sys.modules)} modules", file=sys.stderr, flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    try:
        import setproctitle

        setproctitle.setproctitle(f"npu-harness prefork zygote {sock_path}")
    except ImportError:
        pass
    reads = None if _IMPORT_READS is None else sorted(_IMPORT_READS)
    print(f"ready {os.getpid()} " + json.dumps({"reads": reads, "writes": _IMPORT_WRITES}), flush=True)
    os.dup2(2, 1)  # stdout (the pipe the starter waits on) -> the zygote's log
    _serve(listener)


if __name__ == "__main__":
    main(sys.argv[1:])
