"""Whisper-style log-mel features of 16 kHz mono audio, as Qwen3-ASR's processor computes them (numpy only).

Qwen/Qwen3-ASR-1.7B (and the tiny checkpoint of :mod:`npusim.tinymodel.asr`) ships
``preprocessor_config.json`` naming transformers' ``WhisperFeatureExtractor`` with 128 mel bins,
``n_fft`` 400, ``hop_length`` 160, ``chunk_length`` 30, no dither. :func:`log_mel` computes, for one
clip of ``L`` samples (``Qwen3ASRProcessor`` pads nothing for a single clip: ``padding=True``):

1. reflect-pad 200 samples on each side (a centred STFT) and cut frames of 400 samples every 160;
2. multiply by a periodic Hann window, take the power spectrum ``|rfft|**2`` (201 bins);
3. drop the last frame, so there are ``frames = L // 160`` (100 per second);
4. apply the Slaney-normalised, Slaney-scale mel filter bank (128 filters, 0 - 8000 Hz);
5. ``log10(max(mel, 1e-10))``, floored at the clip's maximum minus 8, then ``(x + 4) / 4``.

The floor in step 5 uses the maximum of the *whole clip*: the features of a clip are not the
concatenation of the features of its pieces. Everything is evaluated in float64 and returned as
float32; transformers evaluates the STFT in float32, and ``tests/npusim/test_asr_golden.py``
asserts a max abs difference below 1e-4 (measured 4.7e-5 on clips of 0.3 s to 35 s).
"""

from __future__ import annotations

import numpy as np

__all__ = ["HOP_LENGTH", "MIN_SAMPLES", "N_FFT", "N_MELS", "SAMPLE_RATE", "AudioInputError", "frame_count",
           "log_mel", "mel_filter_bank"]

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
#: The centred STFT reflect-pads ``N_FFT // 2`` samples, which needs more samples than that.
MIN_SAMPLES = N_FFT // 2 + 1


class AudioInputError(ValueError):
    """Samples that :func:`log_mel` cannot take (wrong rank or dtype, non-finite, too short);
    the message names the shape/value and the rule."""


def frame_count(num_samples: int) -> int:
    """Mel frames of a clip of ``num_samples`` samples: ``num_samples // 160`` (10 ms per frame)."""
    return int(num_samples) // HOP_LENGTH


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    f = np.asarray(f, np.float64)
    step = 200.0 / 3.0
    log_step = np.log(6.4) / 27.0
    mel = f / step
    hi = f >= 1000.0
    return np.where(hi, 1000.0 / step + np.log(np.maximum(f, 1e-12) / 1000.0) / log_step, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, np.float64)
    step = 200.0 / 3.0
    log_step = np.log(6.4) / 27.0
    lin = m * step
    m_break = 1000.0 / step
    return np.where(m >= m_break, 1000.0 * np.exp(log_step * (m - m_break)), lin)


def mel_filter_bank(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                    f_min: float = 0.0, f_max: float = 8000.0) -> np.ndarray:
    """Triangular Slaney-normalised mel filters, shape ``[n_fft // 2 + 1, n_mels]`` float64.

    Filter ``m`` rises linearly from mel point ``m`` to ``m + 1`` and falls to ``m + 2`` (points
    equally spaced on the Slaney mel scale from ``f_min`` to ``f_max``), scaled by
    ``2 / (f[m + 2] - f[m])`` so each filter has unit area in Hz.
    """
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    mels = np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2)
    pts = _mel_to_hz(mels)
    diff = np.diff(pts)
    slopes = pts[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (pts[2:n_mels + 2] - pts[:n_mels]))


_FILTERS = mel_filter_bank()
_WINDOW = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann


def log_mel(samples: np.ndarray) -> np.ndarray:
    """Log-mel features ``[128, len(samples) // 160]`` float32 of one 16 kHz mono clip.

    Args:
        samples: 1-D float array (float64 is rounded to float32 first, as the processor does);
            at least :data:`MIN_SAMPLES` (201) samples.

    Returns:
        The features transformers' ``WhisperFeatureExtractor`` (as ``Qwen3ASRProcessor`` calls
        it) returns for the same samples; see the module docstring for the steps.

    Raises:
        AudioInputError: ``samples`` is not 1-D, not a float array, has a non-finite value, or
            has fewer than 201 samples.
    """
    x = np.asarray(samples)
    if x.ndim != 1:
        raise AudioInputError(f"samples must be 1-D mono audio, got shape {x.shape}")
    if x.dtype.kind != "f":
        raise AudioInputError(f"samples must be a float array (16 kHz, about -1..1), got dtype {x.dtype}")
    if x.shape[0] < MIN_SAMPLES:
        raise AudioInputError(f"need at least {MIN_SAMPLES} samples (the STFT reflect-pads {N_FFT // 2}), "
                              f"got shape {x.shape}")
    x = x.astype(np.float32).astype(np.float64)
    if not np.isfinite(x).all():
        raise AudioInputError("samples contain a non-finite value")
    pad = N_FFT // 2
    xp = np.pad(x, pad, mode="reflect")
    n_frames = 1 + x.shape[0] // HOP_LENGTH
    idx = np.arange(N_FFT)[None, :] + HOP_LENGTH * np.arange(n_frames)[:, None]
    spec = np.fft.rfft(xp[idx] * _WINDOW, axis=1)
    power = (spec.real ** 2 + spec.imag ** 2)[:-1]  # [frames, 201], last frame dropped
    mel = power @ _FILTERS  # [frames, 128]
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).T.astype(np.float32)
