"""The devices of the serving suite: each module here supplies one device's
:class:`~npu_conformance.devices.base.DeviceLab` (how to build its artifact, start its server,
what its plugin refuses, which faults it injects). ``docs/conformance.md`` shows how a new
device joins.
"""

from __future__ import annotations

import importlib

from npu_conformance.devices.base import DeviceLab

#: Every device family that serves through ``vllm serve`` with a plugin of ours, in report order.
SERVING_DEVICES: tuple[str, ...] = ("mblt", "rbln", "neuron")

#: Device -> ``module:class`` of its lab.
_LABS: dict[str, str] = {"mblt": "npu_conformance.devices.mblt:MbltLab",
                         "rbln": "npu_conformance.devices.rbln:RblnLab",
                         "neuron": "npu_conformance.devices.neuron:NeuronLab"}
#: Serving devices whose lab is not written yet, and the issue that writes it.
_PENDING: dict[str, str] = {}
#: Vendor columns (``targets.Target.kind == "vendor"``) -> ``module:class`` of their lab.
_VENDOR_LABS: dict[str, str] = {"vllm-rbln@rbln-sim": "npu_conformance.devices.rbln_vendor:VllmRblnLab",
                                "vllm-mblt@mblt-sim": "npu_conformance.devices.mblt_vendor:VllmMbltLab"}


class NoDeviceLab(LookupError):
    """The device has no lab for the serving suite (yet); the message says why."""


def lab_class(device: str) -> type[DeviceLab]:
    """The :class:`DeviceLab` subclass of ``device``.

    Raises:
        NoDeviceLab: a serving device whose lab is not built yet (naming the issue), or a
            device that does not serve through vLLM.
    """
    if device in _LABS:
        module, _, name = _LABS[device].partition(":")
        return getattr(importlib.import_module(module), name)
    if device in _PENDING:
        raise NoDeviceLab(f"no serving profile for {device} yet ({_PENDING[device]})")
    raise NoDeviceLab(f"{device} does not serve through vllm serve with a plugin of this project")


def lab_class_for(target: str) -> type[DeviceLab]:
    """The :class:`DeviceLab` subclass of target ``target``: a vendor column's own lab, else
    its device's (:func:`lab_class`).

    Raises:
        NoDeviceLab: as :func:`lab_class`.
    """
    from npu_conformance.targets import TARGETS

    if target in _VENDOR_LABS:
        module, _, name = _VENDOR_LABS[target].partition(":")
        return getattr(importlib.import_module(module), name)
    return lab_class(TARGETS[target].device)
