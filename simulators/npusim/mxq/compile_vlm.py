"""``compile_vlm_release``: a tiny Qwen2-VL / Qwen3-VL checkpoint as a Mobilint VLM release directory.

Input: a transformers-5.19-layout checkpoint (``config.json`` ``model_type`` ``qwen2_vl`` /
``qwen3_vl`` with ``vision_config`` and ``text_config``; tensors ``model.visual.*``,
``model.language_model.*``, ``lm_head.weight``), e.g. :mod:`npusim.tinymodel.vlm`'s. Output::

    config.json             model_type mobilint-qwen2_vl / mobilint-qwen3_vl, architectures
                            Mobilint{Qwen2VL,Qwen3VL}ForConditionalGeneration; the checkpoint's keys
                            and token ids; vision_config / text_config with model_type
                            mobilint-qwen2_vl(_text) / mobilint-qwen3_vl(_text) and their NPU fields
                            nested, as transformers-mblt's MobilintConfigMixin serialises them
                            (mxq_path, dev_no, core_mode, target_device, max_batch_size; text_config
                            also npu_prefill_chunk_size); Qwen2-VL: dynamic_vision (top level and in
                            vision_config); Qwen3-VL: is_dynamic + dynamic_vision, and
                            vision_config.vision_output_order
    vision.mxq              kind qwen2_vl_vision / qwen3_vl_vision (npusim.mxq.vlm_kinds), no KV
    text.mxq                kind decoder with vlm_text_layout (npusim.mxq.vlm_kinds), the text model
    model.safetensors       the host's weights: model.language_model.embed_tokens.weight (dynamic
                            Qwen3-VL also model.visual.pos_embed.weight, for the host's bilinear
                            position embeddings)
    tokenizer, preprocessor_config.json, video_preprocessor_config.json, chat template,
    generation_config.json  copied (those present)
    proxy_qwen2_vl.py / proxy_qwen3_vl.py + auto_map
                            with ``hub_proxy`` only: the Hub releases' remote-code entry
                            (:func:`write_hub_proxy`), and text_config.architectures (as
                            transformers 4.57 saves a Qwen2-VL / Qwen3-VL config; :func:`add_hub_proxy`)

Layouts (docs/mblt-vlm-release.md §2; ``vision`` and ``text_layout`` options):

============ ========= ======================================== ============================================
family        vision    vision.mxq (``vision_layout``)            text.mxq (``vlm_text_layout``)
============ ========= ======================================== ============================================
qwen2_vl      static    ``static``: 1 input ``(896, 56, 6)``       ``qwen2_static``: embeds
                        (224x224, grid 1x16x16)
qwen2_vl      dynamic   ``rope`` (2 in) or ``cos_sin`` (3 in)      ``qwen2_rope``: embeds, rope
qwen3_vl      static    ``folded`` ``(1, 256, 1536)`` (256x256)    ``qwen3_bundled_static`` (embeds, deepstack)
                        or ``legacy`` ``(1024, 64, 6)``            or ``qwen3_split_static`` (embeds, ds0..ds2)
qwen3_vl      dynamic   ``dynamic``: rope, pos, folded (or         ``qwen3_bundled_rope`` (embeds, deepstack,
                        folded, pos, rope), N <= 4096              rope), ``qwen3_split_rope`` (+ ds0..ds2);
                                                                   batch: ``qwen3_batch_rope`` (embeds, rope,
                                                                   deepstack)
============ ========= ======================================== ============================================

The vision and text MXQs must agree, as transformers-mblt's composite model requires: a static
vision MXQ goes with a text MXQ without a RoPE input, a dynamic one with a RoPE input. A batch
text MXQ (``max_batch_size > 1``): Qwen2-VL static only (transformers-mblt refuses a batched
RoPE-input Qwen2-VL text MXQ); Qwen3-VL any layout (a batch build without RoPE input is written,
though transformers-mblt refuses split-static batch at construction and vllm-mblt refuses every
RoPE-less batch Qwen3-VL text MXQ at load).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..llm import Decoder, ModelConfig, load_safetensors, save_safetensors
from ..llm.vlm_reference import mrope_params, vlm_decoder_tensors, vlm_text_config
from .compile import BATCH_MAX_WIDTH, COPIED_FILES, CORE_MODES, _chunk_values, _compiled_modes, _positive_int, \
    kv_and_width
from .mxqfile import write_mxq
from .vlm_kinds import DEFAULT_VISION_OUTPUT_ORDER, QWEN3_INPUT_ORDERS, VISION_PREFIX, VlmVisionPart, \
    vision_tensor_names

__all__ = ["HUB_PROXY_CLASSES", "STATIC_FRAME", "TEXT_LAYOUT_OPTIONS", "VISION_LAYOUT_OPTIONS", "VISION_MAX_PATCHES", "VLM_ARCHITECTURES",
           "VLM_COPIED_FILES", "VLM_MXQ_PATHS", "VLM_SOURCE_TYPES", "compile_vlm_release", "text_layout_name",
           "add_hub_proxy", "write_hub_proxy"]

VLM_SOURCE_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen3_vl")
#: family -> (release model_type, architecture, vision sub-config model_type, text sub-config model_type)
VLM_ARCHITECTURES: dict[str, tuple[str, str, str, str]] = {
    "qwen2_vl": ("mobilint-qwen2_vl", "MobilintQwen2VLForConditionalGeneration", "mobilint-qwen2_vl",
                 "mobilint-qwen2_vl_text"),
    "qwen3_vl": ("mobilint-qwen3_vl", "MobilintQwen3VLForConditionalGeneration", "mobilint-qwen3_vl",
                 "mobilint-qwen3_vl_text"),
}
VLM_MXQ_PATHS: dict[str, str] = {"vision": "vision.mxq", "text": "text.mxq"}
#: The fixed frame (pixels, square) of a static vision MXQ: transformers-mblt's Qwen2-VL processor
#: resizes to 224x224; Qwen3-VL's to 224x224 too, which upstream's min_pixels lifts to 256x256.
STATIC_FRAME: dict[str, int] = {"qwen2_vl": 224, "qwen3_vl": 256}
#: Most pre-merge patches per dynamic vision infer (the vendor's 4096-token encoder limit).
VISION_MAX_PATCHES = 4096
#: ``vision_layout`` choices per (family, vision); the first is the default.
VISION_LAYOUT_OPTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("qwen2_vl", "static"): ("static",), ("qwen2_vl", "dynamic"): ("rope", "cos_sin"),
    ("qwen3_vl", "static"): ("folded", "legacy"),
    ("qwen3_vl", "dynamic"): ("rope,pos,folded", "folded,pos,rope"),
}
#: ``text_layout`` values: ``bundled`` / ``split`` (RoPE input follows ``vision``), or the explicit
#: ``<deepstack>_<rope>`` names, which must agree with ``vision``.
TEXT_LAYOUT_OPTIONS: tuple[str, ...] = ("bundled", "split", "bundled_static", "bundled_rope", "split_static",
                                        "split_rope")
VLM_COPIED_FILES: tuple[str, ...] = COPIED_FILES + (
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json", "chat_template.json",
    "chat_template.jinja")
HOST_EMBED = "model.language_model.embed_tokens.weight"
HOST_POS_EMBED = VISION_PREFIX + "pos_embed.weight"


#: family -> (config, model, processor) classes of transformers-mblt the Hub release's proxy exports
#: (TM/models/<family>/proxy_<family>.py).
HUB_PROXY_CLASSES: dict[str, tuple[str, str, str]] = {
    "qwen2_vl": ("MobilintQwen2VLConfig", "MobilintQwen2VLForConditionalGeneration", "MobilintQwen2VLProcessor"),
    "qwen3_vl": ("MobilintQwen3VLConfig", "MobilintQwen3VLForConditionalGeneration", "MobilintQwen3VLProcessor"),
}


def write_hub_proxy(out: Path, family: str) -> dict[str, str]:
    """Write ``proxy_<family>.py`` into ``out`` and return the ``auto_map`` naming its classes.

    The module is what the Hub Qwen2-VL / Qwen3-VL releases ship (transformers-mblt's own
    ``proxy_qwen2_vl.py`` / ``proxy_qwen3_vl.py``): it re-exports transformers-mblt's config, model
    and processor classes, falling back to ``mblt_model_zoo.hf_transformers`` (the same classes
    under the legacy path). Importing it registers the ``mobilint-*`` model type with transformers'
    ``AutoConfig`` / ``AutoModel`` / ``AutoModelForImageTextToText`` / ``AutoProcessor`` (and, for
    Qwen3-VL, ``AutoVideoProcessor``), which ``--trust-remote-code`` needs in an environment without
    our plugin. ``auto_map`` names ``AutoModelForImageTextToText``: vllm-mblt 0.8.0's worker loads a
    VLM with ``AutoModelForImageTextToText.from_pretrained(..., trust_remote_code=True)``.
    """
    config_cls, model_cls, processor_cls = HUB_PROXY_CLASSES[family]
    module = f"proxy_{family}"

    def imports(pkg: str, indent: str) -> str:
        return "".join(f"{indent}from {pkg}.models.{family}.{sub}_{family} import {cls}\n"
                       for sub, cls in (("configuration", config_cls), ("modeling", model_cls),
                                        ("processing", processor_cls)))

    (out / f"{module}.py").write_text(
        f'''"""Remote-code entry of this {family} release (written by npu-harness mxq compile --hub-proxy), as the
