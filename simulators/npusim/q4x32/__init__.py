"""Q4_0x32 tile math and the IME2 .hp instruction model (not built yet: issue 3)."""

from __future__ import annotations

#: Names this module will provide once built.
PLANNED: tuple[str, ...] = ("ime2_hp_gemm", "quantize_q4_0", "pack_b", "quantize_a")


def __getattr__(name: str):
    if name in PLANNED:
        raise NotImplementedError(f"npusim.q4x32.{name} is not built yet: issue 3")
    raise AttributeError(f"module 'npusim.q4x32' has no attribute {name!r}")
