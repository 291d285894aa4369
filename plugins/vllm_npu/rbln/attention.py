"""The attention backend of the RBLN ``vllm`` model path: vLLM's ``Attention`` layers on the
device's paged attention operators.

vLLM's own model code (``LlamaForCausalLM``...) builds one ``Attention`` layer per decoder
layer; the RBLN platform answers :class:`RblnAttentionBackend` for them. The layer calls
``torch.ops.vllm.unified_attention_with_output`` (an opaque operator: the platform's
``opaque_attention_op`` is True, so the graph the compiler sees keeps attention as one call
per layer), which hands :class:`RblnAttentionImpl` the layer's KV cache and the step's
:class:`RblnAttentionMetadata`. The implementation calls ``rebel``'s operators,
``torch.ops.rbln_custom_ops.paged_causal_attn_{prefill,decode}`` (one KV block per sequence)
or ``paged_flash_causal_attn_{prefill,decode}`` (several blocks, partition = the block), which
write the step's keys and values into the cache by block table and attend causally.

Layouts (``Hkv`` KV heads, ``R`` query heads per KV head, ``D`` head size)::

    kv_cache   [2, num_blocks, Hkv, 1, block_size, D]   (keys, values), indexed by vLLM block id
    prefill    one sequence, Q = the step's token count: q [1, Hkv, R, Q, D]
    decode     B rows of one token each:                 q [B, Hkv, R, 1, D]

Block 0 is vLLM's null block: no request owns it, so padding rows and the padded tail of a
prefill chunk point there (a valid block the kernel may write and nobody reads).

The operators exist once ``rebel`` is imported (the real rebel-compiler, or the simulator
through the alias); this module never imports the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType

__all__ = ["RblnAttentionBackend", "RblnAttentionImpl", "RblnAttentionMetadata", "RblnAttentionError"]

BACKEND_PATH = "vllm_npu.rbln.attention.RblnAttentionBackend"


class RblnAttentionError(ValueError):
    """A layer or a step the RBLN attention kernels cannot run (names the value)."""


@dataclass(frozen=True)
class RblnAttentionMetadata:
    """One device call's attention inputs (the same for every layer).

    Attributes:
        phase: ``"prefill"`` (one sequence, every token a query) or ``"decode"`` (one token
            per row).
        seq: ``[B, 1]`` int32, the position of each row's first query token.
        block_table: int32, ``[n]`` (prefill) or ``[B, n]`` (decode): vLLM block ids in
            position order, unused entries 0 (the null block).
        block_size: tokens per KV block.
    """

    phase: str
    seq: torch.Tensor
    block_table: torch.Tensor
    block_size: int


class RblnAttentionImpl(AttentionImpl[RblnAttentionMetadata]):
    """Paged causal attention on ``rbln_custom_ops`` (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **extra: Any) -> None:
        """Raises:
            RblnAttentionError: ALiBi, sliding windows, soft caps, non-decoder attention, KV
                sharing, a quantized KV cache or attention sinks (the kernels the decoder path
                calls have none of them).
        """
        refused = [name for name, on in (
            ("alibi_slopes", alibi_slopes is not None), ("sliding_window", sliding_window is not None),
            ("logits_soft_cap", bool(logits_soft_cap)), ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
            (f"attn_type={attn_type}", attn_type != AttentionType.DECODER),
            (f"kv_cache_dtype={kv_cache_dtype}", kv_cache_dtype not in ("auto", None)),
            ("sinks", extra.get("sinks") is not None)) if on]
        if refused:
            raise RblnAttentionError(
                "the RBLN vllm model path's attention runs causal decoder attention with a full-precision "
                f"paged KV cache only; this layer asks for {', '.join(refused)}")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        if self.num_heads % self.num_kv_heads:
            raise RblnAttentionError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.kv_cache_dtype = "auto"
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        self._scale = torch.tensor(self.scale, dtype=torch.float32)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: RblnAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` and put the attention result in ``output``.

        ``query`` is ``[N, num_heads, D]``, ``key``/``value`` ``[N, num_kv_heads, D]``; ``N``
        is the step's (padded) token count. Without metadata (vLLM's profiling run) the
        output is zeros.

        Raises:
            RblnAttentionError: the KV cache is not bound, or output quantization is asked.
        """
        if output_scale is not None or output_block_scale is not None:
            raise RblnAttentionError("the RBLN attention kernels have no fused output quantization")
        if attn_metadata is None:
            return output.zero_()
        if kv_cache.dim() != 6:
            raise RblnAttentionError(f"layer {getattr(layer, 'layer_name', '?')}: no KV cache bound "
                                     f"(got a tensor of shape {list(kv_cache.shape)})")
        md = attn_metadata
        hkv, d = self.num_kv_heads, self.head_size
        r = self.num_heads // hkv
        n = query.shape[0]
        b, q_len = (1, n) if md.phase == "prefill" else (n, 1)
        q = query.reshape(b, q_len, hkv, r, d).permute(0, 2, 3, 1, 4)
        k = key.reshape(b, q_len, hkv, 1, d).permute(0, 2, 3, 1, 4)
        v = value.reshape(b, q_len, hkv, 1, d).permute(0, 2, 3, 1, 4)
        kcache, vcache = kv_cache[0], kv_cache[1]
        width = md.block_table.shape[-1]
        ops = torch.ops.rbln_custom_ops
        args = dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), kcache=kcache, vcache=vcache,
                    seq=md.seq, scale=self._scale, block_table=md.block_table, block_size=md.block_size)
        if width == 1:
            op = ops.paged_causal_attn_prefill if md.phase == "prefill" else ops.paged_causal_attn_decode
            out = op(**args)
        else:
            op = ops.paged_flash_causal_attn_prefill if md.phase == "prefill" else ops.paged_flash_causal_attn_decode
            out = op(**args, partition=md.block_size)
        output.copy_(out.permute(0, 3, 1, 2, 4).reshape(output.shape))
        return output


class RblnAttentionBackend(AttentionBackend):
    """The backend the RBLN platform answers for every decoder attention layer."""

    accept_output_buffer: ClassVar[bool] = True
    forward_includes_kv_cache_update: ClassVar[bool] = True  # the kernels write the KV themselves

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RblnAttentionImpl]:
        return RblnAttentionImpl

    @staticmethod
    def get_builder_cls():  # noqa: ANN205 - the worker builds RblnAttentionMetadata itself
        raise NotImplementedError("the RBLN worker builds RblnAttentionMetadata itself; vLLM's "
                                  "GPU model runner (which asks for a builder) does not run on RBLN")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, 1, block_size, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)


def register() -> None:
    """Register :class:`RblnAttentionBackend` as vLLM's ``CUSTOM`` attention backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
