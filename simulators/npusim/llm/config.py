"""Model configuration parsed from a Hugging Face ``config.json``.

Families (``model_type``): ``llama``, ``qwen2``, ``qwen3``, ``exaone4`` (EXAONE 4.0: hybrid
sliding-window / global attention, global layers without RoPE, QK RMSNorm, norms on the
sub-layer outputs), ``hyperclovax`` (HyperCLOVA X: Llama with MuP multipliers and
Peri-LN output norms) and ``qwen3_moe`` (Qwen3-MoE: Qwen3 attention, sparse Mixture-of-Experts
MLPs with top-k routing).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError
from .rope import RopeConfig

__all__ = ["LAYER_TYPES", "NORM_LAYOUTS", "SUPPORTED_MODEL_TYPES", "ModelConfig", "load_config"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "exaone4", "hyperclovax", "qwen3_moe")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function under two names

#: Attention kinds a layer may have (``ModelConfig.layer_types`` entries).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

#: Where a layer's RMSNorms sit (``ModelConfig.norm_layout``), see the ModelConfig docstring.
NORM_LAYOUTS = ("pre", "post", "peri")

# transformers' defaults for keys a config.json may omit, per family.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "exaone4": 2048, "hyperclovax": 2048,
                          "qwen3_moe": 32768}
_DEFAULT_RMS_EPS = {"exaone4": 1e-5}  # every other family: 1e-6
#: EXAONE 4.0's global-attention layer every ``sliding_window_pattern`` layers (int form only).
_EXAONE4_DEFAULT_PATTERN = 4
#: transformers' ``Qwen3MoeConfig`` defaults for the Mixture-of-Experts keys a config may omit.
_QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
    "norm_topk_prob": False, "mlp_only_layers": [],
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama / Qwen2 / Qwen3 / EXAONE 4 / HyperCLOVA X / Qwen3-MoE decoder-only model.

    Attributes:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
        vocab_size: number of token ids; valid ids are ``0 .. vocab_size - 1``.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP (of the dense layers, for a Mixture-of-Experts model).
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention; divides the query heads).
        head_dim: per-head dimension (explicit ``head_dim`` or ``hidden_size // num_attention_heads``).
        max_position_embeddings: the context length the model was configured for (tokens). Not
            enforced by the decoder (transformers does not either); the ``dynamic`` RoPE type
            rescales beyond it.
        rms_norm_eps: epsilon of every RMSNorm.
        hidden_act: the MLP activation (``"silu"``).
        tie_word_embeddings: the LM head reuses ``embed_tokens``.
        attention_bias: q/k/v projections have biases (always for qwen2).
        o_proj_bias: the output projection has a bias (llama/qwen3 ``attention_bias``; never qwen2).
        mlp_bias: gate/up/down projections have biases (llama ``mlp_bias`` only).
        qk_norm: per-head RMSNorm on q and k before RoPE (qwen3, exaone4).
        rope: RoPE parameters.
        layer_types: one entry per layer, ``"full_attention"`` (causal over the whole cache) or
            ``"sliding_attention"`` (causal over the last ``sliding_window`` tokens). Every
            family but exaone4 is all ``"full_attention"``.
        sliding_window: window of the ``sliding_attention`` layers, in tokens, including the
            query itself: the query at position ``p`` sees keys ``max(0, p - sliding_window + 1)
            .. p``. ``None``: no window (exaone4 ``sliding_window: null``). The KV cache always
            keeps every token; the window is only a mask.
        full_attention_rope: ``full_attention`` layers apply RoPE. ``False`` for exaone4 whenever
            ``sliding_window`` is set ("global NoPE": transformers rotates q/k only in the sliding
            layers then); sliding layers always apply RoPE.
        norm_layout: where the RMSNorms of a layer sit (``h`` the residual stream, ``m`` the
            ``residual_multiplier``):

            * ``"pre"`` (llama, qwen2, qwen3; hyperclovax with ``use_post_norm: false``):
              ``h += m * attn(n1(h)); h += m * mlp(n2(h))`` with ``n1 = input_layernorm`` and
              ``n2 = post_attention_layernorm``.
            * ``"post"`` (exaone4): ``h += n1(attn(h)); h += n2(mlp(h))`` with
              ``n1 = post_attention_layernorm`` and ``n2 = post_feedforward_layernorm``; no
              norm before the sub-layers.
            * ``"peri"`` (hyperclovax ``use_post_norm: true``, Peri-LN):
              ``h += m * p1(attn(n1(h))); h += m * p2(mlp(n2(h)))`` with ``n1``/``n2`` as in
              ``"pre"`` and ``p1 = post_norm1``, ``p2 = post_norm2``.

            Every layout ends with the final ``model.norm``.
        embedding_multiplier: the embedding rows (also embeddings passed to
            ``forward_embeddings``) are multiplied by this before the first layer (hyperclovax;
            1.0 otherwise). Dimensionless.
        residual_multiplier: each sub-layer's output is multiplied by this before it is added to
            the residual stream (hyperclovax; 1.0 otherwise). Dimensionless.
        attention_multiplier: the factor the attention scores ``q . k`` are multiplied by before
            the softmax; ``None`` means the standard ``head_dim ** -0.5`` (see
            :attr:`attention_scale`). Only hyperclovax sets it.
        logits_scaling: the LM head's output is multiplied by this (hyperclovax, a multiplier,
            unlike Granite's divisor; 1.0 otherwise). Dimensionless.
        num_experts: experts per sparse layer (qwen3_moe; 0 for every other family: no sparse
            layer).
        num_experts_per_tok: experts each token is routed to in a sparse layer (top-k of the
            router's softmax); 0 when ``num_experts`` is 0.
        moe_intermediate_size: width of each expert's SwiGLU MLP; 0 when ``num_experts`` is 0.
        norm_topk_prob: the top-k routing probabilities are renormalised to sum to 1 before
            weighting the experts' outputs (transformers ``norm_topk_prob``).
        sparse_layers: one flag per layer, true where the MLP is the sparse Mixture-of-Experts
            block (qwen3_moe: layer ``i`` not in ``mlp_only_layers`` and ``(i + 1) %
            decoder_sparse_step == 0``, as transformers decides); empty for dense families.
        bos_token_id, eos_token_ids, pad_token_id: special token ids from the config (``eos``
            may be several ids; empty tuple if absent).
        architectures: e.g. ``("LlamaForCausalLM",)``.
        dtype: the checkpoint's declared ``dtype`` / ``torch_dtype`` string, if any.
        raw: the config.json dict as read (not compared, not hashed).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    full_attention_rope: bool = True
    norm_layout: str = "pre"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    architectures: tuple[str, ...] = ()
    dtype: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_attention_heads * head_dim``)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and value) projection output (``num_key_value_heads * head_dim``)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor attention scores are multiplied by: ``attention_multiplier`` or ``head_dim ** -0.5``."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def is_moe(self) -> bool:
        """At least one layer's MLP is a sparse Mixture-of-Experts block."""
        return any(self.sparse_layers)

    def is_sparse(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) has the sparse Mixture-of-Experts MLP (router and experts)."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def is_sliding(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) attends over the last :attr:`sliding_window` tokens only."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def uses_rope(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) rotates q and k (false for exaone4's global NoPE layers)."""
        return self.full_attention_rope or self.is_sliding(layer)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build a config from a ``config.json`` dict.

        Raises:
            UnsupportedModelError: unknown ``model_type``, ``hidden_act`` other than SiLU,
                an unsupported RoPE type, or an attention pattern the family does not have:
                for llama/qwen2/qwen3 any sliding window (``use_sliding_window: true`` or a
                non-full ``layer_types`` entry); for exaone4 a ``layer_types`` entry other than
                ``full_attention`` / ``sliding_attention``, or no ``layer_types`` and a
                ``sliding_window_pattern`` that is not a positive integer.
            CheckpointError: a required key is missing or a size is invalid (non-positive,
                heads not divisible by key/value heads, odd head_dim, ``layer_types`` not one
                per layer, sliding layers without a positive ``sliding_window``, hyperclovax
                ``hidden_size`` not a multiple of the heads, a multiplier that is not a
                finite number); for qwen3_moe a Mixture-of-Experts key of the wrong type or out of
                range (``num_experts`` < 0, ``num_experts_per_tok`` not in ``1 ..
                num_experts``, ``moe_intermediate_size`` or ``decoder_sparse_step`` not
                positive, an ``mlp_only_layers`` entry that is not a layer index).
        """
        d = dict(config)
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def req(key: str) -> int:
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"config: {key!r} must be a positive integer, got {v!r}")
            return v

        vocab = req("vocab_size")
        hidden = req("hidden_size")
        inter = req("intermediate_size")
        layers = req("num_hidden_layers")
        heads = req("num_attention_heads")
        kv_heads = d.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise CheckpointError(
                f"config: num_key_value_heads {kv_heads!r} must be a positive divisor of num_attention_heads {heads}"
            )
        if mt == "hyperclovax" and hidden % heads:
            raise CheckpointError(
                f"config: hidden_size {hidden} must be a multiple of num_attention_heads {heads} (hyperclovax)"
            )
        head_dim = d.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise CheckpointError(f"config: head_dim must be a positive even integer, got {head_dim!r}")
        max_pos = d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[mt]

        act = d.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {act!r} is not supported (the MLP must be SwiGLU with 'silu')"
            )
        if mt == "exaone4":
            layer_types, window = _exaone4_attention(d, layers)
            full_rope = window is None  # transformers: "global NoPE for hybrid attention model"
        else:
            layer_types, window, full_rope = _full_attention_only(d, layers), None, True
        qkv_bias, o_bias, mlp_bias, qk_norm = _biases_and_qk_norm(d, mt)
        norm_layout = {"exaone4": "post", "hyperclovax": "peri" if d.get("use_post_norm", True) else "pre"}.get(mt, "pre")
        mults = _multipliers(d) if mt == "hyperclovax" else {}
        moe = _qwen3_moe(d, layers) if mt == "qwen3_moe" else {}

        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = () if eos is None else ((int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos))
        rope = RopeConfig.from_hf_config(d, head_dim=head_dim, max_position_embeddings=int(max_pos))
        return cls(
            model_type=mt,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(max_pos),
            rms_norm_eps=float(d.get("rms_norm_eps", _DEFAULT_RMS_EPS.get(mt, 1e-6))),
            hidden_act=act,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            rope=rope,
            layer_types=layer_types,
            sliding_window=window,
            full_attention_rope=full_rope,
            norm_layout=norm_layout,
            **mults,
            **moe,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            architectures=tuple(d.get("architectures") or ()),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            raw=copy.deepcopy(d),
        )


def _full_attention_only(d: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types`` of llama/qwen2/qwen3: all full attention; any sliding window is refused."""
    if d.get("use_sliding_window"):
        raise UnsupportedModelError(
            f"sliding-window attention (use_sliding_window=true, sliding_window={d.get('sliding_window')!r}) "
            f"is not supported for {d.get('model_type')} (only full causal attention)"
        )
    layer_types = d.get("layer_types")
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != FULL_ATTENTION})
        if other:
            raise UnsupportedModelError(
                f"layer_types {other} are not supported for {d.get('model_type')} (only 'full_attention')"
            )
    return (FULL_ATTENTION,) * layers


