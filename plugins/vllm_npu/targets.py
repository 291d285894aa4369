"""Target names shared by the plugins and the conformance suite, and the env var that picks one.

This module imports nothing: the pytest plugin and the vLLM plugins both read it.
"""

from __future__ import annotations

import os

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
