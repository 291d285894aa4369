"""Where a vLLM start's time goes: one JSON line per milestone, in every vLLM process.

vLLM general plugin ``start_profile`` (entry point ``vllm.general_plugins``). Inert unless
``NPU_HARNESS_START_PROFILE`` names a directory; then each vLLM process (the ``vllm serve``
API server, its engine core, a ``vllm.LLM`` in a test, a ``vllm bench`` run) appends to
``<dir>/<pid>.jsonl``:

- one ``process`` record when the plugin first loads there: ``pid``, ``ppid`` (the process that
  asked for it: ``NPU_HARNESS_START_PPID`` when ``npu_conformance.prefork`` forked it), ``argv``, the
  process's creation time (``created``, from ``/proc``, 10 ms resolution), ``loaded`` (now:
  the interpreter start and vLLM's imports lie between the two), ``target``
  (``NPU_HARNESS_TARGET``), ``test`` (``PYTEST_CURRENT_TEST`` inherited from the test that
  started it) and ``label`` (``NPU_HARNESS_START_LABEL``: a fixture's own name for a start);
- one ``milestone`` record each time vLLM logs one of :data:`MILESTONES` (its time is the log
  record's, with ``test`` and ``label`` as they are then), so ``engine_init`` counts the engines
  started, whatever process they run in (a ``vllm.LLM`` with the engine in-process included);
- one ``exit`` record when the process ends normally (``SIGTERM`` included, which vLLM turns into
  an orderly exit): its CPU seconds, so a run's CPU can be split between starts and serving.

:mod:`npu_conformance.starts` reads the files: ``benchmarks/suite_profile.py`` turns them into
the start table of ``docs/benchmarks.md``, and the conformance plugin counts a test run's starts
against ``tests/start_budget.json``. Standard library only; it never raises into vLLM (an
unwritable directory drops the records).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

ENV_DIR = "NPU_HARNESS_START_PROFILE"
ENV_LABEL = "NPU_HARNESS_START_LABEL"
ENV_PPID = "NPU_HARNESS_START_PPID"

#: Milestone name -> the vLLM log message (a regular expression) that marks it.
MILESTONES: dict[str, str] = {
    "args": r"^non-default args",  # the API server parsed its command line (imports done)
    "engine_init": r"^Initializing a V1 LLM engine",  # an engine core begins (one per engine)
    "model_loaded": r"^Model loading took",
    "engine_ready": r"^init engine \(profile, create kv cache, warmup model\) took",
    "server_ready": r"^Starting vLLM (API )?server on",
}
_PATTERNS = {name: re.compile(rx) for name, rx in MILESTONES.items()}
_installed = False


def _process_created() -> float | None:
    """This process's creation time (epoch seconds, 10 ms resolution), or None off Linux.

    ``/proc/self/stat`` gives it in clock ticks since boot; the boot's epoch time is now minus
    ``CLOCK_BOOTTIME`` (``/proc/stat``'s ``btime`` would round it to the second)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _parent() -> int:
    """The process that started this one: ``NPU_HARNESS_START_PPID`` when the harness's prefork
    zygote forked it for a ``multiprocessing`` spawn (consumed here, so this process's own
    children do not inherit it), else ``os.getppid()``."""
    asked = os.environ.pop(ENV_PPID, "")
    return int(asked) if asked.isdigit() else os.getppid()


def _process_record() -> dict:
    return {
        "kind": "process", "pid": os.getpid(), "ppid": _parent(), "argv": sys.argv[:12],
        "created": _process_created(), "loaded": time.time(),
        "target": os.environ.get("NPU_HARNESS_TARGET", ""),
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "label": os.environ.get(ENV_LABEL, ""),
    }


#: The process whose ``process`` record is written (a forked child inherits the factory but
#: not vLLM's plugin loading, so its first milestone writes its record).
_recorded_pid = 0


def _write(directory: Path, record: dict) -> None:
    global _recorded_pid
    if _recorded_pid != os.getpid():
        _recorded_pid = os.getpid()
        if record.get("kind") != "process":
            _write(directory, _process_record())
    try:
        with open(directory / f"{os.getpid()}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    except OSError:
        pass


def _milestone_factory(directory: Path, inner):
    """A ``logging`` record factory that records :data:`MILESTONES` and defers to ``inner``.

    A record factory, not a handler: vLLM reapplies its ``dictConfig`` (which replaces the
    ``vllm`` logger's handlers) when an engine configures logging, and wraps whatever factory
    it finds instead of replacing it."""

    def make(*args, **kwargs):
        record = inner(*args, **kwargs)
        if record.name.startswith("vllm") and isinstance(record.msg, str):
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a broken log call is vLLM's, not ours to raise
                return record
            for name, pattern in _PATTERNS.items():
                if pattern.search(message):
                    _write(directory, {"kind": "milestone", "name": name, "pid": os.getpid(),
                                       "t": record.created, "message": message[:200],
                                       "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                       "label": os.environ.get(ENV_LABEL, "")})
                    break
        return record

    return make


def register() -> None:
    """vLLM general plugin: start recording in this process when ``NPU_HARNESS_START_PROFILE``
    is set (idempotent; never raises)."""
    global _installed
    directory = os.environ.get(ENV_DIR, "")
    if _installed or not directory:
        return
    _installed = True
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    _write(path, _process_record())
    logging.setLogRecordFactory(_milestone_factory(path, logging.getLogRecordFactory()))
    atexit.register(_exit_record, path)
    os.register_at_fork(after_in_child=lambda: atexit.register(_exit_record, path))


def _exit_record(directory: Path) -> None:
    """The ``exit`` record: this process's CPU seconds (user + system) and its end time."""
    times = os.times()
    _write(directory, {"kind": "exit", "pid": os.getpid(), "t": time.time(), "cpu_s": times.user + times.system})
