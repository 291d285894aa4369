"""The simulated machine behind :mod:`npusim.mxq`: Aries cards, their cores, memory, clock and faults.

This module is the simulator's addition (qbruntime has no such knobs). It is configured by the
environment variable ``NPUSIM_MXQ`` (a JSON object; read lazily and re-read whenever its value
changes) and, for tests, by :func:`configure` / :func:`reset`. Fields set with
:func:`configure` override the environment.

Fields (all optional):

=====================  =========  ==============================================================
field                  default    meaning
=====================  =========  ==============================================================
``devices``            1          number of Aries cards (device numbers ``0 .. devices-1``), >= 0
``device_memory_mib``  16384      device memory per card, MiB (> 0)
``infer_fixed_us``     200        ``run npu`` cost per infer call, µs
``infer_us_per_token`` 50         ``run npu`` cost per input token, µs
``io_fixed_us``        100        each ``copy to npu`` / ``copy from npu`` / ``read device`` span, µs
``dump_us_per_kib``    2          ``dump_cache_memory`` cost per KiB read, µs
``load_us_per_kib``    2          ``load_cache_memory`` cost per KiB written, µs
``pace``               false      sleep so each infer/dump/load takes at least its simulated cost
``no_device``          false      every ``Accelerator`` raises (no NPU in the system)
``bad_alloc_at_launch`` null      int n >= 1: the n-th ``launch`` raises ``BadAlloc``
``infer_fail_after``   null       int n >= 0: after n successful infers, the next ones fail
``infer_fail_times``   1          how many infers fail once ``infer_fail_after`` is reached
``infer_fail_status``  InternalError  status of an injected infer failure
``infer_costs``        {}         per MXQ kind (FORMAT.md: ``decoder``, ``eagle3_base``, ...), an
                                  object ``{"fixed_us": f, "us_per_token": c}`` replacing
                                  ``infer_fixed_us`` / ``infer_us_per_token`` for that kind's
                                  infers: a board's MXQs differ in the weights each infer streams
                                  (the EAGLE-3 benchmark's paced model, docs/benchmarks.md)
``expert_finish_jitter_us`` 500   an MoE expert MXQ's ``infer_npu_data`` returns after a random
                                  wall-clock wait of 0 .. this many µs, so experts run in parallel
                                  finish in a varying order, as on the board (the seed: greedy
                                  output can differ run to run because the expert outputs are
                                  added in the order they finish); 0 turns it off
=====================  =========  ==============================================================

Costs are numbers >= 0. Counters of the faults (launches, successful infers, injected failures)
restart whenever the effective configuration changes, and on :func:`reset`.

Clock: every card has a device clock in µs (float), starting at 0. An infer advances it by
``2*io_fixed_us + infer_fixed_us + infer_us_per_token*tokens``; a dump by
``io_fixed_us + dump_us_per_kib*KiB``; a load by ``io_fixed_us + load_us_per_kib*KiB``. Trace
timestamps are read from this clock.

Cores: an Aries card has 2 clusters x 4 cores. A launched model holds its cores until
``dispose``. Several models may hold one core when each of them was named that core explicitly
(single-core mode with core ids) and every one of them is memory-flexible (the MXQ header's
``memory_flexible``, true unless compiled otherwise): they share it in time, on the card's one
clock. Cores the runtime picks itself, and the clusters of the cluster modes, are always free
ones. A memory-fixed MXQ never shares: the real core's text for that case is
:data:`MEMORY_AREA_IN_USE`. Memory: a launch uploads ``weights + K * kv_bytes_per_cache_id`` bytes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..env_settings import check_keys, is_int, json_object
from .errors import STATUS_CODES
from .types import Cluster, Core, CoreId, core_key

__all__ = ["ENV_VAR", "MEMORY_AREA_IN_USE", "Device", "MemoryAreaInUse", "Settings", "configure", "device", "reset", "settings"]

ENV_VAR = "NPUSIM_MXQ"

#: The real core's text (its format string, with the core's id in hex) for a core that another
#: model's memory area occupies.
MEMORY_AREA_IN_USE = ("core [{:x}] memory area is already in use. Recommend to use latest compiler to "
                      "utilize memory flexible. Or use other core please.")


class MemoryAreaInUse(Exception):
    """A named core is held by a model it cannot share with (one of them is memory-fixed).

    Attributes:
        core: the first such core.
    """

    def __init__(self, core: CoreId) -> None:
        super().__init__(f"core {core} is held by a model it cannot share with")
        self.core = core


# Guards clocks, core tables and counters: qbruntime callers run infers of different Models
# from worker threads (the simulated cost's sleep happens outside it).
_lock = threading.RLock()

ALL_CORES: tuple[CoreId, ...] = tuple(
    CoreId(cl, co) for cl in (Cluster.Cluster0, Cluster.Cluster1) for co in (Core.Core0, Core.Core1, Core.Core2, Core.Core3)
)


@dataclass(frozen=True)
class Settings:
    """The effective machine configuration (see the module docstring for each field)."""

    devices: int = 1
    device_memory_mib: float = 16384
    infer_fixed_us: float = 200
    infer_us_per_token: float = 50
    io_fixed_us: float = 100
    dump_us_per_kib: float = 2
    load_us_per_kib: float = 2
    pace: bool = False
    no_device: bool = False
    bad_alloc_at_launch: int | None = None
    infer_fail_after: int | None = None
    infer_fail_times: int = 1
    infer_fail_status: str = "InternalError"
    expert_finish_jitter_us: float = 500
    infer_costs: dict[str, dict[str, float]] = field(default_factory=dict)

    def infer_run_us(self, kind: str, tokens: int) -> float:
        """The ``run npu`` cost (µs) of one infer of ``tokens`` input tokens on an MXQ of ``kind``."""
        cost = self.infer_costs.get(kind)
        if cost is None:
            return self.infer_fixed_us + self.infer_us_per_token * tokens
        return cost["fixed_us"] + cost["us_per_token"] * tokens


_FIELDS = {f.name for f in fields(Settings)}
_COSTS = ("infer_fixed_us", "infer_us_per_token", "io_fixed_us", "dump_us_per_kib", "load_us_per_kib",
          "expert_finish_jitter_us")


def _is_cost(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _check_infer_costs(v: Any, source: str) -> None:
    """Raises: ValueError unless ``v`` maps kind names to ``{"fixed_us": >= 0, "us_per_token": >= 0}``."""
    if not isinstance(v, dict):
        raise ValueError(f"{source}: infer_costs={v!r} must be an object of MXQ kind -> costs")
    for kind, cost in v.items():
        if not isinstance(cost, dict) or set(cost) != {"fixed_us", "us_per_token"} or not all(
                _is_cost(x) for x in cost.values()):
            raise ValueError(f"{source}: infer_costs[{kind!r}]={cost!r} must be {{\"fixed_us\": number >= 0, "
                             "\"us_per_token\": number >= 0}")


def _check(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate machine fields.

    Raises:
        ValueError: an unknown field or a value breaking its rule (field, value and rule named).
    """
    check_keys(source, values, _FIELDS)
    for name, v in values.items():
        if name == "devices" and not (is_int(v) and v >= 0):
            raise ValueError(f"{source}: devices={v!r} must be an integer >= 0")
        elif name == "device_memory_mib" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{source}: device_memory_mib={v!r} must be a number > 0")
        elif name in _COSTS and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0):
            raise ValueError(f"{source}: {name}={v!r} must be a number >= 0 (µs)")
        elif name == "infer_costs":
            _check_infer_costs(v, source)
        elif name in ("pace", "no_device") and not isinstance(v, bool):
            raise ValueError(f"{source}: {name}={v!r} must be true or false")
        elif name == "bad_alloc_at_launch" and not (v is None or (is_int(v) and v >= 1)):
            raise ValueError(f"{source}: bad_alloc_at_launch={v!r} must be null or an integer >= 1")
        elif name == "infer_fail_after" and not (v is None or (is_int(v) and v >= 0)):
            raise ValueError(f"{source}: infer_fail_after={v!r} must be null or an integer >= 0")
        elif name == "infer_fail_times" and not (is_int(v) and v >= 1):
            raise ValueError(f"{source}: infer_fail_times={v!r} must be an integer >= 1")
        elif name == "infer_fail_status" and v not in STATUS_CODES:
            raise ValueError(f"{source}: infer_fail_status={v!r} must be one of {', '.join(STATUS_CODES)}")
    return values


