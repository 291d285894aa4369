"""The Qwen3-ASR audio-encoder MXQ kind (``FORMAT.md``): its input, output and computation.

A Qwen3-ASR release (:mod:`npusim.mxq.compile_asr`) ships two MXQs: the thinker's text decoder
(the ordinary ``decoder`` kind) and this one. transformers-mblt's host code feeds the audio
encoder one fixed window of log-mel features per infer, ``infer([chunk], None, 0)``:

============== =========================================== ===========================================
kind            input                                       output
============== =========================================== ===========================================
audio_encoder   ``input_features`` float32 ``[1, 1, M, 100]`` ``audio_embeds`` float32 ``[1, D, 1, 13]``
                (NCHW: M = ``num_mel_bins`` mel bins x 100  (D = ``output_dim``; the host squeezes axis
                frames, one second of audio)                2 and transposes to ``[13, D]``)
============== =========================================== ===========================================

The shape is fixed, as the real MXQ's is: anything but exactly 100 frames of M bins (rank 4, or
rank 3 ``[1, M, 100]``, the HWC form qbruntime's shape matcher also accepts) is refused with
qbruntime's ``Input shape is invalid.`` (:class:`AudioInputError`, a ``ValueError``). The
computation is :meth:`npusim.llm.audio_encoder.AudioEncoder.encode_window`, the golden code
itself, so the output is bit-identical to it in float32. The MXQ holds no KV: ``cache_size`` is
ignored and it has no CacheInfo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..llm.audio_encoder import TOWER_PREFIX, WINDOW_FRAMES, WINDOW_TOKENS, AudioEncoder, AudioEncoderConfig
from ..llm.errors import CheckpointError

__all__ = ["ASR_INPUTS", "ASR_KINDS", "ASR_OUTPUTS", "AUDIO_PREFIX", "AudioEncoderPart", "AudioInputError",
           "audio_tensor_names"]

#: Input names of each kind, in the order ``Model.infer`` takes them.
ASR_INPUTS: dict[str, tuple[str, ...]] = {"audio_encoder": ("input_features",)}
#: Output names of each kind, in the default order.
ASR_OUTPUTS: dict[str, tuple[str, ...]] = {"audio_encoder": ("audio_embeds",)}
ASR_KINDS: tuple[str, ...] = tuple(ASR_INPUTS)
#: The audio tower's tensors in a Qwen3-ASR checkpoint start with this; the MXQ payload keeps
#: these Hugging Face names.
AUDIO_PREFIX = TOWER_PREFIX


class AudioInputError(ValueError):
    """The input of an audio-encoder infer is not the compiled ``[1, 1, M, 100]`` window (the
    message starts with qbruntime's ``Input shape is invalid.`` and names expected and got)."""


def audio_tensor_names(names: Sequence[str]) -> list[str]:
    """The checkpoint tensors an ``audio_encoder`` MXQ carries, out of ``names``: the audio tower's."""
    return [n for n in names if n.startswith(AUDIO_PREFIX)]


class AudioEncoderPart:
    """One audio-encoder MXQ's computation and I/O shapes.

    Attributes:
        kind: ``"audio_encoder"``.
        num_mel_bins: M, mel bins per frame (the input's height).
        output_dim: D, channels of each audio token (the thinker's hidden size).
        frames: frames per window (100, ``WINDOW_FRAMES``).
        tokens: audio tokens per window (13, ``WINDOW_TOKENS``).
        kv_layers: 0 (no KV).
    """

    kind = "audio_encoder"
    kv_layers = 0

    def __init__(self, audio_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                 source: str = "weights") -> None:
        """Build the golden audio encoder from the header's audio config and the payload.

        Args:
            audio_config: the checkpoint's ``thinker_config.audio_config`` dict.
            tensors: the MXQ payload, ``thinker.audio_tower.*`` (:func:`audio_tensor_names`).

        Raises:
            CheckpointError: a payload tensor outside the audio tower, a missing or misshapen one.
            AudioConfigError: (a ValueError) the golden code refuses the config.
        """
        stray = sorted(n for n in tensors if not n.startswith(AUDIO_PREFIX))
        if stray:
            raise CheckpointError(f"{source}: an audio_encoder MXQ payload holds only {AUDIO_PREFIX}* tensors, "
                                  f"found {stray[:4]}")
        self.config = AudioEncoderConfig.from_dict(dict(audio_config))
        self._encoder = AudioEncoder(self.config, {n[len(AUDIO_PREFIX):]: t for n, t in tensors.items()},
                                     source=source)
        self.num_mel_bins, self.output_dim = self.config.num_mel_bins, self.config.output_dim
        self.frames, self.tokens = int(WINDOW_FRAMES), int(WINDOW_TOKENS)

    # ------------------------------------------------------------------ shapes
    @property
    def input_names(self) -> tuple[str, ...]:
        return ASR_INPUTS[self.kind]

    def input_shape(self) -> tuple[int, int, int]:
        """The compiled input shape, HWC as qbruntime reports it: ``(1, M, 100)``."""
        return (1, self.num_mel_bins, self.frames)

    def output_shape(self) -> tuple[int, int, int]:
        """The compiled output shape, HWC: ``(D, 1, 13)``."""
        return (self.output_dim, 1, self.tokens)

    # ------------------------------------------------------------------ compute
    def check(self, arrays: Sequence[Any]) -> tuple[np.ndarray, int]:
        """The one input as float32 ``[M, 100]`` and its rank (3 or 4).

        Raises:
            ValueError: not exactly one input (``The number of inputs is invalid``).
            AudioInputError: any shape but ``[1, 1, M, 100]`` / ``[1, M, 100]``.
        """
        if len(arrays) != 1:
            raise ValueError(f"The number of inputs is invalid (expected 1, got {len(arrays)}).")
        x = np.asarray(arrays[0], dtype=np.float32)
        hwc = self.input_shape()
        if x.shape not in ((1,) + hwc, hwc):
            raise AudioInputError(
                f"Input shape is invalid. inputs[0] (input_features) must be [1, {hwc[0]}, {hwc[1]}, {hwc[2]}] "
                f"(or {list(hwc)}): the audio encoder MXQ is compiled for one window of {self.frames} frames of "
                f"{self.num_mel_bins} mel bins; got {list(x.shape)}.")
        return x.reshape(self.num_mel_bins, self.frames), x.ndim

    def run(self, mel: np.ndarray, rank: int) -> np.ndarray:
        """``encode_window(mel)`` ``[13, D]`` as the MXQ's output: ``[1, D, 1, 13]`` (``[D, 1, 13]`` for
        a rank-3 input), float32.

        Raises:
            AudioShapeError: (a ValueError) ``mel`` holds a non-finite value.
        """
        emb = np.asarray(self._encoder.encode_window(mel), dtype=np.float32)  # [13, D]
        out = np.ascontiguousarray(emb.T)[:, None, :]  # [D, 1, 13]
        return out[None] if rank == 4 else out
