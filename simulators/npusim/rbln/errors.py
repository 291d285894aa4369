"""Exceptions of the ``rebel`` simulator (stdlib only).

The real ``rebel-compiler`` raises ``RuntimeError``/``ValueError`` subclasses from its C++ core;
every class here subclasses the builtin a caller of the real package would catch, so vendor code
(optimum-rbln's ``except RuntimeError``) handles them the same way.
"""

from __future__ import annotations

__all__ = [
    "RBLNSimError",
    "RBLNSettingsError",
    "RBLNDeviceError",
    "RBLNOutOfMemoryError",
    "RBLNInputError",
    "RBLNFileError",
    "RBLNCompileError",
    "RBLNRuntimeFault",
]


class RBLNSimError(RuntimeError):
    """Base of every error the simulator raises."""


class RBLNSettingsError(ValueError):
    """``$NPUSIM_RBLN`` is not a JSON object of known, valid fields."""


class RBLNDeviceError(RBLNSimError):
    """A device id that is not a present NPU, or an NPU name no part matches."""


class RBLNOutOfMemoryError(RBLNSimError):
    """An allocation that does not fit the DRAM left on a chiplet."""


class RBLNInputError(ValueError):
    """A runtime call whose tensors are not exactly the compiled shapes and dtypes."""


class RBLNFileError(RBLNSimError):
    """A ``.rbln`` file that is missing, truncated, corrupt or of an unknown version."""


class RBLNCompileError(RBLNSimError):
    """A module the compiler cannot turn into a static graph (the cause is chained)."""


class RBLNRuntimeFault(RBLNSimError):
    """An injected device fault (``$NPUSIM_RBLN`` ``fault``): the runtime call failed."""