class Device:
    """One simulated Aries card: cores in use, memory in use, device clock (µs)."""

    def __init__(self, dev_no: int) -> None:
        self.dev_no = dev_no
        self.clock_us = 0.0
        # (cluster, core) -> identifiers of the models holding it, in launch order (CoreId is
        # unhashable, as in qbruntime)
        self.cores_in_use: dict[tuple[Cluster, Core], list[int]] = {}
        # identifiers of launched models whose MXQ is memory-fixed (they never share a core)
        self.memory_fixed: set[int] = set()
        self.memory_used = 0  # bytes

    def free_cores(self) -> list[CoreId]:
        """Cores not held by any launched model, in order."""
        return [c for c in ALL_CORES if core_key(c) not in self.cores_in_use]

    def advance(self, cost_us: float, wall_start: float | None = None) -> tuple[float, float]:
        """Advance the clock by ``cost_us``; with ``pace``, sleep until ``wall_start + cost``.

        Returns:
            ``(start_us, end_us)`` on the device clock.
        """
        with _lock:
            start = self.clock_us
            self.clock_us += float(cost_us)
            end = self.clock_us
        if settings().pace and wall_start is not None:
            remaining = cost_us / 1e6 - (time.perf_counter() - wall_start)
            if remaining > 0:
                time.sleep(remaining)
        return start, end


