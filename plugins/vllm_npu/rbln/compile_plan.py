"""What the ``optimum`` model path compiles, and what vLLM's scheduler takes from a compiled model.

Two directions, as vllm-rbln's sync does (reference §5.1, §6):

* :func:`rbln_config_for`: vLLM's settings -> optimum-rbln's ``rbln_config`` for a compile
  (``batch_size`` = ``max_num_seqs``, ``max_seq_len`` = ``max_model_len``, flash attention with
  ``kvcache_partition_len`` = ``block_size`` when the block is shorter than the model length,
  the device's prefill chunk), with the user's ``optimum_overrides`` laid over it;
* :class:`CompiledModelSpec` + :func:`scheduler_plan`: a compiled directory's
  ``rbln_config.json`` -> ``max_num_seqs``, ``max_model_len``, ``block_size``,
  ``max_num_batched_tokens`` and the KV block count vLLM must use (the artifact wins).

This module imports only the standard library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CompilePlanError", "CompiledModelSpec", "SchedulerPlan", "rbln_config_for", "scheduler_plan",
           "BLOCK_SIZE_REQUIRED"]

BLOCK_SIZE_REQUIRED = (
    "`block_size` is required to run optimum-rbln models in vLLM RBLN. Pass --block-size: equal "
    "to --max-model-len for eager attention (one KV block per sequence), or a KV partition "
    "length for flash attention (1024 .. 32768 on ATOM, 1024 .. 16384 on Rebel100, dividing "
    "--max-model-len).")


class CompilePlanError(ValueError):
    """vLLM's settings and the compiled model (or the compile) contradict each other."""


def _merge(base: dict[str, Any], over: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        where = f"{path}{key}"
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value, where + ".")
        elif key in base and base[key] != value:
            raise CompilePlanError(
                f"rbln_overrides conflict with vllm-derived compile config: {where} "
                f"(compiled={base[key]!r}, override={value!r})")
        else:
            out[key] = value
    return out


def rbln_config_for(*, max_num_seqs: int, max_model_len: int, block_size: int | None,
                    num_devices: int, prefill_chunk_size: int, npu: str,
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """optimum-rbln's ``rbln_config`` for compiling a decoder under vLLM.

    Raises:
        CompilePlanError: no ``block_size``; a block below 1 or one that does not divide
            ``max_model_len``; an override that changes a derived value (names the key and
            both values), including the KV block the attention choice implies
            (``kvcache_block_size``; under eager attention also ``attn_impl`` and
            ``kvcache_partition_len``, whose derived values are ``"eager"`` and None).
    """
    if block_size is None:
        raise CompilePlanError(BLOCK_SIZE_REQUIRED)
    if block_size < 1 or block_size > max_model_len or max_model_len % block_size:
        raise CompilePlanError(
            f"--block-size {block_size} must divide --max-model-len {max_model_len} (the KV "
            "partition of flash attention), or equal it (eager attention)")
    cfg: dict[str, Any] = {"num_devices": int(num_devices), "batch_size": int(max_num_seqs),
                           "max_seq_len": int(max_model_len), "prefill_chunk_size": int(prefill_chunk_size),
                           "npu": npu}
    if block_size != max_model_len:
        cfg.update(kvcache_partition_len=int(block_size), attn_impl="flash_attn")
        # optimum-rbln's KV block is the partition under flash attention.
        implied: dict[str, Any] = {"kvcache_block_size": int(block_size)}
    else:
        # Eager attention: no partition, one block of max_seq_len. optimum-rbln switches to
        # flash attention (a smaller KV block than vLLM's) when a partition or flash_attn is
        # given, so these count as derived values too, though the config does not carry them.
        implied = {"attn_impl": "eager", "kvcache_partition_len": None,
                   "kvcache_block_size": int(max_model_len)}
    over = dict(overrides or {})
    merged = _merge({**cfg, **implied}, over)
    return {k: v for k, v in merged.items() if k in cfg or k in over}


@dataclass(frozen=True)
class CompiledModelSpec:
    """The scheduler-relevant fields of a compiled directory's ``rbln_config.json``.

    Attributes:
        path: the directory.
        cls_name: optimum-rbln's config class (``RBLNLlamaForCausalLMConfig``).
        batch_size, max_seq_len, block_size, prefill_chunk_size, kvcache_num_blocks: tokens /
            sequences / blocks as compiled.
        decoder_batch_sizes: the compiled decode batch buckets, ascending.
        dtype: the compiled dtype name.
        attn_impl: ``eager`` or ``flash_attn``.
        use_inputs_embeds: the graphs take ``inputs_embeds`` (token ids are embedded on the host).
    """

    path: str
    cls_name: str
    batch_size: int
    max_seq_len: int
    block_size: int
    prefill_chunk_size: int
    kvcache_num_blocks: int
    decoder_batch_sizes: tuple[int, ...]
    dtype: str
    attn_impl: str
    use_inputs_embeds: bool = False

    @property
    def model_class(self) -> str:
        """optimum-rbln's model class (``RBLNLlamaForCausalLM``)."""
        return self.cls_name.removesuffix("Config")

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> "CompiledModelSpec":
        """Raises:
            CompilePlanError: no readable ``rbln_config.json``, or one that is not a decoder's.
        """
        p = Path(path) / "rbln_config.json"
        try:
            raw = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise CompilePlanError(f"{p}: cannot read the compiled model's rbln_config.json ({exc})") from exc
        try:
            max_seq_len = int(raw["max_seq_len"])
            block = raw.get("kvcache_block_size")
            part = raw.get("kvcache_partition_len")
            if block is not None and part is not None and int(block) != int(part):
                raise CompilePlanError(
                    f"kvcache_partition_len must equal kvcache_block_size for {raw.get('cls_name')} models.")
            block = int(block if block is not None else part if part is not None else max_seq_len)
            batch = int(raw["batch_size"])
            buckets = tuple(sorted(int(b) for b in (raw.get("decoder_batch_sizes") or [batch])))
            return cls(str(path), str(raw["cls_name"]), batch, max_seq_len, block,
                       int(raw["prefill_chunk_size"]), int(raw.get("kvcache_num_blocks") or 0),
                       buckets, str(raw.get("dtype", "float32")), str(raw.get("attn_impl") or "eager"),
                       bool(raw.get("use_inputs_embeds", False)))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CompilePlanError):
                raise
            raise CompilePlanError(f"{p}: not a decoder's rbln_config.json ({exc!r})") from exc


