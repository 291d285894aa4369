"""DRAM accounting of the simulated NPUs (stdlib only).

A compiled model occupies, on each of its devices ("nodes") and each chiplet of those devices:

* its weights (``Weight``) and working buffers (``Activation``), split evenly over the
  ``num_devices x chiplets`` chiplets it was compiled for, and
* its static-address buffers (``past_key_values_*``, the ``DramTensor`` key), split the same way,
  scaled by the multiplier ``exp_multiply_buffer_size`` set.

Every allocation is rounded up to 2 MiB, as optimum-rbln assumes. Runtimes that share a compile
context share its static buffers, so they are counted once per context group.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import RBLNOutOfMemoryError
from .parts import Part

__all__ = ["ALIGN", "align", "split", "DeviceMemory", "ledger"]

ALIGN = 2 * 2**20


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 2 MiB (0 stays 0)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def split(nbytes: int, nodes: int, chiplets: int) -> list[list[int]]:
    """``nbytes`` spread over ``nodes x chiplets``: ``[[bytes per chiplet] per node]``, the
    remainder on the first chiplets (so the total is exact)."""
    parts = nodes * chiplets
    base, rem = divmod(int(nbytes), parts)
    flat = [base + (1 if i < rem else 0) for i in range(parts)]
    return [flat[n * chiplets:(n + 1) * chiplets] for n in range(nodes)]


@dataclass
class DeviceMemory:
    """What is allocated on one device, per chiplet and per owner."""

    device_id: int
    part: Part
    used: list[int] = field(default_factory=list)
    owners: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.used:
            self.used = [0] * self.part.chiplets

    def allocate(self, owner: str, per_chiplet: list[int]) -> None:
        """Reserve ``per_chiplet`` bytes (aligned) for ``owner``.

        Raises:
            RBLNOutOfMemoryError: a chiplet has less left than asked; the message names the
                device, chiplet, bytes asked and left.
        """
        want = [align(b) for b in per_chiplet]
        for chip, (u, w) in enumerate(zip(self.used, want)):
            left = self.part.usable_per_chiplet - u
            if w > left:
                raise RBLNOutOfMemoryError(
                    f"device {self.device_id} ({self.part.name}) chiplet {chip}: cannot allocate "
                    f"{w} bytes for {owner}, {left} of {self.part.usable_per_chiplet} bytes left "
                    f"(RBLN_ERROR: out of device memory)")
        for chip, w in enumerate(want):
            self.used[chip] += w
        prev = self.owners.get(owner, [0] * self.part.chiplets)
        self.owners[owner] = [p + w for p, w in zip(prev, want)]

    def free(self, owner: str) -> None:
        """Release everything ``owner`` holds (no-op when it holds nothing)."""
        for chip, w in enumerate(self.owners.pop(owner, [])):
            self.used[chip] -= w


class _Ledger:
    """Process-wide :class:`DeviceMemory` per device id (the simulator's DRAM)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[tuple[int, str, int], DeviceMemory] = {}

    def device(self, device_id: int, part: Part) -> DeviceMemory:
        key = (device_id, part.name, part.dram_per_chiplet)
        with self._lock:
            mem = self._devices.get(key)
            if mem is None:
                mem = self._devices[key] = DeviceMemory(device_id, part)
            return mem


ledger = _Ledger()