@dataclass
class _State:
    overrides: dict[str, Any] = field(default_factory=dict)
    env_raw: str | None = None
    env_values: dict[str, Any] = field(default_factory=dict)
    effective: Settings | None = None
    stale: bool = True  # overrides changed since ``effective`` was computed
    devices: dict[int, Device] = field(default_factory=dict)
    launches: int = 0
    infers_ok: int = 0
    infer_failures: int = 0


_state = _State()


def _read_env() -> dict[str, Any]:
    raw = os.environ.get(ENV_VAR)
    if raw == _state.env_raw:
        return _state.env_values
    values = _check(json_object(ENV_VAR, raw, known=_FIELDS), ENV_VAR)
    _state.env_raw, _state.env_values = raw, values
    return values


def settings() -> Settings:
    """The effective settings: defaults, then ``$NPUSIM_MXQ``, then :func:`configure`.

    Raises:
        ValueError: ``$NPUSIM_MXQ`` is not a JSON object of known, valid fields.
    """
    if not _state.stale and _state.effective is not None and os.environ.get(ENV_VAR) == _state.env_raw:
        return _state.effective  # the hot path: nothing changed since the last call
    new = replace(Settings(), **{**_read_env(), **_state.overrides})
    _state.stale = False
    if new != _state.effective:
        _state.effective = new
        _state.launches = _state.infers_ok = _state.infer_failures = 0
    return new


def configure(**values: Any) -> Settings:
    """Override machine fields for this process (tests); returns the effective settings.

    Raises:
        ValueError: an unknown field or an invalid value.
    """
    _check(values, "npusim.mxq.machine.configure")
    _state.overrides.update(values)
    _state.stale = True
    return settings()


def reset() -> None:
    """Forget :func:`configure` overrides, device state (cores, memory, clocks) and fault counters."""
    global _state
    _state = _State()


def device_numbers() -> list[int]:
    """Device numbers of the present cards (none when ``no_device``)."""
    s = settings()
    return [] if s.no_device else list(range(s.devices))


def device(dev_no: int) -> Device:
    """The state of card ``dev_no`` (created on first use; caller checks it exists)."""
    if dev_no not in _state.devices:
        _state.devices[dev_no] = Device(dev_no)
    return _state.devices[dev_no]


def memory_bytes() -> int:
    """Device memory per card in bytes."""
    return int(settings().device_memory_mib * 2**20)


def note_launch() -> bool:
    """Count one launch; True if the ``bad_alloc_at_launch`` fault fires for it."""
    s = settings()
    with _lock:
        _state.launches += 1
    return s.bad_alloc_at_launch is not None and _state.launches == s.bad_alloc_at_launch


def infer_fault() -> str | None:
    """The injected status if this infer must fail (counted), else None."""
    s = settings()
    with _lock:
        if s.infer_fail_after is None or _state.infers_ok < s.infer_fail_after:
            return None
        if _state.infer_failures >= s.infer_fail_times:
            return None
        _state.infer_failures += 1
        return s.infer_fail_status


def note_infer_ok() -> None:
    """Count one successful infer."""
    settings()
    with _lock:
        _state.infers_ok += 1


def allocate_cores(dev: Device, owner: int, candidates: Iterable[list[CoreId]], *,
                   shared: bool = False, memory_flexible: bool = True) -> list[CoreId] | None:
    """Take the first candidate core group ``owner`` may hold; None if there is none.

    Args:
        dev: the card.
        owner: the launching model's identifier.
        candidates: core groups in order of preference.
        shared: the group is the explicitly named cores of a single-core model: a core held by
            other models is taken too, when they and ``owner`` are all memory-flexible.
            Otherwise only a group of free cores is taken.
        memory_flexible: whether ``owner``'s MXQ is memory-flexible.

    Raises:
        MemoryAreaInUse: ``shared`` and the first group has a core held by a model that cannot
            share it (``owner`` or the holder is memory-fixed); carries that core.
    """
    with _lock:
        for group in candidates:
            held = [c for c in group if dev.cores_in_use.get(core_key(c))]
            if held and shared:
                rigid = not memory_flexible or any(o in dev.memory_fixed for c in held
                                                   for o in dev.cores_in_use[core_key(c)])
                if rigid:
                    raise MemoryAreaInUse(held[0])
            elif held:
                continue
            for c in group:
                dev.cores_in_use.setdefault(core_key(c), []).append(owner)
            if not memory_flexible:
                dev.memory_fixed.add(owner)
            return list(group)
        return None


def release_cores(dev: Device, owner: int) -> None:
    """Free every core held by ``owner`` (a shared core stays held by its other models)."""
    with _lock:
        for key in [k for k, owners in dev.cores_in_use.items() if owner in owners]:
            dev.cores_in_use[key].remove(owner)
            if not dev.cores_in_use[key]:
                del dev.cores_in_use[key]
        dev.memory_fixed.discard(owner)
