"""RBLN parts, the simulated device inventory and injected faults (stdlib only).

Parts (from the vendor's docs and optimum-rbln 0.12.0's DRAM table):

=========  =============  ========  ==================  =====================
family     SKU pattern    chiplets  DRAM per chiplet    reserved per chiplet
=========  =============  ========  ==================  =====================
ATOM       ``RBLN-CA*``   1         16 GiB              288 MiB
Rebel100   ``RBLN-CR*``   4         36 GiB (144 total)  1 GiB
=========  =============  ========  ==================  =====================

The inventory is what ``rebel.get_npu_name``/``npu_is_available``/``device_count`` report. It is
read, on every call, from:

1. ``$NPUSIM_RBLN``, a JSON object with the optional fields
   ``devices`` (list of SKU names, ``[]`` = no NPU at all),
   ``dram_per_chiplet`` (bytes, overrides the part's, to model a card another process fills),
   ``fault`` (``{"after_calls": N, "times": T}``: runtime calls ``N+1 .. N+T`` fail,
   ``times`` null = every call from ``N+1`` on) and
   ``fault_log`` (a file each injected fault appends one line to);
2. else one device named by ``$RBLN_FORCE_NPU_NAME`` or ``$RBLN_TARGET_SOC``;
3. else one ``RBLN-CA25``.

What is a guess about the real device: the chiplet count and per-chiplet split of Rebel100
(144 GiB over 4 chiplets) and that weights and KV split evenly over chiplets.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..env_settings import EnvParseCache, FaultSchedule, json_object, parse_fault
from .errors import RBLNDeviceError, RBLNSettingsError

__all__ = [
    "ENV_VAR",
    "DEFAULT_NPU",
    "Part",
    "Settings",
    "part_for",
    "settings",
]

ENV_VAR = "NPUSIM_RBLN"
DEFAULT_NPU = "RBLN-CA25"
GIB = 2**30
MIB = 2**20

_SKU = re.compile(r"^RBLN-(CA|CR)(\d{2})$")


@dataclass(frozen=True)
class Part:
    """One NPU SKU.

    Attributes:
        name: the SKU (``RBLN-CA25``).
        family: ``atom`` or ``rebel100``.
        chiplets: DRAM partitions of one card.
        dram_per_chiplet: bytes of DRAM on one chiplet.
        reserved_per_chiplet: bytes the system keeps on each chiplet.
    """

    name: str
    family: str
    chiplets: int
    dram_per_chiplet: int
    reserved_per_chiplet: int

    @property
    def usable_per_chiplet(self) -> int:
        """Bytes a program may allocate on one chiplet."""
        return self.dram_per_chiplet - self.reserved_per_chiplet


def part_for(name: str, dram_per_chiplet: int | None = None) -> Part:
    """The part of SKU ``name`` (``RBLN-CA02``..``RBLN-CA25``, ``RBLN-CR03``..).

    Raises:
        RBLNDeviceError: ``name`` is not an ``RBLN-CAnn``/``RBLN-CRnn`` SKU.
    """
    m = _SKU.match(str(name).strip().upper()) if isinstance(name, str) else None
    if m is None:
        raise RBLNDeviceError(
            f"unknown NPU name {name!r}: expected an ATOM (RBLN-CAnn) or Rebel100 (RBLN-CRnn) SKU"
        )
    if m.group(1) == "CA":
        part = Part(m.group(0), "atom", 1, 16 * GIB, 288 * MIB)
    else:
        part = Part(m.group(0), "rebel100", 4, 36 * GIB, 1 * GIB)
    if dram_per_chiplet is not None:
        part = Part(part.name, part.family, part.chiplets, int(dram_per_chiplet),
                    min(part.reserved_per_chiplet, int(dram_per_chiplet) // 2))
    return part


@dataclass(frozen=True)
class Settings:
    """The effective simulator settings (see the module docstring)."""

    devices: tuple[str, ...]
    dram_per_chiplet: int | None = None
    fault: FaultSchedule | None = None
    fault_log: str | None = None

    def part(self, device_id: int) -> Part | None:
        """The part at ``device_id``, None when no such device is present."""
        if not isinstance(device_id, int) or isinstance(device_id, bool):
            return None
        if 0 <= device_id < len(self.devices):
            return part_for(self.devices[device_id], self.dram_per_chiplet)
        return None


_KNOWN = ("devices", "dram_per_chiplet", "fault", "fault_log")


def _parse(key: tuple[str | None, str | None]) -> Settings:
    """``(raw $NPUSIM_RBLN, forced NPU name)`` -> the settings (see the module docstring)."""
    raw, forced = key
    values = json_object(ENV_VAR, raw, known=_KNOWN, error=RBLNSettingsError)
    devices = values.get("devices")
    if devices is None:
        devices = [forced or DEFAULT_NPU]
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise RBLNSettingsError(f"{ENV_VAR}: devices must be a list of NPU names, got {devices!r}")
    for d in devices:
        part_for(d)  # raises on a bad SKU
    dram = values.get("dram_per_chiplet")
    if dram is not None and (not isinstance(dram, int) or isinstance(dram, bool) or dram <= 0):
        raise RBLNSettingsError(f"{ENV_VAR}: dram_per_chiplet must be a positive int (bytes), got {dram!r}")
    fault = parse_fault(values.get("fault"), source=f"{ENV_VAR}: fault", error=RBLNSettingsError)
    log = values.get("fault_log")
    if log is not None and not isinstance(log, str):
        raise RBLNSettingsError(f"{ENV_VAR}: fault_log must be a path string, got {log!r}")
    return Settings(tuple(d.strip().upper() for d in devices), dram, fault, log)


_cache: EnvParseCache[tuple[str | None, str | None], Settings] = EnvParseCache(_parse)


def settings(environ: dict[str, str] | None = None) -> Settings:
    """The effective settings, re-read whenever the environment variables change.

    Raises:
        RBLNSettingsError: ``$NPUSIM_RBLN`` is malformed (names the field and value).
        RBLNDeviceError: a device name is not an RBLN SKU.
    """
    env = os.environ if environ is None else environ
    forced = env.get("RBLN_FORCE_NPU_NAME") or env.get("RBLN_TARGET_SOC") or None
    key = (env.get(ENV_VAR), forced)
    return _cache.get(key) if environ is None else _parse(key)
