"""A ``multiprocessing`` spawn start, or vLLM's model-registry run, handed to the prefork zygote
(``python -S -E``; standard library only).

``multiprocessing.set_executable`` points a forked ``vllm serve`` at a launcher script that
runs ``python -S -E prefork_spawn.py SOCKET PYTHON ARGS...``. ``ARGS`` are what the spawn start
method passes its interpreter. When they end in ``-c <spawn_main program>
--multiprocessing-fork`` (vLLM's engine core and anything else ``multiprocessing`` spawns), and
the zygote accepts their interpreter flags (its own: a forked process inherits them), or when
they are ``-m MODULE`` with ``MODULE`` in :data:`MODULES` (vLLM's model-registry inspection: the
zygote points its ``_SUBPROCESS_COMMAND`` here), and the zygote accepts the environment, this
process:

1. hands every descriptor it holds (the spawn pipes and the resource tracker's included, at
   the same numbers), its environment and directory to the zygote, which forks the child;
2. closes its own copies (so the spawner's sentinel follows the real child);
3. forwards ``SIGTERM``, ``SIGINT``, ``SIGHUP``, ``SIGQUIT``, ``SIGUSR1`` and ``SIGUSR2`` to the
   child; if it is killed itself, the zygote kills the child (its connection closed);
4. ends as the child ended: the same exit code, or the same signal.

Anything else (a resource tracker, a forkserver, other interpreter flags), and whatever the
zygote refuses, runs ``PYTHON ARGS...`` itself (``exec``). With ``NPU_HARNESS_START_PROFILE`` set, the child's environment gets
``NPU_HARNESS_START_PPID`` (this process's parent: the process that asked for the spawn), so
``vllm_npu.start_profile`` records the parent a spawned child would have.
"""

import json
import os
import re
import signal
import socket
import struct
import sys

SPAWN_PROGRAM = re.compile(r"from multiprocessing\.spawn import spawn_main; "
                           r"spawn_main\(tracker_fd=\d+, pipe_handle=\d+\)")
#: Modules run as ``python -m MODULE`` that the zygote forks (the same tuple as
#: ``prefork_zygote.MODULES``): vLLM inspects a model class it has not met in a new interpreter
#: running its registry module, which imports vLLM, torch and the model's module.
MODULES = ("vllm.model_executor.models.registry",)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> None:
    sock_path, python, *args = argv
    if len(args) >= 3 and args[-3] == "-c" and SPAWN_PROGRAM.fullmatch(args[-2]) and args[-1] == "--multiprocessing-fork":
        kind = "spawn"
    elif len(args) == 2 and args[0] == "-m" and args[1] in MODULES:
        kind = "module"
    else:
        os.execv(python, [python, *args])
    pending: list[int] = []
    child = {"pid": None}

    def forward(signum: int, _frame: object) -> None:
        if child["pid"] is None:
            pending.append(signum)
        else:
            try:
                os.kill(child["pid"], signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if fd != conn.fileno() and _is_open(fd)]
    env = dict(os.environ)
    if env.get("NPU_HARNESS_START_PROFILE"):
        env["NPU_HARNESS_START_PPID"] = str(os.getppid())
    body = json.dumps({"kind": kind, "argv": args, "env": env, "cwd": os.getcwd(), "fds": fds}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)
    pid = struct.unpack("!q", _recv(conn, 8))[0]
    if pid == 0:  # refused (other interpreter flags, environment): what would have run
        conn.close()
        os.execv(python, [python, *args])
    child["pid"] = pid
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for sig in pending:
        forward(sig, None)
    code = struct.unpack("!i", _recv(conn, 4))[0]
    sys.stdout.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _recv(conn: socket.socket, n: int) -> bytes:
    raw = b""
    while len(raw) < n:
        chunk = conn.recv(n - len(raw))
        if not chunk:  # the zygote is gone, and its children with it
            os._exit(128 + signal.SIGKILL)
        raw += chunk
    return raw


if __name__ == "__main__":
    main(sys.argv[1:])
