"""The three EAGLE-3 MXQ kinds (``FORMAT.md``): their inputs, outputs and computation.

An EAGLE-3 release (:mod:`npusim.mxq.compile_eagle3`) ships three MXQs, each fed by
transformers-mblt's host code with rank-4 float32 inputs ``[1, 1, T, C]``:

============== ============================================================ =========================
kind            inputs (in order)                                            outputs (default order)
============== ============================================================ =========================
eagle3_base     inputs_embeds ``H``, attention_mask ``cache_size+T``,         hidden1, hidden2, hidden3
                position_embs ``P``                                           ``H`` each, logits ``V``
eagle3_fc       hidden_states ``3H``                                          hidden ``Hd``
eagle3_draft    inputs_embeds ``Hd``, hidden_states ``Hd``, attention_mask   hidden ``Hd``, logits ``Dv``
                ``cache_size+T``, position_embs ``Pd``
============== ============================================================ =========================

The base computes with :meth:`npusim.llm.Decoder.forward_tree` (the three ``hidden`` outputs are
its taps at the header's ``eagle3_taps``: the residual stream entering those layers), fc with
:meth:`npusim.llm.eagle3.Eagle3Draft.fc` and the draft with :meth:`Eagle3Draft.forward`: the same
code as the golden pieces, so outputs are bit-identical to them in float32.

``attention_mask``: 1.0 (any non-zero) = masked, 0.0 = visible; every row must see at least one
key. ``position_embs``: the host's packed RoPE rows (:func:`pack_rope_rows`), unpacked here
(:func:`unpack_rope_rows`) to the ``cos``/``sin`` tables ``[T, head_dim]`` the golden code takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..llm import Decoder, KVCache
from ..llm import ModelConfig as LlmConfig
from ..llm.eagle3 import Eagle3Draft, Eagle3DraftConfig, draft_tensor_shapes

__all__ = ["EAGLE3_KINDS", "EAGLE3_INPUTS", "EAGLE3_OUTPUTS", "Eagle3Part", "Eagle3InputError", "kind_tensor_names",
           "pack_rope_rows", "rope_row_width", "unpack_rope_rows"]

#: Input names of each kind, in the order ``Model.infer`` takes them.
EAGLE3_INPUTS: dict[str, tuple[str, ...]] = {
    "eagle3_base": ("inputs_embeds", "attention_mask", "position_embs"),
    "eagle3_fc": ("hidden_states",),
    "eagle3_draft": ("inputs_embeds", "hidden_states", "attention_mask", "position_embs"),
}
#: Output names of each kind, in the default order (the header's ``outputs`` may permute them).
EAGLE3_OUTPUTS: dict[str, tuple[str, ...]] = {
    "eagle3_base": ("hidden1", "hidden2", "hidden3", "logits"),
    "eagle3_fc": ("hidden",),
    "eagle3_draft": ("hidden", "logits"),
}
EAGLE3_KINDS: tuple[str, ...] = tuple(EAGLE3_INPUTS)
#: Draft-checkpoint tensors each draft-side kind's payload holds (the others stay on the host or
#: in the other MXQ).
_DRAFT_SIDE: dict[str, tuple[str, ...]] = {
    "eagle3_fc": ("fc.weight",),
    "eagle3_draft": tuple(n for n in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                                      "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                                      "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                                      "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                                      "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
                                      "norm.weight", "lm_head.weight")),
}


class Eagle3InputError(ValueError):
    """An input of an EAGLE-3 MXQ infer is wrong (count, shape, mask); the message names it."""


def rope_row_width(head_dim: int) -> int:
    """``P = 2 * ceil64(head_dim)``: the width of one packed RoPE row, elements."""
    return 2 * (-(-int(head_dim) // 64) * 64)


def pack_rope_rows(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Pack ``cos``/``sin`` ``[T, C]`` (``C = head_dim``, even) into the host's RoPE rows ``[T, P]``.

    With ``h = C/2`` and ``Cp = ceil64(C)``: ``row[0:C:2] = cos[:, :h]``, ``row[1:C:2] = -sin[:, :h]``,
    ``row[Cp:Cp+C:2] = sin[:, h:]``, ``row[Cp+1:Cp+C:2] = cos[:, h:]``, zeros elsewhere (float32).

    Raises:
        ValueError: ``cos`` and ``sin`` differ in shape, are not 2-D, or have an odd width.
    """
    c, s = np.asarray(cos, dtype=np.float32), np.asarray(sin, dtype=np.float32)
    if c.shape != s.shape or c.ndim != 2 or c.shape[1] % 2:
        raise ValueError(f"cos and sin must both be [T, head_dim] with an even head_dim, got {list(c.shape)} "
                         f"and {list(s.shape)}")
    t, width = c.shape
    h, cp = width // 2, rope_row_width(width) // 2
    rows = np.zeros((t, 2 * cp), dtype=np.float32)
    rows[:, 0:width:2] = c[:, :h]
    rows[:, 1:width:2] = -s[:, :h]
    rows[:, cp:cp + width:2] = s[:, h:]
    rows[:, cp + 1:cp + width:2] = c[:, h:]
    return rows


