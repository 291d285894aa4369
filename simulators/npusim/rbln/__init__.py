"""Simulator of the Rebellions rebel runtime API: static compiled graphs (not built yet: issue 16)."""

from __future__ import annotations

#: Names this module will provide once built.
PLANNED: tuple[str, ...] = ("Runtime", "RBLNCompiledModel")


def __getattr__(name: str):
    if name in PLANNED:
        raise NotImplementedError(f"npusim.rbln.{name} is not built yet (issue 16)")
    raise AttributeError(f"module 'npusim.rbln' has no attribute {name!r}")
