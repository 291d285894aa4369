"""The Qwen3-ASR audio tower as Mobilint's NPU runs it: fixed 1-second windows (numpy only).

Mobilint compiles the audio encoder for one window of :data:`WINDOW_FRAMES` (100) mel frames,
which it turns into :data:`WINDOW_TOKENS` (13) audio tokens. The host (transformers-mblt's
``MobilintQwen3ASRAudioEncoder``) zero-pads the mel to a whole number of windows, runs every
window independently and keeps only :func:`audio_token_count` tokens: 13 per full window plus
the tail's. :meth:`AudioEncoder.encode` does the same; :meth:`AudioEncoder.encode_window` is
the whole tower on one window (tensor names of the original Qwen release, without the
``thinker.audio_tower.`` prefix)::

    x = gelu(conv2d1(mel))            3x3, stride 2, padding 1: [C, 64, 50]   (C = downsample_hidden_size)
    x = gelu(conv2d2(x))              [C, 32, 25]
    x = gelu(conv2d3(x))              [C, 17, 13]
    h = conv_out(x as [13, C * 17])   no bias, index c * 17 + f            -> [13, d_model]
    h = h + sinusoids[:13]            [sin(t / 10000 ** (i / (d/2 - 1))), cos(...)]
    per layer:  h = h + out_proj(attention(self_attn_layer_norm(h)))    all 13 tokens, no mask
                h = h + fc2(act(fc1(final_layer_norm(h))))
    y = proj2(act(proj1(ln_post(h))))                                     -> [13, output_dim]

``gelu`` is the exact (erf) GELU; ``act`` is the config's ``activation_function``; layer norms
use eps 1e-5; attention is multi-head with biases, scaled by ``head_dim ** -0.5``.

Where this differs from upstream (transformers 5.19 / vLLM 0.32 on CPU or GPU): upstream runs
the convolutions per 100-frame chunk too (the tail chunk zero-padded, as here), but its
attention spans ``n_window_infer`` frames (800 in the real config: up to 8 chunks, 104 tokens)
and only the valid tokens of the tail chunk. So the two agree exactly for a clip of at most one
full window (100 frames) and in general differ beyond: the NPU's tokens of a window never see
the other windows, and the tail window's valid tokens also attend to its padded ones.

Numerics: float64 throughout, float32 out. Against transformers 5.19's float32 tower on one window
``tests/npusim/test_asr_golden.py`` asserts NMSE <= 1e-10 (measured about 1.4e-13).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError
from .safetensors import load_safetensors

__all__ = ["ACTIVATIONS", "TOWER_PREFIX", "WINDOW_FRAMES", "WINDOW_TOKENS", "AudioConfigError", "AudioEncoder",
           "AudioEncoderConfig", "AudioShapeError", "audio_token_count", "tower_tensor_shapes", "window_token_count"]

WINDOW_FRAMES = 100
WINDOW_TOKENS = 13
#: Where the original Qwen3-ASR release keeps the audio tower's tensors.
TOWER_PREFIX = "thinker.audio_tower."
LAYER_NORM_EPS = 1e-5


class AudioConfigError(ValueError):
    """An ``audio_config`` value the NPU encoder cannot have; the message names the key and value."""


class AudioShapeError(ValueError):
    """A mel array of the wrong shape or dtype; the message names the shape and the rule."""


def window_token_count(frames: int) -> int:
    """Tokens three (k=3, s=2, p=1) convolutions leave of ``frames`` valid frames (0 for 0).

    Raises:
        ValueError: ``frames`` is negative or not an integer.
    """
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 0:
        raise ValueError(f"frames must be an integer >= 0, got {frames!r}")
    n = int(frames)
    for _ in range(3):
        n = (n - 1) // 2 + 1 if n > 0 else 0
    return n


def audio_token_count(frames: int) -> int:
    """Audio tokens of ``frames`` mel frames: 13 per full window plus the tail's
    (``window_token_count(frames % 100)``): vLLM's / the vendor's ``_get_feat_extract_output_lengths``.

    Raises:
        ValueError: ``frames`` is negative or not an integer.
    """
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 0:
        raise ValueError(f"frames must be an integer >= 0, got {frames!r}")
    return (int(frames) // WINDOW_FRAMES) * WINDOW_TOKENS + window_token_count(int(frames) % WINDOW_FRAMES)


def _erf(x: np.ndarray) -> np.ndarray:
    return _ERF(x).astype(np.float64)


_ERF = np.frompyfunc(math.erf, 1, 1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


#: ``activation_function`` values and their functions (``gelu`` exact, the tanh ones approximate).
ACTIVATIONS = {
    "gelu": _gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0.0),
    "silu": _silu,
}


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The audio tower's sizes (a Qwen3-ASR ``thinker_config.audio_config``)."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    downsample_hidden_size: int
    output_dim: int
    max_source_positions: int = 1500
    n_window: int = 50
    n_window_infer: int = 800
    activation_function: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def freq_bins(self) -> int:
        """Mel bins left after the three stride-2 convolutions (17 of 128)."""
        return window_token_count(self.num_mel_bins)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AudioEncoderConfig:
        """Read an ``audio_config`` dict (other keys, e.g. ``dropout``, ``conv_chunksize``, are ignored).

        ``scale_embedding`` is ignored as upstream ignores it (neither transformers' nor vLLM's
        tower multiplies by it).

        Raises:
            AudioConfigError: a size key missing or not a positive integer; ``d_model`` not a
                multiple of ``encoder_attention_heads`` or odd; ``n_window`` other than 50 (the
                NPU window is 100 frames); ``max_source_positions`` below 13; an unknown
                ``activation_function``; ``d`` not a mapping.
        """
        if not isinstance(d, Mapping):
            raise AudioConfigError(f"audio_config must be a mapping, got {type(d).__name__}")

        def pos_int(key: str, default: int | None = None) -> int:
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise AudioConfigError(f"audio_config[{key!r}] must be a positive integer, got {v!r}")
            return v

        cfg = cls(
            num_mel_bins=pos_int("num_mel_bins"),
            d_model=pos_int("d_model"),
            encoder_layers=pos_int("encoder_layers"),
            encoder_attention_heads=pos_int("encoder_attention_heads"),
            encoder_ffn_dim=pos_int("encoder_ffn_dim"),
            downsample_hidden_size=pos_int("downsample_hidden_size"),
            output_dim=pos_int("output_dim"),
            max_source_positions=pos_int("max_source_positions", 1500),
            n_window=pos_int("n_window", 50),
            n_window_infer=pos_int("n_window_infer", 800),
            activation_function=d.get("activation_function", "gelu"),
        )
        if cfg.d_model % cfg.encoder_attention_heads or cfg.d_model % 2:
            raise AudioConfigError(f"audio_config['d_model'] {cfg.d_model} must be even and a multiple of "
                                   f"encoder_attention_heads {cfg.encoder_attention_heads}")
        if cfg.n_window * 2 != WINDOW_FRAMES:
            raise AudioConfigError(f"audio_config['n_window'] {cfg.n_window}: the NPU encoder window is fixed at "
                                   f"{WINDOW_FRAMES} mel frames (n_window {WINDOW_FRAMES // 2})")
        if cfg.max_source_positions < WINDOW_TOKENS:
            raise AudioConfigError(f"audio_config['max_source_positions'] {cfg.max_source_positions} must be >= "
                                   f"{WINDOW_TOKENS} (the tokens of one window)")
        if cfg.activation_function not in ACTIVATIONS:
            raise AudioConfigError(f"audio_config['activation_function'] {cfg.activation_function!r} is not "
                                   f"supported (supported: {', '.join(ACTIVATIONS)})")
        return cfg


def tower_tensor_shapes(cfg: AudioEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name (without :data:`TOWER_PREFIX`) -> shape, for every tensor the tower needs."""
    c, d, f = cfg.downsample_hidden_size, cfg.d_model, cfg.encoder_ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "conv2d1.weight": (c, 1, 3, 3), "conv2d1.bias": (c,),
        "conv2d2.weight": (c, c, 3, 3), "conv2d2.bias": (c,),
        "conv2d3.weight": (c, c, 3, 3), "conv2d3.bias": (c,),
        "conv_out.weight": (d, c * cfg.freq_bins),
    }
    for i in range(cfg.encoder_layers):
        p = f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (d, d)
            shapes[p + f"self_attn.{proj}.bias"] = (d,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + ln + ".weight"] = (d,)
            shapes[p + ln + ".bias"] = (d,)
        shapes[p + "fc1.weight"] = (f, d)
        shapes[p + "fc1.bias"] = (f,)
        shapes[p + "fc2.weight"] = (d, f)
        shapes[p + "fc2.bias"] = (d,)
    shapes.update({
        "ln_post.weight": (d,), "ln_post.bias": (d,),
        "proj1.weight": (d, d), "proj1.bias": (d,),
        "proj2.weight": (cfg.output_dim, d), "proj2.bias": (cfg.output_dim,),
    })
    return shapes


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's sinusoidal positions ``[length, channels]``: sines then cosines of
    ``t * max_timescale ** (-i / (channels / 2 - 1))``."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1)


