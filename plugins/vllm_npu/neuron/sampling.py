"""On-device sampling (ODS) and async scheduling rules of the Neuron plugin.

ODS samples on the Neuron device from a float32 ``(num_reqs, 3)`` tensor of rows
``[top_k, top_p, temperature]`` (reference neuron.md §6; seed "On-device sampling"): it honours
temperature, top_k and top_p only. ``top_k=-1`` is limited to ``max_top_k`` (256); a
temperature below 1e-5 is greedy (equivalent to ``top_k=1``).

:func:`ods_refusals` lists the request parameters ODS cannot honour, so the platform can
answer HTTP 400 instead of silently ignoring them; :func:`check_async` applies the async
scheduling rules.

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_TOP_K", "DEFAULT_TOP_P", "DEFAULT_TEMPERATURE", "GREEDY_TEMPERATURE",
           "ASYNC_NEEDS_ODS", "ASYNC_STRUCTURED_OUTPUTS", "SPECULATIVE_DISABLES_ASYNC",
           "on_device_row", "is_greedy", "ods_refusals", "check_async"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: Row defaults when vLLM omits a parameter.
DEFAULT_TOP_K = -1
DEFAULT_TOP_P = 1.0
DEFAULT_TEMPERATURE = 0.0
#: Temperatures below this are greedy (argmax).
GREEDY_TEMPERATURE = 1e-5

ASYNC_NEEDS_ODS = "On-device sampling must be enabled for async execution"
ASYNC_STRUCTURED_OUTPUTS = ("Structured outputs with async scheduling is not supported. Disable "
                            "async scheduling with: --no-async-scheduling")
#: Our text for the documented startup warning.
SPECULATIVE_DISABLES_ASYNC = ("Speculative decoding (--speculative-config) is not supported "
                              "with async scheduling on Neuron; disabling async scheduling.")


def on_device_row(temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, *, max_top_k: int = 256
                  ) -> tuple[float, float, float]:
    """One ODS parameter row ``(top_k, top_p, temperature)`` as floats.

    None takes the vendor default (top_k -1, top_p 1.0, temperature 0.0). A top_k <= 0 (no
    top-k filter: -1) becomes ``max_top_k`` (the kernel always takes a top-k of that width), and
    a top_k above ``max_top_k`` is limited to it too (our reading: the kernel cannot see past
    its top-k width).

    Args:
        temperature: >= 0; below :data:`GREEDY_TEMPERATURE` is greedy.
        top_k: tokens; -1 (or any value <= 0) = all (limited to ``max_top_k``).
        top_p: in (0, 1].
        max_top_k: ``on_device_sampling_config.max_top_k``.
    """
    k = DEFAULT_TOP_K if top_k is None else int(top_k)
    k = max_top_k if k <= 0 or k > max_top_k else k
    p = DEFAULT_TOP_P if top_p is None else float(top_p)
    t = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    return float(k), p, t


def is_greedy(row: tuple[float, float, float]) -> bool:
    """The row samples greedily (temperature below :data:`GREEDY_TEMPERATURE`, or top_k 1)."""
    return row[2] < GREEDY_TEMPERATURE or row[0] == 1.0


def _set(value: Any) -> bool:
    return value is not None and value != [] and value != {} and value != () and value != set()


def ods_refusals(params_fields: Mapping[str, Any], *, async_scheduling: bool = False
                 ) -> list[tuple[str, str]]:
    """The request parameters on-device sampling cannot honour, as ``(param, text)`` pairs.

    Honoured (never refused): ``temperature``, ``top_k``, ``top_p``, ``seed``, ``max_tokens``,
    ``stop`` / ``stop_token_ids``, ``ignore_eos``, any ``n`` (vLLM fans ``n`` out into independent
    child requests before a worker sees them), ``logprobs`` (returned in the raw
    mode the runner resolves), structured outputs (a bitmask applied on device) without async
    scheduling, ``prompt_logprobs`` (scored from the NEFFs' logits, one prompt token per prefill
    call). Refused (our decision, documented per parameter): ``presence_penalty`` /
    ``frequency_penalty`` != 0, ``repetition_penalty`` != 1, ``min_p`` > 0, a non-empty
    ``logit_bias``, ``allowed_token_ids``, ``bad_words`` or ``logits_processors``,
    ``min_tokens`` > 0, and
    ``structured_outputs`` (or the older ``guided_decoding``) with async scheduling. Missing
    keys count as their neutral value.

    Args:
        params_fields: SamplingParams fields by name (plain values).
        async_scheduling: async scheduling is on.
    """
    f = params_fields
    out: list[tuple[str, str]] = []

    def refuse(param: str, why: str) -> None:
        out.append((param, f"{param}={f.get(param)!r} is not supported with Neuron on-device "
                           f"sampling ({why}); it supports temperature, top_k and top_p."))

    for name in ("presence_penalty", "frequency_penalty"):
        if f.get(name) not in (None, 0, 0.0):
            refuse(name, "penalties are not applied on device")
    if f.get("repetition_penalty") not in (None, 1, 1.0):
        refuse("repetition_penalty", "penalties are not applied on device")
    if (f.get("min_p") or 0) > 0:
        refuse("min_p", "no min-p filter on device")
    for name, why in (("logit_bias", "logits are not modified on device"),
                      ("allowed_token_ids", "logits are not masked on device"),
                      ("bad_words", "logits are not masked on device"),
                      ("logits_processors", "logits never reach the host")):
        if _set(f.get(name)):
            refuse(name, why)
    if (f.get("min_tokens") or 0) > 0:
        refuse("min_tokens", "EOS is not suppressed on device")
    if async_scheduling:
        for name in ("structured_outputs", "guided_decoding"):
            if _set(f.get(name)):
                out.append((name, ASYNC_STRUCTURED_OUTPUTS))
    return out


def check_async(async_scheduling: bool, ods_enabled: bool, structured_outputs: bool,
                speculative: bool) -> bool:
    """Whether async scheduling stays on; applies its rules.

    Speculative decoding disables async scheduling with a warning
    (:data:`SPECULATIVE_DISABLES_ASYNC`, our text for the documented warning), before the other
    checks.

    Args:
        async_scheduling: vLLM's ``async_scheduling`` (on by default on Neuron).
        ods_enabled: on-device sampling is on.
        structured_outputs: structured outputs are enabled.
        speculative: ``--speculative-config`` is set.

    Raises:
        RuntimeError: async without ODS ("On-device sampling must be enabled for async
            execution").
        AssertionError: structured outputs with async ("Structured outputs with async
            scheduling is not supported. Disable async scheduling with:
            --no-async-scheduling"), the vendor's type; raised explicitly, so ``python -O``
            keeps it.
    """
    if not async_scheduling:
        return False
    if speculative:
        logger.warning(SPECULATIVE_DISABLES_ASYNC)
        return False
    if not ods_enabled:
        raise RuntimeError(ASYNC_NEEDS_ODS)
    if structured_outputs:
        raise AssertionError(ASYNC_STRUCTURED_OUTPUTS)
    return True
