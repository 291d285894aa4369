"""``compile_artifact``: turn a tiny HF checkpoint into a Mobilint-layout MXQ artifact directory.

Output directory::

    config.json        HF config + Mobilint keys (model_type mobilint-<arch>, mxq_path, max_batch_size, ...)
    model.mxq          the simulator's MXQ (FORMAT.md): decoder config + all decoder weights
    model.safetensors  only model.embed_tokens.weight (the host-side embedding, as Mobilint ships)
    tokenizer files and generation_config.json copied from the HF directory (those present)

A qwen3_moe checkpoint becomes a Mixture-of-Experts release instead (:mod:`npusim.mxq.compile_moe`);
with ``eagle3`` options, a base and its EAGLE-3 draft become an EAGLE-3 release
(:mod:`npusim.mxq.compile_eagle3`); a qwen3_asr checkpoint becomes a Qwen3-ASR release
(:mod:`npusim.mxq.compile_asr`); a qwen2_vl / qwen3_vl checkpoint becomes a Qwen2-VL / Qwen3-VL
release (:mod:`npusim.mxq.compile_vlm`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..llm import Decoder, load_config, load_safetensors, save_safetensors
from .mxqfile import write_mxq

__all__ = ["CORE_MODES", "compile_artifact"]

CORE_MODES: tuple[str, ...] = ("auto", "single", "multi", "global4", "global8")
#: HF ``model_type`` -> (the release's Mobilint ``model_type``, its architecture), as vllm-mblt
#: registers them. HyperCLOVAX releases are Llama-compatible artifacts: the MXQ computes the
#: HyperCLOVAX graph (its multipliers included), the host only embeds, so they ship as
#: ``mobilint-llama`` / ``MobilintLlamaForCausalLM`` (vllm-mblt's "Llama / HyperCLOVAX-compatible
#: text models" row).
RELEASE_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("mobilint-llama", "MobilintLlamaForCausalLM"),
    "qwen2": ("mobilint-qwen2", "MobilintQwen2ForCausalLM"),
    "qwen3": ("mobilint-qwen3", "MobilintQwen3ForCausalLM"),
    "exaone4": ("mobilint-exaone4", "MobilintExaone4ForCausalLM"),
    "hyperclovax": ("mobilint-llama", "MobilintLlamaForCausalLM"),
}
#: Model types the golden decoder computes whose release layout ``mxq compile`` does not write yet,
#: with the message it raises (``NotImplementedError``). Empty: every such type has a layout.
NOT_BUILT_RELEASES: dict[str, str] = {}
#: Model types written as a Mixture-of-Experts release (:mod:`npusim.mxq.compile_moe`).
MOE_TYPES: tuple[str, ...] = ("qwen3_moe",)
#: Model types written as a Qwen3-ASR (speech-to-text) release (:mod:`npusim.mxq.compile_asr`).
ASR_TYPES: tuple[str, ...] = ("qwen3_asr",)
#: Model types written as a Qwen2-VL / Qwen3-VL (vision-language) release (:mod:`npusim.mxq.compile_vlm`).
VLM_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen3_vl")
COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
)
MAX_DEFAULT_CACHE = 4096


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} {v!r} must be an integer >= 1")
    return v


def _chunk_values(chunk: int | Mapping[str, int]) -> list[int]:
    """Raises: ValueError for a chunk size that is not an int >= 1 or a dict of core-mode/default keys to such ints."""
    if isinstance(chunk, Mapping):
        if not chunk:
            raise ValueError("prefill_chunk_size dict must not be empty")
        allowed = CORE_MODES + ("default", "DEFAULT")
        for k, v in chunk.items():
            if k not in allowed:
                raise ValueError(f"prefill_chunk_size key {k!r} must be one of {', '.join(allowed)}")
            _positive_int(f"prefill_chunk_size[{k!r}]", v)
        return list(chunk.values())
    return [_positive_int("prefill_chunk_size", chunk)]


def _compiled_modes(core_mode: str, k: int) -> list[str]:
    if core_mode != "auto":
        return [core_mode]
    return ["single"] if k > 1 else ["single", "multi", "global4", "global8"]


#: Most tokens per item per infer of a batch MXQ (max_batch_size > 1): the seed's "qbruntime
#: batch execution limit" of 128, to which vllm-mblt clamps batch models' chunked prefill.
BATCH_MAX_WIDTH = 128


def _write_hub_proxy(out: Path, model_type: str, architecture: str) -> dict[str, str]:
    """Write ``proxy_<family>.py`` and return the ``auto_map`` naming its two classes."""
    family = model_type.removeprefix("mobilint-")
    config_cls = architecture.removesuffix("ForCausalLM") + "Config"
    module = f"proxy_{family}"
    (out / f"{module}.py").write_text(
        f'''"""Remote-code entry of this artifact (written by npu-harness mxq compile --hub-proxy): the
