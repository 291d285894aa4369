"""Model configuration parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError
from .rope import RopeConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "load_config"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function under two names

# transformers' defaults for keys a config.json may omit, per family.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama / Qwen2 / Qwen3 decoder-only model.

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size: number of token ids; valid ids are ``0 .. vocab_size - 1``.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
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
        qk_norm: per-head RMSNorm on q and k before RoPE (qwen3).
        rope: RoPE parameters.
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

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build a config from a ``config.json`` dict.

        Raises:
            UnsupportedModelError: unknown ``model_type``, ``hidden_act`` other than SiLU,
                sliding-window attention (``use_sliding_window: true`` or a non-full
                ``layer_types`` entry), or an unsupported RoPE type.
            CheckpointError: a required key is missing or a size is invalid (non-positive,
                heads not divisible by key/value heads, odd head_dim).
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
        head_dim = d.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise CheckpointError(f"config: head_dim must be a positive even integer, got {head_dim!r}")
        max_pos = d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[mt]

        act = d.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {act!r} is not supported (the MLP must be SwiGLU with 'silu')"
            )
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"sliding-window attention (use_sliding_window=true, sliding_window={d.get('sliding_window')!r}) "
                "is not supported (only full causal attention)"
            )
        layer_types = d.get("layer_types")
        if layer_types is not None:
            other = sorted({t for t in layer_types if t != "full_attention"})
            if other:
                raise UnsupportedModelError(
                    f"layer_types {other} are not supported (only 'full_attention')"
                )

        attention_bias = bool(d.get("attention_bias", False))
        if mt == "llama":
            qkv_bias, o_bias, mlp_bias, qk_norm = attention_bias, attention_bias, bool(d.get("mlp_bias", False)), False
        elif mt == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        else:  # qwen3
            qkv_bias, o_bias, mlp_bias, qk_norm = attention_bias, attention_bias, False, True

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
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            hidden_act=act,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            rope=rope,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            architectures=tuple(d.get("architectures") or ()),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            raw=copy.deepcopy(d),
        )


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
