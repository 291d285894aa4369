"""``compile_moe_release``: a tiny Qwen3-MoE checkpoint as a Mobilint Mixture-of-Experts release.

The layout is the one transformers-mblt 0.6.1 and vllm-mblt 0.8.0 read (``docs/mblt-moe-release.md``)::

    config.json        model_type mobilint-qwen3_moe; max_batch_size 1; the role keys (shared_, expert_,
                       lm_head_ prefixes: mxq_path, core_mode, target_device, target_cores);
                       num_expert_workers; moe_mxq_pack_index (packed) ; npu_prefill_chunk_size
    model.safetensors  model.embed_tokens.weight (the host-side embedding)
    mxq/index.json     packed: the pack index, format "mobilint-moe-mxqpack" version 1
    mxq/block_{layer}.mxqpack   packed: member 0 the layer's shared MXQ, member 1+e expert e, each
                       starting at a multiple of ``alignment`` (zero padding between members)
    mxq/block_{layer}_shared.mxq, mxq/block_{layer}_expert_{expert}.mxq   unpacked instead of packs
    mxq/lm_head.mxq    the lm_head MXQ (never packed)
    tokenizer files and generation_config.json, copied

MXQ kinds (``FORMAT.md``): ``moe_shared`` (one per layer: attention and its KV, the residual add,
post-attention norm and router; outputs ``residual``, ``expert_in``, ``gate`` in
``shared_output_order``), ``moe_expert`` (one per layer and expert, stateless) and ``lm_head``
(final norm and LM head). Every piece computes as the golden decoder (:mod:`npusim.llm.moe_parts`).

Quantisation scales (powers of two, so the scale bookkeeping is exact): a shared MXQ's
``expert_in`` output scale is the exact reciprocal of its layer's expert input scale, its other
outputs' scales are not, and each expert's output scale differs from its neighbours', as the
release's do (transformers-mblt finds ``expert_in`` by these scales and corrects expert outputs
read through a shared buffer pool by them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..llm import ModelConfig, load_config, load_safetensors, save_safetensors
from ..llm.moe_parts import DecoderPart, part_tensor_names
from .compile import COPIED_FILES, _chunk_values, _positive_int, _write_hub_proxy, kv_and_width
from .mxqfile import write_mxq

__all__ = ["MOE_MODEL_TYPE", "MOE_ARCHITECTURE", "SHARED_OUTPUTS", "PACK_FORMAT", "compile_moe_release", "release_placement"]

MOE_MODEL_TYPE = "mobilint-qwen3_moe"
MOE_ARCHITECTURE = "MobilintQwen3MoEForCausalLM"
SHARED_OUTPUTS: tuple[str, ...] = ("residual", "expert_in", "gate")
PACK_FORMAT = "mobilint-moe-mxqpack"
PACK_VERSION = 1
#: Quantisation scales, as dequantisation multipliers (an input's Scale is the reciprocal).
SHARED_IN, RESIDUAL, EXPERT_IN, GATE = 2.0**-4, 2.0**-3, 2.0**-5, 2.0**-2
LM_HEAD_IN, LM_HEAD_OUT = 2.0**-3, 2.0**-1
#: The shared MXQs' KV capacity cap, tokens (the release's shared MXQs hold 4096).
MAX_SHARED_CACHE = 4096


def expert_output_scale(expert: int) -> float:
    """Expert ``expert``'s output scale (dequantisation multiplier): ``2**-(4 + expert % 3)``."""
    return 2.0 ** -(4 + expert % 3)


