"""``Accelerator``: a handle on one simulated NPU card (see :mod:`npusim.mxq.machine`)."""

from __future__ import annotations

from . import machine
from .errors import fail, log

__all__ = ["DEVICE_NAMES", "Accelerator", "get_available_device_numbers", "get_available_devices"]

#: Names qbruntime accepts; the simulated cards answer to ``auto``, ``aries`` and ``aries-rb``.
DEVICE_NAMES: tuple[str, ...] = (
    "auto", "aries", "aries-rb", "regulus", "regulus-usb", "regulus-ra", "regulus-ra-usb", "regulus-rb", "regulus-rb-usb",
)
SIMULATED_NAMES: tuple[str, ...] = ("auto", "aries", "aries-rb")


class Accelerator:
    """One NPU card: ``Accelerator(device_name="auto", dev_no=0)`` or ``Accelerator(dev_no)``.

    Raises:
        QbRuntimeError: ``Acc_DeviceNotFound`` (``auto`` and no card ``dev_no``; ``aries``
            and no card at all) or ``Driver_NotInitialized`` (a named device whose card
            ``dev_no`` does not exist); each after the real core's two glog lines.
        ValueError: an unknown device name (the known ones are listed).
    """

    def __init__(self, device_name: str | int = "auto", dev_no: int = 0) -> None:
        if isinstance(device_name, int) and not isinstance(device_name, bool):
            device_name, dev_no = "auto", device_name
        if device_name not in DEVICE_NAMES:
            raise ValueError(f"unknown device name {device_name!r} (known: {', '.join(DEVICE_NAMES)})")
        if isinstance(dev_no, bool) or not isinstance(dev_no, int) or dev_no < 0:
            raise ValueError(f"dev_no {dev_no!r} must be an integer >= 0")
        present = machine.device_numbers() if device_name in SIMULATED_NAMES else []
        if dev_no not in present:
            # the real core's lines and statuses, as the 1.5.0 wheel prints them without a device
            family = "REGULUS" if device_name.startswith("regulus") else "ARIES"
            if device_name == "auto":
                err = fail("Acc_DeviceNotFound", "No NPU device found in the system.", "device.cc:239")
            elif device_name == "aries" and not present:
                err = fail("Acc_DeviceNotFound", "No ARIES device found in the system.", "device.cc:130")
            else:
                err = fail("Driver_NotInitialized", f"{family} device #{dev_no} not found.",
                           "regulus.cc:149" if family == "REGULUS" else "aries.cc:173")
            log("Accelerator not created.", "acc.cc:33")
            raise err
        # auto and a base name resolve to the concrete device, as the real core does
        self._name = "aries-rb" if device_name in ("auto", "aries") else device_name
        self._dev_no = dev_no

    @property
    def _device(self) -> machine.Device:
        return machine.device(self._dev_no)

    def __repr__(self) -> str:
        return f"Accelerator(device_name={self._name!r}, dev_no={self._dev_no})"

    def get_device_name(self) -> str:
        """The resolved device name: ``"aries-rb"`` (the simulated card) for ``auto`` and
        ``aries``, as the real core resolves them."""
        return self._name

    def get_dev_no(self) -> int:
        """The card number (simulator addition)."""
        return self._dev_no

    def device_clock_us(self) -> float:
        """The card's simulated clock in µs (simulator addition)."""
        return self._device.clock_us

    def allocate_pinned_memory(self, shape: object, dtype: object) -> None:
        """Regulus only: not available on Aries.

        Raises:
            QbRuntimeError: ``NotImplemented``.
        """
        raise fail("NotImplemented", "Pinned memory is only available on Regulus devices.", "accelerator.cc:57")


def get_available_devices() -> list[str]:
    """Names of present device kinds: ``["aries"]`` if any card exists, else ``[]``."""
    return ["aries"] if machine.device_numbers() else []


def get_available_device_numbers(device_name: str = "auto") -> list[int]:
    """Card numbers answering to ``device_name`` (empty for Regulus names)."""
    return machine.device_numbers() if device_name in SIMULATED_NAMES else []
