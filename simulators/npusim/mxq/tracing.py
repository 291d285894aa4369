"""Process-global event tracing: ``start_tracing_events(path)`` / ``stop_tracing_events()``.

Events are Chrome trace JSON objects ``{"name", "cat", "ph", "pid", "tid", "ts"}`` with ``B``/``E``
pairs; ``ts`` is in µs of the simulated device clock (:mod:`npusim.mxq.machine`), ``pid`` the
device number, ``tid`` the model's identifier. The file is written only by
:func:`stop_tracing_events`: one event per line between ``[`` and ``]``; an empty window
writes exactly ``"[\\n\\n]"``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["active", "span", "start_tracing_events", "stop_tracing_events"]

CATEGORY = "qbruntime"

_path: Path | None = None
_events: list[dict[str, object]] = []


def start_tracing_events(path: str | os.PathLike) -> bool:
    """Start recording into ``path``; False (nothing changes) if a trace is already recording."""
    global _path, _events
    if _path is not None:
        return False
    _path, _events = Path(path), []
    return True


def stop_tracing_events() -> None:
    """Write the recorded events to the path given at start and stop recording (no-op if none).

    Raises:
        OSError: the file cannot be written (recording stops anyway).
    """
    global _path, _events
    if _path is None:
        return
    path, events = _path, _events
    _path, _events = None, []
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]", encoding="utf-8")


def active() -> bool:
    """True while a trace is recording."""
    return _path is not None


def span(name: str, start_us: float, end_us: float, pid: int, tid: int) -> None:
    """Record a ``B``/``E`` pair (if recording). Nested spans must be recorded outer-first."""
    if _path is None:
        return
    base = {"name": name, "cat": CATEGORY, "pid": pid, "tid": tid}
    _events.append({**base, "ph": "B", "ts": round(start_us, 3)})
    _events.append({**base, "ph": "E", "ts": round(end_us, 3)})
