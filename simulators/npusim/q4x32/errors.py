"""Exceptions raised by :mod:`npusim.q4x32`.

Every class is a :class:`ValueError` (through :class:`Q4x32Error`), so callers that already catch
``ValueError`` keep working. Messages name the offending value and the rule it breaks.
"""

from __future__ import annotations

__all__ = [
    "AnswersError",
    "DTypeError",
    "InstructionError",
    "KDimensionError",
    "LayoutError",
    "NonFiniteError",
    "OptionError",
    "Q4x32Error",
    "ShapeMismatchError",
]


class Q4x32Error(ValueError):
    """Base class of every error raised by :mod:`npusim.q4x32`."""


class KDimensionError(Q4x32Error):
    """K (the reduction length) is not a positive multiple of 32, the Q4_0 block length.

    K that is not a multiple of 256 is accepted (the tile format pads it, see
    :mod:`npusim.q4x32.layout`); K that is not a multiple of 32 cannot be expressed in
    ``qweight [N, K/32, 16]`` and is rejected, as the seed's op contract says.
    """


class ShapeMismatchError(Q4x32Error):
    """Array shapes disagree: ``A [M, K]``, ``qweight [N, K/32, 16]``, ``scales [N, K/32]``."""


class DTypeError(Q4x32Error):
    """An array has the wrong dtype (``A`` and ``scales`` float32, ``qweight`` uint8)."""


class NonFiniteError(Q4x32Error):
    """An input array holds NaN or +/-Inf; the message names the array, index and value."""


class LayoutError(Q4x32Error):
    """A serialized tile buffer has the wrong size for the shape it is decoded as."""


class OptionError(Q4x32Error):
    """An option string (``level``, ``rounding``, ``dot``, ``overflow``, ``order``, ``m4``, ...) is
    unknown, or a default set through ``set_defaults`` / ``NPUSIM_Q4X32`` names an unknown option
    or value."""


class AnswersError(OptionError):
    """A board answers file (``ime2-board-answers.json``) is unreadable or malformed, or answers an
    option with none of the modelled values."""


class InstructionError(Q4x32Error):
    """An instruction word, register image or immediate is not a valid IME2 ``.hp`` operand."""
