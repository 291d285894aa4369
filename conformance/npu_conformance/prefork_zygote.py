"""The prefork zygote: an interpreter that imported vLLM's third-party dependencies once and
forks a ``vllm serve`` (or the engine core it spawns, or a harness probe's ``python -c``) on
request.

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

- ``kind == "serve"``: ``argv[0]`` is the ``vllm`` console script; it runs as ``__main__``
  (``runpy.run_path``) with ``sys.argv = argv`` and ``sys.path[0]`` its directory;
- ``kind == "python"``: ``argv`` is ``[*FLAGS, "-c", PROGRAM, *ARGS]``, what follows the
  interpreter in a ``python -c`` command line, where ``FLAGS`` must be none or this
  interpreter's own (else the answer is pid 0: refused); ``PROGRAM`` runs as a ``python -c``
  would run it (``sys.argv == ["-c", *ARGS]``, a new ``__main__``, ``sys.path[0] == ""``);
- ``kind == "spawn"``: the same, for :mod:`multiprocessing`'s spawn start method: ``PROGRAM``
  must be its ``spawn_main`` call and ``ARGS`` ``["--multiprocessing-fork"]``;
- with ``spawn_executable`` in the request, :func:`multiprocessing.set_executable` gets it
  first (a launcher of ``npu_conformance/prefork_spawn.py``: the child's spawns come back here);
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


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the process that started the zygote ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
    os.chdir(request["cwd"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _activate_env_hooks()
    argv = list(request["argv"])
    _fresh_process_state([sys.executable, *argv])
    code: object = 0
    try:
        if request.get("spawn_executable"):
            import multiprocessing

            multiprocessing.set_executable(request["spawn_executable"])
        if request["kind"] == "serve":
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
    """``serve``; or ``python`` / ``spawn`` whose argv is ``[*FLAGS, "-c", PROGRAM, *ARGS]``
    with FLAGS none or this interpreter's own (``-B``, ``-X``, ``-W``... as ``multiprocessing``
    derives them; a child forked from here has exactly these, and a new interpreter with the
    zygote's environment and no flags would too); ``spawn`` also needs PROGRAM to be
    ``multiprocessing``'s ``spawn_main`` call and ARGS ``["--multiprocessing-fork"]``."""
    kind = request.get("kind")
    if kind == "serve":
        return True
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


def _start_child(listener: socket.socket, children: dict, watched: dict) -> None:
    conn, _ = listener.accept()
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError) as exc:
        print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return
    if not _acceptable(request):
        print(f"zygote: refused {request.get('kind')!r} argv {request.get('argv')!r}", file=sys.stderr, flush=True)
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
    pid = os.fork()
    if pid == 0:
        try:
            listener.detach()
            conn.detach()
            for c in watched:
                c.detach()
            for c, _ in children.values():
                c.detach()
            _become(request, fds)
        finally:
            os._exit(70)
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
    sock_path, *preload = argv
    os.chdir("/")
    for name in preload:
        importlib.import_module(name)
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
    print(f"ready {os.getpid()}", flush=True)
    os.dup2(2, 1)  # stdout (the pipe the starter waits on) -> the zygote's log
    _serve(listener)


if __name__ == "__main__":
    main(sys.argv[1:])
