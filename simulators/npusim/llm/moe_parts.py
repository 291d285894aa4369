"""The three pieces a Mobilint Mixture-of-Experts release splits a Qwen3-MoE decoder into.

A release (``docs/mblt-moe-release.md``) runs each piece as its own MXQ, with the routing and the
weighted expert sum on the host::

    shared (one per layer L):   residual = h + o_proj(attention(input_layernorm(h)))   (KV of layer L)
                                expert_in = post_attention_layernorm(residual)
                                gate = router(expert_in)                                (logits, not softmaxed)
    expert (one per L, e):      expert_e(expert_in)                                     (SwiGLU, unweighted)
    lm_head (one):              lm_head(norm(h))                                        (the final RMSNorm inside)

and the host computes ``h_next = residual + sum_k w_k * expert_{e_k}(expert_in)``. Every piece
evaluates exactly as :class:`~npusim.llm.Decoder` does (same code: :class:`DecoderPart`
subclasses it), so ``lm_head(shared/expert chain)`` with the golden routing and an expert sum in
ascending expert id is the golden decoder's computation.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .config import ModelConfig
from .decoder import _ACC, Decoder, _rms_norm, checked_weights, decoder_dtype, expected_tensor_shapes
from .errors import UnsupportedModelError
from .kvcache import KVCache

__all__ = ["PART_KINDS", "DecoderPart", "part_tensor_names"]

#: The pieces, by the name the simulator's MXQ header gives them.
PART_KINDS: tuple[str, ...] = ("moe_shared", "moe_expert", "lm_head")


def _check_part(config: ModelConfig, kind: str, layer: int | None, expert: int | None) -> None:
    if kind not in PART_KINDS:
        raise ValueError(f"part kind {kind!r} must be one of {', '.join(PART_KINDS)}")
    if not config.is_moe:
        raise UnsupportedModelError(f"{config.model_type} is not a Mixture-of-Experts model: it has no {kind} part")
    if config.norm_layout != "pre":
        raise UnsupportedModelError(f"MoE parts need the 'pre' norm layout, got {config.norm_layout!r}")
    n_layers, n_experts = config.num_hidden_layers, config.num_experts
    if kind == "lm_head":
        if layer is not None or expert is not None:
            raise ValueError(f"the lm_head part takes no layer or expert (got layer={layer!r}, expert={expert!r})")
        return
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer!r} is out of range [0, {n_layers})")
    if not config.is_sparse(int(layer)):
        raise ValueError(f"layer {layer} is not a sparse layer, so it has no {kind} part")
    if kind == "moe_shared" and expert is not None:
        raise ValueError(f"the moe_shared part takes no expert (got {expert!r})")
    if kind == "moe_expert" and (isinstance(expert, bool) or not isinstance(expert, (int, np.integer))
                                 or not 0 <= expert < n_experts):
        raise ValueError(f"expert {expert!r} is out of range [0, {n_experts})")


def part_tensor_names(config: ModelConfig, kind: str, layer: int | None = None, expert: int | None = None) -> list[str]:
    """HF names of the tensors the piece needs, in checkpoint order.

    Raises:
        ValueError: an unknown ``kind``, or a ``layer``/``expert`` outside its range or not sparse.
        UnsupportedModelError: ``config`` is not a Mixture-of-Experts model with pre-norms.
    """
    _check_part(config, kind, layer, expert)
    names = list(expected_tensor_shapes(config))
    if kind == "lm_head":
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        return ["model.norm.weight", head]
    if kind == "moe_expert":
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        return [n for n in names if n.startswith(prefix)]
    prefix = f"model.layers.{layer}."
    return [n for n in names if n.startswith(prefix) and ".mlp.experts." not in n]


class DecoderPart(Decoder):
    """One piece (:data:`PART_KINDS`) of a Mixture-of-Experts decoder, evaluated as the golden decoder does.

    ``DecoderPart(config, weights, kind, layer=None, expert=None, dtype=np.float32, source=...)``;
    ``weights`` needs only :func:`part_tensor_names` (others are ignored). Methods by kind:
    :meth:`shared` (``moe_shared``), :meth:`expert_mlp` (``moe_expert``), :meth:`head` (``lm_head``).

    Raises:
        ValueError: as :func:`part_tensor_names`; an unsupported ``dtype``.
        UnsupportedModelError: as :func:`part_tensor_names`.
        CheckpointError: a needed tensor is missing or misshapen.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], kind: str, *, layer: int | None = None,
                 expert: int | None = None, dtype: np.dtype | type = np.float32, source: str = "weights") -> None:
        names = part_tensor_names(config, kind, layer, expert)
        dt = decoder_dtype(dtype)
        shapes = expected_tensor_shapes(config)
        w = checked_weights({n: shapes[n] for n in names}, weights, dt, source)
        self.config, self.dtype, self.linear, self._q4 = config, dt, "float", None
        self.kind = kind
        self.layer = None if layer is None else int(layer)
        self.expert_id = None if expert is None else int(expert)
        self._layers = {}  # type: ignore[assignment]  # only this part's layer, by its index
        if kind == "moe_shared":
            self._layers[self.layer] = self._load_layer(self.layer, w, experts=False)  # type: ignore[index]
        elif kind == "moe_expert":
            p = f"model.layers.{layer}.mlp.experts.{expert}."
            self._expert_w = (w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        else:
            self._final_norm = w["model.norm.weight"]
            self._lm_head = w[names[1]]

    def new_cache(self, capacity: int) -> KVCache:
        """A KV cache of this shared part's one layer, ``capacity`` tokens (as :meth:`Decoder.new_cache`)."""
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, capacity, dtype=self.dtype)

    def _want(self, kind: str) -> None:
        if self.kind != kind:
            raise ValueError(f"this is a {self.kind} part, not a {kind} part")

    def _rows(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        h = self.config.hidden_size
        if x.ndim != 2 or x.shape[1] != h or x.shape[0] < 1:
            raise ValueError(f"expected hidden states of shape [T, {h}] with T >= 1, got shape {x.shape}")
        return x.astype(self.dtype, copy=False)

    def shared(self, h: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shared piece on hidden states ``h`` ``[T, hidden]``, appended to ``cache`` (from
        :meth:`new_cache`) at its length, which is also the first token's RoPE position.

        Returns:
            ``(residual, expert_in, gate)``: ``[T, hidden]``, ``[T, hidden]``, ``[T, num_experts]``.

        Raises:
            ValueError: not a shared part, or a bad shape.
            KVCacheOverflowError: the tokens do not fit (nothing is written).
        """
        self._want("moe_shared")
        x = self._rows(h)
        n, start = x.shape[0], cache.length
        cache.check_append(n)
        li, L = self.layer, self._layers[self.layer]  # type: ignore[index]
        eps = self.config.rms_norm_eps
        cos, sin = self._rope_tables([start], [n])
        a = self._attention(li, L, _rms_norm(x, L["ln1"], eps, self.dtype), cos, sin, [(0, cache, start, n)], kv_layer=0)
        residual = self._residual_add(x, a, L["pn1"])
        expert_in = _rms_norm(residual, L["ln2"], eps, self.dtype)
        gate = self._linear(expert_in, L["router"], None)
        cache.advance(n)
        return residual, expert_in, gate

    def expert_mlp(self, x: np.ndarray) -> np.ndarray:
        """This expert on ``x`` ``[T, hidden]``, unweighted. Raises: ValueError: not an expert part, or a bad shape."""
        self._want("moe_expert")
        return self._swiglu(self._rows(x), *self._expert_w)

    def head(self, h: np.ndarray) -> np.ndarray:
        """Logits ``[T, vocab]`` float32 of the final hidden states ``h`` ``[T, hidden]`` (final RMSNorm inside).

        Raises: ValueError: not an lm_head part, or a bad shape.
        """
        self._want("lm_head")
        x = _rms_norm(self._rows(h), self._final_norm, self.config.rms_norm_eps, self.dtype)
        logits = (x.astype(_ACC) @ self._lm_head.T).astype(self.dtype)
        return self._scale(logits, self.config.logits_scaling).astype(np.float32)
