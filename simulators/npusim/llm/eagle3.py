"""The EAGLE-3 draft model: one decoder block that reads the base model's hidden states.

An EAGLE-3 draft (Li et al., 2025; the checkpoint layout vLLM's ``LlamaForCausalLMEagle3``
loads) predicts the base model's next tokens from three of the base's hidden states and the
embedding of the token just sampled::

    fc:        g = fc(concat(tap_1, tap_2, tap_3))          [T, 3 * target_hidden] -> [T, hidden]
    midlayer:  x = concat(input_layernorm(embed(ids)), hidden_norm(g))             [T, 2 * hidden]
               h = g + o_proj(attention(q/k/v_proj(x)))          (RoPE, the caller's mask; KV)
               out = h + mlp(post_attention_layernorm(h))                           (layer output)
    head:      logits = lm_head(norm(out))                                          [T, draft_vocab]

``tap_i`` is the residual stream entering base layer ``eagle_aux_hidden_state_layer_ids[i]``
(:meth:`npusim.llm.Decoder.forward_tree`). Deeper draft steps feed ``out`` back in place of ``g``
(no fc). Draft index ``i`` is the target token ``i + d2t[i]``.

Checkpoint tensor names (HF EAGLE-3 layout): ``fc.weight``, ``midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``,
``embed_tokens.weight`` (``[vocab_size, hidden]``, the draft's embedding of target ids), ``d2t``
(int64 ``[draft_vocab_size]``), ``t2d`` (bool ``[vocab_size]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .decoder import _ACC, _rms_norm, cached_attention, decoder_dtype
from .errors import CheckpointError, UnsupportedModelError
from .kvcache import KVCache
from .rope import RopeConfig, apply_rope
from .safetensors import load_safetensors

__all__ = ["DRAFT_ARCHITECTURE", "Eagle3Draft", "Eagle3DraftConfig", "draft_tensor_shapes"]

#: The ``architectures`` entry of an EAGLE-3 draft checkpoint (vLLM's name for the model).
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _positive_int(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UnsupportedModelError(f"EAGLE-3 draft config {key}={v!r} must be a positive integer")
    return v


@dataclass(frozen=True)
class Eagle3DraftConfig:
    """The shapes of an EAGLE-3 draft (sizes in elements, ``rms_norm_eps`` a float).

    Attributes:
        hidden_size: the draft's width ``Hd``.
        target_hidden_size: the base model's width ``H`` (fc reads ``3 * H``).
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: the midlayer's.
        vocab_size: the base (target) vocabulary; the draft embeds target ids.
        draft_vocab_size: rows of ``lm_head`` (``<= vocab_size``).
        rms_norm_eps: every RMSNorm's epsilon.
        rope: the midlayer's RoPE.
        aux_layer_ids: the three base layers whose inputs are the draft's features.
    """

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Eagle3DraftConfig:
        """Read an EAGLE-3 draft ``config.json`` dict (``eagle_config.eagle_aux_hidden_state_layer_ids``
        names the taps; ``target_hidden_size`` defaults to ``hidden_size``).

        Raises:
            UnsupportedModelError: a size that is not a positive integer, more than one layer,
                ``draft_vocab_size > vocab_size``, heads that do not divide, no three taps.
        """
        hidden = _positive_int(d, "hidden_size")
        heads = _positive_int(d, "num_attention_heads")
        kv = _positive_int(d, "num_key_value_heads", heads)
        head_dim = _positive_int(d, "head_dim", hidden // heads if hidden % heads == 0 else None)
        if heads % kv:
            raise UnsupportedModelError(f"EAGLE-3 draft: num_attention_heads {heads} is not a multiple of "
                                        f"num_key_value_heads {kv}")
        layers = d.get("num_hidden_layers", 1)
        if layers != 1:
            raise UnsupportedModelError(f"EAGLE-3 draft num_hidden_layers={layers!r}: a draft has exactly one block")
        vocab = _positive_int(d, "vocab_size")
        draft_vocab = _positive_int(d, "draft_vocab_size", vocab)
        if draft_vocab > vocab:
            raise UnsupportedModelError(f"EAGLE-3 draft draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
        eagle = d.get("eagle_config") or {}
        taps = eagle.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(taps, (list, tuple)) or len(taps) != 3 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in taps):
            raise UnsupportedModelError(f"EAGLE-3 draft eagle_config.eagle_aux_hidden_state_layer_ids={taps!r} must "
                                        "be three non-negative layer indices")
        max_pos = _positive_int(d, "max_position_embeddings", 2048)
        return cls(
            hidden_size=hidden,
            target_hidden_size=_positive_int(d, "target_hidden_size", hidden),
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_config(d, head_dim, max_pos),
            aux_layer_ids=(int(taps[0]), int(taps[1]), int(taps[2])),
        )


def draft_tensor_shapes(c: Eagle3DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a draft checkpoint and its shape, in checkpoint order."""
    hd, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "fc.weight": (hd, 3 * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (hd,),
        "midlayer.hidden_norm.weight": (hd,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * hd),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * hd),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * hd),
        "midlayer.self_attn.o_proj.weight": (hd, q),
        "midlayer.post_attention_layernorm.weight": (hd,),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, hd),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, hd),
        "midlayer.mlp.down_proj.weight": (hd, c.intermediate_size),
        "norm.weight": (hd,),
        "lm_head.weight": (c.draft_vocab_size, hd),
        "embed_tokens.weight": (c.vocab_size, hd),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