@dataclass(frozen=True)
class SchedulerPlan:
    """What vLLM's scheduler and KV manager use for a compiled model.

    Attributes:
        max_num_seqs: decode batch = compiled ``batch_size``.
        max_model_len: compiled ``max_seq_len``.
        block_size: KV block in tokens = the compiled block (``kvcache_block_size``).
        max_num_batched_tokens: the compiled prefill chunk.
        num_gpu_blocks: the compiled KV blocks + 1 (vLLM's null block 0).
    """

    max_num_seqs: int
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    num_gpu_blocks: int


def scheduler_plan(spec: CompiledModelSpec, *, user_max_num_batched_tokens: int | None = None,
                   user_max_model_len: int | None = None, user_max_num_seqs: int | None = None,
                   user_block_size: int | None = None) -> SchedulerPlan:
    """The artifact wins; a user value that contradicts it is refused.

    Raises:
        CompilePlanError: the reference's ``max_num_batched_tokens`` conflict message, or a
            ``--max-model-len``/``--max-num-seqs``/``--block-size`` the artifact cannot serve.
    """
    if user_max_num_batched_tokens is not None and user_max_num_batched_tokens != spec.prefill_chunk_size:
        raise CompilePlanError(
            f"max_num_batched_tokens ({user_max_num_batched_tokens}) conflicts with the compiled "
            f"prefill_chunk_size ({spec.prefill_chunk_size}) in rbln_config.json. Omit "
            "max_num_batched_tokens or recompile the model with a matching prefill chunk size.")
    if user_max_model_len is not None and user_max_model_len > spec.max_seq_len:
        raise CompilePlanError(
            f"--max-model-len {user_max_model_len} exceeds the compiled max_seq_len "
            f"{spec.max_seq_len} of {spec.path}; pass --max-model-len {spec.max_seq_len} or lower")
    if user_max_num_seqs is not None and user_max_num_seqs > spec.batch_size:
        raise CompilePlanError(
            f"--max-num-seqs {user_max_num_seqs} exceeds the compiled batch_size {spec.batch_size} "
            f"of {spec.path}")
    if user_block_size is not None and user_block_size != spec.block_size:
        raise CompilePlanError(
            f"--block-size {user_block_size} differs from the compiled KV block size "
            f"{spec.block_size} of {spec.path}; omit --block-size")
    blocks = spec.kvcache_num_blocks or spec.batch_size * (spec.max_seq_len // spec.block_size)
    return SchedulerPlan(
        max_num_seqs=spec.batch_size if user_max_num_seqs is None else user_max_num_seqs,
        max_model_len=spec.max_seq_len if user_max_model_len is None else user_max_model_len,
        block_size=spec.block_size, max_num_batched_tokens=spec.prefill_chunk_size,
        num_gpu_blocks=blocks + 1)
