"""SpacemiT K3 IME2 int4 linear layers for vLLM's CPU backend (issues 3 and 5; not built yet)."""

from __future__ import annotations

_PENDING = {
    "ime2_hp_gemm_cpu": "issue 3 (the Q4_0x32 kernel and its host build)",
    "register": "issue 5 (the ime2_q4 quantization method)",
}


def __getattr__(name: str):
    if name in _PENDING:
        raise NotImplementedError(f"vllm_npu.ime2.{name} is not built yet: {_PENDING[name]}")
    raise AttributeError(f"module 'vllm_npu.ime2' has no attribute {name!r}")
