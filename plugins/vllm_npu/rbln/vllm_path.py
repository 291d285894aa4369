"""The platform's half of the RBLN ``vllm`` model path: the rules and sizes it fixes before
the engine starts (reference §7, §8 "vllm wiring").

* **decode batch buckets** from the ``--rbln-decode-batch-bucket-*`` options
  (:func:`decode_buckets`): ``exponential`` ``[max, max//step, ...]``, ``linear``
  ``[max, max-step, ...]``, each at most ``limit`` entries and at least ``min``; ``manual``
  the given list. A step's decodes run on the smallest bucket that fits, so the largest
  bucket is always ``max_num_seqs``.
* **the prefill chunk**: ``--max-num-batched-tokens``, else the device's chunk (128 on ATOM,
  512 on Rebel100); every prefill call is one chunk, zero-padded.
* **KV blocks** (:func:`kv_plan`): enough for ``max_num_seqs`` sequences of
  ``max_model_len`` (or ``--num-gpu-blocks-override``), plus vLLM's null block, checked
  against the part's DRAM (:func:`vllm_npu.rbln.device.dram_bytes`) times
  ``gpu_memory_utilization`` less the weights, as the device would refuse them.
* refusals with vllm-rbln's messages: chunked prefill off, LoRA; and what this plugin does
  not build on the path (tensor/pipeline parallelism, speculative decoding). Prefix caching is
  vLLM's own (the worker starts a prefill at vLLM's cache hit).

Nothing here imports vLLM, torch or the device runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_npu.rbln import device

__all__ = ["VllmPathError", "decode_buckets", "KvPlan", "kv_plan", "CHUNKED_PREFILL_OFF", "LORA"]

CHUNKED_PREFILL_OFF = ("Disabling chunked prefill is not supported on RBLN. Please enable chunked "
                       "prefill by yourself.")
LORA = "LoRA is not supported on RBLN."


class VllmPathError(ValueError):
    """Settings the ``vllm`` model path cannot run (names the value and the rule)."""


def decode_buckets(max_num_seqs: int, strategy: str, minimum: int = 1, step: int = 2, limit: int = 1,
                   manual: list[int] | None = None) -> list[int]:
    """The decode batch sizes compiled for, ascending.

    Raises:
        VllmPathError: a manual list whose largest entry is not ``max_num_seqs`` (a full
            batch would fit no bucket), or entries above it.
    """
    top = int(max_num_seqs)
    if strategy == "manual":
        got = sorted(set(int(b) for b in manual or []))
        if not got or got[-1] != top:
            raise VllmPathError(
                f"decode_batch_bucket_manual_buckets {manual} must include max_num_seqs {top} as its "
                "largest entry (a full decode batch must fit a bucket)")
        return got
    out: list[int] = []
    b = top
    while b >= max(1, minimum) and len(out) < limit:
        out.append(b)
        nxt = b // step if strategy == "exponential" else b - step
        if nxt == b:
            break
        b = nxt
    return sorted(out)


@dataclass(frozen=True)
class KvPlan:
    """KV blocks for the ``vllm`` path.

    Attributes:
        num_blocks: blocks vLLM manages, null block 0 included.
        block_bytes: bytes of one block across every layer (keys and values).
        fits_bytes: the DRAM the KV may take on the part.
    """

    num_blocks: int
    block_bytes: int
    fits_bytes: int


def kv_plan(*, npu: str, max_num_seqs: int, max_model_len: int, block_size: int, num_layers: int,
            num_kv_heads: int, head_size: int, dtype_bytes: int, weight_bytes: int,
            memory_utilization: float, override: int | None = None) -> KvPlan:
    """Size the KV cache (see the module docstring).

    Raises:
        VllmPathError: the override cannot hold one sequence of ``max_model_len``, or the
            blocks do not fit the part's DRAM (names the device, the bytes asked and left).
    """
    per_seq = math.ceil(max_model_len / block_size)
    block_bytes = 2 * num_layers * num_kv_heads * block_size * head_size * dtype_bytes
    blocks = int(override) if override else max_num_seqs * per_seq + 1
    if blocks < per_seq + 1:
        raise VllmPathError(
            f"--num-gpu-blocks-override {override} holds less than one sequence of max_model_len "
            f"{max_model_len} ({per_seq} blocks of {block_size} tokens, plus the null block)")
    room = int(device.dram_bytes(npu) * memory_utilization) - int(weight_bytes)
    if blocks * block_bytes > room:
        raise VllmPathError(
            f"the KV cache of {blocks} blocks ({blocks * block_bytes} bytes) does not fit {npu}: "
            f"{max(room, 0)} bytes are left at gpu_memory_utilization {memory_utilization} after "
            f"{weight_bytes} bytes of weights; lower --max-num-seqs, --max-model-len or "
            "--num-gpu-blocks-override")
    return KvPlan(blocks, block_bytes, room)
