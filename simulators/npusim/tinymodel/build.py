"""Build tiny random-weight Hugging Face checkpoints locally (no network).

Architectures: :data:`ARCHES` (llama, qwen2, qwen3, exaone4, hyperclovax, qwen3_moe).

A built directory holds ``config.json`` and ``generation_config.json`` (transformers 5.19
format), ``model.safetensors`` (float32, HF tensor names, written with numpy), and a byte-level
BPE tokenizer trained on :file:`corpus.txt` (``tokenizer.json``, ``tokenizer_config.json`` with
a ChatML chat template, ``special_tokens_map.json``). Every file is a pure function of
``(arch, seed, config_overrides)``: building twice gives byte-identical files.

Weight scales (so activations stay O(1) and logits have a real spread, without near-ties):
projections ``N(0, 1/fan_in)``, except ``o_proj``/``down_proj`` ``N(0, 4/fan_in)`` (so the
layers, not the input embedding, dominate the residual stream); embeddings ``N(0, 1)``
(untied) or ``N(0, 0.04)`` (tied, where they are also the LM head: a larger scale makes greedy
decoding repeat the last token); untied LM head ``N(0, 9/hidden)``; norm weights
``1 + N(0, 0.05^2)``; biases ``N(0, 0.1^2)``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..llm.config import ModelConfig
from ..llm.decoder import expected_tensor_shapes
from ..llm.safetensors import save_safetensors

__all__ = [
    "ARCHES",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "SPECIAL_TOKENS",
    "build",
    "exaone4_layer_types",
    "make_config",
    "make_weights",
    "train_tokenizer",
]

ARCHES = ("llama", "qwen2", "qwen3", "exaone4", "hyperclovax", "qwen3_moe")

#: exaone4's attention pattern ("L" sliding, "G" global), repeated over the layers; the last
#: layer is always global (as the pattern's documentation in transformers says).
EXAONE4_PATTERN = "LLLG"
#: exaone4's sliding window in tokens: small, so a 64-token prompt and decoding cross it.
EXAONE4_SLIDING_WINDOW = 8

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Special tokens in id order (ids 0..3).
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, IM_START, IM_END)
TARGET_VOCAB_SIZE = 1024
TRANSFORMERS_VERSION = "5.19.0"  # the format written; no transformers import is needed

#: ChatML. Content may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = Path(__file__).with_name("corpus.txt")

_COMMON: dict[str, Any] = {
    "attention_dropout": 0.0,
    "dtype": "float32",
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "transformers_version": TRANSFORMERS_VERSION,
    "use_cache": True,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "max_window_layers": 28,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "max_window_layers": 28,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    # EXAONE 4.0 hybrid attention: 3 sliding-window (RoPE) layers, then a global (NoPE) one
    "exaone4": {
        "architectures": ["Exaone4ForCausalLM"],
        "model_type": "exaone4",
        "num_hidden_layers": 4,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": EXAONE4_SLIDING_WINDOW,
        "sliding_window_pattern": EXAONE4_PATTERN,
        "tie_word_embeddings": False,
    },
    # HyperCLOVA X: every MuP factor away from 1 (and the attention scale away from
    # head_dim ** -0.5), Peri-LN output norms on
    "hyperclovax": {
        "architectures": ["HyperCLOVAXForCausalLM"],
        "model_type": "hyperclovax",
        "attention_bias": False,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 1.5,
        "logits_scaling": 0.75,
        "mlp_bias": False,
        "residual_multiplier": 1.25,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_post_norm": True,
    },
    # Qwen3-MoE as mobilint/Qwen3-30B-A3B is laid out (every layer sparse, untied head,
    # renormalised top-k, 40960 positions declared), scaled down: 8 experts, top-2, experts 64 wide
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "max_position_embeddings": 40960,
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "max_window_layers": 28,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
}


def _check_arch(arch: str) -> None:
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r} (choices: {', '.join(ARCHES)})")


def train_tokenizer(vocab_size: int = TARGET_VOCAB_SIZE):
    """Train the byte-level BPE tokenizer on :file:`corpus.txt`; returns a ``tokenizers.Tokenizer``.

    Special tokens get ids 0..3 in :data:`SPECIAL_TOKENS` order. Training is deterministic.

    Raises:
        ImportError: the optional ``tokenizers`` package (extra ``models``) is missing.
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "building a tiny model needs the 'tokenizers' package: pip install 'npu-harness[models]'"
        ) from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


