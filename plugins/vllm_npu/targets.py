"""Target names shared by the plugins and the conformance suite, the env var that picks one, and
the runtime seam table: which module each device's plugin reaches on each target.

This module imports only the standard library: the pytest plugin, ``npu-harness doctor`` and the
vLLM plugins all read it.

The runtime seam table (:data:`RUNTIME_SEAMS`), one row per device whose plugin talks to a
Python runtime module:

========  =============  ==============  ==================================================
device    vendor module  simulator       how ``<device>-sim`` / ``<device>-hw`` select it
========  =============  ==============  ==================================================
mblt      ``qbruntime``  ``npusim.mxq``  by name: the simulator's name on sim, the vendor's
                                         on hw (``npusim.alias`` also maps ``qbruntime`` on
                                         sim, for the vendor's own vllm-mblt)
rbln      ``rebel``      ``npusim.rbln`` the vendor's name on both: optimum-rbln imports
                                         ``rebel`` itself, so on sim ``npusim.alias`` binds
                                         that name to the simulator (one module object)
neuron    ``nrtpy``      ``npusim.neff`` by name, as mblt (no alias)
========  =============  ==============  ==================================================

IME2 has no runtime module: its plugin loads the kernel library ``kernels/ime2`` (ctypes,
:mod:`vllm_npu.ime2.kernel`) on both of its targets, and ``npusim.q4x32`` is the golden model
that library is checked against, not a runtime it calls.

``npusim.alias`` (which may import nothing of ``vllm_npu``) keeps its own copy of the alias
rows; ``tests/vllm_npu/test_runtime_seams.py`` holds the two equal.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

ENV_VAR = "NPU_HARNESS_TARGET"

#: Every target name of the user-facing contract, in report-column order.
TARGET_NAMES: tuple[str, ...] = (
    "mblt-sim",
    "mblt-hw",
    "rbln-sim",
    "rbln-hw",
    "neuron-sim",
    "neuron-hw",
    "ime2-qemu",
    "ime2-hw",
)


class UnknownTargetError(ValueError):
    """A target name that is not one of :data:`TARGET_NAMES` (or an alias such as ``sim``)."""


def selected_target(environ: dict[str, str] | None = None) -> str | None:
    """Return the target named by ``NPU_HARNESS_TARGET``, or None when it is unset or empty.

    Raises:
        UnknownTargetError: the variable holds a name that is not a target.
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    if not value:
        return None
    if value not in TARGET_NAMES:
        raise UnknownTargetError(
            f"{ENV_VAR}={value!r} is not a target; expected one of: {', '.join(TARGET_NAMES)}"
        )
    return value


def platform_for(device: str, qualname: str, environ: dict[str, str] | None = None) -> str | None:
    """What a device's vLLM platform plugin returns: ``qualname`` when ``NPU_HARNESS_TARGET``
    names ``<device>-sim`` or ``<device>-hw``, else None (inactive).

    An invalid value also yields None here: vLLM swallows exceptions raised by platform
    plugins, so the invalid value is reported by :func:`invalid_target_platform` instead.
    """
    try:
        target = selected_target(environ)
    except UnknownTargetError:
        return None
    return qualname if target in (f"{device}-sim", f"{device}-hw") else None


def invalid_target_platform(environ: dict[str, str] | None = None) -> str | None:
    """Platform plugin ``npu_harness_target``: activates only when ``NPU_HARNESS_TARGET`` is
    invalid, so that vLLM fails at start-up with :class:`UnknownTargetError` (importing the
    returned module raises it) instead of silently serving on another platform."""
    try:
        selected_target(environ)
    except UnknownTargetError:
        return "vllm_npu._invalid_target.InvalidTargetPlatform"
    return None


# ---------------------------------------------------------------------------------------------
# the runtime seam table


