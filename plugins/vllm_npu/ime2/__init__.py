"""SpacemiT K3 IME2 int4 linear layers for vLLM's CPU backend (issues 3 and 5).

* ``ime2_hp_gemm_cpu(A, qweight, scales)``, ``register_torch_op()`` and the rest of
  :mod:`vllm_npu.ime2.kernel`: the host build of ``kernels/ime2`` through its C ABI (issue 3).
  Loaded lazily, so importing this package stays cheap (no ctypes load, no torch).
* :mod:`vllm_npu.ime2.fence`: the K3 core fence (load on the X100 cores, then register the
  kernel's GEMM worker threads in ``/proc/set_ai_thread`` and pin one per A100 core, the calling
  thread staying on the X100 cores; a no-op with one log line on any other host; issues 5, 15).
* ``PackedQ4Weight``, ``pack_count``: :mod:`vllm_npu.ime2.linear`, a linear layer's weight
  Q4_0-quantized and packed once, applied through the kernel with its N tiles over threads.
* :func:`register`: the vLLM general plugin (entry point ``vllm.general_plugins``: ``ime2``)
  that registers the ``ime2_q4`` quantization method of :mod:`vllm_npu.ime2.quant` (issue 5).
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM_KERNEL = (
    "ime2_hp_gemm_cpu",
    "register_torch_op",
    "pack_b",
    "quantize_a",
    "gemm_packed",
    "Ime2Error",
    "KernelUnavailableError",
)

_FROM_LINEAR = ("PackedQ4Weight", "pack_count")

_PENDING: dict[str, str] = {}

__all__ = list(_FROM_KERNEL) + list(_FROM_LINEAR) + ["register"]


def register() -> None:
    """vLLM general plugin: register the ``ime2_q4`` quantization method (idempotent).

    vLLM calls this in every process it starts, and an exception here would stop vLLM's
    start-up even for users who never pass ``--quantization ime2_q4``. So a failure (vLLM or
    torch missing or incompatible) is logged as one warning naming the cause, and
    ``ime2_q4`` is then simply not offered; vLLM itself rejects ``--quantization ime2_q4`` as
    an unknown method.
    """
    import logging

    try:
        from .quant import register as _register

        _register()
    except Exception as exc:  # noqa: BLE001 - must never break vLLM start-up (see docstring)
        logging.getLogger("vllm.vllm_npu.ime2").warning(
            "vllm_npu.ime2: the ime2_q4 quantization method is not registered: %s: %s",
            type(exc).__name__, exc)


def __getattr__(name: str) -> Any:
    if name in _FROM_KERNEL:
        return getattr(importlib.import_module(f"{__name__}.kernel"), name)
    if name in _FROM_LINEAR:
        return getattr(importlib.import_module(f"{__name__}.linear"), name)
    if name in _PENDING:
        raise NotImplementedError(f"vllm_npu.ime2.{name} is not built yet: {_PENDING[name]}")
    raise AttributeError(f"module 'vllm_npu.ime2' has no attribute {name!r}")