def make_config(arch: str, vocab_size: int = TARGET_VOCAB_SIZE, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` dict of a tiny model (transformers 5.19 format).

    ``overrides`` are merged at the top level. A ``rope_parameters`` override without
    ``rope_theta`` gets the arch's default theta. Unless overridden, ``layer_types`` follows
    ``num_hidden_layers``: all ``full_attention`` for qwen2/qwen3, :func:`exaone4_layer_types`
    for exaone4 (llama and hyperclovax configs have no such key).

    Raises:
        ValueError: unknown ``arch`` (names it and the choices).
    """
    _check_arch(arch)
    cfg: dict[str, Any] = {**copy.deepcopy(_COMMON), **copy.deepcopy(_ARCH_DEFAULTS[arch])}
    cfg.update(
        vocab_size=vocab_size,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    )
    default_theta = cfg["rope_parameters"]["rope_theta"]
    cfg.update(copy.deepcopy(overrides))
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" not in rp and "rope_theta" not in overrides:
        rp["rope_theta"] = default_theta
    if "layer_types" not in overrides:
        n_layers = int(cfg["num_hidden_layers"])
        if arch in ("qwen2", "qwen3"):
            cfg["layer_types"] = ["full_attention"] * n_layers
        elif arch == "exaone4":
            cfg["layer_types"] = exaone4_layer_types(n_layers)
    return dict(sorted(cfg.items()))


def exaone4_layer_types(num_layers: int, pattern: str = EXAONE4_PATTERN) -> list[str]:
    """``layer_types`` of ``num_layers`` layers: ``pattern`` ("L" sliding, "G" full attention)
    repeated from layer 0, the last layer always ``full_attention``.

    Raises:
        ValueError: ``num_layers < 1``, or ``pattern`` is empty or has a letter other than L/G.
    """
    if num_layers < 1 or not pattern or set(pattern) - {"L", "G"}:
        raise ValueError(f"need num_layers >= 1 and a pattern of 'L'/'G', got {num_layers!r}, {pattern!r}")
    kinds = {"L": "sliding_attention", "G": "full_attention"}
    types = [kinds[pattern[i % len(pattern)]] for i in range(num_layers)]
    types[-1] = "full_attention"
    return types


def make_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with HF names for ``config``, from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    hidden = config.hidden_size
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name == "model.embed_tokens.weight":
            std = 0.2 if config.tie_word_embeddings else 1.0
            w = rng.normal(0.0, std, shape)
        elif name == "lm_head.weight":
            w = rng.normal(0.0, 3.0 / np.sqrt(hidden), shape)
        elif name.endswith(".mlp.gate.weight"):  # a MoE router: logits of spread ~1, no near-ties
            w = rng.normal(0.0, 1.0 / np.sqrt(hidden), shape)
        elif len(shape) == 1 and name.endswith(".weight"):  # the only 1-D weights are RMSNorm scales
            w = 1.0 + rng.normal(0.0, 0.05, shape)
        elif name.endswith(".bias"):
            w = rng.normal(0.0, 0.1, shape)
        else:  # projection [out, in]; the two that write into the residual stream are doubled
            gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            w = rng.normal(0.0, gain / np.sqrt(shape[1]), shape)
        out[name] = w.astype(np.float32)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build(arch: str, out_dir: str | os.PathLike, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a complete tiny HF model directory for ``arch`` into ``out_dir``.

    Args:
        arch: ``"llama"`` (untied LM head, rope_theta 1e4), ``"qwen2"`` (tied, q/k/v biases,
            rope_theta 1e6), ``"qwen3"`` (tied, q/k norms, rope_theta 1e6), ``"exaone4"``
            (untied, 4 layers: sliding-window 8 / sliding / sliding / global NoPE, q/k norms,
            post-sub-layer norms, rope_theta 1e6) or ``"hyperclovax"`` (untied, Peri-LN,
            embedding x1.5, residual x1.25, attention scale 0.125, logits x0.75, rope_theta 1e4)
            or ``"qwen3_moe"`` (untied, q/k norms, rope_theta 1e6, every layer a sparse block of
            8 experts 64 wide, top-2 routing renormalised).
        out_dir: destination directory (created if missing; our files are overwritten).
        seed: weight seed. Same arguments -> byte-identical files.
        **config_overrides: keys merged into ``config.json`` (e.g. ``num_hidden_layers=1``,
            ``max_position_embeddings=32``, ``rope_parameters={...}``); weights follow the
            resulting sizes.

    Defaults: hidden 128, 4 heads, 2 KV heads, head_dim 32, intermediate 256, 2 layers (exaone4:
    4), vocab 1024 (the tokenizer's size), max_position_embeddings 1024 (qwen3_moe: 40960, as
    Qwen3-30B-A3B declares); about 2 MB (exaone4 3.4 MB, qwen3_moe 3.1 MB).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown ``arch``; ``seed`` not an integer in [0, 2**32); ``out_dir`` is
            an existing file; a ``vocab_size`` override smaller than the tokenizer.
        UnsupportedModelError: the overrides make a config the golden decoder rejects.
        ImportError: ``tokenizers`` is not installed.
    """
    _check_arch(arch)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed!r} must be an integer in [0, 2**32)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    tok = train_tokenizer()
    n_tok = tok.get_vocab_size()
    overrides = dict(config_overrides)
    cfg = make_config(arch, vocab_size=overrides.pop("vocab_size", n_tok), **overrides)
    if int(cfg["vocab_size"]) < n_tok:
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {n_tok} tokens")
    model_cfg = ModelConfig.from_dict(cfg)
    weights = make_weights(model_cfg, seed)

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": cfg["bos_token_id"],
            "do_sample": False,
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
            "transformers_version": TRANSFORMERS_VERSION,
        },
    )
    save_safetensors(out / "model.safetensors", weights, metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    special = {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            **special,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(cfg["max_position_embeddings"]),
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return out

