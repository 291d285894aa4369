"""Build a tiny EAGLE-3 checkpoint: a tiny base model and a one-block draft fitted to it (no network).

``build_eagle3(out_dir, base_arch="llama", seed=0)`` writes:

- ``out_dir``: the base, a tiny HF checkpoint of :func:`npusim.tinymodel.build` with 4 layers;
- ``out_dir/eagle3_draft``: the draft, in the HF EAGLE-3 layout :mod:`npusim.llm.eagle3` reads
  (``config.json`` naming ``LlamaForCausalLMEagle3``, ``model.safetensors``).

A random draft would never guess the base's next token, so every speculative round would settle
one token and nothing would be measured. The draft is instead *constructed and fitted*, with
numpy only, so that it predicts the base's greedy continuation often enough to exercise
acceptance:

0. the base is :func:`build`'s with its residual writers damped (:data:`LAYER_GAIN`);
1. the base greedily continues :data:`FIT_SEQUENCES` random prompts; the fit data are its taps
   (the residual stream entering layers :data:`AUX_LAYERS`) at every position;
2. ``fc`` passes the last tap through (``0.5 * I``); the midlayer's attention is built so each
   row attends to itself (queries and keys are a scaled copy of the normed token embedding), its
   values copy that embedding and ``o_proj`` adds it to the residual: the block's output holds
   both the base's state at token ``t`` and the embedding of token ``t + 1``; the MLP is small;
3. the draft vocabulary is the :data:`DRAFT_VOCAB` target ids the base emits most often;
4. ``lm_head`` is the ridge-regression fit of the base's logits at ``t + 1`` (on the draft
   vocabulary) from the draft's final-normed output at ``t``.

Every file is a pure function of ``(base_arch, seed)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..llm.decoder import Decoder, _attention_mask
from ..llm.eagle3 import DRAFT_ARCHITECTURE, Eagle3Draft, Eagle3DraftConfig, draft_tensor_shapes
from ..llm.safetensors import load_safetensors, save_safetensors
from .build import build

__all__ = ["AUX_LAYERS", "BASE_LAYERS", "DRAFT_DIR", "DRAFT_VOCAB", "EAGLE3_BASE_ARCHES", "build_eagle3"]

#: Base families an EAGLE-3 release is made of (vllm-mblt's three EAGLE-3 model types).
EAGLE3_BASE_ARCHES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
#: The draft's directory inside the built checkpoint.
DRAFT_DIR = "eagle3_draft"
BASE_LAYERS = 4
#: The base layers whose inputs the draft reads (EAGLE-3's low, middle and high features).
AUX_LAYERS: tuple[int, int, int] = (1, 2, 3)
#: The draft vocabulary (EAGLE-3's drafts keep the target ids they see most: 32000 of 128256 for
#: Llama 3); here 512 of the tiny base's 1024.
DRAFT_VOCAB = 512
FIT_SEQUENCES = 48
FIT_PROMPT_TOKENS = (4, 12)
FIT_NEW_TOKENS = 40
RIDGE = 1e-2
#: Queries and keys are this multiple of the normed embedding: a row's score against itself
#: (about ``QK_GAIN**2 * sqrt(head_dim)``) dwarfs its score against other tokens.
QK_GAIN = 2.0
#: The base's ``o_proj``/``down_proj`` are scaled by this after :func:`build`. Undamped, the tiny
#: base's next token depends on its whole context so erratically that no one-block draft predicts
#: it; damped, it leans on the current token as a trained model's often does, and the fitted
#: draft's top-1 / top-8 on held-out greedy runs are printed by
#: ``pytest -s tests/npusim/test_eagle3_draft.py -k fitted`` (49% / 80%).
LAYER_GAIN = 0.15


def _base_tokens(base: Decoder, rng: np.random.Generator) -> list[np.ndarray]:
    """Random prompts continued greedily by the base: the sequences the draft is fitted on."""
    vocab = base.config.vocab_size
    seqs = []
    for _ in range(FIT_SEQUENCES):
        prompt = rng.integers(0, vocab, size=int(rng.integers(*FIT_PROMPT_TOKENS)))
        seqs.append(np.concatenate([prompt, base.generate_greedy(prompt, FIT_NEW_TOKENS)]).astype(np.int64))
    return seqs


def _causal(n: int) -> np.ndarray:
    return _attention_mask(0, n, None)


def _draft_config(base: Decoder) -> dict[str, Any]:
    c = base.config
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": 2 * c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": 2 * c.hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": c.hidden_size // 2,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": min(DRAFT_VOCAB, c.vocab_size),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": int(c.max_position_embeddings),
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }


def _structure(cfg: Eagle3DraftConfig, base_embed: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every draft tensor but ``lm_head``, ``d2t`` and ``t2d`` (see the module docstring, step 2)."""
    hd, h = cfg.hidden_size, cfg.target_hidden_size
    w = {name: np.zeros(shape, np.float32) for name, shape in draft_tensor_shapes(cfg).items()}
    w["fc.weight"][h:, 2 * h:] = 0.5 * np.eye(h)  # the last tap, into the upper half
    w["fc.weight"][:, : 2 * h] = rng.normal(0.0, 0.02 / np.sqrt(2 * h), (hd, 2 * h))
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        w[norm + ".weight"][:] = 1.0
    eye = np.eye(hd, dtype=np.float32)  # acts on the embedding half of the concatenated input
    w["midlayer.self_attn.q_proj.weight"][:, :hd] = QK_GAIN * eye
    w["midlayer.self_attn.k_proj.weight"][:, :hd] = QK_GAIN * eye
    w["midlayer.self_attn.v_proj.weight"][:, :hd] = eye
    w["midlayer.self_attn.o_proj.weight"][:] = eye
    i = cfg.intermediate_size
    w["midlayer.mlp.gate_proj.weight"][:] = rng.normal(0.0, 1.0 / np.sqrt(hd), (i, hd))
    w["midlayer.mlp.up_proj.weight"][:] = rng.normal(0.0, 1.0 / np.sqrt(hd), (i, hd))
    w["midlayer.mlp.down_proj.weight"][:] = rng.normal(0.0, 0.05 / np.sqrt(i), (hd, i))
    w["embed_tokens.weight"][:, :h] = base_embed  # the embedding, in the lower half
    return w