def unpack_rope_rows(rows: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`pack_rope_rows`: ``(cos, sin)``, each float32 ``[T, head_dim]``.

    Raises:
        ValueError: ``rows`` is not ``[T, rope_row_width(head_dim)]``.
    """
    r = np.asarray(rows, dtype=np.float32)
    p = rope_row_width(head_dim)
    if r.ndim != 2 or r.shape[1] != p:
        raise ValueError(f"RoPE rows must have shape [T, {p}] for head_dim {head_dim}, got {list(r.shape)}")
    h, cp = head_dim // 2, p // 2
    cos = np.concatenate([r[:, 0:head_dim:2], r[:, cp + 1:cp + head_dim:2]], axis=1)
    sin = np.concatenate([-r[:, 1:head_dim:2], r[:, cp:cp + head_dim:2]], axis=1)
    assert cos.shape[1] == 2 * h
    return cos, sin


def kind_tensor_names(kind: str, names: Sequence[str]) -> list[str]:
    """The checkpoint tensors an MXQ of ``kind`` carries, out of ``names`` (a base checkpoint's
    for ``eagle3_base``: all of them; a draft checkpoint's for the others)."""
    if kind == "eagle3_base":
        return list(names)
    return [n for n in names if n in _DRAFT_SIDE[kind]]


class Eagle3Part:
    """One EAGLE-3 MXQ's computation and I/O shapes.

    Attributes:
        kind: ``eagle3_base``, ``eagle3_fc`` or ``eagle3_draft``.
        hidden_size: the width of the first input (``H``, ``3H`` for fc, ``Hd``).
        head_dim: the attention's head size (``None`` for fc).
        kv_layers: how many KV layers the MXQ holds (base: all its layers; draft: 1; fc: 0).
    """

    def __init__(self, kind: str, llm_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                 taps: Sequence[int] | None = None, source: str = "weights") -> None:
        """Build the golden piece ``kind`` computes with.

        Args:
            llm_config: the base's HF config (``eagle3_base``) or the draft checkpoint's config.
            tensors: the MXQ payload (:func:`kind_tensor_names`).
            taps: ``eagle3_base`` only: the three layers whose input residual streams are hidden1..3.

        Raises:
            ValueError: an unknown kind; ``taps`` not three layer indices in ``[0, num_hidden_layers]``.
            CheckpointError / UnsupportedModelError: the golden code refuses config or tensors.
        """
        if kind not in EAGLE3_KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(EAGLE3_KINDS)}")
        self.kind = kind
        self._base: Decoder | None = None
        self._draft: Eagle3Draft | None = None
        if kind == "eagle3_base":
            cfg = LlmConfig.from_dict(dict(llm_config))
            if (not isinstance(taps, (list, tuple)) or len(taps) != 3 or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= cfg.num_hidden_layers for t in taps)):
                raise ValueError(f"eagle3_taps={taps!r} must be three layer indices in [0, {cfg.num_hidden_layers}]")
            if any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
                raise ValueError(f"{cfg.model_type} has sliding-window layers, which an EAGLE-3 base MXQ cannot hold")
            self._base = Decoder(cfg, tensors, np.float32, source=source)
            self.taps: tuple[int, ...] = tuple(int(t) for t in taps)
            self.hidden_size, self.head_dim = cfg.hidden_size, cfg.head_dim
            self.kv_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
            self._kv_heads = cfg.num_key_value_heads
        else:
            dcfg = Eagle3DraftConfig.from_dict(llm_config)
            full = {n: np.zeros(s, np.int64 if n == "d2t" else (bool if n == "t2d" else np.float32))
                    for n, s in draft_tensor_shapes(dcfg).items()}
            full.update({n: tensors[n] for n in _DRAFT_SIDE[kind] if n in tensors})
            missing = [n for n in _DRAFT_SIDE[kind] if n not in tensors]
            if missing:
                from ..llm.errors import CheckpointError

                raise CheckpointError(f"{source}: {kind} MXQ payload lacks {missing}")
            self._draft = Eagle3Draft(dcfg, full, np.float32, source=source)
            self.taps = ()
            self.hidden_size = 3 * dcfg.target_hidden_size if kind == "eagle3_fc" else dcfg.hidden_size
            self.head_dim = dcfg.head_dim if kind == "eagle3_draft" else None
            self.kv_layers = 1 if kind == "eagle3_draft" else 0
            self.vocab_size = dcfg.draft_vocab_size
            self._kv_heads = dcfg.num_key_value_heads
            self._hd = dcfg.hidden_size

    # ------------------------------------------------------------------ shapes
    @property
    def input_names(self) -> tuple[str, ...]:
        return EAGLE3_INPUTS[self.kind]

    def input_channels(self) -> list[int]:
        """Channels of each input; ``-1`` for the mask, whose width is ``cache_size + T``."""
        if self.kind == "eagle3_fc":
            return [self.hidden_size]
        p = rope_row_width(self.head_dim or 0)
        if self.kind == "eagle3_base":
            return [self.hidden_size, -1, p]
        return [self.hidden_size, self.hidden_size, -1, p]

    def output_channels(self, name: str) -> int:
        """Channels of output ``name``."""
        if name == "logits":
            return self.vocab_size
        if self.kind == "eagle3_base":
            return self.hidden_size
        return self._hd

    def kv_bytes(self) -> int:
        """Bytes of one KV layer's keys and values per token (float32)."""
        return 2 * self._kv_heads * (self.head_dim or 0) * 4

    def new_cache(self, capacity: int) -> KVCache:
        """The KV cache of this MXQ (``capacity`` tokens; fc has none: a 0-layer cache is never built)."""
        if self._base is not None:
            return self._base.new_cache(capacity)
        assert self._draft is not None
        return self._draft.new_cache(capacity)

    # ------------------------------------------------------------------ compute
    def check(self, arrays: Sequence[np.ndarray], cache_size: int) -> int:
        """Check the rank-2 inputs ``[T, C]`` against this kind; returns T.

        Raises:
            Eagle3InputError: a shape other than the kind's (name, expected and got), a mask row
                that sees no key.
        """
        names, chans = self.input_names, self.input_channels()
        t = arrays[0].shape[0]
        for i, (name, a, c) in enumerate(zip(names, arrays, chans)):
            want = [1, 1, t, cache_size + t if c == -1 else c]
            if a.shape != (t, want[-1]):
                raise Eagle3InputError(f"Input shape is invalid: inputs[{i}] ({name}) expected {want}, "
                                       f"got {[1, 1, *a.shape]}.")
        if "attention_mask" in names:
            m = arrays[names.index("attention_mask")] != 0
            blind = np.flatnonzero(m.all(axis=1))
            if blind.size:
                raise Eagle3InputError(f"attention_mask row {int(blind[0])} masks every key (1.0 = masked): each "
                                       "row must see at least one position.")
        return t

    def run(self, arrays: Sequence[np.ndarray], cache: KVCache | None) -> dict[str, np.ndarray]:
        """Compute the outputs, by name, each float32 ``[T, C]``; KV written at ``[cache.length, +T)``.

        ``arrays`` passed :meth:`check`. Raises: what the golden pieces raise.
        """
        if self.kind == "eagle3_fc":
            assert self._draft is not None
            return {"hidden": self._draft.fc(arrays[0]).astype(np.float32)}
        assert cache is not None and self.head_dim is not None
        *data, mask, rope = arrays
        cos, sin = unpack_rope_rows(rope, self.head_dim)
        hide = mask != 0
        if self._base is not None:
            logits, taps = self._base.forward_tree(data[0], cache, cos, sin, hide, taps=self.taps)
            return {"hidden1": taps[0], "hidden2": taps[1], "hidden3": taps[2], "logits": logits}
        assert self._draft is not None
        out, logits = self._draft.forward(data[0], data[1], cache, cos, sin, hide)
        return {"hidden": out, "logits": logits}
