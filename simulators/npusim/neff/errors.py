"""Exceptions of the NEFF simulator (stdlib only).

Modelled on AWS ``nrtpy``: :class:`NrtpyError` (misuse of the Python API) and :class:`NrtError`
(a runtime status other than ``NRT_SUCCESS``), both ``RuntimeError`` subclasses, so code written
for the real runtime catches them the same way. Runtime status messages use nrtpy's format
``"NRT Error {NAME}({code}): {msg}"`` (:func:`nrt_message`).
"""

from __future__ import annotations

__all__ = [
    "NRT_STATUS",
    "NrtpyError",
    "NrtError",
    "NeffFileError",
    "NeffTargetError",
    "NeffRecompileError",
    "NeffCompileError",
    "NeffConfigError",
    "nrt_message",
]

#: The ``NRT_STATUS`` codes the simulator reports (SDK ``nrt_status.rst``).
NRT_STATUS: dict[str, int] = {
    "NRT_FAILURE": 1,
    "NRT_INVALID": 2,
    "NRT_RESOURCE": 4,
    "NRT_LOAD_NOT_ENOUGH_NC": 9,
}


def nrt_message(name: str, msg: str) -> str:
    """``"NRT Error {name}({code}): {msg}"``.

    Raises:
        KeyError: ``name`` is not in :data:`NRT_STATUS`.
    """
    return f"NRT Error {name}({NRT_STATUS[name]}): {msg}"


class NrtpyError(RuntimeError):
    """Misuse of the Python API (wrong argument types, a tensor written with another shape)."""


class NrtError(RuntimeError):
    """A runtime call failed with an ``NRT_STATUS`` (message ``"NRT Error NAME(code): ..."``)."""


class NeffFileError(NrtError):
    """A NEFF file that is missing, truncated, corrupt, of another version, or stale."""


class NeffTargetError(NrtError):
    """An unknown platform target, or a NEFF compiled for another target than the device's."""


class NeffRecompileError(RuntimeError):
    """A call whose tensor shapes differ from the compiled ones (torch's ``fail_on_recompile`` text)."""


class NeffCompileError(RuntimeError):
    """The simulated ``neuronx-cc`` rejected a program (e.g. ``NCC_EOOM001``: it does not fit HBM)."""


class NeffConfigError(ValueError):
    """``$NPUSIM_NEFF`` or ``$NEURON_LOGICAL_NC_CONFIG`` is malformed (names the key and value)."""
