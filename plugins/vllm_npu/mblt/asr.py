"""A Mobilint Qwen3-ASR release on the runtime API: its rules and its audio encoder (issue 14 §2).

A release (``docs/mblt.md``, "Qwen3-ASR") ships two MXQs: the audio encoder, compiled for a fixed
one-second window (``[1, 1, mel_bins, 100]`` log-mel frames in, ``[1, D, 1, 13]`` audio embeddings
out, no KV), and the thinker's text decoder, an ordinary text-LLM MXQ fed input embeddings. The
host (this module, as transformers-mblt does for vllm-mblt) cuts a clip's log-mel features into
100-frame windows, zero-pads the last, runs each window on its own and keeps only the tokens the
tail's frames produce (:func:`audio_token_count`), so the embeddings line up one to one with the
``<|audio_pad|>`` placeholders vLLM's Qwen3-ASR processor put in the prompt. The worker writes
them over those placeholders' embedding rows; the decoder MXQ never knows audio was involved.

Rules (vllm-mblt 0.8.0's, from the seed): ``max_model_len`` clamped to :data:`ASR_MAX_MODEL_LEN`
(the artifact declares 65536, a request running past token 2048 can stall the NPU), vLLM's
multimodal processor cache off, one audio clip per prompt, transcription only (a translation is
refused), and the model's own ``language X<asr_text>`` preface kept in the text when no language
is forced (:mod:`vllm_npu.mblt.asr_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_npu.mblt.errors import MbltBackendError
from vllm_npu.mblt.placement import make_slot_config, resolve_targets

__all__ = ["ASR_MAX_MODEL_LEN", "ASR_MODEL_TYPE", "WINDOW_FRAMES", "WINDOW_TOKENS", "AsrEncoder", "AsrInputError",
           "AsrRelease", "audio_token_count", "is_asr_release"]

logger = logging.getLogger("vllm.vllm_npu.mblt")

ASR_MODEL_TYPE = "mobilint-qwen3_asr"
#: vllm-mblt's clamp of ``max_model_len`` for Qwen3-ASR (tokens).
ASR_MAX_MODEL_LEN = 2048
#: Log-mel frames per audio-encoder window (10 ms each: one second of audio).
WINDOW_FRAMES = 100
#: Audio embeddings one full window yields (three stride-2 convolutions: 100 -> 50 -> 25 -> 13).
WINDOW_TOKENS = 13


class AsrInputError(ValueError):
    """Audio features the encoder cannot take (the message names the shape and the rule)."""


def _conv_out(n: int) -> int:
    return (n - 1) // 2 + 1 if n > 0 else 0


def audio_token_count(frames: int) -> int:
    """Audio embeddings for ``frames`` log-mel frames: :data:`WINDOW_TOKENS` per full window plus
    what the tail's frames give through the three stride-2 convolutions (vLLM's Qwen3-ASR
    placeholder count).

    Raises:
        AsrInputError: ``frames`` negative.
    """
    if frames < 0:
        raise AsrInputError(f"frames={frames} must be >= 0")
    full, tail = divmod(int(frames), WINDOW_FRAMES)
    return full * WINDOW_TOKENS + _conv_out(_conv_out(_conv_out(tail)))


def is_asr_release(artifact: Mapping[str, object]) -> bool:
    """Whether a parsed ``config.json`` is a Qwen3-ASR release."""
    return artifact.get("model_type") == ASR_MODEL_TYPE


def _sub(artifact: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    thinker = artifact.get("thinker_config") or {}
    sub = thinker.get(name) if isinstance(thinker, Mapping) else None
    return sub if isinstance(sub, Mapping) else {}


@dataclass(frozen=True)
class AsrRelease:
    """Where a release's two MXQs are and how the encoder is placed.

    The loader extra config's ``encoder_``/``decoder_`` keys win over ``config.json``'s
    (``thinker_config.audio_config`` / ``text_config``, or its top-level ``encoder_*`` /
    ``decoder_*`` keys).

    Attributes:
        encoder_mxq: path of the audio-encoder MXQ.
        decoder_mxq: path of the text-decoder MXQ.
        encoder_dev_no: device of the encoder.
        encoder_core_mode: its core mode (``single`` unless configured; ``auto`` means ``single``).
        encoder_target_cores: its cores (``"d:c:k"``), or None for the mode's default.
        decoder_core_mode: the decoder's core mode when the release or the loader extra config
            names one (``decoder_core_mode``, ``text_config.core_mode``), else None.
        decoder_target_cores: the decoder's cores when named, else None.
    """

    encoder_mxq: str
    decoder_mxq: str
    encoder_dev_no: int
    encoder_core_mode: str
    encoder_target_cores: tuple[str, ...] | None
    decoder_core_mode: str | None = None
    decoder_target_cores: tuple[str, ...] | None = None

    @classmethod
    def resolve(cls, model_dir: str, artifact: Mapping[str, Any], extra: Mapping[str, object],
                default_dev: int) -> AsrRelease:
        """Read the release's layout.

        Raises:
            MbltBackendError: neither the loader extra config nor ``config.json`` names one of the
                two MXQ paths (the message names the keys looked at).
        """
        audio, text = _sub(artifact, "audio_config"), _sub(artifact, "text_config")

        def pick(role: str, key: str, sub: Mapping[str, Any]) -> object:
            for value in (extra.get(f"{role}_{key}"), artifact.get(f"{role}_{key}"), sub.get(key)):
                if value is not None:
                    return value
            return None

        paths = {}
        for role, sub in (("encoder", audio), ("decoder", text)):
            rel = pick(role, "mxq_path", sub)
            if not rel:
                raise MbltBackendError(
                    f"{model_dir}/config.json: the Qwen3-ASR release names no {role} MXQ (looked at the "
                    f"loader extra config's {role}_mxq_path, config.json's {role}_mxq_path and "
                    f"thinker_config.{'audio' if role == 'encoder' else 'text'}_config.mxq_path)")
            paths[role] = str(Path(model_dir) / str(rel))
        dev = pick("encoder", "dev_no", audio)
        if isinstance(dev, (list, tuple)):
            dev = dev[0] if dev else None
        cores = pick("encoder", "target_cores", audio)
        dec_cores = pick("decoder", "target_cores", text)
        dec_mode = pick("decoder", "core_mode", text)
        return cls(
            encoder_mxq=paths["encoder"],
            decoder_mxq=paths["decoder"],
            encoder_dev_no=int(dev) if dev is not None else default_dev,
            encoder_core_mode=str(pick("encoder", "core_mode", audio) or "single").replace("auto", "single"),
            encoder_target_cores=tuple(str(c) for c in cores) if cores else None,
            decoder_core_mode=str(dec_mode) if dec_mode else None,
            decoder_target_cores=tuple(str(c) for c in dec_cores) if dec_cores else None,
        )


class AsrEncoder:
    """The launched audio-encoder MXQ and the host's windowing; build with :meth:`create`.

    Attributes:
        mel_bins: log-mel bins per frame the MXQ takes.
        hidden_size: width of one audio embedding (the decoder's hidden size).
    """

    def __init__(self, runtime: Any, model: Any, accelerator: Any) -> None:
        """Internal: use :meth:`create`. Reads the window shape from the model."""
        self.runtime = runtime
        self.model = model
        self.accelerator = accelerator
        # qbruntime reports shapes HWC: input (1, mel_bins, 100), output (D, 1, 13)
        in_shape = tuple(int(v) for v in model.get_model_input_shape()[0])
        out_shape = tuple(int(v) for v in model.get_model_output_shape()[0])
        self.mel_bins = in_shape[-2]
        self.hidden_size = out_shape[-3]

    @classmethod
    def create(cls, runtime: Any, release: AsrRelease, device_name: str) -> AsrEncoder:
        """Create and launch the encoder MXQ on its device and cores.

        Raises:
            MbltTargetError: targets that do not resolve.
            QbRuntimeError: the runtime's error, unchanged (the model disposed).
        """
        placement = resolve_targets((release.encoder_dev_no,), release.encoder_core_mode,
                                    release.encoder_target_cores, None, device_name)
        acc = runtime.Accelerator(device_name, release.encoder_dev_no)
        model = runtime.Model(release.encoder_mxq,
                              make_slot_config(runtime, placement, release.encoder_dev_no, 0, 1))
        try:
            model.launch(acc)
        except BaseException:
            model.dispose()
            raise
        return cls(runtime, model, acc)

    def encode(self, features: np.ndarray) -> np.ndarray:
        """Audio embeddings ``[audio_token_count(T), hidden_size]`` float32 of one clip's log-mel
        features ``[mel_bins, T]``: one infer per 100-frame window, the last zero-padded and
        trimmed to its frames' tokens.

        Raises:
            AsrInputError: not ``[mel_bins, T]`` with ``T >= 1``.
            QbRuntimeError: the runtime's error, unchanged.
        """
        x = np.asarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[0] != self.mel_bins or x.shape[1] < 1:
            raise AsrInputError(f"audio features of shape {tuple(x.shape)}: the encoder takes "
                                f"[{self.mel_bins}, T] log-mel frames with T >= 1")
        frames = x.shape[1]
        n_windows = -(-frames // WINDOW_FRAMES)
        padded = np.zeros((self.mel_bins, n_windows * WINDOW_FRAMES), dtype=np.float32)
        padded[:, :frames] = x
        pieces = []
        for w in range(n_windows):
            window = np.ascontiguousarray(padded[None, None, :, w * WINDOW_FRAMES:(w + 1) * WINDOW_FRAMES])
            out = np.asarray(self.model.infer([window], None, 0)[0], dtype=np.float32)
            pieces.append(out.reshape(self.hidden_size, WINDOW_TOKENS).T)  # [1, D, 1, 13] -> [13, D]
        rows = np.concatenate(pieces, axis=0)
        return np.ascontiguousarray(rows[:audio_token_count(frames)])

    def dispose(self) -> None:
        """Dispose the model (never raises: a failure is logged)."""
        try:
            self.model.dispose()
        except Exception as exc:  # noqa: BLE001 - teardown
            logger.warning("Disposing the Mobilint audio encoder failed: %s", exc)


def feature_rows(mm_features: Sequence[Any], encoder: AsrEncoder) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(vLLM's item hash, prompt positions, embeddings)`` of each audio item of a request, in
    prompt order.

    ``mm_features`` are vLLM's ``MultiModalFeatureSpec`` of a new request (``data`` holds the
    processor's ``input_audio_features`` ``[mel_bins, T]``; ``mm_position`` the placeholder
    range). Placeholder ranges may include non-embedding tokens (``is_embed``); the embeddings
    go to the embedding positions in order.

    Raises:
        AsrInputError: an item without features (the processor cache must be off), or whose
            embedding count differs from its placeholder count (both named).
    """
    out: list[tuple[str, np.ndarray, np.ndarray]] = []
    for spec in sorted(mm_features, key=lambda f: f.mm_position.offset):
        if spec.modality != "audio":
            raise AsrInputError(f"a {spec.modality!r} item: Qwen3-ASR takes audio only")
        data = spec.data
        if data is None:
            raise AsrInputError(
                f"audio item {spec.identifier} arrived without its features (vLLM's multimodal processor cache "
                "must be off for Qwen3-ASR: the platform sets mm_processor_cache_gb=0)")
        if "input_audio_features" not in data:
            raise AsrInputError(f"audio item {spec.identifier} has no input_audio_features (fields: "
                                f"{sorted(data)}; {data!r:.300})")
        feats = data["input_audio_features"].data
        feats = feats.numpy() if hasattr(feats, "numpy") else np.asarray(feats)
        rows = encoder.encode(feats)
        pos = spec.mm_position
        positions = int(pos.offset) + np.arange(int(pos.length))
        if pos.is_embed is not None:
            positions = positions[np.asarray(pos.is_embed, dtype=bool)]
        if positions.size != rows.shape[0]:
            raise AsrInputError(f"audio item {spec.identifier}: {rows.shape[0]} embeddings from "
                                f"{feats.shape[-1]} frames for {positions.size} placeholder tokens")
        out.append((spec.identifier, positions, rows))
    return out
