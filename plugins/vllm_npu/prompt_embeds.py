"""Prompt embeddings (``--enable-prompt-embeds``, ``prompt_embeds`` of shape ``[seq_len, hidden_size]``)
for every worker whose device takes input embeddings from the host (MBLT's MXQs, Neuron's prefill
NEFFs): :func:`prompt_embeds_of` reads a new request's embeddings once, checks them, and gives the
request record the ids the rest of the step engine reads.

vLLM sends an embeddings prompt with placeholder token ids (0), or, for a prompt that mixes ids
and embeddings, ``prompt_is_token_ids`` (True where the position is a token id). The embedding
positions then hold id 0 in :attr:`~vllm_npu.step_engine.Request.prompt_ids` and the vocabulary
size (vLLM's padding id, which no penalty counts) in
:attr:`~vllm_npu.step_engine.Request.penalty_prompt_ids`; the device writes
:attr:`PromptEmbeds.rows` in place of the token embeddings at :attr:`PromptEmbeds.positions`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PromptEmbeds", "PromptEmbedsError", "prompt_embeds_of", "content_key_ids"]


def content_key_ids(identifier: str, n: int) -> list[int]:
    """Negative ids standing for ``n`` positions of content named ``identifier`` (embeddings by
    their digest, an audio clip or an image by vLLM's item hash) in a device's KV bookkeeping: a
    pure function of ``identifier``, never equal to a token id or another item's."""
    return [-1 - int.from_bytes(hashlib.blake2b(f"{identifier}:{i}".encode(), digest_size=7).digest(), "little")
            for i in range(n)]


class PromptEmbedsError(ValueError):
    """Prompt embeddings the model cannot take (the message names the shapes)."""


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """A request's prompt embeddings.

    Attributes:
        positions: int64 ``[n]``, the prompt positions whose input is an embedding row.
        rows: float32 ``[n, hidden_size]``, their embeddings.
        digest: a content hash of all the embeddings (a KV prefix keyed by it is reused only for
            the same embeddings).
    """

    positions: np.ndarray
    rows: np.ndarray
    digest: str

    def key_ids(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` with content-derived ids (:func:`content_key_ids`) at the embedding
        positions: what a device's prefix bookkeeping compares, so KV is reused only for the
        same embeddings."""
        keys = list(prompt_ids)
        for p, k in zip(self.positions.tolist(), content_key_ids(f"prompt_embeds:{self.digest}", int(self.positions.size))):
            keys[p] = k
        return keys

    def window(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The offsets in ``[0, n)`` of the embedding positions in ``[start, start + n)``, and their rows."""
        sel = (self.positions >= start) & (self.positions < start + n)
        return self.positions[sel] - start, self.rows[sel]


def prompt_embeds_of(req: Any, new: Any, hidden_size: int, vocab_size: int) -> PromptEmbeds | None:
    """The embeddings of vLLM's ``NewRequestData`` ``new`` (None without), with ``req``'s
    ``prompt_ids`` and ``penalty_prompt_ids`` set as the module docstring says.

    Raises:
        PromptEmbedsError: embeddings that are not ``[tokens, hidden_size]``, or whose length is
            not the prompt's.
    """
    embeds = getattr(new, "prompt_embeds", None)
    if embeds is None:
        return None
    rows = np.asarray(embeds.detach().to("cpu").float().numpy() if hasattr(embeds, "detach") else embeds,
                      dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != hidden_size:
        raise PromptEmbedsError(f"req_id={req.req_id}: prompt_embeds of shape {tuple(rows.shape)}, expected "
                                f"[tokens, {hidden_size}]")
    n = rows.shape[0]
    if not req.prompt_ids:
        req.prompt_ids = [0] * n  # vLLM's placeholder ids of an embeddings-only prompt
    if len(req.prompt_ids) != n:
        raise PromptEmbedsError(f"req_id={req.req_id}: {n} prompt_embeds rows for a {len(req.prompt_ids)}-token prompt")
    is_token = getattr(new, "prompt_is_token_ids", None)
    mask = np.ones(n, bool) if is_token is None else ~np.asarray(is_token, bool)
    req.prompt_ids = [0 if m else int(t) for t, m in zip(req.prompt_ids, mask)]
    req.penalty_prompt_ids = [int(vocab_size) if m else t for t, m in zip(req.prompt_ids, mask)]
    positions = np.flatnonzero(mask)
    return PromptEmbeds(positions, rows[positions], hashlib.blake2b(rows.tobytes(), digest_size=16).hexdigest())