def _conv3x3s2(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Conv2d, kernel 3, stride 2, padding 1: ``x`` [Cin, H, W] -> [Cout, ceil(H/2), ceil(W/2)]."""
    _, h, wd = x.shape
    ho, wo = (h - 1) // 2 + 1, (wd - 1) // 2 + 1
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    out = np.zeros((w.shape[0], ho, wo))
    for di in range(3):
        for dj in range(3):
            patch = xp[:, di:di + 2 * ho:2, dj:dj + 2 * wo:2]
            out += np.einsum("oc,chw->ohw", w[:, :, di, dj], patch, optimize=True)
    return out + b[:, None, None]


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + LAYER_NORM_EPS) * w + b


class AudioEncoder:
    """The audio tower of one Qwen3-ASR checkpoint, windowed as the Mobilint NPU runs it.

    Attributes:
        config: the :class:`AudioEncoderConfig`.
    """

    def __init__(self, config: AudioEncoderConfig, tensors: Mapping[str, np.ndarray], *,
                 source: str = "tensors") -> None:
        """Check and keep (as float64) the tower's tensors.

        Args:
            config: the tower's sizes.
            tensors: name (without ``thinker.audio_tower.``) -> array; extra names are ignored.
            source: where the tensors came from, for error messages.

        Raises:
            CheckpointError: a tensor is missing or has a shape other than
                :func:`tower_tensor_shapes` says (both shapes named).
        """
        self.config = config
        self._w: dict[str, np.ndarray] = {}
        for name, shape in tower_tensor_shapes(config).items():
            if name not in tensors:
                raise CheckpointError(f"{source}: audio tower tensor {name!r} is missing")
            arr = np.asarray(tensors[name])
            if tuple(arr.shape) != shape:
                raise CheckpointError(f"{source}: audio tower tensor {name!r} has shape {tuple(arr.shape)}, "
                                      f"the config implies {shape}")
            self._w[name] = arr.astype(np.float64)
        self._pos = sinusoids(config.max_source_positions, config.d_model)[:WINDOW_TOKENS]
        self._act = ACTIVATIONS[config.activation_function]

    @classmethod
    def from_pretrained(cls, hf_dir: str | os.PathLike) -> AudioEncoder:
        """Load ``thinker_config.audio_config`` of ``config.json`` and the ``thinker.audio_tower.*``
        tensors of an original-layout Qwen3-ASR directory.

        Raises:
            CheckpointError: no readable ``config.json``, no ``thinker_config.audio_config`` in it,
                a missing tensor or a shape mismatch.
            AudioConfigError: a bad ``audio_config`` value.
        """
        d = Path(hf_dir)
        try:
            raw = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{d / 'config.json'}: cannot read: {exc}") from exc
        audio = (raw.get("thinker_config") or {}).get("audio_config")
        if audio is None:
            raise CheckpointError(f"{d / 'config.json'}: no thinker_config.audio_config (not an original-layout "
                                  "Qwen3-ASR checkpoint)")
        cfg = AudioEncoderConfig.from_dict(audio)
        names = [TOWER_PREFIX + n for n in tower_tensor_shapes(cfg)]
        tensors = load_safetensors(d, names=names)
        return cls(cfg, {n[len(TOWER_PREFIX):]: t for n, t in tensors.items()}, source=str(d))

    # ------------------------------------------------------------------ public API

    def encode_window(self, mel: np.ndarray) -> np.ndarray:
        """The tower on one window: ``mel`` ``[num_mel_bins, 100]`` -> ``[13, output_dim]`` float32.

        Raises:
            AudioShapeError: ``mel`` is not a float ``[num_mel_bins, 100]`` array of finite values.
        """
        x = self._check_mel(mel, window=True)
        return self._window(x).astype(np.float32)

    def encode(self, mel: np.ndarray) -> np.ndarray:
        """The NPU's windowing: ``mel`` ``[num_mel_bins, T]`` (``T >= 1``) ->
        ``[audio_token_count(T), output_dim]`` float32.

        The mel is zero-padded to ``ceil(T / 100)`` windows, each window encoded independently
        (:meth:`encode_window`), and the last window's tokens cut to its valid frames' count.

        Raises:
            AudioShapeError: ``mel`` is not a float ``[num_mel_bins, T]`` array of finite values
                with ``T >= 1``.
        """
        x = self._check_mel(mel, window=False)
        t = x.shape[1]
        n_win = -(-t // WINDOW_FRAMES)
        xp = np.zeros((x.shape[0], n_win * WINDOW_FRAMES))
        xp[:, :t] = x
        out = [self._window(xp[:, i * WINDOW_FRAMES:(i + 1) * WINDOW_FRAMES]) for i in range(n_win)]
        tail = t % WINDOW_FRAMES
        if tail:
            out[-1] = out[-1][:window_token_count(tail)]
        return np.concatenate(out, axis=0).astype(np.float32)

    # ------------------------------------------------------------------ internals

    def _check_mel(self, mel: np.ndarray, window: bool) -> np.ndarray:
        x = np.asarray(mel)
        bins = self.config.num_mel_bins
        rule = f"[{bins}, {WINDOW_FRAMES}] (one window)" if window else f"[{bins}, T] with T >= 1"
        if x.dtype.kind != "f":
            raise AudioShapeError(f"mel must be a float array {rule}, got dtype {x.dtype}")
        ok = x.ndim == 2 and x.shape[0] == bins and (x.shape[1] == WINDOW_FRAMES if window else x.shape[1] >= 1)
        if not ok:
            raise AudioShapeError(f"mel must have shape {rule}, got shape {x.shape}")
        x = x.astype(np.float32).astype(np.float64)
        if not np.isfinite(x).all():
            raise AudioShapeError(f"mel of shape {x.shape} has a non-finite value")
        return x

    def _window(self, mel: np.ndarray) -> np.ndarray:
        w, cfg = self._w, self.config
        x = mel[None]
        for k in (1, 2, 3):
            x = _gelu(_conv3x3s2(x, w[f"conv2d{k}.weight"], w[f"conv2d{k}.bias"]))
        c, f, t = x.shape  # [C, 17, 13]
        h = x.transpose(2, 0, 1).reshape(t, c * f) @ w["conv_out.weight"].T
        h = h + self._pos[:t]
        heads, hd = cfg.encoder_attention_heads, cfg.head_dim
        for i in range(cfg.encoder_layers):
            p = f"layers.{i}."
            y = _layer_norm(h, w[p + "self_attn_layer_norm.weight"], w[p + "self_attn_layer_norm.bias"])
            q, k, v = (
                (y @ w[p + f"self_attn.{n}.weight"].T + w[p + f"self_attn.{n}.bias"])
                .reshape(t, heads, hd).transpose(1, 0, 2)
                for n in ("q_proj", "k_proj", "v_proj")
            )
            s = q @ k.transpose(0, 2, 1) * hd ** -0.5
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            a = (s / s.sum(axis=-1, keepdims=True)) @ v
            a = a.transpose(1, 0, 2).reshape(t, heads * hd)
            h = h + a @ w[p + "self_attn.out_proj.weight"].T + w[p + "self_attn.out_proj.bias"]
            y = _layer_norm(h, w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"])
            y = self._act(y @ w[p + "fc1.weight"].T + w[p + "fc1.bias"])
            h = h + y @ w[p + "fc2.weight"].T + w[p + "fc2.bias"]
        h = _layer_norm(h, w["ln_post.weight"], w["ln_post.bias"])
        h = self._act(h @ w["proj1.weight"].T + w["proj1.bias"])
        return h @ w["proj2.weight"].T + w["proj2.bias"]
