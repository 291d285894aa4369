"""``compile_eagle3_release``: a base checkpoint and its EAGLE-3 draft as a Mobilint EAGLE-3 release.

The layout is the one transformers-mblt 0.6.1 and vllm-mblt 0.8.0 read (``docs/mblt-eagle3-release.md``,
"EAGLE-3 release layout")::

    config.json             the base's HF fields; model_type mobilint-<family>-eagle3; architectures
                            [Mobilint<Family>Eagle3ForCausalLM]; draft_config (a LlamaConfig dict);
                            base_/draft_/fc_ mxq_path, max_batch_size 1, core_mode single, target_device;
                            npu_prefill_chunk_size; eagle3_tree_depth, eagle3_tree_top_k; num_assistant_tokens
    generation_config.json  the base's, plus num_assistant_tokens, eagle3_tree_depth, eagle3_tree_top_k
    model.safetensors       eagle3_base_model.embed_tokens.weight, eagle3_draft_model.embed_tokens.weight,
                            eagle3_draft_model.d2t (int64), eagle3_draft_model.t2d (bool)
    mxq/base.mxq            kind eagle3_base: every base layer (KV), the three taps and all-row logits
    mxq/draft.mxq           kind eagle3_draft: the draft's midlayer (KV), norm and lm_head
    mxq/fc.mxq              kind eagle3_fc: the draft's fc (3H -> Hd), no KV
    tokenizer files, copied from the base

The draft checkpoint is ``<hf_dir>/eagle3_draft/`` (``npusim.tinymodel.eagle3.build_eagle3``'s
layout) unless ``draft_dir`` names another.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..llm import Decoder, load_config, load_safetensors, save_safetensors
from ..llm.eagle3 import Eagle3Draft, Eagle3DraftConfig
from .compile import COPIED_FILES, MAX_DEFAULT_CACHE, _chunk_values, _positive_int, kv_and_width
from .eagle3_kinds import Eagle3Part, kind_tensor_names
from .mxqfile import write_mxq

__all__ = ["DRAFT_DIR", "EAGLE3_FAMILIES", "MXQ_PATHS", "compile_eagle3_release", "release_type"]

#: The draft checkpoint's directory inside an EAGLE-3 checkpoint.
DRAFT_DIR = "eagle3_draft"
#: Base ``model_type`` -> the family name in the release's model type and architecture.
EAGLE3_FAMILIES: dict[str, str] = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
MXQ_PATHS: dict[str, str] = {"base": "mxq/base.mxq", "draft": "mxq/draft.mxq", "fc": "mxq/fc.mxq"}
#: Defaults of the tree shape: the vendor's (transformers-mblt 0.6.1's fallbacks).
DEFAULT_TREE = {"num_assistant_tokens": 64, "tree_depth": 5, "tree_top_k": 8}
#: generation_config.json values vllm-mblt refuses for every request (key -> the only accepted value test).
_REFUSED_DEFAULTS = {"repetition_penalty": lambda v: v == 1, "min_p": lambda v: not v}
#: The draft_config keys written (a LlamaConfig dict), read from the draft checkpoint's config.
_DRAFT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_hidden_layers", "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta",
               "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "target_hidden_size",
               "eagle_config")


def release_type(base_model_type: str) -> tuple[str, str]:
    """``(model_type, architecture)`` of the EAGLE-3 release of a base family.

    Raises:
        ValueError: the base is not llama, qwen2 or qwen3.
    """
    if base_model_type not in EAGLE3_FAMILIES:
        raise ValueError(f"EAGLE-3 base model_type {base_model_type!r} must be one of {', '.join(EAGLE3_FAMILIES)}")
    fam = EAGLE3_FAMILIES[base_model_type]
    return f"mobilint-{base_model_type}-eagle3", f"Mobilint{fam}Eagle3ForCausalLM"


def _write_hub_proxy(out: Path, base_model_type: str) -> dict[str, str]:
    """Write ``proxy_<family>_eagle3.py`` (as the Hub releases ship) and return its ``auto_map``."""
    fam = EAGLE3_FAMILIES[base_model_type]
    module = f"proxy_{base_model_type}_eagle3"
    pkg = f"transformers_mblt.models.{base_model_type}_eagle3"
    config_cls, model_cls = f"Mobilint{fam}Eagle3Config", f"Mobilint{fam}Eagle3ForCausalLM"
    (out / f"{module}.py").write_text(
        f'''"""Remote-code entry of this EAGLE-3 release (written by npu-harness mxq compile --hub-proxy): the
Mobilint classes of transformers-mblt, under the names config.json's auto_map gives."""

from {pkg}.configuration_{base_model_type}_eagle3 import {config_cls}
from {pkg}.modeling_{base_model_type}_eagle3 import {model_cls}

