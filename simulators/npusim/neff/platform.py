"""The simulated Trainium device: target, logical cores, HBM (stdlib only).

=========  ==============  ==================  ==================  ===========  ======
target     physical cores  HBM per chip        per logical core    fp8 e4m3     MXFP4
                           (GiB)               LNC=2 / LNC=1       max
=========  ==============  ==================  ==================  ===========  ======
trn2       8               96                  24 / 12 GiB         240.0        no
trn3       8               144                 36 / 18 GiB         448.0        yes
trn3pre    8               144                 36 / 18 GiB         448.0        yes
=========  ==============  ==================  ==================  ===========  ======

Sources: Neuron SDK ``trainium2.rst`` / ``trainium3.rst`` (HBM per chip), the LNC page (8 physical
cores per chip, 4 logical at LNC=2), vllm-neuron ``dtype_utils.py`` (fp8 clamp). Guessed: that
Trn3 also has 8 physical cores per chip, and that HBM splits evenly over logical cores.

Environment: ``$NEURON_PLATFORM_TARGET_OVERRIDE`` (wins), ``$NEURON_LOGICAL_NC_CONFIG`` (1|2,
default 2), ``$NEURON_RT_VISIBLE_CORES`` (``"0-3"``, ``"0,2"``), and ``$NPUSIM_NEFF``
(:mod:`npusim.neff.config`: ``target``, ``chips``, ``hbm_gib_per_core``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import config
from .errors import NeffConfigError, NeffTargetError

__all__ = [
    "TARGETS",
    "DeviceInfo",
    "get_platform_target",
    "logical_nc_config",
    "device_info",
    "get_nc_count",
    "visible_cores",
    "get_total_available_memory",
]

TARGETS = config.TARGETS
GIB = 2**30
PHYSICAL_CORES_PER_CHIP = 8
_HBM_GIB_PER_CHIP = {"trn2": 96, "trn3": 144, "trn3pre": 144}
_FP8_MAX = {"trn2": 240.0, "trn3": 448.0, "trn3pre": 448.0}


@dataclass(frozen=True)
class DeviceInfo:
    """The simulated instance.

    Attributes:
        target: ``"trn2"``, ``"trn3"`` or ``"trn3pre"``.
        chips: Trainium chips.
        physical_cores_per_chip: 8.
        lnc: logical NeuronCore config (1 or 2 physical cores per logical core).
        logical_cores: ``chips * 8 / lnc``.
        hbm_bytes_per_logical_core: bytes of HBM each logical core owns.
        fp8_e4m3_max: largest FP8 KV value (240.0 on trn2's e4m3, 448.0 on trn3's e4m3fn).
        supports_mxfp4: MXFP4 weights (trn3 and trn3pre only).
    """

    target: str
    chips: int
    physical_cores_per_chip: int
    lnc: int
    logical_cores: int
    hbm_bytes_per_logical_core: int
    fp8_e4m3_max: float
    supports_mxfp4: bool


def check_target(value: str, where: str = "target") -> str:
    """Return ``value`` if it is a known target.

    Raises:
        NeffTargetError: names the value and the allowed targets.
    """
    if value not in TARGETS:
        raise NeffTargetError(f"unknown Neuron platform target {value!r} ({where}); allowed: {', '.join(TARGETS)}")
    return value


def get_platform_target() -> str:
    """``$NEURON_PLATFORM_TARGET_OVERRIDE``, else ``$NPUSIM_NEFF`` ``target``, else ``"trn2"``.

    Raises:
        NeffTargetError: the override is not a known target.
        NeffConfigError: ``$NPUSIM_NEFF`` is malformed.
    """
    override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
    if override:
        return check_target(override, "NEURON_PLATFORM_TARGET_OVERRIDE")
    return config.settings().target or "trn2"


def logical_nc_config() -> int:
    """``$NEURON_LOGICAL_NC_CONFIG`` as an int (1 or 2), default 2.

    Raises:
        NeffConfigError: any other value (named).
    """
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if not raw:
        return 2
    if raw not in ("1", "2"):
        raise NeffConfigError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {raw!r}")
    return int(raw)


#: The variables the device model reads; its answers are cached per value of them.
_ENV_VARS = ("NEURON_PLATFORM_TARGET_OVERRIDE", "NEURON_LOGICAL_NC_CONFIG", "NPUSIM_NEFF", "NEURON_RT_VISIBLE_CORES")
_CACHE: dict[tuple, Any] = {}


def _cached(name: str, arg: Any, compute):
    """``compute()`` memoized on ``(name, arg)`` and the current values of :data:`_ENV_VARS`
    (every device call asks; the environment rarely changes)."""
    key = (name, arg, tuple(os.environ.get(v) for v in _ENV_VARS))
    try:
        return _CACHE[key]
    except KeyError:
        if len(_CACHE) > 256:
            _CACHE.clear()
        value = _CACHE[key] = compute()
        return value


def device_info(target: str | None = None) -> DeviceInfo:
    """The simulated device (``target`` defaults to :func:`get_platform_target`).

    Raises:
        NeffTargetError: unknown target.
        NeffConfigError: malformed ``$NPUSIM_NEFF`` or ``$NEURON_LOGICAL_NC_CONFIG``.
    """
    return _cached("device_info", target, lambda: _device_info(target))


def _device_info(target: str | None) -> DeviceInfo:
    target = check_target(target) if target is not None else get_platform_target()
    s = config.settings()
    lnc = logical_nc_config()
    logical = s.chips * PHYSICAL_CORES_PER_CHIP // lnc
    if s.hbm_gib_per_core is not None:
        hbm = int(s.hbm_gib_per_core * GIB)
    else:
        hbm = _HBM_GIB_PER_CHIP[target] * GIB // (PHYSICAL_CORES_PER_CHIP // lnc)
    return DeviceInfo(target, s.chips, PHYSICAL_CORES_PER_CHIP, lnc, logical, hbm, _FP8_MAX[target], target.startswith("trn3"))


def _parse_cores(raw: str) -> list[int]:
    cores: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise NeffConfigError(f"NEURON_RT_VISIBLE_CORES must look like '0-3' or '0,2', got {raw!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise NeffConfigError(f"NEURON_RT_VISIBLE_CORES has a descending range {part!r} in {raw!r}")
        cores.extend(range(a, b + 1))
    return cores


def visible_cores() -> list[int]:
    """The logical cores this process may use (``$NEURON_RT_VISIBLE_CORES``, default all).

    Raises:
        NeffConfigError: malformed variable.
        NrtError (``NRT_LOAD_NOT_ENOUGH_NC``): it names a core the instance does not have.
    """
    return list(_cached("visible_cores", None, _visible_cores))


def _visible_cores() -> tuple[int, ...]:
    from .errors import NrtError, nrt_message

    n = device_info().logical_cores
    raw = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not raw:
        return tuple(range(n))
    cores = _parse_cores(raw)
    missing = [c for c in cores if c >= n]
    if missing:
        raise NrtError(nrt_message("NRT_LOAD_NOT_ENOUGH_NC",
                                   f"NeuronCore(s) not available - Requested: {raw} Available: 0-{n - 1}"))
    return tuple(cores)


def get_nc_count() -> int:
    """Logical cores visible to this process."""
    return len(visible_cores())


def get_total_available_memory() -> float:
    """HBM of one logical core in GiB (as ``libtorch_neuronx_lite.compile.platform``)."""
    return device_info().hbm_bytes_per_logical_core / GIB
