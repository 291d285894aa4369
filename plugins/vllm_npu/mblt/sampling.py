"""Host-side sampling for the MBLT worker: :class:`vllm_npu.host_sampling.HostSampler` (vLLM's
own ``Sampler`` on the MXQ's logits, as vllm-mblt does), with MBLT's switch
``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0`` that drops the penalties (MBLT's alone: the worker
passes it to its sampler; the other devices' samplers never read it)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_npu.host_sampling import HostSampler, SampleRequest

__all__ = ["PENALTIES_ENV", "HostSampler", "SampleRequest", "SamplingSettingError", "penalties_enabled"]

PENALTIES_ENV = "VLLM_MBLT_ENABLE_SAMPLING_PENALTIES"
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


class SamplingSettingError(ValueError):
    """A sampling switch holds a value that is neither on nor off (the message names it)."""


def penalties_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES``: on when unset or empty, or 1/true/yes/on; off
    for 0/false/no/off (any case).

    Raises:
        SamplingSettingError: any other value (named, with the accepted ones).
    """
    env = os.environ if environ is None else environ
    raw = env.get(PENALTIES_ENV, "")
    value = raw.strip().lower()
    if value in _FALSE:
        return False
    if not value or value in _TRUE:
        return True
    raise SamplingSettingError(
        f"{PENALTIES_ENV}={raw!r} is neither on (1, true, yes, on) nor off (0, false, no, off)"
    )
