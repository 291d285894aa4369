"""Host-side sampling for the MBLT worker: :class:`vllm_npu.host_sampling.HostSampler` (vLLM's
own ``Sampler`` on the MXQ's logits, as vllm-mblt does), with MBLT's switch
``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0`` that drops the penalties."""

from __future__ import annotations

from vllm_npu.host_sampling import PENALTIES_ENV, HostSampler, SampleRequest, penalties_enabled

__all__ = ["PENALTIES_ENV", "HostSampler", "SampleRequest", "penalties_enabled"]