Mobilint classes of transformers-mblt, under the names config.json's auto_map gives."""

from transformers_mblt.models.{family}.configuration_{family} import {config_cls}
from transformers_mblt.models.{family}.modeling_{family} import {architecture}

__all__ = ["{config_cls}", "{architecture}"]
''', encoding="utf-8")
    return {"AutoConfig": f"{module}.{config_cls}", "AutoModelForCausalLM": f"{module}.{architecture}"}


def kv_and_width(max_pos: int, max_cache_size: int | None, max_width: int | None, chunks: list[int], *,
                 default_cache: int, default_width: int) -> tuple[int, int]:
    """An MXQ's KV capacity and width (tokens): the given values, else ``min(max_pos,
    default_cache)`` and ``default_width``.

    Raises:
        ValueError: a value that is not a positive integer; a capacity above ``max_pos``
            (``max_position_embeddings``); a width below the largest prefill chunk.
    """
    t = min(max_pos, default_cache) if max_cache_size is None else _positive_int("max_cache_size", max_cache_size)
    if t > max_pos:
        raise ValueError(f"max_cache_size {t} must be <= max_position_embeddings {max_pos}")
    w = default_width if max_width is None else _positive_int("max_width", max_width)
    if w < max(chunks):
        raise ValueError(f"max_width {w} must be >= every prefill chunk size (largest: {max(chunks)})")
    return t, w


def _require_fixed(fixed: Mapping[str, tuple[Any, Any]], what: str, why: str) -> None:
    """Raises: ValueError naming the first option of ``fixed`` (name -> (value, the only one allowed))
    whose value ``what`` does not support, and ``why``."""
    for name, (value, only) in fixed.items():
        if value != only:
            raise ValueError(f"{name}={value!r}: {what} supports only {name}={only!r} ({why})")


def compile_artifact(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_batch_size: int = 1,
    max_cache_size: int | None = None,
    max_width: int | None = None,
    core_mode: str = "single",
    prefill_chunk_size: int | Mapping[str, int] = 128,
    output_logits: str = "last",
    memory_flexible: bool = True,
    hub_proxy: bool = False,
    moe: Mapping[str, Any] | None = None,
    eagle3: Mapping[str, Any] | None = None,
    vlm: Mapping[str, Any] | None = None,
) -> Path:
    """Write an MXQ artifact directory for the HF checkpoint in ``hf_dir``.

    A qwen3_asr checkpoint becomes a Qwen3-ASR release
    (:func:`npusim.mxq.compile_asr.compile_asr_release`: ``audio_encoder.mxq`` + ``decoder.mxq``):
    ``max_cache_size``, ``max_width``, ``core_mode``, ``prefill_chunk_size``, ``output_logits``,
    ``memory_flexible`` and ``hub_proxy`` apply; ``max_batch_size`` must stay 1 (the release's
    decoder is batch 1 and its config declares no max_batch_size) and ``moe`` must be empty.

    A qwen2_vl / qwen3_vl checkpoint becomes a vision-language release
    (:func:`npusim.mxq.compile_vlm.compile_vlm_release`: ``vision.mxq`` + ``text.mxq``, given
    ``vlm``'s keyword arguments: ``vision``, ``text_layout``, ``vision_layout``,
    ``vision_output_order``, ``vision_max_patches``); ``max_batch_size``, ``max_cache_size``,
    ``max_width``, ``core_mode``, ``prefill_chunk_size``, ``output_logits``, ``memory_flexible``
    and ``hub_proxy`` apply; ``moe`` must stay off.

    A qwen3_moe checkpoint becomes a Mixture-of-Experts release
    (:func:`npusim.mxq.compile_moe.compile_moe_release`, given ``moe``'s keyword arguments):
    its MXQs are single-core, batch 1 and memory-flexible, and emit the last position's logits,
    so ``max_batch_size``, ``core_mode``, ``output_logits`` and ``memory_flexible`` must keep
    their defaults.

    Args:
        hf_dir: an HF model directory (config.json + safetensors) of a llama, qwen2, qwen3, exaone4 or
            hyperclovax model (:data:`RELEASE_TYPES`), of a qwen3_moe model (:data:`MOE_TYPES`) or of a
            qwen3_asr model (:data:`ASR_TYPES`).
        out_dir: destination (created; our files overwritten).
        max_batch_size: K, cache ids per Model (>= 1; > 1 needs core_mode single or auto).
        max_cache_size: T, KV capacity in tokens per cache id; default
            ``min(max_position_embeddings, 4096)``; ``1 <= T <= max_position_embeddings``.
        max_width: W, max tokens per item per infer call. Non-batch MXQs: default
            ``max(128, max chunk value)``, and at least every chunk value. Batch MXQs (K > 1):
            default and most :data:`BATCH_MAX_WIDTH` (128, the qbruntime batch execution limit
            the seed states); their config may still advertise larger chunks, which the plugin
            clamps to 128.
        core_mode: auto, single, multi, global4 or global8.
        prefill_chunk_size: int >= 1, or a dict of core-mode / ``default`` keys to ints >= 1
            (written to config.json as ``npu_prefill_chunk_size``).
        output_logits: ``"last"`` (one logits row per item) or ``"all"`` (one per token).
        memory_flexible: whether the MXQ may share an explicitly named core with other
            memory-flexible models (the current compiler's default). False stands for an MXQ of an
            older compiler, whose second launch on a taken core raises ``Acc_CoreAlreadyInUse``.
        moe: options of a Mixture-of-Experts release (ignored for dense checkpoints; a dense
            checkpoint given any raises ValueError).
        eagle3: not None (a dict, possibly empty): write an EAGLE-3 release of the base in
            ``hf_dir`` and its draft (default ``hf_dir/eagle3_draft``) instead, given these keyword
            arguments of :func:`npusim.mxq.compile_eagle3.compile_eagle3_release` (``max_cache_size``,
            ``max_width``, ``prefill_chunk_size``, ``max_batch_size`` and ``hub_proxy`` are passed
            through; ``core_mode``, ``output_logits`` and ``memory_flexible`` must keep their
            defaults). None: a checkpoint with a draft directory compiles as its plain base.
        vlm: options of a Qwen2-VL / Qwen3-VL release (above); any given for another model type
            raises ValueError.
        hub_proxy: also write the Hub releases' remote-code entry: ``auto_map`` in config.json
            and ``proxy_<family>.py`` re-exporting transformers-mblt's classes, so
            ``--trust-remote-code`` resolves the Mobilint model type in an environment that has
            transformers-mblt but no plugin registering it (vllm-mblt on vLLM 0.11.2).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: a value outside its rule (the value and the rule are named), an
            unsupported model_type.
        NotImplementedError: a model type whose release layout is not built yet
            (:data:`NOT_BUILT_RELEASES`, empty today).
        CheckpointError / UnsupportedModelError: the checkpoint cannot be read by the golden decoder.
    """
    src, out = Path(hf_dir), Path(out_dir)
    k = _positive_int("max_batch_size", max_batch_size)
    if core_mode not in CORE_MODES:
        raise ValueError(f"core_mode {core_mode!r} must be one of {', '.join(CORE_MODES)}")
    if k > 1 and core_mode not in ("single", "auto"):
        raise ValueError(f"core_mode {core_mode!r} is not allowed with max_batch_size {k}: batched MXQs support only single or auto")
    chunks = _chunk_values(prefill_chunk_size)
    if output_logits not in ("last", "all"):
        raise ValueError(f"output_logits {output_logits!r} must be 'last' or 'all'")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8")) if (src / "config.json").is_file() else None
    if raw is None:
        raise ValueError(f"{src} has no config.json (expected a Hugging Face model directory)")
    if eagle3 is not None:
        _require_fixed({"core_mode": (core_mode, "single"), "output_logits": (output_logits, "last"),
                        "memory_flexible": (memory_flexible, True)},
                       "an EAGLE-3 release", "its MXQs are single-core and memory-flexible; their logits rows are "
                       "fixed by kind")
        from .compile_eagle3 import compile_eagle3_release

        return compile_eagle3_release(src, out, max_cache_size=max_cache_size, max_width=max_width,
                                      prefill_chunk_size=prefill_chunk_size, max_batch_size=k, hub_proxy=hub_proxy,
                                      **dict(eagle3))
    if raw.get("model_type") in VLM_TYPES:
        if moe:
            raise ValueError(f"Mixture-of-Experts options {sorted(moe)} do not apply to a {raw['model_type']} "
                             "checkpoint: it has no experts")
        from .compile_vlm import compile_vlm_release

        return compile_vlm_release(src, out, max_batch_size=k, max_cache_size=max_cache_size, max_width=max_width,
                                   core_mode=core_mode, prefill_chunk_size=prefill_chunk_size,
                                   output_logits=output_logits, memory_flexible=memory_flexible, hub_proxy=hub_proxy,
                                   **dict(vlm or {}))
    if vlm:
        raise ValueError(f"vision-language options {sorted(vlm)} given for model_type {raw.get('model_type')!r}, "
                         f"which is not one of {', '.join(VLM_TYPES)}")
    if raw.get("model_type") in NOT_BUILT_RELEASES:
        raise NotImplementedError(NOT_BUILT_RELEASES[raw["model_type"]])
    if raw.get("model_type") in ASR_TYPES:
        _require_fixed({"max_batch_size": (k, 1)}, "a Qwen3-ASR release",
                       "its decoder MXQ is compiled for batch 1 and the release's config declares no max_batch_size; "
                       "serve it with --max-num-seqs 1")
        if moe:
            raise ValueError(f"Mixture-of-Experts options {sorted(moe)} do not apply to a Qwen3-ASR checkpoint "
                             f"(model_type {raw['model_type']!r}): it has no experts")
        from .compile_asr import compile_asr_release

        return compile_asr_release(src, out, max_cache_size=max_cache_size, max_width=max_width, core_mode=core_mode,
                                   prefill_chunk_size=prefill_chunk_size, output_logits=output_logits,
                                   memory_flexible=memory_flexible, hub_proxy=hub_proxy)
    if raw.get("model_type") in MOE_TYPES:
        _require_fixed({"max_batch_size": (k, 1), "core_mode": (core_mode, "single"),
                        "output_logits": (output_logits, "last"), "memory_flexible": (memory_flexible, True)},
                       "a Mixture-of-Experts release", "its MXQs are single-core, batch 1, memory-flexible and emit "
                       "the last logits")
        from .compile_moe import compile_moe_release

        return compile_moe_release(src, out, max_cache_size=max_cache_size, max_width=max_width,
                                   prefill_chunk_size=prefill_chunk_size, hub_proxy=hub_proxy, **dict(moe or {}))
    if moe:
        raise ValueError(f"Mixture-of-Experts options {sorted(moe)} given for model_type {raw.get('model_type')!r}, "
                         f"which is not one of {', '.join(MOE_TYPES)}")
    if raw.get("model_type") not in RELEASE_TYPES:
        raise ValueError(f"model_type {raw.get('model_type')!r} must be one of {', '.join(RELEASE_TYPES)}")
    cfg = load_config(src)
    max_pos = cfg.max_position_embeddings
    if k > 1:  # a batch MXQ's width is qbruntime's batch execution limit
        t, _ = kv_and_width(max_pos, max_cache_size, None, [1], default_cache=MAX_DEFAULT_CACHE, default_width=1)
        w = BATCH_MAX_WIDTH if max_width is None else _positive_int("max_width", max_width)
        if w > BATCH_MAX_WIDTH:
            raise ValueError(f"max_width {w} exceeds {BATCH_MAX_WIDTH}, the most tokens a batch MXQ "
                             f"(max_batch_size {k} > 1) takes per item per infer")
    else:
        t, w = kv_and_width(max_pos, max_cache_size, max_width, chunks, default_cache=MAX_DEFAULT_CACHE,
                            default_width=max(128, *chunks))
    weights = load_safetensors(src)
    Decoder(cfg, weights, source=str(src))  # validates every tensor the artifact needs
    arch = cfg.model_type
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "llm_config": raw, "max_batch_size": k, "max_cache_size": t, "max_width": w,
        "core_modes": _compiled_modes(core_mode, k), "output_logits": output_logits, "target_device": "aries",
        "memory_flexible": bool(memory_flexible),
    }
    write_mxq(out / "model.mxq", header, weights)
    save_safetensors(out / "model.safetensors", {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}, metadata={"format": "pt"})
    config = {k_: v for k_, v in raw.items() if k_ not in ("model_type", "architectures")}
    config.update(
        model_type=RELEASE_TYPES[arch][0], architectures=[RELEASE_TYPES[arch][1]],
        mxq_path="model.mxq", max_batch_size=k,
        npu_prefill_chunk_size=dict(prefill_chunk_size) if isinstance(prefill_chunk_size, Mapping) else prefill_chunk_size,
        core_mode=core_mode, target_device="aries", dev_no=0, max_position_embeddings=max_pos,
        tie_word_embeddings=False, _name_or_path=str(src),
    )
    if hub_proxy:
        config["auto_map"] = _write_hub_proxy(out, *RELEASE_TYPES[arch])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out
