"""Named options for the details the public IME2 spec leaves open, and their validation.

The ``.hp`` instructions compute ``vd[p] += (fp16)tmp * scale`` (Zvvm_spacemit v0.6, section 5.4.3)
without saying how many roundings happen, how precise ``(fp16)tmp`` is internally, or what an
fp16 overflow produces (ime2.md, "Open questions"). Each is a named option; the defaults follow
the reference's model of the real kernel (ime2.md section 3.3: ``d16 + fp16(fp16(dot) * sc)``,
IEEE overflow to inf).

=========== ============================ ==================================================
option      values (default first)       meaning
=========== ============================ ==================================================
rounding    ``"unfused"``, ``"fused"``   ``unfused``: ``fp16(vd + fp16(t * scale))`` (two
                                         roundings); ``fused``: ``fp16(vd + t * scale)`` (one)
dot         ``"fp16"``, ``"exact"``      ``t = fp16(tmp)`` (RNE) or the exact int32 ``tmp``
overflow    ``"inf"``, ``"saturate"``    an fp16 result beyond 65504 is +/-inf (IEEE) or
                                         clamps to +/-65504
order       ``"hi_lo"``, ``"lo_hi"``     GEMM kernels only: the kernel issues the high-nibble
                                         ``vmadotsu.hp`` before the low-nibble ``vmadotu.hp``
                                         (``hi_lo``, as in ``gemm_kernel_i8i4_hp_m1/m4``)
=========== ============================ ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import OptionError

__all__ = ["DOT", "LEVELS", "ORDERS", "OVERFLOW", "ROUNDING", "HpMode", "check_option"]

Rounding = Literal["unfused", "fused"]
Dot = Literal["fp16", "exact"]
Overflow = Literal["inf", "saturate"]
Order = Literal["hi_lo", "lo_hi"]
Level = Literal["exact", "hardware"]

ROUNDING: tuple[str, ...] = ("unfused", "fused")
DOT: tuple[str, ...] = ("fp16", "exact")
OVERFLOW: tuple[str, ...] = ("inf", "saturate")
ORDERS: tuple[str, ...] = ("hi_lo", "lo_hi")
LEVELS: tuple[str, ...] = ("exact", "hardware")


def check_option(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``.

    Raises:
        OptionError: ``value`` is not one of ``allowed``; the message names both.
    """
    if not isinstance(value, str) or value not in allowed:
        raise OptionError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


@dataclass(frozen=True)
class HpMode:
    """The open ``.hp`` arithmetic details, validated. See the module docstring for each."""

    rounding: Rounding = "unfused"
    dot: Dot = "fp16"
    overflow: Overflow = "inf"

    def __post_init__(self) -> None:
        check_option("rounding", self.rounding, ROUNDING)
        check_option("dot", self.dot, DOT)
        check_option("overflow", self.overflow, OVERFLOW)

    @property
    def saturate(self) -> bool:
        """True when fp16 overflow clamps to +/-65504."""
        return self.overflow == "saturate"