class Eagle3Draft:
    """An EAGLE-3 draft evaluated with numpy, in the golden decoder's arithmetic (float64
    accumulation, every step rounded to ``dtype``).

    Attributes:
        config: the :class:`Eagle3DraftConfig`.
        dtype: float16, float32 or float64.
        d2t: int64 ``[draft_vocab_size]`` offsets (draft index ``i`` is target id ``i + d2t[i]``).
    """

    def __init__(self, config: Eagle3DraftConfig, weights: Mapping[str, np.ndarray], dtype: np.dtype | type = np.float32,
                 *, source: str = "weights") -> None:
        """Check ``weights`` against ``config`` and keep them.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (both shapes named), or
                ``d2t`` maps a draft index outside the target vocabulary.
            ValueError: unsupported ``dtype``.
        """
        dt = decoder_dtype(dtype)
        self.config, self.dtype = config, dt
        w: dict[str, np.ndarray] = {}
        for name, shape in draft_tensor_shapes(config).items():
            if name not in weights:
                raise CheckpointError(f"{source}: EAGLE-3 draft tensor {name!r} is missing")
            a = np.asarray(weights[name])
            if a.shape != shape:
                raise CheckpointError(f"{source}: EAGLE-3 draft tensor {name!r} has shape {list(a.shape)}, "
                                      f"expected {list(shape)}")
            w[name] = a if name in ("d2t", "t2d") else a.astype(dt).astype(_ACC)
        self.d2t = w["d2t"].astype(np.int64)
        targets = np.arange(config.draft_vocab_size) + self.d2t
        if targets.min(initial=0) < 0 or targets.max(initial=0) >= config.vocab_size:
            raise CheckpointError(f"{source}: d2t maps a draft index outside the target vocabulary [0, {config.vocab_size})")
        self._w = w
        self._embed = np.asarray(weights["embed_tokens.weight"]).astype(dt)

    @classmethod
    def from_pretrained(cls, draft_dir: str | os.PathLike, dtype: np.dtype | type = np.float32) -> Eagle3Draft:
        """Load a draft checkpoint directory (``config.json`` + safetensors).

        Raises:
            CheckpointError: missing or malformed files, a missing or misshapen tensor.
            UnsupportedModelError: a config :meth:`Eagle3DraftConfig.from_dict` refuses.
        """
        d = Path(draft_dir)
        try:
            cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{d}/config.json: {exc}") from exc
        return cls(Eagle3DraftConfig.from_dict(cfg), load_safetensors(d), dtype=dtype, source=str(d))

    def new_cache(self, capacity: int) -> KVCache:
        """An empty one-layer :class:`KVCache` of ``capacity`` tokens for the midlayer."""
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, capacity, dtype=self.dtype)

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The draft's embedding rows ``[T, hidden_size]`` of target token ids.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(ids[np.argmax(bad)])} is out of range [0, {self.config.vocab_size})")
        return self._embed[ids]

    def to_target(self, draft_ids: np.ndarray) -> np.ndarray:
        """Target token ids of draft indices (``i + d2t[i]``)."""
        idx = np.asarray(draft_ids, dtype=np.int64)
        return idx + self.d2t[idx]

    def fc(self, features: np.ndarray) -> np.ndarray:
        """Project the base's concatenated taps ``[T, 3 * target_hidden_size]`` to ``[T, hidden_size]``.

        Raises:
            ValueError: ``features`` is not ``[T, 3 * target_hidden_size]``.
        """
        x = np.asarray(features)
        want = 3 * self.config.target_hidden_size
        if x.ndim != 2 or x.shape[1] != want:
            raise ValueError(f"fc expects features of shape [T, {want}], got {list(x.shape)}")
        return self._lin(x, "fc.weight")

    def forward(self, embeds: np.ndarray, hidden: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray,
                mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One midlayer pass over ``T`` rows, their keys/values written at ``[cache.length,
        cache.length + T)`` (the cache advances by ``T``).

        Args:
            embeds: ``[T, hidden_size]`` draft embeddings (:meth:`embed`).
            hidden: ``[T, hidden_size]``: :meth:`fc` of the base's taps, or an earlier ``out``.
            cos, sin: ``[T, head_dim]`` RoPE tables of each row's position.
            mask: ``[T, cache.length + T]`` booleans, true where row ``t`` must not see key ``j``.

        Returns:
            ``(out [T, hidden_size], logits [T, draft_vocab_size])``, both float32.

        Raises:
            ValueError: a shape other than the ones above, a row that sees no key.
            KVCacheOverflowError: the rows do not fit (nothing is written).
        """
        c, dt, w = self.config, self.dtype, self._w
        e, g = np.asarray(embeds), np.asarray(hidden)
        t = e.shape[0] if e.ndim == 2 else -1
        for name, a, shape in (("embeds", e, (t, c.hidden_size)), ("hidden", g, (t, c.hidden_size)),
                               ("cos", cos, (t, c.head_dim)), ("sin", sin, (t, c.head_dim))):
            if t < 1 or np.shape(a) != shape:
                raise ValueError(f"{name} must have shape [T, {shape[1]}] with T >= 1 rows like embeds, "
                                 f"got {list(np.shape(a))}")
        m = np.asarray(mask, dtype=bool)
        if m.shape != (t, cache.length + t):
            raise ValueError(f"the attention mask must have shape [T, cache length + T] = {[t, cache.length + t]}, "
                             f"got {list(m.shape)}")
        if m.all(axis=1).any():
            raise ValueError(f"the attention mask hides every key from row {int(np.flatnonzero(m.all(axis=1))[0])}")
        cache.check_append(t)
        eps = c.rms_norm_eps
        e, g = e.astype(dt), g.astype(dt)
        x = np.concatenate([_rms_norm(e, w["midlayer.input_layernorm.weight"], eps, dt),
                            _rms_norm(g, w["midlayer.hidden_norm.weight"], eps, dt)], axis=-1)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cs, sn = np.asarray(cos).astype(dt).astype(_ACC), np.asarray(sin).astype(dt).astype(_ACC)
        q = apply_rope(self._lin(x, "midlayer.self_attn.q_proj.weight").reshape(t, nh, hd).astype(_ACC), cs, sn).astype(dt)
        k = apply_rope(self._lin(x, "midlayer.self_attn.k_proj.weight").reshape(t, nkv, hd).astype(_ACC), cs, sn).astype(dt)
        v = self._lin(x, "midlayer.self_attn.v_proj.weight").reshape(t, nkv, hd)
        attn = cached_attention(cache, 0, q, k, v, m, hd ** -0.5, dt).reshape(t, nh * hd)
        h = (g.astype(_ACC) + self._lin(attn, "midlayer.self_attn.o_proj.weight")).astype(dt)
        y = _rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps, dt)
        gate, up = self._lin(y, "midlayer.mlp.gate_proj.weight"), self._lin(y, "midlayer.mlp.up_proj.weight")
        act = (gate.astype(_ACC) / (1.0 + np.exp(-gate.astype(_ACC)))).astype(dt)
        out = (h.astype(_ACC) + self._lin((act.astype(_ACC) * up).astype(dt), "midlayer.mlp.down_proj.weight")).astype(dt)
        cache.advance(t)
        logits = self._lin(_rms_norm(out, w["norm.weight"], eps, dt), "lm_head.weight")
        return out.astype(np.float32), logits.astype(np.float32)

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return (np.asarray(x).astype(_ACC) @ self._w[name].T).astype(self.dtype)
