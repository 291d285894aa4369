"""Host-side sampling for the MBLT worker: :class:`vllm_npu.host_sampling.HostSampler` (vLLM's
own ``Sampler`` on the MXQ's logits, as vllm-mblt does), with MBLT's switch
``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0`` that drops the penalties (MBLT's alone: the worker
passes it to its sampler; the other devices' samplers never read it)."""

from __future__ import annotations

from collections.abc import Mapping

from vllm_npu.host_sampling import HostSampler, SampleRequest
from vllm_npu.settings import env_switch

__all__ = ["PENALTIES_ENV", "HostSampler", "SampleRequest", "SamplingSettingError", "penalties_enabled"]

PENALTIES_ENV = "VLLM_MBLT_ENABLE_SAMPLING_PENALTIES"


class SamplingSettingError(ValueError):
    """A sampling switch holds a value that is neither on nor off (the message names it)."""


def penalties_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES`` (:func:`vllm_npu.settings.env_switch`): on when
    unset or blank, or 1/true/yes/on; off for 0/false/no/off (any case).

    Raises:
        SamplingSettingError: any other value (named, with the accepted words).
    """
    return env_switch(PENALTIES_ENV, default=True, environ=environ, error=SamplingSettingError)
