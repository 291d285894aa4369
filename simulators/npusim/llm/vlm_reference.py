"""Golden numpy Qwen2-VL / Qwen3-VL: vision tower, M-RoPE positions, decoder (numpy only).

The pipeline of a ``Qwen2VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration``
checkpoint (transformers 5.19 save layout: ``model.visual.*``, ``model.language_model.*``,
``lm_head.weight``), evaluated with numpy::

    pixel_values, grid = npusim.llm.vision_inputs.patchify(image or video frames, ...)
    embeds, deepstack  = VlmReference.encode(pixel_values, grids)       the vision tower
    x, pos, delta, ds  = VlmReference.prompt_inputs(ids, ...)           <|image_pad|>/<|video_pad|> rows replaced
    logits             = Decoder.forward_rope(x, cache, *mrope_cos_sin(pos), layer_adds=ds)

* Text model: a ``qwen2`` (Qwen2-VL: q/k/v biases) or ``qwen3`` (Qwen3-VL: q/k RMSNorm)
  :class:`npusim.llm.Decoder` of ``text_config`` (:func:`vlm_text_config`); M-RoPE tables from
  :func:`npusim.llm.mrope.mrope_cos_sin` (chunked sections for Qwen2-VL, interleaved for Qwen3-VL).
* Positions: :func:`npusim.llm.mrope.rope_index` for the prompt; decode step ``k`` (cache
  position ``T + k``) rotates by ``T + k + delta`` on all three rows, as transformers' generate.
  ``positions="linear"``: all rows ``0 .. T-1`` and decoding at ``T`` (plain RoPE), what a text
  MXQ without a RoPE input computes in our simulator (CONTRACT "Static text MXQ").
* DeepStack (Qwen3-VL): ``deepstack[k]`` at the visual rows (image rows from the image features,
  video rows from the video features) is added after decoder layer ``k``.

Against transformers 5.19 (float32, eager attention) on the tiny checkpoints the prompt logits
agree to NMSE <= 1e-10 (tests/npusim/test_vlm_golden.py).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .decoder import Decoder
from .errors import CheckpointError, UnsupportedModelError
from .mrope import mrope_cos_sin, rope_index
from .safetensors import load_safetensors
from .vision import VISION_PREFIX, Qwen2VisionTower, Qwen3VisionTower

__all__ = ["VLM_FAMILIES", "VisionTokenMismatchError", "VlmReference", "vlm_decoder_tensors", "vlm_text_config"]

#: ``config.json`` ``model_type`` -> (decoder family, tower class).
VLM_FAMILIES: dict[str, tuple[str, type]] = {"qwen2_vl": ("qwen2", Qwen2VisionTower), "qwen3_vl": ("qwen3", Qwen3VisionTower)}
TEXT_PREFIX = "model.language_model."


class VisionTokenMismatchError(ValueError):
    """The prompt's ``<|image_pad|>``/``<|video_pad|>`` count differs from the vision embeddings (both named)."""


def mrope_params(text_config: Mapping[str, Any]) -> tuple[list[int], bool, float]:
    """``(mrope_section, interleaved, rope_theta)`` of a VLM ``text_config`` (``rope_scaling`` or
    ``rope_parameters``; ``rope_theta`` there or top-level).

    Raises:
        UnsupportedModelError: no ``mrope_section``.
    """
    rs = text_config.get("rope_scaling") or text_config.get("rope_parameters") or {}
    sec = rs.get("mrope_section")
    if not isinstance(sec, (list, tuple)) or len(sec) != 3:
        raise UnsupportedModelError(f"text_config has no 3-part mrope_section in its rope parameters: {dict(rs)!r}")
    inter = bool(rs.get("mrope_interleaved", rs.get("interleaved", False)))
    theta = float(rs.get("rope_theta", text_config.get("rope_theta", 10000.0)))
    return [int(s) for s in sec], inter, theta


