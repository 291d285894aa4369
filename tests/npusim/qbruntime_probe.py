"""Run qbruntime's host-side API (what works without an NPU) and print what it did, as JSON.

``python qbruntime_probe.py`` imports ``qbruntime``, whichever one the environment gives: the real
1.5.0 wheel (on ``PYTHONPATH``) or ``npusim.mxq`` through the alias (``NPUSIM_ALIAS=qbruntime``,
with ``NPUSIM_MXQ='{"no_device": true}'`` so that the simulator has no card either). Each probe
records its return value, the exception it raised and the glog lines it printed (severity and
detail; timestamps, thread ids and source locations are dropped). ``test_mxq_against_real_qbruntime``
runs it under both and compares: when they disagree, the simulator has the bug.

Values are normalised so that the comparison is about behaviour: enums as ``str()`` and ``int()``,
lists element-wise, objects by their public fields.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import qbruntime as q

GLOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] (.*)$")


def norm(value: Any) -> Any:
    """A JSON-able picture of ``value`` (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [norm(v) for v in value]
    if type(value).__name__ in ("CoreMode", "Cluster", "Core", "LogLevel", "CacheType", "DataType",
                                "CoreAllocationPolicy"):
        return str(value)
    if type(value).__name__ == "CoreId":
        return f"CoreId({value.cluster}, {value.core})"
    return f"<{type(value).__name__}>"


def _capture(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` with fd 1 and 2 redirected (the real core's glog writes from C++)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                result: dict[str, Any] = {"return": norm(fn())}
            except Exception as exc:  # noqa: BLE001 - the exception is what is compared
                result = {"raise": type(exc).__name__, "message": str(exc)}
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        streams = {}
        for name, f in (("stdout", out), ("stderr", err)):
            f.seek(0)
            streams[name] = f.read().decode("utf-8", "replace").splitlines()
    for name, lines in streams.items():
        glog = []
        for line in lines:
            m = GLOG_LINE.match(line)
            glog.append(f"{m.group(1)} {m.group(2)}" if m else f"(plain) {line}")
        if glog:
            result[name] = glog
    return result


def probes() -> dict[str, Callable[[], Any]]:
    """Name -> call. Every call is host-side: none needs a device."""
    C0, C1 = q.Cluster.Cluster0, q.Cluster.Cluster1

    def cid(cluster: Any, core: str) -> Any:
        return q.CoreId(cluster, getattr(q.Core, core))

    def config_after(*steps: Callable[[Any], Any]) -> Callable[[], Any]:
        def run() -> Any:
            mc = q.ModelConfig()
            returns = [norm(step(mc)) for step in steps]
            return {"returns": returns, "mode": norm(mc.get_core_mode()), "num_cores": mc.get_num_cores(),
                    "core_ids": norm(mc.get_core_ids()), "clusters": norm(mc.get_clusters()),
                    "activation_slots": mc.get_activation_slots(),
                    "policy": norm(mc.get_core_allocation_policy())}
        return run

    bad_mxq = os.path.join(tempfile.mkdtemp(), "bad.mxq")
    with open(bad_mxq, "wb") as fh:
        fh.write(b"not an mxq file at all" * 4)
    found: dict[str, Callable[[], Any]] = {
        "enum values": lambda: {
            e: [[n, int(getattr(q, e).__members__[n].value)] for n in getattr(q, e).__members__]
            for e in ("CoreMode", "Cluster", "Core", "LogLevel", "CacheType", "CoreAllocationPolicy")
        },
        "config default": config_after(),
        "config deprecated num_cores": lambda: (lambda mc: [mc.get_core_mode(), mc.get_num_cores(),
                                                            mc.get_activation_slots()])(q.ModelConfig(3)),
        "single core ids": config_after(lambda mc: mc.set_single_core_mode(None, [cid(C1, "Core3"), cid(C0, "Core2"),
                                                                                  cid(C0, "Core2")])),
        "single core ids positional": config_after(lambda mc: mc.set_single_core_mode([cid(C0, "Core1")])),
        "single empty": config_after(lambda mc: mc.set_single_core_mode(None, [])),
        "single global core": config_after(lambda mc: mc.set_single_core_mode(None, [cid(C0, "GlobalCore")])),
        "single num 0": config_after(lambda mc: mc.set_single_core_mode(0)),
        "single num 3": config_after(lambda mc: mc.set_single_core_mode(3)),
        "single num 9": config_after(lambda mc: mc.set_single_core_mode(9)),
        "multi default": config_after(lambda mc: mc.set_multi_core_mode()),
        "multi one": config_after(lambda mc: mc.set_multi_core_mode([C1])),
        "multi empty": config_after(lambda mc: mc.set_multi_core_mode([])),
        "multi bad cluster": config_after(lambda mc: mc.set_multi_core_mode([q.Cluster.Error])),
        "global4 default": config_after(lambda mc: mc.set_global4_core_mode()),
        "global4 one": config_after(lambda mc: mc.set_global4_core_mode([C0])),
        "global8": config_after(lambda mc: mc.set_global8_core_mode()),
        "multi then single": config_after(lambda mc: mc.set_multi_core_mode([C1]),
                                          lambda mc: mc.set_single_core_mode(None, [cid(C0, "Core0")])),
        "single then auto": config_after(lambda mc: mc.set_single_core_mode(None, [cid(C0, "Core0")]),
                                         lambda mc: mc.set_auto_core_mode()),
        "slots set": config_after(lambda mc: mc.set_activation_slots(5)),
        "slots negative": config_after(lambda mc: mc.set_activation_slots(4), lambda mc: mc.set_activation_slots(-1)),
        "slots then cluster mode": config_after(lambda mc: mc.set_activation_slots(5),
                                                lambda mc: mc.set_multi_core_mode([C0])),
        "async pipeline": config_after(lambda mc: mc.set_async_pipeline_enabled(True)),
        "core id": lambda: [norm(cid(C0, "Core1")), cid(C0, "Core1") == cid(C0, "Core1"),
                            cid(C0, "Core1") == cid(C1, "Core1")],
        "core id hash": lambda: hash(cid(C0, "Core1")),
        "buffer info defaults": lambda: [getattr(q.BufferInfo(), f) for f in (
            "original_height", "original_width", "original_channel", "reshaped_height", "reshaped_width",
            "reshaped_channel", "height", "width", "channel", "max_height", "max_width", "max_channel",
            "max_cache_size")],
        "buffer info keywords": lambda: [q.BufferInfo(max_width=7, max_cache_size=9).max_width,
                                         q.BufferInfo(max_width=7, max_cache_size=9).max_cache_size],
        "cache info defaults": lambda: [norm(getattr(q.CacheInfo(), f)) for f in (
            "cache_type", "name", "layer_hash", "size", "num_batches")],
        "accelerator without a device": lambda: q.Accelerator(),
        "model on a file that is not an MXQ": lambda: q.Model(bad_mxq),
        "log level off": lambda: (q.set_log_level(q.LogLevel.Off), q.ModelConfig().set_single_core_mode(0),
                                  q.set_log_level(q.LogLevel.Warn))[1],
        "log level err drops warnings": lambda: (q.set_log_level(q.LogLevel.Err), q.ModelConfig().set_single_core_mode(0),
                                                 q.set_log_level(q.LogLevel.Warn))[1],
    }
    return found


def main() -> None:
    results = {name: _capture(fn) for name, fn in probes().items()}
    sys.stdout.write(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