def _exaone4_attention(d: Mapping[str, Any], layers: int) -> tuple[tuple[str, ...], int | None]:
    """EXAONE 4.0's ``(layer_types, sliding_window)``.

    Without ``layer_types``, transformers derives them from an integer ``sliding_window_pattern``
    ``P`` (default 4): layer ``i`` is full attention when ``(i + 1) % P == 0``, sliding otherwise.
    """
    window = d.get("sliding_window", 4096)  # transformers' default when the key is absent
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise CheckpointError(f"config: sliding_window must be a positive integer (tokens) or null, got {window!r}")
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = d.get("sliding_window_pattern", _EXAONE4_DEFAULT_PATTERN) if window is not None else None
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise UnsupportedModelError(
                f"exaone4 without layer_types needs a positive integer sliding_window_pattern and a "
                f"sliding_window, got sliding_window_pattern={pattern!r}, sliding_window={window!r} "
                "(give layer_types explicitly)"
            )
        layer_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers:
        raise CheckpointError(
            f"config: layer_types must list one attention type per layer ({layers}), got {layer_types!r}"
        )
    unknown = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(
            f"layer_types {unknown} are not supported for exaone4 (only {', '.join(repr(t) for t in LAYER_TYPES)})"
        )
    if SLIDING_ATTENTION in layer_types and window is None:
        raise CheckpointError("config: exaone4 'sliding_attention' layers need a positive sliding_window, got null")
    return tuple(layer_types), window