__all__ = ["{config_cls}", "{model_cls}"]
''', encoding="utf-8")
    return {"AutoConfig": f"{module}.{config_cls}", "AutoModelForCausalLM": f"{module}.{model_cls}"}


def _header(llm_config: Mapping[str, Any], kind: str, *, t: int, w: int, **extra: Any) -> dict[str, Any]:
    return {"llm_config": dict(llm_config), "kind": kind, "max_batch_size": 1, "max_cache_size": t, "max_width": w,
            "core_modes": ["single"], "output_logits": "all", "target_device": "aries", "memory_flexible": True,
            **extra}


def _draft_config(draft_raw: Mapping[str, Any], dcfg: Eagle3DraftConfig) -> dict[str, Any]:
    """The release's ``draft_config``: a LlamaConfig dict of the draft's shapes."""
    d = {k: draft_raw[k] for k in _DRAFT_KEYS if k in draft_raw}
    d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=dcfg.hidden_size,
             intermediate_size=dcfg.intermediate_size, num_attention_heads=dcfg.num_attention_heads,
             num_key_value_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim, num_hidden_layers=1,
             vocab_size=dcfg.vocab_size, draft_vocab_size=dcfg.draft_vocab_size, rms_norm_eps=dcfg.rms_norm_eps,
             rope_theta=float(dcfg.rope.theta), max_position_embeddings=int(dcfg.rope.max_position_embeddings),
             tie_word_embeddings=False)
    return d


def compile_eagle3_release(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    draft_dir: str | os.PathLike | None = None,
    max_cache_size: int | None = None,
    max_width: int | None = None,
    prefill_chunk_size: int | Mapping[str, int] = 128,
    num_assistant_tokens: int = DEFAULT_TREE["num_assistant_tokens"],
    tree_depth: int = DEFAULT_TREE["tree_depth"],
    tree_top_k: int = DEFAULT_TREE["tree_top_k"],
    max_batch_size: int = 1,
    hub_proxy: bool = False,
) -> Path:
    """Write the EAGLE-3 release of the base checkpoint in ``hf_dir`` and its draft (module docstring).

    Args:
        draft_dir: the draft checkpoint; default ``<hf_dir>/eagle3_draft``.
        max_cache_size: KV capacity of the base and draft MXQs, tokens; default
            ``min(max_position_embeddings, 4096)``; ``1 <= T <= max_position_embeddings``.
        max_width: most tokens per base/draft infer; default the largest prefill chunk or one
            round's base infer (``num_assistant_tokens + tree_depth + 1``: the previous round's
            accepted tokens, at most ``tree_depth + 1``, then the tree), whichever is larger; at
            least every prefill chunk. The fc MXQ's width is ``max_cache_size`` (transformers-mblt
            projects a whole prompt in one infer).
        prefill_chunk_size: int >= 1 or a dict of core-mode keys (config.json ``npu_prefill_chunk_size``).
        num_assistant_tokens: the tree's size with its root, >= 2 (generation_config.json).
        tree_depth, tree_top_k: the draft tree's depth and fan-out, >= 1 (config.json and
            generation_config.json).
        max_batch_size: must be 1 (EAGLE-3 serves one sequence per base MXQ).
        hub_proxy: also write ``proxy_<family>_eagle3.py`` and ``auto_map``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: a value outside its rule (named with the rule); a base that is not llama,
            qwen2 or qwen3, has sliding-window layers, or whose hidden size or vocabulary the
            draft's ``target_hidden_size`` / ``vocab_size`` disagree with; taps outside the base's
            layers; no draft checkpoint.
        CheckpointError / UnsupportedModelError: a checkpoint cannot be read.
    """
    src, out = Path(hf_dir), Path(out_dir)
    for name, v in (("tree_depth", tree_depth), ("tree_top_k", tree_top_k)):
        _positive_int(name, v)
    if isinstance(num_assistant_tokens, bool) or not isinstance(num_assistant_tokens, int) or num_assistant_tokens < 2:
        raise ValueError(f"num_assistant_tokens {num_assistant_tokens!r} must be an integer >= 2 (the root token "
                         "plus at least one draft token)")
    if max_batch_size != 1:
        raise ValueError(f"max_batch_size {max_batch_size!r} must be 1: an EAGLE-3 release serves one sequence per "
                         "base MXQ")
    chunks = _chunk_values(prefill_chunk_size)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json (expected a Hugging Face model directory)")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    model_type, architecture = release_type(raw.get("model_type"))
    ddir = src / DRAFT_DIR if draft_dir is None else Path(draft_dir)
    if not (ddir / "config.json").is_file():
        raise ValueError(f"EAGLE-3 draft checkpoint {str(ddir)!r} has no config.json")
    sliding = [i for i, kind in enumerate(raw.get("layer_types") or []) if kind == "sliding_attention"]
    if raw.get("use_sliding_window") or sliding:
        raise ValueError(f"the base uses sliding-window attention (use_sliding_window={raw.get('use_sliding_window')!r}, "
                         f"sliding layers {sliding}), which an EAGLE-3 base MXQ (an explicit host mask) cannot hold")
    cfg = load_config(src)
    draft_raw = json.loads((ddir / "config.json").read_text(encoding="utf-8"))
    dcfg = Eagle3DraftConfig.from_dict(draft_raw)
    if dcfg.rope.rope_type != "default":
        raise ValueError(f"draft RoPE type {dcfg.rope.rope_type!r} must be 'default': transformers-mblt builds the "
                         "draft's RoPE rows unscaled")
    if dcfg.target_hidden_size != cfg.hidden_size:
        raise ValueError(f"draft target_hidden_size {dcfg.target_hidden_size} differs from the base's hidden_size "
                         f"{cfg.hidden_size}")
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"draft vocab_size {dcfg.vocab_size} differs from the base's vocab_size {cfg.vocab_size}")
    bad_taps = [t for t in dcfg.aux_layer_ids if t > cfg.num_hidden_layers]
    if bad_taps:
        raise ValueError(f"draft eagle_aux_hidden_state_layer_ids {list(dcfg.aux_layer_ids)} name layers past the "
                         f"base's {cfg.num_hidden_layers}")
    max_pos = cfg.max_position_embeddings
    t, w = kv_and_width(max_pos, max_cache_size, max_width, chunks, default_cache=MAX_DEFAULT_CACHE,
                        default_width=max(*chunks, num_assistant_tokens + tree_depth + 1))
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")

    base_w = load_safetensors(src)
    Decoder(cfg, base_w, source=str(src))  # checks every base tensor
    draft_w = load_safetensors(ddir)
    draft = Eagle3Draft(dcfg, draft_w, source=str(ddir))  # checks every draft tensor (and d2t)
    (out / "mxq").mkdir(parents=True, exist_ok=True)
    taps = list(dcfg.aux_layer_ids)
    for kind, path, llm, weights, header in (
        ("eagle3_base", MXQ_PATHS["base"], raw, base_w, _header(raw, "eagle3_base", t=t, w=w, eagle3_taps=taps)),
        ("eagle3_draft", MXQ_PATHS["draft"], draft_raw, draft_w, _header(draft_raw, "eagle3_draft", t=t, w=w)),
        ("eagle3_fc", MXQ_PATHS["fc"], draft_raw, draft_w, _header(draft_raw, "eagle3_fc", t=1, w=t)),
    ):
        tensors = {n: weights[n] for n in kind_tensor_names(kind, list(weights))}
        Eagle3Part(kind, llm, tensors, taps=taps if kind == "eagle3_base" else None, source=str(src))
        write_mxq(out / path, header, tensors)

    save_safetensors(out / "model.safetensors", {
        "eagle3_base_model.embed_tokens.weight": np.asarray(base_w["model.embed_tokens.weight"], np.float32),
        "eagle3_draft_model.embed_tokens.weight": np.asarray(draft_w["embed_tokens.weight"], np.float32),
        "eagle3_draft_model.d2t": draft.d2t.astype(np.int64),
        "eagle3_draft_model.t2d": np.asarray(draft_w["t2d"]).astype(bool),
    }, metadata={"format": "pt"})
    chunk_value = dict(prefill_chunk_size) if isinstance(prefill_chunk_size, Mapping) else prefill_chunk_size
    config = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    config.update(
        model_type=model_type, architectures=[architecture], tie_word_embeddings=False, _name_or_path=str(src),
        max_position_embeddings=max_pos, draft_config=_draft_config(draft_raw, dcfg),
        npu_prefill_chunk_size=chunk_value, eagle3_tree_depth=tree_depth, eagle3_tree_top_k=tree_top_k,
        num_assistant_tokens=num_assistant_tokens,
    )
    for role in ("base", "draft", "fc"):
        config.update({f"{role}_mxq_path": MXQ_PATHS[role], f"{role}_max_batch_size": 1,
                       f"{role}_core_mode": "single", f"{role}_target_device": "aries", f"{role}_dev_no": 0})
    if hub_proxy:
        config["auto_map"] = _write_hub_proxy(out, raw["model_type"])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if name != "generation_config.json" and (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    gen = json.loads((src / "generation_config.json").read_text(encoding="utf-8")) \
        if (src / "generation_config.json").is_file() else {}
    gen = {k: v for k, v in gen.items() if k not in _REFUSED_DEFAULTS or _REFUSED_DEFAULTS[k](v)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key not in gen and raw.get(key) is not None:
            gen[key] = raw[key]
    gen.update(num_assistant_tokens=num_assistant_tokens, eagle3_tree_depth=tree_depth, eagle3_tree_top_k=tree_top_k)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