@dataclass(frozen=True)
class RuntimeSeam:
    """How one device's plugin reaches its runtime (see the module docstring's table).

    Attributes:
        device: ``mblt``, ``rbln`` or ``neuron``; its targets are ``<device>-sim`` and
            ``<device>-hw``.
        vendor_module: the vendor's runtime module (``qbruntime``).
        simulator_module: the numpy simulator with the same surface (``npusim.mxq``).
        selection: ``by-name`` (the plugin imports the simulator's own name on sim) or
            ``vendor-name`` (the plugin imports the vendor's name on both targets; on sim it is
            the simulator through ``npusim.alias``).
        sim_alias: whether ``<device>-sim`` enables the ``npusim.alias`` vendor name
            (``NPU_HARNESS_TARGET=<device>-sim`` in a process with the start-up hook).
        hw_install: how to get the vendor module on a machine with the device.
    """

    device: str
    vendor_module: str
    simulator_module: str
    selection: Literal["by-name", "vendor-name"]
    sim_alias: bool
    hw_install: str

    @property
    def targets(self) -> tuple[str, str]:
        """``(<device>-sim, <device>-hw)``."""
        return f"{self.device}-sim", f"{self.device}-hw"

    def import_name(self, target: str) -> str:
        """The module name the plugin imports on ``target``.

        Raises:
            ValueError: ``target`` is not one of :attr:`targets`.
        """
        sim, hw = self.targets
        if target == sim:
            return self.vendor_module if self.selection == "vendor-name" else self.simulator_module
        if target == hw:
            return self.vendor_module
        raise ValueError(f"target {target!r} has no {self.device} runtime; expected one of: {sim}, {hw}")

    def backing_module(self, target: str) -> str:
        """The module that answers on ``target``: the simulator on sim, the vendor's on hw.

        Raises:
            ValueError: ``target`` is not one of :attr:`targets`.
        """
        self.import_name(target)
        return self.simulator_module if target == self.targets[0] else self.vendor_module

    def install_hint(self, target: str) -> str:
        """How to make :meth:`import_name` importable on ``target``."""
        if target == self.targets[1]:
            return self.hw_install
        if self.selection == "vendor-name":
            return (f"install npu-harness (pip install -e .), run `npu-harness alias install` and set "
                    f"{ENV_VAR}={target}, so that `import {self.vendor_module}` gives {self.simulator_module}")
        return "install npu-harness (pip install -e .) or put its simulators/ directory on PYTHONPATH"


#: Device -> its runtime seam (the module docstring's table).
RUNTIME_SEAMS: dict[str, RuntimeSeam] = {s.device: s for s in (
    RuntimeSeam("mblt", "qbruntime", "npusim.mxq", "by-name", True,
                "pip install mobilint-qb-runtime (Mobilint's qbruntime 1.5.0 wheel: CPython 3.11, x86_64 "
                "Linux, with the NPU driver installed)"),
    RuntimeSeam("rbln", "rebel", "npusim.rbln", "vendor-name", True,
                "pip install --extra-index-url https://pypi.rbln.ai/simple rebel-compiler==0.12.0 (on an "
                "RBLN host)"),
    RuntimeSeam("neuron", "nrtpy", "npusim.neff", "by-name", False,
                "install the Neuron SDK's Python runtime (nrtpy) on a Trn2/Trn3 instance with the "
                "aws-neuronx-runtime-lib and driver packages"),
)}


class RuntimeUnavailable(RuntimeError):
    """The runtime module of a target cannot be imported (the message names the module and how
    to get it; the ImportError is chained)."""


def load_runtime(device: str, target: str, *,
                 import_module: Callable[[str], ModuleType] = importlib.import_module,
                 error: type[RuntimeError] = RuntimeUnavailable) -> ModuleType:
    """Import and return the runtime module ``device``'s plugin talks to on ``target``.

    Args:
        device: a key of :data:`RUNTIME_SEAMS`.
        target: ``<device>-sim`` or ``<device>-hw``.
        import_module: the importer (a seam for tests; default :func:`importlib.import_module`).
        error: the device's exception class for an import failure.

    Raises:
        ValueError: ``device`` has no seam, or ``target`` is not one of its targets.
        error: the module cannot be imported; the message names it and how to install it.
    """
    try:
        seam = RUNTIME_SEAMS[device]
    except (KeyError, TypeError):
        raise ValueError(f"device {device!r} has no runtime seam; expected one of: "
                         f"{', '.join(RUNTIME_SEAMS)}") from None
    name = seam.import_name(target)
    try:
        return import_module(name)
    except ImportError as exc:
        raise error(f"target {target!r} needs the Python module {name!r}, which cannot be imported "
                    f"({exc}); {seam.install_hint(target)}") from exc
