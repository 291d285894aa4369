"""Drop-in simulator of Mobilint's qbruntime API: MXQ model slots and KV cache ids (not built yet: issue 4)."""

from __future__ import annotations

#: Names this module will provide once built.
PLANNED: tuple[str, ...] = ("Accelerator", "Model", "ModelConfig", "BatchParam", "QbRuntimeError")


def __getattr__(name: str):
    if name in PLANNED:
        raise NotImplementedError(f"npusim.mxq.{name} is not built yet: issue 4")
    raise AttributeError(f"module 'npusim.mxq' has no attribute {name!r}")
