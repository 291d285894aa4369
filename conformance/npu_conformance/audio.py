"""Audio files for the speech-to-text scenarios, made locally: WAV encoding and hostile uploads.

Nothing is downloaded: clips are numpy arrays (for the simulator, the tiny Qwen3-ASR model's
fitted tone clips, ``npusim.tinymodel.asr``), encoded here as 16-bit PCM WAV with the standard
library's :mod:`wave`.
"""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

__all__ = ["SAMPLE_RATE", "hostile_uploads", "wav_bytes"]

#: Samples per second of every clip (what Qwen3-ASR's feature extractor takes).
SAMPLE_RATE = 16000


def wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    """Mono 16-bit PCM WAV of ``samples`` (float, nominally in [-1, 1]; clipped).

    Raises:
        ValueError: ``samples`` is not 1-D.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"samples of shape {x.shape}: a mono clip is 1-D")
    pcm = (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def hostile_uploads(valid: bytes) -> dict[str, bytes]:
    """Malformed and truncated files made from a valid WAV ``valid``, by name:

    - ``empty``: zero bytes;
    - ``garbage``: 64 KiB of deterministic noise bytes, no header;
    - ``header_only``: the 44-byte RIFF header, no samples;
    - ``truncated``: the first half of the file (its header still declares the whole length);
    - ``huge_declared_length``: the header's RIFF and data sizes set to 4 GiB - 1, with only the
      real samples behind them;
    - ``riff_not_wave``: a RIFF header whose form type is not ``WAVE``;
    - ``text``: a text file sent as audio;
    - ``truncated_flac``: the clip as FLAC, cut in half (only when ``soundfile`` is installed).
    """
    rng = np.random.default_rng(7)
    huge = bytearray(valid)
    huge[4:8] = struct.pack("<I", 0xFFFFFFFF)
    data_at = bytes(valid).find(b"data")
    if data_at >= 0:
        huge[data_at + 4:data_at + 8] = struct.pack("<I", 0xFFFFFFFF)
    not_wave = bytearray(valid)
    not_wave[8:12] = b"AVI "
    out = {
        "empty": b"",
        "garbage": rng.integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes(),
        "header_only": bytes(valid[:44]),
        "truncated": bytes(valid[: len(valid) // 2]),
        "huge_declared_length": bytes(huge),
        "riff_not_wave": bytes(not_wave),
        "text": b"this is not audio\n" * 100,
    }
    try:
        import soundfile
    except ImportError:
        return out
    with wave.open(io.BytesIO(valid)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        rate = w.getframerate()
    buf = io.BytesIO()
    soundfile.write(buf, pcm, rate, format="FLAC", subtype="PCM_16")
    flac = buf.getvalue()
    out["truncated_flac"] = flac[: len(flac) // 2]
    return out
