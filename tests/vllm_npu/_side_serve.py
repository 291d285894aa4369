"""``SideServe``: a short ``vllm serve`` beside a test module's main server, expected to exit (a
refused start) or only to log a line, then stopped with its engine-core child."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from npu_conformance import vllm_server

TIMEOUT_S = 240


class SideServe:
    """``vllm serve MODEL ARGS`` on ``mblt-sim`` in its own process group, logging to ``log``.

    Started at construction so several run at once; :meth:`result` waits for the exit or, with
    ``until``, for that text in the log (at most :data:`TIMEOUT_S` seconds), then stops it.
    """

    def __init__(self, model: Path, args: list[str], log: Path, until: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        args = ["serve", str(model), "--host", "127.0.0.1",
               "--port", str(vllm_server.free_port()), *args]
        self.log, self.until = log, until
        self._fh = open(log, "w")  # noqa: SIM115 - closed in stop()
        # forked from the prefork zygote like every other start; its own session, so that
        # stop() ends the engine core with it
        self.proc = vllm_server.popen_vllm(args, stdout=self._fh.fileno(), new_session=True,
                                           env=vllm_server.vllm_env("mblt-sim", **dict(env or {})))

    def result(self) -> tuple[int | None, str]:
        """(exit code, or None when ``until`` was logged first; the log)."""
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                if self.until and self.until in self.log.read_text(errors="replace"):
                    return None, self.log.read_text(errors="replace")
                time.sleep(0.5)
            return self.proc.poll(), self.log.read_text(errors="replace")
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        if not self._fh.closed:
            self._fh.close()
