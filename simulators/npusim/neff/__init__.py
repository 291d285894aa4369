"""Simulator of Neuron NEFF programs and their shape buckets (not built yet: issue 11)."""

from __future__ import annotations

#: Names this module will provide once built.
PLANNED: tuple[str, ...] = ("NeffProgram", "BucketLadder")


def __getattr__(name: str):
    if name in PLANNED:
        raise NotImplementedError(f"npusim.neff.{name} is not built yet (issue 11)")
    raise AttributeError(f"module 'npusim.neff' has no attribute {name!r}")
