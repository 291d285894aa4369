"""``QbRuntimeError`` and the glog-style detail lines qbruntime prints to stderr.

qbruntime's C++ core reports a failure twice: a detail line on stderr in glog format
(``E1129 08:25:18.639 18099 model.cc:123] <detail>``) and a Python ``QbRuntimeError`` whose
message names only the status code. :func:`fail` does both: it prints the line (unless the log
level is ``Off``) and returns the exception for the caller to raise.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["DOCS_URL", "INFERRED_STATUSES", "STATUS_CODES", "QbRuntimeError", "fail", "glog_line", "set_log_threshold"]

DOCS_URL = "https://docs.mobilint.com/v1.5/doxygen/html_en/group__CPPAPI.html"

#: Status codes the simulator raises. Every one is a status string of the real qbruntime 1.5.0
#: core (read from the ``mobilint-qb-runtime`` 1.5.0 wheel's ``qbruntime*.so``). Which status the
#: board reports after a given detail line is known only where the line and status appear
#: together in vendor code; the others are our choice among the real strings, listed in
#: :data:`INFERRED_STATUSES` with the situation they stand for.
STATUS_CODES: tuple[str, ...] = (
    "InternalError",
    "NotImplemented",
    "BadAlloc",
    "Acc_DeviceNotFound",
    "Acc_CoreAlreadyInUse",
    "Driver_FailedToClaimCores",
    "Driver_NotInitialized",
    "Model_FailedToLoadMXQ",
    "Model_NotLaunched",
    "Model_AlreadyLaunched",
    "Model_CacheOverflow",
    "Model_InvalidBatchParam",
    "Model_ShapeMismatched",
    "Model_NumCacheMismatched",
    "Model_BufferSizeMismatched",
    "Model_CacheNotFound",
    "Model_FailedToOpenCacheFile",
    "Model_MXQAndModelConfigNotMatch",
    "Model_InvalidVariantIdx",
)

#: Statuses the simulator raises where no board or vendor code showed which status follows
#: (real strings, our pairing): status -> the situation.
INFERRED_STATUSES: dict[str, str] = {
    "Driver_FailedToClaimCores": "auto core allocation finds fewer free cores than the mode needs "
                                 "(the glog line 'Core allocation failed - available cores : N vs "
                                 "requested cores : M' is the real one)",
    "Model_ShapeMismatched": "an input item longer than the MXQ's max width",
    "Model_InvalidBatchParam": "a cache_id >= the MXQ's batch size K in dump/load_cache_memory "
                               "(BatchParam errors in infer are the documented use)",
    "Model_NumCacheMismatched": "load_cache_memory given the wrong number of blobs",
    "Model_BufferSizeMismatched": "a KV blob or cache file of the wrong size",
    "Model_CacheNotFound": "no KV cache with the given name or layer hash",
    "Model_FailedToOpenCacheFile": "load_cache_memory_from: a cache file is missing",
    "Model_MXQAndModelConfigNotMatch": "CoreMode.Auto on an MXQ compiled for several core modes",
}

# glog severity letters; the simulator only prints errors (E) and warnings (W).
_threshold = 3  # LogLevel.Warn (the real default): W and E lines; LogLevel.Off (6) silences them


def set_log_threshold(level: int) -> None:
    """Print detail lines of severity ``>= level`` (``LogLevel`` values: 1 Debug .. 5 Fatal, 6 Off)."""
    global _threshold
    _threshold = int(level)


class QbRuntimeError(RuntimeError):
    """qbruntime's error type (a ``RuntimeError``).

    Raised by the simulator with ``str(exc) == "<Status> occurred.\\nPlease visit <docs> for more
    details."`` and ``exc.status == "<Status>"`` (``.status`` is the simulator's addition).
    Constructible from Python with any message, as vendor tests do (``QbRuntimeError("BadAlloc: x")``);
    then ``.status`` is ``None``.
    """

    def __init__(self, *args: object, status: str | None = None) -> None:
        super().__init__(*args)
        self.status = status

    @classmethod
    def from_status(cls, status: str) -> QbRuntimeError:
        """The exception the C++ core raises for ``status``."""
        return cls(f"{status} occurred.\nPlease visit {DOCS_URL} for more details.", status=status)


def glog_line(detail: str, source: str = "model.cc:0", severity: str = "E") -> str:
    """One glog line ``E<mmdd> <HH:MM:SS.mmm> <pid> <source>] <detail>`` (no trailing newline)."""
    now = time.time()
    t = time.localtime(now)
    ms = int((now % 1) * 1000)
    return f"{severity}{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{ms:03d} {os.getpid()} {source}] {detail}"


def log(detail: str, source: str = "model.cc:0", severity: str = "E") -> None:
    """Print one detail line to ``sys.stdout`` (where the real core's glog writes) if the log
    level lets it through."""
    level = {"W": 3, "E": 4}.get(severity, 4)  # LogLevel.Warn, LogLevel.Err
    if level >= _threshold:
        sys.stdout.write(glog_line(detail, source, severity) + "\n")
        sys.stdout.flush()


def fail(status: str, detail: str, source: str = "model.cc:0") -> QbRuntimeError:
    """Print ``detail`` as a glog error line and return the ``QbRuntimeError`` for ``status``.

    Raises:
        ValueError: ``status`` is not one of :data:`STATUS_CODES` (a simulator bug).
    """
    if status not in STATUS_CODES:
        raise ValueError(f"unknown qbruntime status {status!r} (known: {', '.join(STATUS_CODES)})")
    log(detail, source)
    return QbRuntimeError.from_status(status)
