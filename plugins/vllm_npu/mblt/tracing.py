"""qbruntime NPU event tracing behind vLLM's worker profiler hook.

Facts (seed "NPU Event Tracing", reference §2 and §9): ``start_tracing_events(path)`` returns a
bool and the Chrome-trace JSON is written only by ``stop_tracing_events()``; one trace records per
process, and qbruntime cannot say whether one is running, so this module keeps the process-global
owner (:data:`_ACTIVE_TRACER`) and also looks at the benchmark helpers' handle of
transformers-mblt / mblt-model-zoo when those modules are already imported (never importing
them). A second start is refused with a warning, not an error; a stop with nothing running only
logs; a trace that cannot be started or written is an error; during shutdown it is logged and
skipped. Files are ``{hostname}_{pid}.mblt_npu_rank{rank}.{time_ns}.json`` (torch's
tensorboard_trace_handler convention).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["EXTERNAL_TRACE_MODULES", "MbltTraceError", "MbltTracer", "active_tracer"]

logger = logging.getLogger("vllm.vllm_npu.mblt")

#: Modules whose ``_ACTIVE_QBRUNTIME_TRACE_HANDLE`` marks a trace started by their benchmark
#: helpers; consulted only if already in ``sys.modules``.
EXTERNAL_TRACE_MODULES: tuple[str, ...] = (
    "transformers_mblt.utils.benchmark_utils",
    "mblt_model_zoo.hf_transformers.utils.benchmark_utils",
)

_ACTIVE_TRACER: MbltTracer | None = None
_ACTIVE_LOCK = threading.Lock()


class MbltTraceError(RuntimeError):
    """A trace directory that cannot be used, or a trace that cannot be started or written."""


def active_tracer() -> MbltTracer | None:
    """The tracer whose trace is recording in this process, if any."""
    return _ACTIVE_TRACER


def _external_trace_owner() -> str | None:
    for name in EXTERNAL_TRACE_MODULES:
        module = sys.modules.get(name)
        handle = getattr(module, "_ACTIVE_QBRUNTIME_TRACE_HANDLE", None) if module else None
        if handle is not None:
            return name
    return None


class MbltTracer:
    """One rank's NPU event traces, written into ``trace_dir``.

    Args:
        runtime: module with ``start_tracing_events(path) -> bool`` and ``stop_tracing_events()``.
        trace_dir: local directory for the trace files (created on start).
        rank: the worker's rank (>= 0), part of the file name.
        hostname, pid: file-name parts; default ``socket.gethostname()`` / ``os.getpid()``.
        clock_ns: nanosecond clock for the file name (default :func:`time.time_ns`).

    Raises:
        MbltTraceError: ``trace_dir`` is empty or remote (contains ``://``).
        ValueError: ``rank`` < 0.
    """

    def __init__(self, runtime: Any, trace_dir: str, rank: int, hostname: str | None = None,
                 pid: int | None = None, clock_ns: Callable[[], int] = time.time_ns) -> None:
        if not trace_dir or "://" in str(trace_dir):
            raise MbltTraceError(
                f"MBLT NPU traces are written by qbruntime to a local directory; trace_dir="
                f"{trace_dir!r} is not one"
            )
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        self.runtime = runtime
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self._clock_ns = clock_ns
        self._path: Path | None = None

    @property
    def running(self) -> bool:
        """Whether this tracer's trace is recording."""
        return _ACTIVE_TRACER is self

    @property
    def path(self) -> Path | None:
        """The file of the running (or last stopped) trace."""
        return self._path

    def start(self) -> Path | None:
        """Start recording into a new file; return its path (written at :meth:`stop`).

        Returns None, with a warning, when a trace is already recording in this process
        (this tracer's, another's, or a benchmark helper's).

        Raises:
            MbltTraceError: qbruntime refused (``start_tracing_events`` returned False).
            OSError: ``trace_dir`` cannot be created.
        """
        global _ACTIVE_TRACER
        with _ACTIVE_LOCK:
            if _ACTIVE_TRACER is not None:
                logger.warning(
                    "An MBLT NPU trace is already recording to %s; refusing to start another "
                    "(one qbruntime trace per process).", _ACTIVE_TRACER.path)
                return None
            owner = _external_trace_owner()
            if owner is not None:
                logger.warning(
                    "A qbruntime trace started by %s is recording; refusing to start an MBLT "
                    "NPU trace (one qbruntime trace per process).", owner)
                return None
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            path = self.trace_dir / (
                f"{self.hostname}_{self.pid}.mblt_npu_rank{self.rank}.{self._clock_ns()}.json")
            if not self.runtime.start_tracing_events(str(path)):
                raise MbltTraceError(f"qbruntime refused to start an MBLT NPU trace at {path}.")
            _ACTIVE_TRACER = self
            self._path = path
        logger.info("Started MBLT NPU trace: %s", path)
        return path

    def stop(self) -> Path | None:
        """Stop this tracer's trace and return the written file; None (logged) if it is not
        recording.

        Raises:
            MbltTraceError: the file is missing after ``stop_tracing_events()``.
            Exception: whatever ``stop_tracing_events()`` raised (the trace counts as stopped).
        """
        global _ACTIVE_TRACER
        with _ACTIVE_LOCK:
            if _ACTIVE_TRACER is not self:
                logger.info("No MBLT NPU trace of rank %d is recording; nothing to stop.",
                            self.rank)
                return None
            path = self._path
            try:
                self.runtime.stop_tracing_events()
            finally:
                _ACTIVE_TRACER = None
        assert path is not None
        if not path.is_file():
            raise MbltTraceError(
                f"qbruntime stopped the MBLT NPU trace, but its log could not be written to {path}."
            )
        logger.info("Wrote MBLT NPU trace: %s", path)
        return path

    def shutdown(self) -> Path | None:
        """Stop a running trace for teardown; any failure is logged and swallowed."""
        if not self.running:
            return None
        try:
            return self.stop()
        except Exception:  # noqa: BLE001 - shutdown must go on
            logger.exception("Could not write the MBLT NPU trace during shutdown; skipping it.")
            return None
