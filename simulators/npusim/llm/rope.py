"""Rotary position embeddings (RoPE) as Hugging Face Llama/Qwen models apply them.

Convention: "rotate half" — for a head vector ``x`` of even size ``d`` split into halves
``x1 = x[:d/2]``, ``x2 = x[d/2:]``, ``rope(x) = x * cos + concat(-x2, x1) * sin`` where
``cos``/``sin`` are ``concat(f, f)`` with ``f = position * inv_freq`` (``inv_freq`` has ``d/2``
entries). Positions are absolute token indices (0-based).

Scaling types (the ``rope_type`` of ``rope_parameters`` / ``rope_scaling``):

* ``default``: ``inv_freq[i] = 1 / theta ** (2i / d)``.
* ``linear``: ``inv_freq / factor``.
* ``dynamic`` (NTK-aware): when ``seq_len`` (max position of the current forward + 1) exceeds
  ``max_position_embeddings``, the base becomes
  ``theta * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``;
  otherwise the default frequencies are used. As in transformers 5.x, the threshold and the
  formula use ``max_position_embeddings`` (an ``original_max_position_embeddings`` key is
  ignored for this type), and keys already in a KV cache keep the rotation they were given.
* ``llama3``: low frequencies (wavelength > ``original_max / low_freq_factor``) divided by
  ``factor``, high frequencies (wavelength < ``original_max / high_freq_factor``) kept, the band
  between interpolated smoothly.

The arithmetic is done in float32 (the precision transformers uses) unless float64 is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedModelError

__all__ = ["SUPPORTED_ROPE_TYPES", "RopeConfig", "apply_rope"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

#: Layer-type keys under which transformers may nest rope parameters per attention type.
_NESTED_KEYS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters of a model.

    Attributes:
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        theta: the base (``rope_theta``), > 0.
        head_dim: rotary dimension (the full head dimension; even, >= 2).
        max_position_embeddings: the model's ``max_position_embeddings`` (tokens); the
            ``dynamic`` type rescales beyond it.
        factor: scaling factor for ``linear``, ``dynamic`` and ``llama3`` (1.0 for ``default``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only: the pre-training context (tokens).
    """

    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise UnsupportedModelError(f"RoPE needs an even head_dim >= 2, got {self.head_dim}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type == "dynamic" and self.head_dim <= 2:
            raise UnsupportedModelError("dynamic RoPE needs head_dim > 2")
        if self.rope_type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None or self.original_max_position_embeddings is None:
                raise ValueError("llama3 RoPE needs low_freq_factor, high_freq_factor and original_max_position_embeddings")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"llama3 RoPE needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} <= {self.low_freq_factor}"
                )

    @classmethod
    def from_hf_config(cls, config: Mapping, head_dim: int, max_position_embeddings: int) -> RopeConfig:
        """Read RoPE settings from an HF ``config.json`` dict, in either format.

        transformers 5.x writes ``"rope_parameters": {"rope_type", "rope_theta", ...}``; older
        configs write a top-level ``rope_theta`` plus ``rope_scaling`` (with ``type`` or
        ``rope_type``). As in transformers, ``rope_scaling`` wins over ``rope_parameters``,
        a ``rope_theta`` inside the dict wins over the top-level one (default 10000), and for
        ``llama3`` a top-level ``original_max_position_embeddings`` wins over the dict's, which
        defaults to ``max_position_embeddings``.

        Raises:
            UnsupportedModelError: an unsupported rope type, a partial rotary factor other than
                1, or parameters nested per layer type for anything but full attention.
            ValueError: a required parameter (e.g. ``factor``) is missing or invalid.
        """
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope parameters must be an object, got {params!r}")
        nested = [k for k in params if k in _NESTED_KEYS]
        if nested:
            if nested != ["full_attention"]:
                raise UnsupportedModelError(
                    f"rope parameters per layer type {nested} are not supported (only full_attention)"
                )
            params = params["full_attention"] or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        prf = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if prf is not None and float(prf) != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {prf} is not supported (only 1.0)")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

        def need(key: str) -> float:
            if params.get(key) is None:
                raise ValueError(f"rope type {rope_type!r} needs {key!r} in its parameters, got {dict(params)!r}")
            return float(params[key])

        kwargs: dict = {}
        if rope_type in ("linear", "dynamic", "llama3"):
            kwargs["factor"] = need("factor")
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = need("low_freq_factor")
            kwargs["high_freq_factor"] = need("high_freq_factor")
            omax = config.get("original_max_position_embeddings")
            if omax is None:
                omax = params.get("original_max_position_embeddings", max_position_embeddings)
            kwargs["original_max_position_embeddings"] = int(omax)
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            head_dim=int(head_dim),
            max_position_embeddings=int(max_position_embeddings),
            **kwargs,
        )

    def inv_freq(self, seq_len: int | None = None, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """Inverse frequencies, shape ``[head_dim // 2]``, in radians per position.

        Args:
            seq_len: for ``dynamic``: the max position of the current forward + 1 (tokens);
                ignored by the other types. ``None`` means no rescaling.
            dtype: ``float32`` (as transformers computes) or ``float64``.
        """
        dt = np.dtype(dtype)
        d = self.head_dim
        exponents = np.arange(0, d, 2, dtype=dt) / dt.type(d)
        base = dt.type(self.theta)
        if self.rope_type == "dynamic" and seq_len is not None and seq_len > self.max_position_embeddings:
            f = dt.type(self.factor)
            scale = f * dt.type(seq_len) / dt.type(self.max_position_embeddings) - (f - dt.type(1))
            base = base * scale ** dt.type(d / (d - 2))
        inv = (dt.type(1) / (base**exponents)).astype(dt)
        if self.rope_type == "linear":
            inv = inv / dt.type(self.factor)
        elif self.rope_type == "llama3":
            f = dt.type(self.factor)
            lo, hi = dt.type(self.low_freq_factor), dt.type(self.high_freq_factor)
            old = dt.type(self.original_max_position_embeddings)
            low_freq_wavelen = old / lo
            high_freq_wavelen = old / hi
            wavelen = dt.type(2 * math.pi) / inv
            scaled = np.where(wavelen > low_freq_wavelen, inv / f, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (dt.type(1) - smooth) * scaled / f + smooth * scaled
            medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(dt)

    def cos_sin(self, positions: np.ndarray, seq_len: int | None = None, dtype: np.dtype | type = np.float32) -> tuple[np.ndarray, np.ndarray]:
        """``cos`` and ``sin`` tables for the given positions, each ``[len(positions), head_dim]``.

        Args:
            positions: absolute token positions (non-negative ints), 1-D.
            seq_len: see :meth:`inv_freq`; defaults to ``max(positions) + 1``.
            dtype: computation and result dtype (``float32`` or ``float64``).
        """
        dt = np.dtype(dtype)
        pos = np.asarray(positions)
        if seq_len is None:
            seq_len = int(pos.max()) + 1 if pos.size else 0
        freqs = pos.astype(dt)[:, None] * self.inv_freq(seq_len, dt)[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb).astype(dt), np.sin(emb).astype(dt)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` with ``cos``/``sin`` of shape ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