def _fit(base: Decoder, cfg_dict: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """The draft's tensors, fitted to ``base`` (module docstring)."""
    rng = np.random.default_rng(seed + 1)
    cfg = Eagle3DraftConfig.from_dict(cfg_dict)
    seqs = _base_tokens(base, rng)
    w = _structure(cfg, np.asarray(base._embed, np.float32), rng)
    # the draft vocabulary: the ids the base emits most, ascending
    counts = np.bincount(np.concatenate([s[1:] for s in seqs]), minlength=cfg.vocab_size)
    order = np.lexsort((np.arange(cfg.vocab_size), -counts))
    vocab = np.sort(order[: cfg.draft_vocab_size])
    w["d2t"] = (vocab - np.arange(cfg.draft_vocab_size)).astype(np.int64)
    w["t2d"] = np.zeros(cfg.vocab_size, dtype=bool)
    w["t2d"][vocab] = True
    w["lm_head.weight"] = np.zeros((cfg.draft_vocab_size, cfg.hidden_size), np.float32)
    draft = Eagle3Draft(cfg, w)
    feats, targets = [], []
    for ids in seqs:
        n = len(ids)
        bc = base.new_cache(n)
        cos, sin = base.config.rope.cos_sin(np.arange(n), dtype=np.float32)
        logits, taps = base.forward_tree(base.embed(ids), bc, cos, sin, _causal(n), taps=AUX_LAYERS)
        # draft row t reads token t+1's embedding with the base's taps at t, predicting token t+2
        g = draft.fc(np.concatenate(taps, axis=-1)[: n - 1])
        dc = draft.new_cache(n)
        dcos, dsin = cfg.rope.cos_sin(np.arange(n - 1), dtype=np.float32)
        out, _ = draft.forward(draft.embed(ids[1:]), g, dc, dcos, dsin, _causal(n - 1))
        normed = out / np.sqrt(np.mean(out.astype(np.float64) ** 2, axis=-1, keepdims=True) + cfg.rms_norm_eps)
        feats.append(normed)
        targets.append(logits[1:][:, vocab])
    x = np.concatenate(feats).astype(np.float64)
    y = np.concatenate(targets).astype(np.float64)
    y -= y.mean(axis=1, keepdims=True)
    lm = np.linalg.solve(x.T @ x + RIDGE * len(x) * np.eye(x.shape[1]), x.T @ y)
    w["lm_head.weight"] = lm.T.astype(np.float32)
    return w


def _damp_layers(model_dir: Path) -> None:
    """Scale the base's residual writers (``o_proj``, ``down_proj``) by :data:`LAYER_GAIN`."""
    path = model_dir / "model.safetensors"
    weights = load_safetensors(model_dir)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = (weights[name] * np.float32(LAYER_GAIN)).astype(np.float32)
    save_safetensors(path, weights, metadata={"format": "pt"})


def build_eagle3(out_dir: str | os.PathLike, base_arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny EAGLE-3 checkpoint (the base in ``out_dir``, the draft in ``out_dir/eagle3_draft``).

    Args:
        out_dir: destination directory (created; our files overwritten).
        base_arch: the base family, one of :data:`EAGLE3_BASE_ARCHES`.
        seed: the base's weight seed (the draft's fit data use ``seed + 1``).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: ``base_arch`` is not an EAGLE-3 base family; what :func:`build` raises.
    """
    if base_arch not in EAGLE3_BASE_ARCHES:
        raise ValueError(f"EAGLE-3 base arch {base_arch!r} must be one of {', '.join(EAGLE3_BASE_ARCHES)}")
    out = build(base_arch, out_dir, seed=seed, num_hidden_layers=BASE_LAYERS)
    _damp_layers(out)
    base = Decoder.from_pretrained(out)
    cfg = _draft_config(base)
    weights = _fit(base, cfg, seed)
    draft_dir = out / DRAFT_DIR
    draft_dir.mkdir(exist_ok=True)
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_safetensors(draft_dir / "model.safetensors", weights, metadata={"format": "pt"})
    return out
