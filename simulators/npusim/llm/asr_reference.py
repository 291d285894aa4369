"""Golden numpy Qwen3-ASR: the NPU-windowed audio encoder, then the thinker's Qwen3 decoder (numpy only).

The pipeline a Mobilint Qwen3-ASR release runs, evaluated with numpy::

    mel    = npusim.llm.mel.log_mel(samples)                   [128, frames]
    audio  = AudioEncoder.encode(mel)                          [audio_token_count(frames), hidden]
    embeds = AsrReference.merge(prompt_ids, audio)             embedding rows, <|audio_pad|> rows replaced
    tokens = greedy decoding of the thinker's text model from ``embeds``

It reads an original-layout Qwen3-ASR directory (``config.json`` with ``thinker_config``;
tensors ``thinker.audio_tower.*``, ``thinker.model.*``, ``thinker.lm_head.weight``). The text
model is evaluated by :class:`npusim.llm.Decoder` as a ``qwen3`` model: :func:`text_model_config`
turns ``thinker_config.text_config`` into a qwen3 ``config.json`` dict and
:func:`decoder_tensors` renames ``thinker.model.X`` to ``model.X`` and ``thinker.lm_head.weight``
to ``lm_head.weight``.

Positions: the thinker uses M-RoPE (``rope_scaling.mrope_section``, three position rows: time,
height, width). For a prompt whose only multimodal item is audio, vLLM's
``get_mrope_input_positions`` gives all three rows ``0, 1, ..., T - 1`` (audio tokens advance
the position one per token like text) and decoding continues at ``T``; with equal rows every
frequency band of M-RoPE (interleaved or not) rotates by the same position, which is plain RoPE
with the same ``rope_theta``. So the decoder here uses plain RoPE; ``tests/npusim/test_asr_golden.py``
checks both facts against vLLM's positions and transformers' interleaved M-RoPE.

Against transformers 5.19's ``Qwen3ASRForConditionalGeneration`` (float32, the tiny checkpoint
mapped to its "-hf" layout) the prompt logits of a one-window (1.0 s) clip agree to NMSE
<= 1e-10 (asserted; measured about 1.2e-12). Beyond one window they differ by design: see
:mod:`npusim.llm.audio_encoder` (NPU windowing).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .audio_encoder import TOWER_PREFIX, AudioEncoder, AudioEncoderConfig, tower_tensor_shapes
from .config import ModelConfig
from .decoder import Decoder, expected_tensor_shapes
from .errors import CheckpointError, UnsupportedModelError
from .safetensors import load_safetensors

__all__ = ["AudioTokenMismatchError", "AsrReference", "decoder_tensors", "text_model_config"]

TEXT_PREFIX = "thinker.model."
LM_HEAD = "thinker.lm_head.weight"


class AudioTokenMismatchError(ValueError):
    """The prompt's ``<|audio_pad|>`` count differs from the number of audio embeddings (both named)."""