def vlm_text_config(model_type: str, text_config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``qwen2`` / ``qwen3`` ``config.json`` dict for :class:`npusim.llm.Decoder` from a VLM's
    ``text_config`` (``rope_scaling`` becomes plain default RoPE with the same theta; the M-RoPE
    sections are applied by the tables given to :meth:`Decoder.forward_rope`).

    Raises:
        UnsupportedModelError: ``model_type`` is not qwen2_vl/qwen3_vl; no ``mrope_section``.
    """
    if model_type not in VLM_FAMILIES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a supported VLM ({', '.join(VLM_FAMILIES)})")
    _, _, theta = mrope_params(text_config)
    d = copy.deepcopy(dict(text_config))
    d["model_type"] = VLM_FAMILIES[model_type][0]
    d.pop("rope_parameters", None)
    d["rope_scaling"] = {"rope_type": "default", "rope_theta": theta}
    d["rope_theta"] = theta
    d.setdefault("tie_word_embeddings", False)
    return d


def vlm_decoder_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The text tensors under the names :class:`Decoder` expects (``model.language_model.X`` ->
    ``model.X``; ``lm_head.weight`` kept); the others dropped."""
    out = {"model." + n[len(TEXT_PREFIX):]: t for n, t in tensors.items() if n.startswith(TEXT_PREFIX)}
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    return out


class VlmReference:
    """The golden Qwen2-VL / Qwen3-VL pipeline of one checkpoint (module docstring).

    Attributes:
        family: ``"qwen2_vl"`` or ``"qwen3_vl"``.
        config: the whole ``config.json`` dict.
        decoder: the text model (:class:`Decoder`).
        vision: the :class:`Qwen2VisionTower` / :class:`Qwen3VisionTower`.
        image_token_id, video_token_id, vision_start_token_id, vision_end_token_id: from the config.
        mrope_section, mrope_interleaved, rope_theta: the text model's M-RoPE.
    """

    def __init__(self, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, source: str = "tensors") -> None:
        """Build the tower and the decoder from a ``config.json`` dict and the checkpoint's tensors.

        Raises:
            CheckpointError: missing config parts, tensors or token ids; shape mismatches.
            UnsupportedModelError: not qwen2_vl/qwen3_vl, or an unsupported setting.
        """
        cfg = dict(config)
        mt = cfg.get("model_type")
        if mt not in VLM_FAMILIES:
            raise UnsupportedModelError(f"{source}: model_type {mt!r} is not a supported VLM ({', '.join(VLM_FAMILIES)})")
        for key in ("text_config", "vision_config"):
            if not isinstance(cfg.get(key), Mapping):
                raise CheckpointError(f"{source}: config.json has no {key}")
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not isinstance(cfg.get(key), int):
                raise CheckpointError(f"{source}: config.json has no integer {key}")
        self.family: str = mt
        self.config = cfg
        self.image_token_id = int(cfg["image_token_id"])
        self.video_token_id = int(cfg["video_token_id"])
        self.vision_start_token_id = int(cfg["vision_start_token_id"])
        self.vision_end_token_id = int(cfg["vision_end_token_id"])
        text = cfg["text_config"]
        self.mrope_section, self.mrope_interleaved, self.rope_theta = mrope_params(text)
        tcfg = ModelConfig.from_dict(vlm_text_config(mt, text))
        self.decoder = Decoder(tcfg, vlm_decoder_tensors(tensors), source=source)
        self.vision = VLM_FAMILIES[mt][1](cfg["vision_config"], tensors, VISION_PREFIX)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> VlmReference:
        """Load ``config.json`` and the safetensors weights of a transformers-5.19-layout VLM directory.

        Raises:
            CheckpointError: unreadable/missing config or weights, missing tensors.
            UnsupportedModelError: not a qwen2_vl/qwen3_vl checkpoint.
        """
        d = Path(model_dir)
        try:
            cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{d / 'config.json'}: cannot read: {exc}") from exc
        return cls(cfg, load_safetensors(d), source=str(d))

    # ------------------------------------------------------------------ pieces

    def encode(self, pixel_values: np.ndarray, grid_thw: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray | None]:
        """The tower on every item: ``(embeds [sum N_i/4, hidden], deepstack [L, sum N_i/4, hidden] or None (Qwen2-VL))``.

        Raises:
            GridError: ``pixel_values`` does not hold the grids' patches.
        """
        out = self.vision.forward(pixel_values, grid_thw)
        return out if isinstance(out, tuple) else (out, None)

    def positions(self, ids: Sequence[int] | np.ndarray, image_grid_thw: Sequence[Sequence[int]] = (),
                  video_grid_thw: Sequence[Sequence[int]] = ()) -> tuple[np.ndarray, int]:
        """:func:`npusim.llm.mrope.rope_index` of ``ids`` with this model's token ids and merge size."""
        return rope_index(ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                          image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                          vision_start_token_id=self.vision_start_token_id,
                          spatial_merge_size=self.vision.merge_size, family=self.family)

    def rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``mrope_cos_sin`` of ``positions`` ``[3, T]`` with this model's sections and theta (float32)."""
        return mrope_cos_sin(positions, head_dim=self.decoder.config.head_dim, rope_theta=self.rope_theta,
                             mrope_section=self.mrope_section, interleaved=self.mrope_interleaved)

    def prompt_inputs(self, ids: Sequence[int] | np.ndarray, *, pixel_values: np.ndarray | None = None,
                      image_grid_thw: Sequence[Sequence[int]] = (), pixel_values_videos: np.ndarray | None = None,
                      video_grid_thw: Sequence[Sequence[int]] = ()
                      ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
        """The decoder's inputs for a prompt.

        Returns:
            ``(embeds [T, hidden] float32, positions int64 [3, T], delta, deepstack)``: token
            embeddings with the image/video rows replaced by the tower's, in order;
            ``deepstack`` ``[L, T, hidden]`` float32 (zero at non-visual rows) for Qwen3-VL with
            visual rows, else ``None``.

        Raises:
            VisionTokenMismatchError: placeholder counts differ from the embeddings (named).
            ValueError: bad ids, grids that do not fit the prompt.
        """
        ids_arr = np.asarray(ids)
        emb = self.decoder.embed(ids_arr).astype(np.float32)
        deep: np.ndarray | None = None
        items = ((self.image_token_id, "image", pixel_values, image_grid_thw),
                 (self.video_token_id, "video", pixel_values_videos, video_grid_thw))
        for tok, name, pv, grids in items:
            rows = np.flatnonzero(ids_arr == tok)
            if pv is None:
                if rows.size:
                    raise VisionTokenMismatchError(f"the prompt has {rows.size} {name} tokens but no {name} pixels")
                continue
            e, d = self.encode(pv, grids)
            if e.shape[0] != rows.size:
                raise VisionTokenMismatchError(f"the prompt has {rows.size} {name} tokens but the {name}s give "
                                               f"{e.shape[0]} embeddings")
            emb[rows] = e
            if d is not None and d.shape[0]:
                if deep is None:
                    deep = np.zeros((d.shape[0], len(ids_arr), emb.shape[1]), np.float32)
                deep[:, rows] = d
        positions, delta = self.positions(ids_arr, image_grid_thw, video_grid_thw)
        return emb, positions, delta, deep

    def prompt_logits(self, ids: Sequence[int] | np.ndarray, *, positions: str = "mrope", **mm: Any) -> np.ndarray:
        """Logits ``[T, vocab]`` float32 of the prompt (``mm``: the multimodal arguments of :meth:`prompt_inputs`)."""
        emb, pos, _, deep = self.prompt_inputs(ids, **mm)
        if positions == "linear":
            pos = np.broadcast_to(np.arange(len(emb), dtype=np.int64), (3, len(emb)))
        cache = self.decoder.new_cache(len(emb))
        return self.decoder.forward_rope(emb, cache, *self.rope_tables(pos), layer_adds=_adds(deep))

    def generate_greedy(self, ids: Sequence[int] | np.ndarray, *, pixel_values: np.ndarray | None = None,
                        image_grid_thw: Sequence[Sequence[int]] = (), pixel_values_videos: np.ndarray | None = None,
                        video_grid_thw: Sequence[Sequence[int]] = (), max_new_tokens: int,
                        eos_token_ids: Iterable[int] = (), positions: str = "mrope") -> list[int]:
        """Greedy decoding (argmax, lowest id on ties) after the prompt.

        Args:
            ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw: as :meth:`prompt_inputs`.
            max_new_tokens: at most this many new tokens (>= 0).
            eos_token_ids: stop after generating one of these (it is included).
            positions: ``"mrope"`` (upstream) or ``"linear"`` (module docstring).

        Returns:
            The new token ids.

        Raises:
            ValueError: bad ``positions`` or ``max_new_tokens``; the errors of :meth:`prompt_inputs`.
        """
        if positions not in ("mrope", "linear"):
            raise ValueError(f"positions must be 'mrope' or 'linear', got {positions!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        emb, pos, delta, deep = self.prompt_inputs(ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                                   pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)
        if max_new_tokens == 0:
            return []
        t = len(emb)
        if positions == "linear":
            pos, delta = np.broadcast_to(np.arange(t, dtype=np.int64), (3, t)), 0
        dec = self.decoder
        cache = dec.new_cache(t + int(max_new_tokens))
        logits = dec.forward_rope(emb, cache, *self.rope_tables(pos), layer_adds=_adds(deep))
        stop = {int(e) for e in eos_token_ids}
        out: list[int] = []
        while True:
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            if tok in stop or len(out) >= max_new_tokens:
                return out
            p = cache.length + delta
            cos, sin = self.rope_tables(np.full((3, 1), p, np.int64))
            logits = dec.forward_rope(dec.embed([tok]), cache, cos, sin)


def _adds(deep: np.ndarray | None) -> dict[int, np.ndarray] | None:
    return None if deep is None else {i: deep[i] for i in range(deep.shape[0])}
