"""SpacemiT K3 IME2 int4 linear layers for vLLM's CPU backend (issues 3 and 5).

* ``ime2_hp_gemm_cpu(A, qweight, scales)``, ``register_torch_op()`` and the rest of
  :mod:`vllm_npu.ime2.kernel`: the host build of ``kernels/ime2`` through its C ABI (issue 3).
  Loaded lazily, so importing this package stays cheap (no ctypes load, no torch).
* :mod:`vllm_npu.ime2.fence`: the K3 core fence (load on the X100 cores, then move to the A100
  cores through ``/proc/set_ai_thread``; a no-op with one log line on any other host; issue 5).
* ``PackedQ4Weight``, ``pack_count``: :mod:`vllm_npu.ime2.linear`, a linear layer's weight
  Q4_0-quantized and packed once, applied through the kernel with its N tiles over threads.
* ``register``: the ``ime2_q4`` quantization method, not built yet (issue 5).
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

_PENDING = {
    "register": "issue 5 (the ime2_q4 quantization method)",
}

__all__ = list(_FROM_KERNEL) + list(_FROM_LINEAR) + ["register"]


def __getattr__(name: str) -> Any:
    if name in _FROM_KERNEL:
        return getattr(importlib.import_module(f"{__name__}.kernel"), name)
    if name in _FROM_LINEAR:
        return getattr(importlib.import_module(f"{__name__}.linear"), name)
    if name in _PENDING:
        raise NotImplementedError(f"vllm_npu.ime2.{name} is not built yet: {_PENDING[name]}")
    raise AttributeError(f"module 'vllm_npu.ime2' has no attribute {name!r}")