def _biases_and_qk_norm(d: Mapping[str, Any], mt: str) -> tuple[bool, bool, bool, bool]:
    """``(q/k/v bias, o_proj bias, MLP biases, q/k RMSNorm)`` as each family's modeling code builds them."""
    attention_bias = bool(d.get("attention_bias", False))
    if mt in ("llama", "hyperclovax"):
        return attention_bias, attention_bias, bool(d.get("mlp_bias", False)), False
    if mt == "qwen2":
        return True, False, False, False
    if mt in ("qwen3", "qwen3_moe"):
        return attention_bias, attention_bias, False, True
    return False, False, False, True  # exaone4: no biases at all, QK norm always


def _multipliers(d: Mapping[str, Any]) -> dict[str, float | None]:
    """HyperCLOVA X's MuP factors (``embedding_multiplier``, ``residual_multiplier``,
    ``attention_multiplier``, ``logits_scaling``), each a finite number (``attention_multiplier``
    may be null: the standard ``head_dim ** -0.5``)."""
    out: dict[str, float | None] = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        v = d.get(key)
        if v is None:
            out[key] = None if key == "attention_multiplier" else 1.0
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CheckpointError(f"config: {key!r} must be a finite number, got {v!r}")
        out[key] = float(v)
    return out


def _qwen3_moe(d: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-MoE's routing keys as :class:`ModelConfig` fields (transformers' defaults for absent keys)."""
    v = {key: d.get(key, default) for key, default in _QWEN3_MOE_DEFAULTS.items()}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] < (0 if key == "num_experts" else 1):
            rule = ">= 0" if key == "num_experts" else ">= 1"
            raise CheckpointError(f"config: {key!r} must be an integer {rule}, got {v[key]!r}")
    experts, top_k = v["num_experts"], v["num_experts_per_tok"]
    if experts and top_k > experts:
        raise CheckpointError(f"config: num_experts_per_tok {top_k} must be <= num_experts {experts}")
    only = v["mlp_only_layers"]
    if not isinstance(only, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise CheckpointError(f"config: 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    outside = sorted(i for i in only if not 0 <= i < layers)
    if outside:
        raise CheckpointError(f"config: mlp_only_layers entry {outside[0]} is not a layer index (0 .. {layers - 1})")
    if not isinstance(v["norm_topk_prob"], bool):
        raise CheckpointError(f"config: 'norm_topk_prob' must be true or false, got {v['norm_topk_prob']!r}")
    step = v["decoder_sparse_step"]
    sparse = tuple(experts > 0 and i not in only and (i + 1) % step == 0 for i in range(layers))
    routed = any(sparse)  # else a dense model: no routing fields
    return {
        "num_experts": experts if routed else 0,
        "num_experts_per_tok": top_k if routed else 0,
        "moe_intermediate_size": v["moe_intermediate_size"] if routed else 0,
        "norm_topk_prob": v["norm_topk_prob"],
        "sparse_layers": sparse,
    }


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` from a model directory (or the file itself).

    Raises:
        CheckpointError: the file is missing or not a JSON object, or a required key is
            missing/invalid.
        UnsupportedModelError: see :meth:`ModelConfig.from_dict`.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{p}: no such config file") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{p}: cannot read config: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{p}: config must be a JSON object")
    try:
        return ModelConfig.from_dict(data)
    except CheckpointError as exc:
        raise CheckpointError(f"{p}: {exc}") from exc