Hub release's: the Mobilint classes of transformers-mblt (or mblt-model-zoo's legacy path to the same
classes), under the names config.json's auto_map gives."""

try:
{imports("transformers_mblt", "    ")}except ModuleNotFoundError as exc:
    if exc.name != "transformers_mblt":
        raise
    try:
{imports("mblt_model_zoo.hf_transformers", "        ")}    except ModuleNotFoundError as legacy_exc:
        if legacy_exc.name not in {{"mblt_model_zoo", "mblt_model_zoo.hf_transformers"}}:
            raise
        raise ImportError("This model requires 'transformers-mblt' to be installed. "
                          "Please run: pip install transformers-mblt") from legacy_exc

__all__ = [{", ".join(f'"{c}"' for c in HUB_PROXY_CLASSES[family])}]
''', encoding="utf-8")
    return {"AutoConfig": f"{module}.{config_cls}", "AutoModel": f"{module}.{model_cls}",
            "AutoModelForImageTextToText": f"{module}.{model_cls}", "AutoProcessor": f"{module}.{processor_cls}"}


def _hub_config(config: dict[str, Any], out: Path, family: str) -> None:
    """``config`` (a release's config.json) with the Hub releases' remote-code entry written to ``out``."""
    config["auto_map"] = write_hub_proxy(out, family)
    text = config.get("text_config")
    if isinstance(text, dict) and not text.get("architectures"):
        # transformers 4.57 (vllm-mblt's) saves the composite's architectures in text_config too, and its
        # Qwen2VLConfig reads every attribute text_config holds from text_config (__getattribute__): without
        # them, vLLM 0.11.2 sees config.architectures None ("No model architectures are specified")
        text["architectures"] = list(config.get("architectures") or [])


def add_hub_proxy(release: str | os.PathLike) -> Path:
    """Give an existing Qwen2-VL / Qwen3-VL release the remote-code entry ``hub_proxy`` writes
    (``proxy_<family>.py``, ``auto_map``, ``text_config.architectures``); a release that has an
    ``auto_map`` is left as it is.

    Raises:
        ValueError: not a Mobilint Qwen2-VL / Qwen3-VL release.
    """
    out = Path(release)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    family = {v[0]: k for k, v in VLM_ARCHITECTURES.items()}.get(config.get("model_type"))
    if family is None:
        raise ValueError(f"{out}: model_type {config.get('model_type')!r} is not a Mobilint Qwen2-VL / Qwen3-VL release")
    if not config.get("auto_map"):
        _hub_config(config, out, family)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def text_layout_name(family: str, vision: str, text_layout: str, max_batch_size: int) -> str:
    """The text MXQ's ``vlm_text_layout`` for these options.

    Raises:
        ValueError: an unknown option; ``split`` for Qwen2-VL (no DeepStack); an explicit text layout
            whose RoPE input disagrees with ``vision`` (transformers-mblt's composite check); a batched
            RoPE-input Qwen2-VL text MXQ.
    """
    if vision not in ("static", "dynamic"):
        raise ValueError(f"vision {vision!r} must be 'static' or 'dynamic'")
    if text_layout not in TEXT_LAYOUT_OPTIONS:
        raise ValueError(f"text_layout {text_layout!r} must be one of {', '.join(TEXT_LAYOUT_OPTIONS)}")
    deep, _, rope = text_layout.partition("_")
    want = "rope" if vision == "dynamic" else "static"
    if rope and rope != want:
        raise ValueError(f"text_layout {text_layout!r} does not go with vision {vision!r}: the vision and text MXQs are "
                         f"one bundle, and a {vision} vision MXQ needs a text MXQ "
                         f"{'with' if vision == 'dynamic' else 'without'} a RoPE input "
                         f"(text_layout {deep}_{want}), as transformers-mblt's composite model requires")
    if family == "qwen2_vl":
        if deep != "bundled":
            raise ValueError(f"text_layout {text_layout!r}: a Qwen2-VL text MXQ has no DeepStack inputs to split "
                             "(use bundled)")
        if vision == "dynamic" and max_batch_size > 1:
            raise ValueError(f"max_batch_size {max_batch_size} with vision 'dynamic': batched Qwen2-VL text MXQs "
                             "with an external RoPE input are not supported (transformers-mblt); a batch Qwen2-VL "
                             "release is static")
        return f"qwen2_{want}"
    if deep == "bundled" and want == "rope" and max_batch_size > 1:
        return "qwen3_batch_rope"
    return f"qwen3_{deep}_{want}"


def _npu_fields(mxq_path: str, core_mode: str, max_batch_size: int) -> dict[str, Any]:
    """One sub-config's NPU fields, as transformers-mblt's MobilintConfigMixin serialises them."""
    return {"mxq_path": mxq_path, "dev_no": 0, "core_mode": core_mode, "target_device": "aries",
            "max_batch_size": max_batch_size}


def _output_order(order: Sequence[int] | str | None) -> list[int]:
    if order is None:
        return list(DEFAULT_VISION_OUTPUT_ORDER)
    items = order.split(",") if isinstance(order, str) else list(order)
    try:
        out = [int(str(i).strip()) for i in items]
    except ValueError:
        raise ValueError(f"vision_output_order {order!r} must be four integers") from None
    if sorted(out) != [0, 1, 2, 3]:
        raise ValueError(f"vision_output_order {order!r} must be a permutation of 0..3 (the indices of the merger "
                         "and DeepStack 0..2 among the vision MXQ's outputs)")
    return out


def compile_vlm_release(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    vision: str = "static",
    text_layout: str = "bundled",
    vision_layout: str | None = None,
    vision_output_order: Sequence[int] | str | None = None,
    vision_max_patches: int = VISION_MAX_PATCHES,
    max_batch_size: int = 1,
    max_cache_size: int | None = None,
    max_width: int | None = None,
    core_mode: str = "single",
    prefill_chunk_size: int | Mapping[str, int] = 128,
    output_logits: str = "last",
    memory_flexible: bool = True,
    hub_proxy: bool = False,
) -> Path:
    """Write the VLM release of the checkpoint in ``hf_dir`` (module docstring).

    Args:
        vision: ``static`` (one fixed frame per infer, :data:`STATIC_FRAME`) or ``dynamic`` (any
            grid up to ``vision_max_patches`` patches, side inputs from the host).
        text_layout: :data:`TEXT_LAYOUT_OPTIONS` (:func:`text_layout_name`).
        vision_layout: the vision MXQ's inputs, :data:`VISION_LAYOUT_OPTIONS` (Qwen2-VL dynamic:
            ``rope`` 2 inputs / ``cos_sin`` 3; Qwen3-VL static: ``folded`` / ``legacy``; Qwen3-VL
            dynamic: the slot order ``rope,pos,folded`` (the shipped 8B's) / ``folded,pos,rope``).
        vision_output_order: Qwen3-VL only: indices of (merger, deepstack0..2) among the vision
            MXQ's outputs, a permutation of 0..3 (list or ``"0,2,3,1"``); default transformers-mblt's
            ``(0, 2, 3, 1)``. Written to the MXQ header and ``vision_config.vision_output_order``.
        vision_max_patches: most pre-merge patches per dynamic vision infer (>= 4; default 4096).
        max_batch_size: the text MXQ's K (cache ids); the vision MXQ is batch 1.
        max_cache_size, max_width, prefill_chunk_size: the text MXQ's KV capacity, width and
            ``npu_prefill_chunk_size`` (``compile_artifact``'s rules; batch: width at most 128).
        core_mode, output_logits, memory_flexible: as ``compile_artifact`` (``output_logits`` for
            the text MXQ).
        hub_proxy: also write the Hub releases' remote-code entry (``auto_map`` in config.json and
            ``proxy_<family>.py``, :func:`write_hub_proxy`), so ``--trust-remote-code`` resolves the
            ``mobilint-*`` model type in an environment that has transformers-mblt but not our plugin.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: an option outside its rule (named, with the rule); not a qwen2_vl/qwen3_vl checkpoint.
        CheckpointError / UnsupportedModelError: the golden code cannot read the checkpoint.
    """
    src, out = Path(hf_dir), Path(out_dir)
    k = _positive_int("max_batch_size", max_batch_size)
    if core_mode not in CORE_MODES:
        raise ValueError(f"core_mode {core_mode!r} must be one of {', '.join(CORE_MODES)}")
    if k > 1 and core_mode not in ("single", "auto"):
        raise ValueError(f"core_mode {core_mode!r} is not allowed with max_batch_size {k}: batched MXQs support only "
                         "single or auto")
    chunks = _chunk_values(prefill_chunk_size)
    if output_logits not in ("last", "all"):
        raise ValueError(f"output_logits {output_logits!r} must be 'last' or 'all'")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json (expected a Hugging Face model directory)")
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    family = raw.get("model_type")
    if family not in VLM_SOURCE_TYPES:
        raise ValueError(f"model_type {family!r} is not one of {', '.join(VLM_SOURCE_TYPES)}: not a Qwen2-VL / "
                         "Qwen3-VL checkpoint")
    if not isinstance(raw.get("vision_config"), dict) or not isinstance(raw.get("text_config"), dict):
        raise ValueError(f"{src}/config.json: a {family} config needs vision_config and text_config objects")
    layout = text_layout_name(family, vision, text_layout, k)
    choices = VISION_LAYOUT_OPTIONS[(family, vision)]
    vl = choices[0] if vision_layout is None else vision_layout
    if vl not in choices:
        raise ValueError(f"vision_layout {vision_layout!r} must be one of {', '.join(choices)} for a {vision} "
                         f"{family} vision MXQ")
    patches_cap = _positive_int("vision_max_patches", vision_max_patches)
    if patches_cap < 4:
        raise ValueError(f"vision_max_patches {patches_cap} must be >= 4 (one merge window)")
    if family == "qwen2_vl" and vision_output_order is not None:
        raise ValueError("vision_output_order applies to Qwen3-VL only (a Qwen2-VL vision MXQ has one output)")
    out_order = _output_order(vision_output_order) if family == "qwen3_vl" else None

    weights = load_safetensors(src)
    text_raw = raw["text_config"]
    llm = vlm_text_config(family, text_raw)
    cfg = ModelConfig.from_dict(llm)
    section, interleaved, _ = mrope_params(text_raw)
    text_w = vlm_decoder_tensors(weights)
    Decoder(cfg, text_w, source=str(src))  # checks every text tensor
    max_pos = cfg.max_position_embeddings
    if k > 1:
        t, _ = kv_and_width(max_pos, max_cache_size, None, [1], default_cache=4096, default_width=1)
        w = BATCH_MAX_WIDTH if max_width is None else _positive_int("max_width", max_width)
        if w > BATCH_MAX_WIDTH:
            raise ValueError(f"max_width {w} exceeds {BATCH_MAX_WIDTH}, the most tokens a batch MXQ "
                             f"(max_batch_size {k} > 1) takes per item per infer")
    else:
        t, w = kv_and_width(max_pos, max_cache_size, max_width, chunks, default_cache=4096,
                            default_width=max(128, *chunks))

    vcfg = dict(raw["vision_config"])
    kind = f"{family}_vision"
    vision_w = {n: weights[n] for n in vision_tensor_names(list(weights))}
    patch = int(vcfg.get("patch_size", 14))
    vheader: dict[str, Any] = {"llm_config": vcfg, "kind": kind, "max_batch_size": 1, "max_cache_size": 1,
                               "output_logits": "all", "target_device": "aries",
                               "core_modes": _compiled_modes(core_mode, 1), "memory_flexible": bool(memory_flexible)}
    if vision == "static":
        side = STATIC_FRAME[family] // patch
        vheader.update(vision_layout=vl, vision_grid=[1, side, side], max_width=side * side)
    elif family == "qwen3_vl":
        vheader.update(vision_layout="dynamic", vision_input_order=vl.split(","), max_width=patches_cap)
    else:
        vheader.update(vision_layout=vl, max_width=patches_cap)
    if out_order is not None:
        vheader["vision_output_order"] = out_order
    VlmVisionPart(kind, vheader, vision_w, source=str(src))  # checks every vision tensor and the grid

    theader: dict[str, Any] = {
        "llm_config": llm, "vlm_text_layout": layout, "vlm_mrope": {"mrope_section": section, "interleaved": interleaved},
        "max_batch_size": k, "max_cache_size": t, "max_width": w, "core_modes": _compiled_modes(core_mode, k),
        "output_logits": output_logits, "target_device": "aries", "memory_flexible": bool(memory_flexible)}
    if family == "qwen3_vl":
        theader["vlm_deepstack_layers"] = len(vcfg.get("deepstack_visual_indexes") or ())

    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_mxq(out / VLM_MXQ_PATHS["vision"], vheader, vision_w)
    write_mxq(out / VLM_MXQ_PATHS["text"], theader, text_w)
    host = {HOST_EMBED: np.asarray(weights[HOST_EMBED], np.float32)}
    if family == "qwen3_vl" and vision == "dynamic":
        host[HOST_POS_EMBED] = np.asarray(weights[HOST_POS_EMBED], np.float32)
    save_safetensors(out / "model.safetensors", host, metadata={"format": "pt"})

    model_type, arch, vision_type, text_type = VLM_ARCHITECTURES[family]
    dynamic = vision == "dynamic"
    chunk_value = dict(prefill_chunk_size) if isinstance(prefill_chunk_size, Mapping) else prefill_chunk_size
    vision_cfg = {**vcfg, "model_type": vision_type, **_npu_fields(VLM_MXQ_PATHS["vision"], core_mode, 1)}
    text_cfg = {**text_raw, "model_type": text_type, "npu_prefill_chunk_size": chunk_value,
                **_npu_fields(VLM_MXQ_PATHS["text"], core_mode, k)}
    config = {key: v for key, v in raw.items() if key not in ("model_type", "architectures", "vision_config",
                                                              "text_config")}
    config.update(model_type=model_type, architectures=[arch], _name_or_path=str(src), tie_word_embeddings=False,
                  vision_config=vision_cfg, text_config=text_cfg, dynamic_vision=dynamic)
    if family == "qwen2_vl":
        vision_cfg["dynamic_vision"] = dynamic
    else:
        config["is_dynamic"] = dynamic
        vision_cfg["vision_output_order"] = out_order
    if hub_proxy:
        _hub_config(config, out, family)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in VLM_COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


assert QWEN3_INPUT_ORDERS[0] == ("rope", "pos", "folded")  # VISION_LAYOUT_OPTIONS' Qwen3-VL dynamic default
