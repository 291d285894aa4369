"""``compile_asr_release``: a Qwen3-ASR checkpoint as a Mobilint Qwen3-ASR release.

The checkpoint is the original Qwen3-ASR layout (``config.json`` ``model_type: "qwen3_asr"`` with
``thinker_config`` {``audio_config``, ``text_config``, token ids}; ``model.safetensors`` holding
``thinker.audio_tower.*``, ``thinker.model.*`` and ``thinker.lm_head.weight``). The release is the
layout transformers-mblt 0.6.1's ``MobilintQwen3ASRForConditionalGeneration`` and vllm-mblt 0.8.0
read (seed "Serve a Speech-to-Text Model")::

    config.json             model_type mobilint-qwen3_asr, architectures
                            [MobilintQwen3ASRForConditionalGeneration], support_languages,
                            npu_prefill_chunk_size, no max_batch_size; thinker_config
                            {model_type mobilint-qwen3_asr_thinker, the Qwen3-ASR token ids,
                            audio_config (mobilint-qwen3_asr_audio_encoder) and text_config
                            (mobilint-qwen3_asr_text), each with its NPU fields mxq_path,
                            dev_no, core_mode, target_device, as transformers-mblt's
                            MobilintConfigMixin serialises them (no max_batch_size)}
    audio_encoder.mxq       kind audio_encoder: the audio tower, one 100-frame mel window per infer
    decoder.mxq             kind decoder: the thinker's Qwen3 text model (inputs_embeds in, logits
                            out), batch 1, KV capacity ``max_cache_size`` (default 2048)
    model.safetensors       thinker.model.embed_tokens.weight (transformers-mblt's host embedding)
    embedding.safetensors   model.embed_tokens.weight (the same table, where vllm_npu.mblt's
                            worker looks for it)
    tokenizer, preprocessor, chat-template and generation_config files, copied

KV capacity: the real artifact's config declares ``max_position_embeddings`` 65536 and vllm-mblt
clamps ``max_model_len`` to 2048 for this model (a request past token 2048 can stall the NPU).
The decoder MXQ therefore holds :data:`ASR_KV_CAPACITY` = 2048 tokens by default (the most the
plugin ever asks for), while ``text_config.max_position_embeddings`` stays the checkpoint's.

transformers-mblt 0.6.1 loads a release directory written here unchanged
(``tests/npusim/test_transformers_mblt_asr.py``) given absolute ``encoder_mxq_path`` /
``decoder_mxq_path``: its Qwen3-ASR config does not hand the directory (``name_or_path``) to the
sub-configs, so a relative ``mxq_path`` resolves from the working directory or the Hub.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..llm import Decoder, ModelConfig, load_safetensors, save_safetensors
from ..llm.asr_reference import decoder_tensors, text_model_config
from .asr_kinds import AudioEncoderPart, audio_tensor_names
from .compile import COPIED_FILES, CORE_MODES, _chunk_values, _compiled_modes, _positive_int, kv_and_width
from .mxqfile import write_mxq

__all__ = ["ASR_ARCHITECTURE", "ASR_COPIED_FILES", "ASR_KV_CAPACITY", "ASR_MODEL_TYPE", "ASR_MXQ_PATHS",
           "ASR_SOURCE_TYPE", "THINKER_TOKENS", "compile_asr_release"]

#: ``model_type`` of a Qwen3-ASR checkpoint ``compile_artifact`` hands to this module.
ASR_SOURCE_TYPE = "qwen3_asr"
ASR_MODEL_TYPE = "mobilint-qwen3_asr"
ASR_ARCHITECTURE = "MobilintQwen3ASRForConditionalGeneration"
#: Sub-config model types of transformers-mblt's MobilintQwen3ASR{Thinker,AudioEncoder,Text}Config.
SUB_MODEL_TYPES = {"thinker": "mobilint-qwen3_asr_thinker", "audio": "mobilint-qwen3_asr_audio_encoder",
                   "text": "mobilint-qwen3_asr_text"}
ASR_MXQ_PATHS: dict[str, str] = {"encoder": "audio_encoder.mxq", "decoder": "decoder.mxq"}
#: Default KV capacity of the decoder MXQ, tokens: vllm-mblt's max_model_len clamp for this model.
ASR_KV_CAPACITY = 2048
#: Files copied from the checkpoint (those present).
ASR_COPIED_FILES: tuple[str, ...] = COPIED_FILES + (
    "preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja")
#: The host embedding table's names: transformers-mblt's (model.safetensors) and vllm_npu.mblt's
#: worker's (embedding.safetensors).
VENDOR_EMBED = "thinker.model.embed_tokens.weight"
WORKER_EMBED = "model.embed_tokens.weight"
#: The token ids of transformers-mblt 0.6.1's MobilintQwen3ASRThinkerConfig and their tokens
#: (byte-level BPE: ``Ċ`` is the newline).
THINKER_TOKENS: dict[str, str] = {
    "audio_token_id": "<|audio_pad|>", "audio_start_token_id": "<|audio_start|>",
    "audio_end_token_id": "<|audio_end|>", "user_token_id": "user", "assistant_token_id": "assistant",
    "asr_text_token_id": "<asr_text>", "im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>",
    "newline_token_id": "\u010a",
}


def _token_ids(thinker: Mapping[str, Any], src: Path) -> dict[str, int]:
    """The Qwen3-ASR token ids of ``thinker_config``: the checkpoint's; for one it omits, the id of
    its token in ``tokenizer.json`` when that is one token (:data:`THINKER_TOKENS`); else left out
    (transformers-mblt then applies its default, the real release's id)."""
    ids = {k: thinker[k] for k in THINKER_TOKENS if k in thinker}
    try:
        tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = dict((tok.get("model") or {}).get("vocab") or {})
        vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens") or []})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        vocab = {}
    for key, text in THINKER_TOKENS.items():
        if key not in ids and isinstance(vocab.get(text), int):
            ids[key] = vocab[text]
    return ids


def _npu_fields(mxq_path: str, core_mode: str) -> dict[str, Any]:
    """One sub-config's NPU fields, as MobilintConfigMixin serialises them (no max_batch_size: the
    release declares none; transformers-mblt defaults it to 1)."""
    return {"mxq_path": mxq_path, "dev_no": 0, "core_mode": core_mode, "target_device": "aries"}


def _write_hub_proxy(out: Path) -> dict[str, str]:
    """Write ``proxy_qwen3_asr.py`` (as the Hub release ships) and return its ``auto_map``.

    ``AutoModelForCausalLM`` is mapped too: vllm-mblt 0.8.0's worker loads every model that is
    not an image-text one with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``,
    and transformers-mblt registers the Qwen3-ASR class for ``AutoModel`` and
    ``AutoModelForSpeechSeq2Seq`` only."""
    pkg = "transformers_mblt.models.qwen3_asr"
    (out / "proxy_qwen3_asr.py").write_text(
        f'''"""Remote-code entry of this Qwen3-ASR release (written by npu-harness mxq compile --hub-proxy): the
Mobilint classes of transformers-mblt (they need its qwen-asr extra), under the names config.json's
auto_map gives."""

from {pkg}.configuration_qwen3_asr import MobilintQwen3ASRConfig
from {pkg}.modeling_qwen3_asr import MobilintQwen3ASRForConditionalGeneration
from {pkg}.processing_qwen3_asr import MobilintQwen3ASRProcessor

__all__ = ["MobilintQwen3ASRConfig", "MobilintQwen3ASRForConditionalGeneration", "MobilintQwen3ASRProcessor"]
''', encoding="utf-8")
    model = "proxy_qwen3_asr.MobilintQwen3ASRForConditionalGeneration"
    return {"AutoConfig": "proxy_qwen3_asr.MobilintQwen3ASRConfig", "AutoModel": model,
            "AutoModelForCausalLM": model, "AutoModelForSpeechSeq2Seq": model,
            "AutoProcessor": "proxy_qwen3_asr.MobilintQwen3ASRProcessor"}


def compile_asr_release(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_cache_size: int | None = None,
    max_width: int | None = None,
    core_mode: str = "single",
    prefill_chunk_size: int | Mapping[str, int] = 128,
    output_logits: str = "last",
    memory_flexible: bool = True,
    hub_proxy: bool = False,
) -> Path:
    """Write the Qwen3-ASR release of the checkpoint in ``hf_dir`` (module docstring).

    Args:
        max_cache_size: the decoder MXQ's KV capacity, tokens; default :data:`ASR_KV_CAPACITY`
            (2048) or ``max_position_embeddings`` if smaller; ``1 <= T <= max_position_embeddings``.
        max_width: most tokens per decoder infer; default ``max(128, largest chunk)``; at least
            every prefill chunk.
        core_mode: auto, single, multi, global4 or global8, for both MXQs (``auto``: compiled for
            every mode; written to both sub-configs).
        prefill_chunk_size: int >= 1 or a dict of core-mode keys (``npu_prefill_chunk_size``,
            written top-level and in ``text_config``, where transformers-mblt reads it).
        output_logits: the decoder's ``"last"`` (one logits row) or ``"all"`` (one per token).
        memory_flexible: both MXQs may share an explicitly named core (``compile_artifact``).
        hub_proxy: also write ``proxy_qwen3_asr.py`` and ``auto_map``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: a value outside its rule (named with the rule); not a Qwen3-ASR checkpoint
            (model_type, a missing ``thinker_config`` / ``audio_config`` / ``text_config``).
        CheckpointError / UnsupportedModelError: the golden code cannot read the checkpoint.
    """
    src, out = Path(hf_dir), Path(out_dir)
    if core_mode not in CORE_MODES:
        raise ValueError(f"core_mode {core_mode!r} must be one of {', '.join(CORE_MODES)}")
    chunks = _chunk_values(prefill_chunk_size)
    if output_logits not in ("last", "all"):
        raise ValueError(f"output_logits {output_logits!r} must be 'last' or 'all'")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json (expected a Hugging Face model directory)")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if raw.get("model_type") != ASR_SOURCE_TYPE:
        raise ValueError(f"model_type {raw.get('model_type')!r} is not {ASR_SOURCE_TYPE!r}: not a Qwen3-ASR checkpoint")
    thinker = raw.get("thinker_config")
    if not isinstance(thinker, dict) or not isinstance(thinker.get("audio_config"), dict) \
            or not isinstance(thinker.get("text_config"), dict):
        raise ValueError(f"{src}/config.json: a Qwen3-ASR config needs thinker_config with audio_config and "
                         "text_config objects")
    weights = load_safetensors(src)
    text_w = decoder_tensors(weights)  # the golden reference's own mapping: the MXQ equals AsrReference.decoder
    llm = text_model_config(thinker["text_config"])
    cfg = ModelConfig.from_dict(llm)
    max_pos = cfg.max_position_embeddings
    t, w = kv_and_width(max_pos, max_cache_size, max_width, chunks, default_cache=ASR_KV_CAPACITY,
                        default_width=max(128, *chunks))
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    Decoder(cfg, text_w, source=str(src))  # checks every text tensor
    audio_w = {n: weights[n] for n in audio_tensor_names(list(weights))}
    AudioEncoderPart(thinker["audio_config"], audio_w, source=str(src))  # checks every audio tensor

    out.mkdir(parents=True, exist_ok=True)
    modes = _compiled_modes(core_mode, 1)
    common = {"max_batch_size": 1, "core_modes": modes, "target_device": "aries",
              "memory_flexible": bool(memory_flexible)}
    write_mxq(out / ASR_MXQ_PATHS["encoder"], {
        "llm_config": dict(thinker["audio_config"]), "kind": "audio_encoder", "max_cache_size": 1,
        "max_width": 100, "output_logits": "all", **common}, audio_w)
    write_mxq(out / ASR_MXQ_PATHS["decoder"], {
        "llm_config": llm, "max_cache_size": t, "max_width": w, "output_logits": output_logits, **common}, text_w)
    embed = np.asarray(text_w[WORKER_EMBED], np.float32)
    save_safetensors(out / "model.safetensors", {VENDOR_EMBED: embed}, metadata={"format": "pt"})
    save_safetensors(out / "embedding.safetensors", {WORKER_EMBED: embed}, metadata={"format": "pt"})

    chunk_value = dict(prefill_chunk_size) if isinstance(prefill_chunk_size, Mapping) else prefill_chunk_size
    audio_cfg = {**thinker["audio_config"], "model_type": SUB_MODEL_TYPES["audio"],
                 **_npu_fields(ASR_MXQ_PATHS["encoder"], core_mode)}
    text_cfg = {**thinker["text_config"], "model_type": SUB_MODEL_TYPES["text"],
                "tie_word_embeddings": bool(cfg.tie_word_embeddings), "npu_prefill_chunk_size": chunk_value,
                **_npu_fields(ASR_MXQ_PATHS["decoder"], core_mode)}
    thinker_cfg = {k: v for k, v in thinker.items() if k not in ("audio_config", "text_config")}
    thinker_cfg.update(_token_ids(thinker, src))
    thinker_cfg.update(model_type=SUB_MODEL_TYPES["thinker"], audio_config=audio_cfg, text_config=text_cfg)
    config = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "thinker_config",
                                                      "max_batch_size")}
    config.update(model_type=ASR_MODEL_TYPE, architectures=[ASR_ARCHITECTURE], _name_or_path=str(src),
                  thinker_config=thinker_cfg, support_languages=raw.get("support_languages"),
                  npu_prefill_chunk_size=chunk_value)
    if hub_proxy:
        config["auto_map"] = _write_hub_proxy(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in ASR_COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out