def release_placement(devices: int) -> dict[str, list[str]]:
    """The release's default ``<role>_target_cores`` on ``devices`` cards (the seed: shared MXQs
    round-robin over the devices, one core each; experts over every core of those devices; the
    lm_head on its own core of the last device).

    Raises:
        ValueError: ``devices`` is not an integer >= 1.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices {devices!r} must be an integer >= 1")
    return {
        "shared_target_cores": [f"{d}:0:0" for d in range(devices)],
        "expert_target_cores": [f"{d}:{cl}:{co}" for d in range(devices) for cl in range(2) for co in range(4)],
        "lm_head_target_cores": [f"{devices - 1}:0:0"],
    }


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _header(raw: dict[str, Any], kind: str, *, t: int, w: int, **extra: Any) -> dict[str, Any]:
    return {"llm_config": raw, "kind": kind, "max_batch_size": 1, "max_cache_size": t, "max_width": w,
            "core_modes": ["single"], "output_logits": "last", "target_device": "aries", "memory_flexible": True,
            **extra}


def _write_pack(path: Path, members: Sequence[bytes], alignment: int) -> list[int]:
    """Concatenate ``members``, each but the last zero-padded to ``alignment``; returns their sizes."""
    with path.open("wb") as f:
        for i, m in enumerate(members):
            f.write(m)
            if i < len(members) - 1:
                f.write(b"\0" * (_aligned(len(m), alignment) - len(m)))
    return [len(m) for m in members]


def compile_moe_release(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_cache_size: int | None = None,
    max_width: int | None = None,
    prefill_chunk_size: int | Mapping[str, int] = 128,
    packed: bool = True,
    alignment: int = 4096,
    devices: int = 3,
    shared_output_order: Sequence[str] = SHARED_OUTPUTS,
    declare_output_order: bool = False,
    last_only: bool = False,
    num_expert_workers: int = 24,
    hub_proxy: bool = False,
) -> Path:
    """Write the Mixture-of-Experts release of the Qwen3-MoE checkpoint in ``hf_dir`` (module docstring).

    Args:
        max_cache_size: KV capacity of each shared MXQ, tokens; default
            ``min(4096, max_position_embeddings)``: the release's 4096, below the 40960 positions its
            config.json declares (the tiny qwen3_moe declares 40960 too). ``1 <= T <= max_position_embeddings``.
        max_width: most tokens per shared/expert infer; default ``max(128, largest chunk)``.
        prefill_chunk_size: int >= 1 or a dict of core-mode keys (config.json ``npu_prefill_chunk_size``).
        packed: write per-layer packs and their index (the release's layout) instead of one file per MXQ.
        alignment: packs' member alignment, bytes, a power of two.
        devices: cards the default placement spans (:func:`release_placement`; the release uses 3).
        shared_output_order: the order of the shared MXQs' three outputs, a permutation of
            ``residual, expert_in, gate``.
        declare_output_order: also write it to config.json as ``moe_shared_output_order``; without
            it transformers-mblt finds the outputs by shape and quantisation scale.
        last_only: compile the last layer's shared MXQ to emit only the last token.
        num_expert_workers: config.json's ``num_expert_workers`` (transformers-mblt's default 24).
        hub_proxy: also write ``proxy_qwen3_moe.py`` and ``auto_map`` (as :func:`compile_artifact`).

    Raises:
        ValueError: a value outside its rule (named with the rule); a checkpoint that is not
            qwen3_moe, or has dense layers (transformers-mblt treats every layer as sparse).
        CheckpointError / UnsupportedModelError: the checkpoint cannot be read.
    """
    src, out = Path(hf_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json (expected a Hugging Face model directory)")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if raw.get("model_type") != "qwen3_moe":
        raise ValueError(f"model_type {raw.get('model_type')!r} must be 'qwen3_moe' for a Mixture-of-Experts release")
    cfg: ModelConfig = load_config(src)
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse(i)]
    if dense:
        raise ValueError(f"layers {dense} are dense (mlp_only_layers / decoder_sparse_step), but a Mobilint "
                         "MoE release makes every layer a shared MXQ plus experts (transformers-mblt treats "
                         "every layer as sparse)")
    if sorted(shared_output_order) != sorted(SHARED_OUTPUTS):
        raise ValueError(f"shared_output_order {list(shared_output_order)!r} must be a permutation of {list(SHARED_OUTPUTS)}")
    alignment = _positive_int("alignment", alignment)
    if alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} must be a power of two")
    _positive_int("num_expert_workers", num_expert_workers)
    chunks = _chunk_values(prefill_chunk_size)
    max_pos = cfg.max_position_embeddings
    t, w = kv_and_width(max_pos, max_cache_size, max_width, chunks, default_cache=MAX_SHARED_CACHE,
                        default_width=max(128, *chunks))
    placement = release_placement(devices)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")

    weights = load_safetensors(src)
    L, E = cfg.num_hidden_layers, cfg.num_experts
    order = list(shared_output_order)
    scales = {"residual": RESIDUAL, "expert_in": EXPERT_IN, "gate": GATE}
    mxq_dir = out / "mxq"
    mxq_dir.mkdir(parents=True, exist_ok=True)

    def mxq(path: Path, header: dict[str, Any], *, layer: int | None = None, expert: int | None = None) -> bytes:
        kind = header["kind"]
        names = part_tensor_names(cfg, kind, layer, expert)
        tensors = {n: weights[n] for n in names if n in weights}
        DecoderPart(cfg, tensors, kind, layer=layer, expert=expert, source=str(src))  # checks every tensor
        extra = {k: v for k, v in (("layer", layer), ("expert", expert)) if v is not None}
        write_mxq(path, {**header, **extra}, tensors)
        return path.read_bytes()

    sizes: list[list[int]] = []
    for layer in range(L):
        members = [mxq(mxq_dir / f"block_{layer}_shared.mxq",
                       _header(raw, "moe_shared", t=t, w=w, outputs=order, input_scales=[1 / SHARED_IN],
                               output_scales=[scales[n] for n in order], last_only=bool(last_only and layer == L - 1)),
                       layer=layer)]
        for e in range(E):
            members.append(mxq(mxq_dir / f"block_{layer}_expert_{e}.mxq",
                               _header(raw, "moe_expert", t=1, w=w, input_scales=[1 / EXPERT_IN],
                                       output_scales=[expert_output_scale(e)]), layer=layer, expert=e))
        if packed:
            sizes.append(_write_pack(mxq_dir / f"block_{layer}.mxqpack", members, alignment))
            (mxq_dir / f"block_{layer}_shared.mxq").unlink()
            for e in range(E):
                (mxq_dir / f"block_{layer}_expert_{e}.mxq").unlink()
    mxq(mxq_dir / "lm_head.mxq", _header(raw, "lm_head", t=1, w=1, input_scales=[1 / LM_HEAD_IN], output_scales=[LM_HEAD_OUT]))
    if packed:
        rows = ",\n".join("    " + json.dumps(r) for r in sizes)
        (mxq_dir / "index.json").write_text(
            f'{{\n  "format": "{PACK_FORMAT}",\n  "version": {PACK_VERSION},\n  "alignment": {alignment},\n'
            f'  "pack": "block_{{layer}}.mxqpack",\n  "sizes": [\n{rows}\n  ]\n}}\n', encoding="utf-8")

    save_safetensors(out / "model.safetensors", {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
                     metadata={"format": "pt"})
    config = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    config.update(
        model_type=MOE_MODEL_TYPE, architectures=[MOE_ARCHITECTURE], max_batch_size=1, tie_word_embeddings=False,
        npu_prefill_chunk_size=dict(prefill_chunk_size) if isinstance(prefill_chunk_size, Mapping) else prefill_chunk_size,
        num_expert_workers=num_expert_workers, max_position_embeddings=max_pos, _name_or_path=str(src),
        lm_head_mxq_path="mxq/lm_head.mxq", **placement,
    )
    for role in ("shared", "expert", "lm_head"):
        config[f"{role}_core_mode"] = "single"
        config[f"{role}_target_device"] = "aries"
    if packed:
        config["moe_mxq_pack_index"] = "mxq/index.json"
    else:
        config["shared_mxq_path"] = "mxq/block_{layer}_shared.mxq"
        config["expert_mxq_path"] = "mxq/block_{layer}_expert_{expert}.mxq"
    if declare_output_order:
        config["moe_shared_output_order"] = {"default": order}
    if hub_proxy:
        config["auto_map"] = _write_hub_proxy(out, MOE_MODEL_TYPE, MOE_ARCHITECTURE)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out
