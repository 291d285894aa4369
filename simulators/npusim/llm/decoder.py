"""The golden numpy decoder for Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X / Qwen3-MoE checkpoints.

Computation per layer, as in transformers' eager implementation (``m`` the residual
multiplier, 1 except for hyperclovax; see ``ModelConfig.norm_layout``)::

    a = attention(rope?(q_norm?(q_proj(x))), rope?(k_norm?(k_proj(x))), v_proj(x))   with x = n1(h) or h
    h = h + m * p1?(o_proj(a))
    h = h + m * p2?(down_proj(silu(gate_proj(y)) * up_proj(y)))                       with y = n2(h) or h

* llama / qwen2 / qwen3 (``"pre"``): ``x = input_layernorm(h)``, ``y = post_attention_layernorm(h)``,
  no output norms.
* exaone4 (``"post"``): no input norms (``x = y = h``); ``p1 = post_attention_layernorm``,
  ``p2 = post_feedforward_layernorm``; q/k RMSNorm in every layer; RoPE only in the
  ``sliding_attention`` layers when a ``sliding_window`` is set (global layers are NoPE),
  in every layer when it is null.
* hyperclovax (``"peri"``): as llama plus ``p1 = post_norm1``, ``p2 = post_norm2``; the input
  embeddings are multiplied by ``embedding_multiplier``, attention scores by
  ``attention_multiplier`` (instead of ``head_dim ** -0.5``) and the logits by ``logits_scaling``.

* qwen3_moe: as qwen3, except that a sparse layer (``ModelConfig.is_sparse``) replaces the MLP by
  a Mixture-of-Experts block, as transformers' ``Qwen3MoeSparseMoeBlock``::

      p = softmax(gate(y))                                  router, per token, over num_experts
      e_1 .. e_k = the top-k experts by p (lowest expert id first on a tie), w_i = p[e_i]
      w_i = w_i / sum(w)                                    only with norm_topk_prob
      out = sum over e_i in ascending expert id of  w_i * expert_{e_i}(y)

  each expert a SwiGLU MLP of width ``moe_intermediate_size``; the sum is accumulated in the
  decoder dtype, in ascending expert id (transformers' ``index_add_`` order), so a token's result
  does not depend on the other tokens of its batch. (The Mobilint device adds the experts in the
  order they finish; that is the simulator's business, not this reference's.)

then a final RMSNorm and the LM head. Attention is grouped-query and causal over the
sequence's KV cache: query ``t`` of a chunk appended at cache length ``L`` sees keys
``0 .. L + t``; in a sliding-window layer only keys ``L + t - W + 1 .. L + t`` (``W`` the
``sliding_window``). The cache always keeps every token; the window is a mask, so chunked
prefill and decode steps past the window are exact.

Numerics: parameters, activations between operations and the KV cache are rounded to the
decoder's ``dtype`` (float32 by default), but every operation (matrix products, RMSNorm,
RoPE, softmax, SiLU) is evaluated in float64. This keeps results independent of how tokens
are chunked or batched (BLAS picks different float32 kernels for different row counts, which
alone moves float32 logits by ~1e-5) while staying within ~1e-5 of transformers' float32
forward. The float64 copies of the weights double the memory of a float32 model (fine for
the tiny models this reference is meant for). Logits are returned as float32.

Linear layers: ``linear="float"`` (default) as above; ``linear="q4x32"`` evaluates every attention
and MLP projection with the IME2 Q4_0x32 GEMM of :mod:`npusim.q4x32` (hardware level), q/k/v and
gate/up fused as vLLM fuses them; see :mod:`npusim.llm.qlinear`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .config import ModelConfig, load_config
from .errors import CheckpointError, KVCacheOverflowError, UnsupportedModelError
from .kvcache import KVCache
from .qlinear import FusedQ4Linear, UnsupportedLinearError, check_linear_kind
from .rope import apply_rope
from .safetensors import load_safetensors

__all__ = ["Decoder", "checked_weights", "decoder_dtype", "expected_tensor_shapes"]

_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

#: HF names of a layer's RMSNorms per ``ModelConfig.norm_layout``, in checkpoint order.
_LAYER_NORMS: dict[str, tuple[str, ...]] = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "peri": ("input_layernorm", "post_attention_layernorm", "post_norm1", "post_norm2"),
}
#: Per layout, the HF norm used at each of the four sites: before attention (``ln1``), after it
#: (``pn1``), before the MLP (``ln2``), after it (``pn2``); ``None``: no norm there.
_NORM_SITES: dict[str, dict[str, str | None]] = {
    "pre": {"ln1": "input_layernorm", "pn1": None, "ln2": "post_attention_layernorm", "pn2": None},
    "post": {"ln1": None, "pn1": "post_attention_layernorm", "ln2": None, "pn2": "post_feedforward_layernorm"},
    "peri": {"ln1": "input_layernorm", "pn1": "post_norm1", "ln2": "post_attention_layernorm", "pn2": "post_norm2"},
}


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every weight the decoder needs for ``config``.

    ``lm_head.weight`` is listed only when embeddings are untied.
    """
    c = config
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in _LAYER_NORMS[c.norm_layout]:
            shapes[p + norm + ".weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        if c.is_sparse(i):
            e_inter = c.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (c.num_experts, h)
            for e in range(c.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (e_inter, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (e_inter, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, e_inter)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if c.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (inter,)
            shapes[p + "mlp.up_proj.bias"] = (inter,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


_ACC = np.float64  # evaluation precision of every operation


def decoder_dtype(dtype: np.dtype | type) -> np.dtype:
    """``dtype`` as a numpy dtype the decoder evaluates in.

    Raises:
        ValueError: not float16, float32 or float64.
    """
    dt = np.dtype(dtype)
    if dt not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported decoder dtype {dt} (supported: float16, float32, float64)")
    return dt


def checked_weights(shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, np.ndarray], dtype: np.dtype,
                    source: str) -> dict[str, np.ndarray]:
    """The tensors ``shapes`` names, each checked and rounded to ``dtype``, held as float64.

    Raises:
        CheckpointError: a tensor is missing, has another shape (both named) or is not numeric.
    """
    w: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        arr = np.asarray(weights[name])
        if arr.shape != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {arr.shape} but the config implies {shape}")
        if arr.dtype.kind not in "fiu":
            raise CheckpointError(f"{source}: tensor {name!r} has non-numeric dtype {arr.dtype}")
        w[name] = np.ascontiguousarray(arr, dtype=dtype).astype(_ACC)
    return w


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, dtype: np.dtype) -> np.ndarray:
    """RMSNorm over the last axis (float64), normalised value rounded to ``dtype``, scaled by ``weight``, rounded."""
    xc = x.astype(_ACC)
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    normed = (xc / np.sqrt(var + eps)).astype(dtype).astype(_ACC)
    return (weight * normed).astype(dtype)


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


class Decoder:
    """A decoder-only transformer (Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X / Qwen3-MoE) evaluated with numpy.

    Attributes:
        config: the :class:`ModelConfig`.
        dtype: dtype of weights, activations and KV caches (float16, float32 or float64).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], dtype: np.dtype | type = np.float32, *, source: str = "weights", linear: str = "float") -> None:
        """Check ``weights`` against ``config`` and keep them (rounded to ``dtype``, held as float64 for evaluation).

        Args:
            config: the architecture.
            weights: HF tensor name -> array (extra tensors are ignored).
            dtype: float16, float32 (default) or float64.
            source: where the weights came from, for error messages.
            linear: ``"float"`` (default) or ``"q4x32"`` (:mod:`npusim.llm.qlinear`): the
                projections quantized once to Q4_0 and run through the IME2 GEMM model.

        Raises:
            CheckpointError: a tensor is missing or its shape differs from the one ``config``
                implies (both shapes are named).
            UnsupportedLinearError: unknown ``linear``; (``q4x32``) a projection whose K is
                not a multiple of 32, or a Mixture-of-Experts model (the experts' GEMMs are not
                quantized by this path).
            ValueError: unsupported ``dtype``.
        """
        self.linear = check_linear_kind(linear)
        if self.linear == "q4x32" and config.is_moe:
            raise UnsupportedLinearError(
                f"linear='q4x32' does not cover Mixture-of-Experts layers ({config.model_type}: "
                f"{config.num_experts} experts); use linear='float'"
            )
        dt = decoder_dtype(dtype)
        self.config = config
        self.dtype = dt
        w = checked_weights(expected_tensor_shapes(config), weights, dt, source)
        self._embed = np.ascontiguousarray(weights["model.embed_tokens.weight"], dtype=dt)
        self._lm_head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self._final_norm = w["model.norm.weight"]
        self._layers: list[dict[str, np.ndarray | None]] = [self._load_layer(i, w) for i in range(config.num_hidden_layers)]
        # linear="q4x32": per layer, the fused GEMMs quantized once (vLLM's fusion and order)
        self._q4: list[dict[str, FusedQ4Linear]] | None = None
        if self.linear == "q4x32":
            self._q4 = []
            for i, L in enumerate(self._layers):
                src = f"{source} layer {i}"
                self._q4.append(
                    {
                        "qkv": FusedQ4Linear([L["wq"], L["wk"], L["wv"]], ["q_proj", "k_proj", "v_proj"], source=src),
                        "o": FusedQ4Linear([L["wo"]], ["o_proj"], source=src),
                        "gate_up": FusedQ4Linear([L["wg"], L["wu"]], ["gate_proj", "up_proj"], source=src),
                        "down": FusedQ4Linear([L["wd"]], ["down_proj"], source=src),
                    }
                )

    def fingerprint(self) -> str:
        """A SHA-256 of the configuration, the linear kind, the dtype and every parameter:
        two decoders with one fingerprint compute the same logits (computed once)."""
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256(f"{self.config!r}|{self.linear}|{np.dtype(self.dtype).name}".encode())
            arrays = [self._embed, self._lm_head, self._final_norm]
            for layer in self._layers:
                arrays += [layer[k] for k in sorted(layer) if isinstance(layer[k], np.ndarray)]
            for a in arrays:
                h.update(np.ascontiguousarray(a).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _load_layer(self, i: int, w: Mapping[str, np.ndarray], *, experts: bool = True) -> dict[str, np.ndarray | None]:
        """Layer ``i``'s weights from ``w`` (float64 copies) under the names the evaluation uses;
        ``experts=False`` leaves a sparse layer's experts out (its router stays)."""
        c = self.config
        p = f"model.layers.{i}."
        norms = {site: (None if name is None else w[p + name + ".weight"]) for site, name in _NORM_SITES[c.norm_layout].items()}
        if c.is_sparse(i):
            mlp: dict[str, np.ndarray | None] = {"router": w[p + "mlp.gate.weight"]}
            if experts:
                names = [f"{p}mlp.experts.{e}." for e in range(c.num_experts)]
                mlp.update(ewg=np.stack([w[x + "gate_proj.weight"] for x in names]),
                           ewu=np.stack([w[x + "up_proj.weight"] for x in names]),
                           ewd=np.stack([w[x + "down_proj.weight"] for x in names]))
        else:
            mlp = _projections(w, p, {"g": "mlp.gate_proj", "u": "mlp.up_proj", "d": "mlp.down_proj"})
        return {
            **norms,
            **_projections(w, p, {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                                  "o": "self_attn.o_proj"}),
            "qn": w.get(p + "self_attn.q_norm.weight"),
            "kn": w.get(p + "self_attn.k_norm.weight"),
            **mlp,
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, dtype: np.dtype | type = np.float32, *, linear: str = "float") -> Decoder:
        """Load ``config.json`` and the safetensors weights (single file or sharded) of an HF model directory.

        ``linear`` as in :class:`Decoder` (``"float"`` or ``"q4x32"``).

        Raises:
            CheckpointError: missing/malformed config or weights, missing tensor, shape mismatch.
            UnsupportedModelError: the config asks for an unsupported feature.
            UnsupportedLinearError: unknown ``linear`` (checked before reading the checkpoint).
        """
        check_linear_kind(linear)
        d = Path(model_dir)
        config = load_config(d)
        weights = load_safetensors(d)
        return cls(config, weights, dtype=dtype, source=str(d), linear=linear)

    # ------------------------------------------------------------------ public API

    def new_cache(self, capacity: int) -> KVCache:
        """An empty :class:`KVCache` for this model holding up to ``capacity`` tokens.

        Raises:
            ValueError: ``capacity`` is negative or not an integer.
        """
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, dtype=self.dtype)

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Embedding rows of ``token_ids``: ``[T, hidden_size]`` in the decoder's dtype.

        ``T`` may be 0 here (an empty ``[0, hidden_size]`` array).

        Raises:
            ValueError: ids are not a 1-D sequence of integers, or an id is outside
                ``[0, vocab_size)`` (the message names the id and the vocabulary size).
        """
        ids = self._check_ids(token_ids, allow_empty=True)
        return self._embed[ids]

    def prefill(self, token_ids: Sequence[int] | np.ndarray, cache: KVCache) -> np.ndarray:
        """Append ``T >= 1`` tokens to ``cache`` and return their logits ``[T, vocab_size]`` (float32).

        Works for any chunk size; feeding a prompt in several chunks gives the same logits
        as one call (up to float rounding), and a single token is a decode step.

        Raises:
            ValueError: empty chunk, or an id outside ``[0, vocab_size)``; a cache of the
                wrong geometry.
            KVCacheOverflowError: the tokens do not fit (nothing is written).
        """
        return self.step_batch([(token_ids, cache)])[0]

    def forward_embeddings(self, embeds: np.ndarray, cache: KVCache) -> np.ndarray:
        """Like :meth:`prefill`, from input embeddings ``[T, hidden_size]`` (``T >= 1``).

        As transformers' ``inputs_embeds``, they are multiplied by the config's
        ``embedding_multiplier`` (hyperclovax), so ``forward_embeddings(embed(ids))`` equals
        ``prefill(ids)``.

        Raises:
            ValueError: ``embeds`` is not ``[T, hidden_size]`` with ``T >= 1`` (shapes named).
            KVCacheOverflowError: the tokens do not fit (nothing is written).
        """
        x = np.asarray(embeds)
        h = self.config.hidden_size
        if x.ndim != 2 or x.shape[1] != h or x.shape[0] < 1:
            raise ValueError(f"expected embeddings of shape [T, {h}] with T >= 1, got shape {x.shape}")
        if x.dtype.kind not in "fiu":
            raise ValueError(f"embeddings must be numeric, got dtype {x.dtype}")
        return self._forward([x.astype(self.dtype, copy=False)], [cache])[0]

    def step_batch_embeddings(self, batch: Sequence[tuple[np.ndarray, KVCache]]) -> list[np.ndarray]:
        """:meth:`step_batch` from input embeddings ``[T_i, hidden_size]`` per sequence (as
        :meth:`forward_embeddings`: ``step_batch_embeddings([(embed(ids), c)])`` equals
        ``step_batch([(ids, c)])``).

        Raises:
            ValueError: embeddings that are not ``[T, hidden_size]`` with ``T >= 1``.
            KVCacheOverflowError: a sequence's tokens do not fit in its cache.
        """
        h = self.config.hidden_size
        xs, caches = [], []
        for i, (embeds, cache) in enumerate(batch):
            x = np.asarray(embeds)
            if x.ndim != 2 or x.shape[1] != h or x.shape[0] < 1 or x.dtype.kind not in "fiu":
                raise ValueError(f"batch item {i}: expected numeric embeddings of shape [T, {h}] with T >= 1, "
                                 f"got shape {x.shape} ({x.dtype})")
            xs.append(x.astype(self.dtype, copy=False))
            caches.append(cache)
        return self._forward(xs, caches)

    def step_batch(self, batch: Sequence[tuple[Sequence[int] | np.ndarray, KVCache]]) -> list[np.ndarray]:
        """Run several sequences in one flattened batch; returns ``[T_i, vocab_size]`` float32 per sequence.

        All sequences' tokens are concatenated into one ``[sum T_i, hidden_size]`` activation
        for embedding, norms, projections and MLP (as vLLM flattens a batch); attention runs
        per sequence against its own cache. Results equal per-sequence :meth:`prefill`.

        Every input and every cache's free space is checked before anything is written, so a
        failed call leaves all caches unchanged.

        Raises:
            ValueError: an empty chunk, a bad token id, the same cache twice, or a cache of
                the wrong geometry.
            KVCacheOverflowError: a sequence's tokens do not fit in its cache.
        """
        xs, caches = [], []
        for i, item in enumerate(batch):
            try:
                token_ids, cache = item
            except (TypeError, ValueError) as exc:
                raise ValueError(f"batch item {i} must be a (token_ids, cache) pair") from exc
            ids = self._check_ids(token_ids, allow_empty=False)
            xs.append(self._embed[ids])
            caches.append(cache)
        return self._forward(xs, caches)

    def generate_greedy(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        capacity: int | None = None,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> list[int]:
        """Greedy (argmax, lowest id on ties) decoding after a prompt.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: how many tokens to generate at most (>= 0).
            capacity: KV cache capacity in tokens; default ``len(prompt) + max_new_tokens``.
            eos_token_id: stop after generating this id (or any of these ids); the eos token
                is included in the result. ``None``: never stop early.

        Returns:
            The new token ids (without the prompt).

        Raises:
            ValueError: empty prompt, bad id, negative ``max_new_tokens``.
            KVCacheOverflowError: ``capacity`` is smaller than the
                ``len(prompt) + max_new_tokens - 1`` tokens that must be cached (raised
                before any compute).
        """
        ids = self._check_ids(prompt_ids, allow_empty=False)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if max_new_tokens == 0:
            return []
        needed = len(ids) + int(max_new_tokens) - 1
        if capacity is None:
            capacity = len(ids) + int(max_new_tokens)
        if capacity < needed:
            raise KVCacheOverflowError(capacity, 0, needed)
        stop = set() if eos_token_id is None else ({int(eos_token_id)} if isinstance(eos_token_id, (int, np.integer)) else {int(e) for e in eos_token_id})
        cache = self.new_cache(capacity)
        return self.continue_greedy(self.prefill(ids, cache), cache, max_new_tokens, stop)

    def continue_greedy(self, logits: np.ndarray, cache: KVCache, max_new_tokens: int,
                        stop: set[int] | frozenset[int]) -> list[int]:
        """Greedy tokens after a prompt already in ``cache`` whose last row of ``logits`` scores
        the first one: up to ``max_new_tokens`` (>= 1), the first id in ``stop`` included."""
        out: list[int] = []
        while True:
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            if tok in stop or len(out) >= max_new_tokens:
                return out
            logits = self.prefill([tok], cache)

    # ------------------------------------------------------------------ internals

    def _check_ids(self, token_ids: Sequence[int] | np.ndarray, allow_empty: bool) -> np.ndarray:
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
        if arr.size == 0:
            if allow_empty:
                return arr.astype(np.int64)
            raise ValueError("empty chunk: at least one token is required")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        vocab = self.config.vocab_size
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            first = int(arr[np.argmax(bad)])
            raise ValueError(f"token id {first} is out of range [0, {vocab}) (vocab_size {vocab})")
        return arr.astype(np.int64)

    def _check_cache(self, cache: KVCache) -> None:
        c = self.config
        if not isinstance(cache, KVCache):
            raise ValueError(f"expected a KVCache, got {type(cache).__name__}")
        want = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
        if got != want:
            raise ValueError(
                f"KV cache geometry (layers, kv_heads, head_dim)={got} does not match the model's {want}"
            )

    def _linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        """``x @ w.T + b`` evaluated in float64, rounded to the decoder dtype."""
        y = x.astype(_ACC) @ w.T
        if b is not None:
            y += b
        return y.astype(self.dtype)

    def forward_tree(self, embeds: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray,
                     hidden: np.ndarray, taps: Sequence[int] = ()) -> tuple[np.ndarray, list[np.ndarray]]:
        """Like :meth:`forward_embeddings`, with each row's RoPE and visibility given explicitly
        (speculative decoding: a draft tree's nodes share positions and see only their ancestors).

        The ``T`` rows' keys and values are written at ``[cache.length, cache.length + T)``
        and the cache advances by ``T``, as for any forward.

        Args:
            embeds: ``[T, hidden_size]`` input embeddings, ``T >= 1``.
            cache: the KV cache (its ``length`` is where the rows are written).
            cos, sin: ``[T, head_dim]`` RoPE tables of each row's position (rounded to the
                decoder dtype, as transformers does with its own tables).
            hidden: ``[T, cache.length + T]`` booleans, true where row ``t`` must not see key ``j``.
            taps: layer indices in ``[0, num_hidden_layers]``: the residual stream entering that
                layer (``num_hidden_layers``: the last layer's output, before the final norm),
                EAGLE-3's auxiliary hidden states.

        Returns:
            ``(logits [T, vocab_size] float32, [tap [T, hidden_size] float32 per entry of taps])``.

        Raises:
            ValueError: a shape that differs from the ones above (both named), a tap outside
                its range.
            UnsupportedModelError: the model has sliding-window layers (their window would be
                ignored by an explicit mask).
            KVCacheOverflowError: the rows do not fit (nothing is written).
        """
        c = self.config
        x = np.asarray(embeds)
        if x.ndim != 2 or x.shape[1] != c.hidden_size or x.shape[0] < 1:
            raise ValueError(f"expected embeddings of shape [T, {c.hidden_size}] with T >= 1, got shape {x.shape}")
        t = x.shape[0]
        self._check_cache(cache)
        for name, table in (("cos", cos), ("sin", sin)):
            if np.shape(table) != (t, c.head_dim):
                raise ValueError(f"{name} must have shape [{t}, {c.head_dim}], got {np.shape(table)}")
        want = (t, cache.length + t)
        if np.shape(hidden) != want:
            raise ValueError(f"the attention mask must have shape [T, cache length + T] = {list(want)}, "
                             f"got {list(np.shape(hidden))}")
        blind = np.flatnonzero(np.asarray(hidden, dtype=bool).all(axis=1))
        if blind.size:
            raise ValueError(f"the attention mask hides every key from row {int(blind[0])}: each row must see at least one")
        if any(c.is_sliding(i) for i in range(c.num_hidden_layers)):
            raise UnsupportedModelError(f"{c.model_type} has sliding-window layers: an explicit attention mask "
                                        "would ignore their window")
        for tap in taps:
            if isinstance(tap, bool) or not isinstance(tap, (int, np.integer)) or not 0 <= tap <= c.num_hidden_layers:
                raise ValueError(f"tap {tap!r} is out of range [0, {c.num_hidden_layers}]")
        rope = (np.asarray(cos).astype(self.dtype).astype(_ACC), np.asarray(sin).astype(self.dtype).astype(_ACC))
        got: dict[int, np.ndarray] = {}
        logits = self._forward([x.astype(self.dtype, copy=False)], [cache], rope=rope,
                               masks=[np.asarray(hidden, dtype=bool)], taps=got, tap_ids=tuple(int(i) for i in taps))
        return logits[0], [got[int(i)] for i in taps]

    def forward_rope(self, embeds: np.ndarray, cache: KVCache, cos: np.ndarray, sin: np.ndarray, *,
                     layer_adds: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
        """Like :meth:`forward_embeddings`, with each row's RoPE tables given (M-RoPE of Qwen2-VL /
        Qwen3-VL: :func:`npusim.llm.mrope.mrope_cos_sin`), causal over the cache and the chunk.

        Args:
            embeds: ``[T, hidden_size]`` input embeddings, ``T >= 1``.
            cache: the KV cache; the rows are written at ``[cache.length, cache.length + T)`` and it advances by ``T``.
            cos, sin: ``[T, head_dim]`` (rounded to the decoder dtype, as transformers does with its tables).
            layer_adds: ``{layer i: [T, hidden_size]}`` added to the residual stream right after
                decoder layer ``i`` (Qwen3-VL DeepStack: zero rows for the text positions).

        Returns:
            logits ``[T, vocab_size]`` float32.

        Raises:
            ValueError: a shape that differs from the ones above (both named), a layer outside
                ``0 .. num_hidden_layers - 1``.
            KVCacheOverflowError: the rows do not fit (nothing is written).
        """
        c = self.config
        x = np.asarray(embeds)
        if x.ndim != 2 or x.shape[1] != c.hidden_size or x.shape[0] < 1 or x.dtype.kind not in "fiu":
            raise ValueError(f"expected numeric embeddings of shape [T, {c.hidden_size}] with T >= 1, got shape {x.shape}")
        t = x.shape[0]
        for name, table in (("cos", cos), ("sin", sin)):
            if np.shape(table) != (t, c.head_dim):
                raise ValueError(f"{name} must have shape [{t}, {c.head_dim}], got {np.shape(table)}")
        adds: dict[int, np.ndarray] = {}
        for li, add in (layer_adds or {}).items():
            if isinstance(li, bool) or not isinstance(li, (int, np.integer)) or not 0 <= li < c.num_hidden_layers:
                raise ValueError(f"layer_adds key {li!r} is out of range [0, {c.num_hidden_layers})")
            if np.shape(add) != (t, c.hidden_size):
                raise ValueError(f"layer_adds[{li}] must have shape [{t}, {c.hidden_size}], got {np.shape(add)}")
            adds[int(li)] = np.asarray(add).astype(self.dtype).astype(_ACC)
        rope = (np.asarray(cos).astype(self.dtype).astype(_ACC), np.asarray(sin).astype(self.dtype).astype(_ACC))
        return self._forward([x.astype(self.dtype, copy=False)], [cache], rope=rope, layer_adds=adds or None)[0]

    def _forward(self, xs: list[np.ndarray], caches: list[KVCache], *, rope: tuple[np.ndarray, np.ndarray] | None = None,
                 masks: list[np.ndarray] | None = None, taps: dict[int, np.ndarray] | None = None,
                 tap_ids: tuple[int, ...] = (), layer_adds: Mapping[int, np.ndarray] | None = None) -> list[np.ndarray]:
        """Run the flattened chunks ``xs`` (embeddings, not yet multiplied) against their caches.

        ``rope``/``masks`` replace the tables and causal masks derived from the cache lengths;
        ``taps`` receives the residual stream entering each layer of ``tap_ids`` (float32);
        ``layer_adds[i]`` (``[sum T, hidden]``, decoder-dtype values) is added to the residual
        stream right after layer ``i`` (Qwen3-VL DeepStack), the sum rounded to the dtype.
        """
        if not xs:
            return []
        c = self.config
        # Validate everything before touching any cache.
        seen: set[int] = set()
        for x, cache in zip(xs, caches):
            self._check_cache(cache)
            if id(cache) in seen:
                raise ValueError("the same KVCache appears twice in one batch")
            seen.add(id(cache))
            cache.check_append(x.shape[0])

        lens = [x.shape[0] for x in xs]
        bounds = [int(b) for b in np.concatenate([[0], np.cumsum(lens)])]
        starts = [cache.length for cache in caches]
        segments = list(zip(bounds[:-1], caches, starts, lens))
        cos, sin = self._rope_tables(starts, lens) if rope is None else rope
        dt = self.dtype
        eps = c.rms_norm_eps
        h = self._scale(np.concatenate(xs).astype(dt, copy=False), c.embedding_multiplier)
        for li, L in enumerate(self._layers):
            if li in tap_ids and taps is not None:
                taps[li] = h.astype(np.float32)
            x = h if L["ln1"] is None else _rms_norm(h, L["ln1"], eps, dt)
            h = self._residual_add(h, self._attention(li, L, x, cos, sin, segments, masks=masks), L["pn1"])
            x = h if L["ln2"] is None else _rms_norm(h, L["ln2"], eps, dt)
            h = self._residual_add(h, self._mlp(li, L, x), L["pn2"])
            if layer_adds is not None and li in layer_adds:
                h = (h.astype(_ACC) + layer_adds[li]).astype(dt)
        if len(self._layers) in tap_ids and taps is not None:
            taps[len(self._layers)] = h.astype(np.float32)
        h = _rms_norm(h, self._final_norm, eps, dt)
        logits = (h.astype(_ACC) @ self._lm_head.T).astype(dt)
        logits = self._scale(logits, c.logits_scaling).astype(np.float32)
        for cache, n in zip(caches, lens):
            cache.advance(n)
        return [logits[s : s + n] for s, n in zip(bounds[:-1], lens)]

    def _rope_tables(self, starts: list[int], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``cos``/``sin`` ``[sum(lens), head_dim]`` (float64 holding decoder-dtype values) for
        positions ``start .. start + n - 1`` of every sequence."""
        c = self.config
        rope_dt = np.float64 if self.dtype == np.float64 else np.float32
        cos_parts, sin_parts = [], []
        for start, n in zip(starts, lens):
            pos = np.arange(start, start + n)
            cs, sn = c.rope.cos_sin(pos, seq_len=start + n, dtype=rope_dt)
            cos_parts.append(cs)
            sin_parts.append(sn)
        # as transformers: tables computed in float32 (float64 for a float64 model), cast to the model dtype
        cos = np.concatenate(cos_parts).astype(self.dtype).astype(_ACC)
        sin = np.concatenate(sin_parts).astype(self.dtype).astype(_ACC)
        return cos, sin

    def _scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        """``x * factor`` rounded to the decoder dtype, the factor first rounded as torch rounds a
        Python scalar (float32 for float16/float32 models). ``factor == 1`` returns ``x`` itself."""
        if factor == 1.0:
            return x
        f = _ACC(factor) if self.dtype == np.float64 else _ACC(np.float32(factor))
        return (x.astype(_ACC) * f).astype(self.dtype)

    def _residual_add(self, h: np.ndarray, out: np.ndarray, post_norm: np.ndarray | None) -> np.ndarray:
        """``h + residual_multiplier * post_norm?(out)``, each step rounded to the decoder dtype."""
        if post_norm is not None:
            out = _rms_norm(out, post_norm, self.config.rms_norm_eps, self.dtype)
        out = self._scale(out, self.config.residual_multiplier)
        return (h.astype(_ACC) + out).astype(self.dtype)

    def _attention(self, li: int, L: Mapping[str, np.ndarray | None], x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   segments: list[tuple[int, KVCache, int, int]], kv_layer: int | None = None,
                   masks: list[np.ndarray] | None = None) -> np.ndarray:
        """Self-attention of layer ``li`` over ``x`` ``[n_tok, hidden]``, through ``o_proj``.

        ``segments``: per sequence ``(row offset in x, cache, cache length before, rows)``. Writes
        the new keys (after q/k norm and RoPE, as transformers caches them) and values into
        each cache (not advanced here), at the cache's layer ``kv_layer`` (default ``li``).
        ``masks``: per segment ``[rows, length before + rows]`` booleans (true = hidden) replacing
        the causal (and sliding) mask.
        """
        kv = li if kv_layer is None else kv_layer
        c, dt = self.config, self.dtype
        n_tok = x.shape[0]
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        if self._q4 is None:
            q = self._linear(x, L["wq"], L["bq"])
            k = self._linear(x, L["wk"], L["bk"])
            v = self._linear(x, L["wv"], L["bv"])
        else:
            q, k, v = self._q4[li]["qkv"](x, (L["bq"], L["bk"], L["bv"]), dt)
        q = q.reshape(n_tok, nh, hd)
        k = k.reshape(n_tok, nkv, hd)
        v = v.reshape(n_tok, nkv, hd)
        if c.qk_norm:
            q = _rms_norm(q, L["qn"], c.rms_norm_eps, dt)
            k = _rms_norm(k, L["kn"], c.rms_norm_eps, dt)
        if c.uses_rope(li):
            q = apply_rope(q.astype(_ACC), cos, sin).astype(dt)
            k = apply_rope(k.astype(_ACC), cos, sin).astype(dt)
        window = c.sliding_window if c.is_sliding(li) else None
        scale = c.attention_scale
        attn = np.empty((n_tok, nh, hd), dtype=dt)
        for si, (s, cache, start, n) in enumerate(segments):
            hide = _attention_mask(start, n, window) if masks is None else masks[si]
            attn[s : s + n] = cached_attention(cache, kv, q[s : s + n], k[s : s + n], v[s : s + n], hide, scale, dt)
        if self._q4 is None:
            return self._linear(attn.reshape(n_tok, nh * hd), L["wo"], L["bo"])
        (o,) = self._q4[li]["o"](attn.reshape(n_tok, nh * hd), (L["bo"],), dt)
        return o

    def route(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router of sparse layer ``layer`` for the normed MLP inputs ``x`` ``[T, hidden_size]``.

        Returns:
            ``(experts, weights)``: ``[T, num_experts_per_tok]`` expert ids (by falling
            probability, lowest id first on a tie) and their weights (the softmax
            probabilities, renormalised with ``norm_topk_prob``), rounded to the decoder dtype.

        Raises:
            ValueError: layer ``layer`` is not a sparse layer (names it), or ``x`` is not
                ``[T, hidden_size]``.
        """
        c = self.config
        L = self._sparse_layer(layer, "router")
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != c.hidden_size:
            raise ValueError(f"expected router inputs of shape [T, {c.hidden_size}], got shape {x.shape}")
        logits = self._linear(x, L["router"], None).astype(_ACC)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : c.num_experts_per_tok]
        weights = np.take_along_axis(probs, top, axis=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return top, weights.astype(self.dtype)

    def expert(self, layer: int, expert: int, x: np.ndarray) -> np.ndarray:
        """Expert ``expert`` of sparse layer ``layer`` on ``x`` ``[T, hidden_size]`` (unweighted), rounded to the dtype.

        Raises:
            ValueError: not a sparse layer, or ``expert`` outside ``0 .. num_experts - 1``.
        """
        n = self.config.num_experts
        L = self._sparse_layer(layer, "experts")
        if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)) or not 0 <= expert < n:
            raise ValueError(f"expert {expert!r} is out of range [0, {n})")
        return self._swiglu(x, L["ewg"][expert], L["ewu"][expert], L["ewd"][expert])

    def _sparse_layer(self, layer: int, what: str) -> Mapping[str, np.ndarray | None]:
        """Layer ``layer``'s weights, or ``ValueError`` naming it when it is not a sparse layer."""
        c = self.config
        if not 0 <= layer < c.num_hidden_layers or not c.is_sparse(layer):
            sparse = [i for i in range(c.num_hidden_layers) if c.is_sparse(i)]
            raise ValueError(f"layer {layer!r} has no {what} (the sparse layers are {sparse})")
        return self._layers[layer]

    def _swiglu(self, x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, bg: np.ndarray | None = None,
                bu: np.ndarray | None = None, bd: np.ndarray | None = None) -> np.ndarray:
        """``down(silu(gate(x)) * up(x))`` (biases optional) in float64, each step rounded to the dtype."""
        return self._linear(self._gated(self._linear(x, wg, bg), self._linear(x, wu, bu)), wd, bd)

    def _gated(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``silu(g) * u``: the SiLU rounded to the dtype, then the product rounded to it."""
        dt = self.dtype
        return (_silu(g.astype(_ACC)).astype(dt).astype(_ACC) * u.astype(_ACC)).astype(dt)

    def _moe(self, li: int, x: np.ndarray) -> np.ndarray:
        """The sparse block of layer ``li``: routed experts, weighted, summed in ascending expert id."""
        dt = self.dtype
        top, weights = self.route(li, x)
        out = np.zeros_like(x, dtype=dt)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            y = self.expert(li, int(e), x[rows]).astype(_ACC) * weights[rows, slot, None].astype(_ACC)
            out[rows] = (out[rows].astype(_ACC) + y.astype(dt)).astype(dt)
        return out

    def _mlp(self, li: int, L: Mapping[str, np.ndarray | None], x: np.ndarray) -> np.ndarray:
        """The MLP of layer ``li``: SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))``, or the sparse block."""
        if self.config.is_sparse(li):
            return self._moe(li, x)
        if self._q4 is None:
            return self._swiglu(x, L["wg"], L["wu"], L["wd"], L["bg"], L["bu"], L["bd"])
        dt = self.dtype
        g, u = self._q4[li]["gate_up"](x, (L["bg"], L["bu"]), dt)
        (d,) = self._q4[li]["down"](self._gated(g, u), (L["bd"],), dt)
        return d


def cached_attention(cache: KVCache, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, hide: np.ndarray,
                     scale: float, dt: np.dtype) -> np.ndarray:
    """Write ``n`` rows' keys/values ``[n, kv_heads, head_dim]`` into ``cache`` layer ``layer`` at
    ``cache.length`` (not advanced) and attend the queries ``q`` ``[n, heads, head_dim]`` over keys
    ``[0, cache.length + n)``: ``[n, heads, head_dim]`` (float64 holding the sums of probabilities
    rounded to ``dt``, as HF rounds them to the model dtype).

    ``hide``: ``[n, cache.length + n]`` booleans, true where a row must not see a key;
    ``scale``: the scores' multiplier. Grouped-query heads share their key/value head.
    """
    n, nh, hd = q.shape
    nkv = k.shape[1]
    cache.write(layer, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    total = cache.length + n
    keys = cache.keys[layer][:, :total].astype(_ACC)  # [nkv, S, hd]
    vals = cache.values[layer][:, :total].astype(_ACC)
    qs = q.astype(_ACC).reshape(n, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)  # [nkv, G, n, hd]
    scores = (qs @ keys[:, None].transpose(0, 1, 3, 2)) * scale  # [nkv, G, n, S]
    scores = np.where(hide, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs.astype(dt).astype(_ACC)
    return (probs @ vals[:, None]).transpose(2, 0, 1, 3).reshape(n, nh, hd)  # from [nkv, G, n, hd]


def _projections(w: Mapping[str, np.ndarray], prefix: str, names: Mapping[str, str]) -> dict[str, np.ndarray | None]:
    """``{"w" + key: weight, "b" + key: bias or None}`` of the projections ``prefix + names[key]``."""
    out: dict[str, np.ndarray | None] = {}
    for key, name in names.items():
        out["w" + key] = w[prefix + name + ".weight"]
        out["b" + key] = w.get(prefix + name + ".bias")
    return out


def _attention_mask(start: int, n: int, window: int | None) -> np.ndarray:
    """``[n, start + n]`` booleans, true where query ``t`` (position ``start + t``) must not see key ``j``.

    Causal: keys after the query are hidden. With a ``window`` (tokens, >= 1), keys at
    positions ``<= start + t - window`` are hidden too, so each query sees at most ``window``
    keys, itself included (transformers' ``kv_idx > q_idx - sliding_window``).
    """
    q_pos = start + np.arange(n)[:, None]
    k_pos = np.arange(start + n)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return hidden