def text_model_config(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """A qwen3 ``config.json`` dict for :class:`npusim.llm.Decoder` from a ``thinker_config.text_config``.

    ``model_type`` becomes ``qwen3`` (q/k RMSNorm, no biases); ``rope_scaling`` keeps its
    ``rope_type``/``rope_theta`` (``mrope_section`` and the interleave flags are dropped: plain
    RoPE, see the module docstring).

    Raises:
        UnsupportedModelError: ``mrope_section`` does not sum to ``head_dim / 2`` (then the
            rotation is not the plain RoPE this reference assumes).
    """
    d = copy.deepcopy(dict(text_config))
    d["model_type"] = "qwen3"
    d.setdefault("tie_word_embeddings", False)
    rs = d.get("rope_scaling")
    if isinstance(rs, Mapping):
        sec = rs.get("mrope_section")
        heads = d.get("num_attention_heads") or 1
        head_dim = d.get("head_dim") or (d.get("hidden_size", 0) // heads)
        if sec is not None and (not isinstance(sec, (list, tuple)) or sum(int(s) for s in sec) != head_dim // 2):
            raise UnsupportedModelError(f"text_config.rope_scaling.mrope_section {sec!r} must sum to head_dim / 2 "
                                        f"= {head_dim // 2}")
        d["rope_scaling"] = {k: v for k, v in rs.items() if k in ("rope_type", "type", "rope_theta", "factor")}
    return d


def decoder_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The thinker's text tensors under the names :class:`npusim.llm.Decoder` expects
    (``thinker.model.X`` -> ``model.X``, ``thinker.lm_head.weight`` -> ``lm_head.weight``); others dropped."""
    out = {"model." + n[len(TEXT_PREFIX):]: t for n, t in tensors.items() if n.startswith(TEXT_PREFIX)}
    if LM_HEAD in tensors:
        out["lm_head.weight"] = tensors[LM_HEAD]
    return out


def _read_config(d: Path) -> dict[str, Any]:
    try:
        raw = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{d / 'config.json'}: cannot read: {exc}") from exc
    th = raw.get("thinker_config")
    if not isinstance(th, Mapping) or "audio_config" not in th or "text_config" not in th:
        raise CheckpointError(f"{d / 'config.json'}: no thinker_config with audio_config and text_config "
                              "(not an original-layout Qwen3-ASR checkpoint)")
    if "audio_token_id" not in th:
        raise CheckpointError(f"{d / 'config.json'}: thinker_config has no audio_token_id")
    return raw


class AsrReference:
    """The golden Qwen3-ASR pipeline of one checkpoint.

    Attributes:
        encoder: the :class:`AudioEncoder` (NPU windowing).
        decoder: the thinker's text model as a :class:`npusim.llm.Decoder` (plain RoPE, see the
            module docstring).
        config: the whole ``config.json`` dict.
        audio_token_id: ``thinker_config.audio_token_id`` (the ``<|audio_pad|>`` id).
    """

    def __init__(self, config: Mapping[str, Any], encoder: AudioEncoder, decoder: Decoder) -> None:
        self.config = dict(config)
        self.encoder = encoder
        self.decoder = decoder
        self.audio_token_id = int(self.config["thinker_config"]["audio_token_id"])
        if encoder.config.output_dim != decoder.config.hidden_size:
            raise CheckpointError(f"audio_config.output_dim {encoder.config.output_dim} differs from "
                                  f"text_config.hidden_size {decoder.config.hidden_size}")

    @classmethod
    def from_config_and_tensors(cls, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                                source: str = "tensors") -> AsrReference:
        """Build from a ``config.json`` dict and the checkpoint's tensors (original names).

        Raises:
            CheckpointError / AudioConfigError / UnsupportedModelError: as :meth:`from_pretrained`.
        """
        th = config["thinker_config"]
        enc_cfg = AudioEncoderConfig.from_dict(th["audio_config"])
        encoder = AudioEncoder(enc_cfg, {n[len(TOWER_PREFIX):]: t for n, t in tensors.items()
                                         if n.startswith(TOWER_PREFIX)}, source=source)
        text_cfg = ModelConfig.from_dict(text_model_config(th["text_config"]))
        decoder = Decoder(text_cfg, decoder_tensors(tensors), source=source)
        return cls(config, encoder, decoder)

    @classmethod
    def from_pretrained(cls, hf_dir: str | os.PathLike) -> AsrReference:
        """Load an original-layout Qwen3-ASR directory (``config.json`` + safetensors).

        Raises:
            CheckpointError: unreadable/foreign config, a missing tensor or a shape mismatch,
                ``output_dim`` differing from the text ``hidden_size``.
            AudioConfigError: a bad ``audio_config`` value.
            UnsupportedModelError: a text config the golden decoder does not implement.
        """
        d = Path(hf_dir)
        raw = _read_config(d)
        th = raw["thinker_config"]
        text_cfg = ModelConfig.from_dict(text_model_config(th["text_config"]))
        enc_cfg = AudioEncoderConfig.from_dict(th["audio_config"])
        names = [TOWER_PREFIX + n for n in tower_tensor_shapes(enc_cfg)]
        for n in expected_tensor_shapes(text_cfg):
            names.append(LM_HEAD if n == "lm_head.weight" else "thinker." + n)
        tensors = load_safetensors(d, names=names)
        return cls.from_config_and_tensors(raw, tensors, source=str(d))

    # ------------------------------------------------------------------ public API

    def encode(self, mel: np.ndarray) -> np.ndarray:
        """``self.encoder.encode(mel)``: ``[audio_token_count(T), hidden]`` float32."""
        return self.encoder.encode(mel)

    def merge(self, token_ids: Sequence[int] | np.ndarray, audio_embeds: np.ndarray) -> np.ndarray:
        """Prompt embeddings ``[len(token_ids), hidden]``: embedding rows, the ``audio_token_id``
        rows replaced in order by the rows of ``audio_embeds`` (as vLLM / transformers merge).

        Raises:
            AudioTokenMismatchError: the prompt's audio-token count differs from ``len(audio_embeds)``.
            ValueError: a bad token id; ``audio_embeds`` not ``[n, hidden]``.
        """
        ids = np.asarray(token_ids)
        emb = self.decoder.embed(ids).copy()
        a = np.asarray(audio_embeds)
        h = self.decoder.config.hidden_size
        if a.ndim != 2 or a.shape[1] != h:
            raise ValueError(f"audio_embeds must have shape [n, {h}], got shape {a.shape}")
        mask = ids == self.audio_token_id
        n_tok = int(mask.sum())
        if n_tok != a.shape[0]:
            raise AudioTokenMismatchError(f"the prompt has {n_tok} audio tokens (id {self.audio_token_id}) but "
                                          f"there are {a.shape[0]} audio embeddings")
        emb[mask] = a.astype(emb.dtype)
        return emb

    def prefill_logits(self, token_ids: Sequence[int] | np.ndarray, mel: np.ndarray) -> np.ndarray:
        """Logits ``[len(token_ids), vocab]`` float32 of the prompt with ``mel``'s audio merged in."""
        emb = self.merge(token_ids, self.encode(mel))
        return self.decoder.forward_embeddings(emb, self.decoder.new_cache(len(emb)))

    def generate_greedy(self, token_ids: Sequence[int] | np.ndarray, mel: np.ndarray, max_new_tokens: int,
                        eos_token_ids: int | Iterable[int] | None = None) -> list[int]:
        """Greedy decoding (argmax, lowest id on ties) after the prompt, fed as embeddings.

        Args:
            token_ids: the prompt, with exactly ``audio_token_count(mel.shape[1])`` audio tokens.
            mel: ``[num_mel_bins, T]`` log-mel features (:func:`npusim.llm.mel.log_mel`).
            max_new_tokens: at most this many new tokens (>= 0).
            eos_token_ids: stop after generating one of these (it is included); ``None``: the
                text config's ``eos_token_id`` if any, else never stop early.

        Returns:
            The new token ids.

        Raises:
            AudioTokenMismatchError: audio-token count mismatch.
            AudioShapeError: a bad mel.
            ValueError: a bad id, ``max_new_tokens`` negative or not an integer.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        emb = self.merge(token_ids, self.encode(mel))
        if max_new_tokens == 0:
            return []
        if eos_token_ids is None:
            stop = set(self.decoder.config.eos_token_ids)
        elif isinstance(eos_token_ids, (int, np.integer)):
            stop = {int(eos_token_ids)}
        else:
            stop = {int(e) for e in eos_token_ids}
        cache = self.decoder.new_cache(len(emb) + int(max_new_tokens))
        return self.decoder.continue_greedy(self.decoder.forward_embeddings(emb, cache), cache, int(max_new_tokens), stop)
