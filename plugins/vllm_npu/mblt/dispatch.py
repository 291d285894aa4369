"""One step's rows -> one ``infer`` per model instance -> logits back in caller order.

Pure functions over numpy arrays; the backend (:mod:`vllm_npu.mblt.backend`) runs the calls.

Facts (reference §3, §4 "Dispatch", §7 "Logits kind", §9): a batched MXQ (K > 1) takes
``infer([x], None, 0, [BatchParam(len_i, cache_size_i, cache_id_i), ...])`` with ``x`` the rows'
embeddings concatenated along the sequence axis, shaped ``(1, 1, sum_T, hidden)`` float32; a
non-batched one (K == 1) takes ``infer([x], None, cache_size)`` with one row. The output holds
either one row per item (``"last"``: each item's last-token logits) or one row per input token
(``"all"``); any other row count is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from vllm_npu.mblt.errors import MbltBackendError

__all__ = ["OutputLayout", "Row", "group_rows", "output_rows", "split_rows", "stack_embeds", "stack_extras"]

#: ``"last"``: one output row per item; ``"all"``: one per input token.
OutputLayout = Literal["last", "all"]


@dataclass(frozen=True, eq=False)
class Row:
    """One request's slice of a step.

    Attributes:
        model_idx: model instance owning the request's KV slot (``0 <= model_idx < models``).
        cache_id: KV slot inside that instance (``0 <= cache_id < k_per_model``).
        embeds: ``[T, hidden]`` input embeddings, ``T >= 1`` tokens; converted to float32.
        cache_size: KV tokens already held in that slot before this row (>= 0); the row is
            written at positions ``[cache_size, cache_size + T)``.
        extras: the MXQ's inputs after the embeddings for this row (a VLM text MXQ's packed RoPE
            rows, DeepStack rows), in input order, each with its ``T`` tokens on axis -2; a batch
            call concatenates each along that axis (:func:`stack_extras`). Empty for a text LLM.

    Raises:
        ValueError: negative indices or cache_size, ``embeds`` not 2-D or with ``T == 0``.
    """

    model_idx: int
    cache_id: int
    embeds: np.ndarray
    cache_size: int
    extras: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        for name in ("model_idx", "cache_id", "cache_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Row.{name} must be a non-negative int, got {value!r}")
        embeds = np.asarray(self.embeds, dtype=np.float32)
        if embeds.ndim != 2 or embeds.shape[0] < 1:
            raise ValueError(
                f"Row.embeds must be [T, hidden] with T >= 1, got shape {embeds.shape}"
            )
        object.__setattr__(self, "embeds", embeds)

    @property
    def n_tokens(self) -> int:
        """``T``, the row's token count."""
        return int(self.embeds.shape[0])


def group_rows(rows: Sequence[Row]) -> dict[int, list[int]]:
    """Row positions per ``model_idx``, models in first-appearance order, rows in caller order."""
    groups: dict[int, list[int]] = {}
    for pos, row in enumerate(rows):
        groups.setdefault(int(row.model_idx), []).append(pos)
    return groups


def stack_embeds(rows: Sequence[Row], hidden: int) -> np.ndarray:
    """The rows' embeddings as one ``(1, 1, sum_T, hidden)`` float32 input.

    Raises:
        MbltBackendError: a row's hidden size differs from the model's.
    """
    for row in rows:
        if row.embeds.shape[1] != hidden:
            raise MbltBackendError(
                f"Row embeds hidden size {row.embeds.shape[1]} does not match the MXQ's "
                f"hidden size {hidden} (model_idx={row.model_idx}, cache_id={row.cache_id})"
            )
    x = np.concatenate([row.embeds for row in rows], axis=0)
    return np.ascontiguousarray(x, dtype=np.float32).reshape(1, 1, x.shape[0], hidden)


def stack_extras(rows: Sequence[Row]) -> list[np.ndarray]:
    """The rows' extra inputs (:attr:`Row.extras`), each concatenated along its token axis (-2)
    into one float32 input; ``[]`` when the rows have none.

    Raises:
        MbltBackendError: rows with different numbers of extra inputs.
    """
    counts = {len(row.extras) for row in rows}
    if len(counts) > 1:
        raise MbltBackendError(f"rows of one call carry different numbers of extra inputs: {sorted(counts)}")
    n = counts.pop() if counts else 0
    return [np.ascontiguousarray(np.concatenate([row.extras[i] for row in rows], axis=-2), dtype=np.float32)
            for i in range(n)]


def output_rows(outputs: Sequence[np.ndarray], vocab: int, lengths: Sequence[int],
                layout: OutputLayout | None) -> tuple[np.ndarray, OutputLayout | None]:
    """The first output as ``[n_rows, vocab]`` and the layout that explains ``n_rows``.

    ``layout`` None (not known from the MXQ's shapes) is decided from the row count; when both
    readings fit (every row has one token) it stays None.

    Raises:
        MbltBackendError: the output does not reshape to ``[n, vocab]``, or ``n`` is neither the
            item count (``"last"``) nor the token count (``"all"``) allowed by ``layout``.
    """
    raw = np.asarray(outputs[0])
    n_items, n_tokens = len(lengths), int(sum(lengths))
    n_rows = raw.size // vocab if vocab > 0 else -1
    allowed = {"last": (n_items,), "all": (n_tokens,), None: (n_items, n_tokens)}[layout]
    if vocab <= 0 or raw.size % vocab != 0 or n_rows not in allowed:
        hint = ""
        if n_rows == 1 and n_items > 1:
            hint = (" The MXQ returned a single row: it may be compiled for batch 1; load a "
                    "batch-compiled MXQ or use max_batch_size=1.")
        pinned = f" The output layout is {layout!r}." if layout else ""
        raise MbltBackendError(
            f"Unexpected batched MXQ output row count {n_rows} (vocab={vocab}, raw size="
            f"{raw.size}) for active={n_items}, total_tokens={n_tokens}: expected {n_items} "
            f"(per-item last row) or {n_tokens} (per-token flat)." + pinned + hint
        )
    if layout is None and n_items != n_tokens:
        layout = "last" if n_rows == n_items else "all"
    return raw.reshape(n_rows, vocab), layout


def split_rows(flat: np.ndarray, lengths: Sequence[int],
               layout: OutputLayout | None) -> list[np.ndarray]:
    """Per-item logits from ``[n_rows, vocab]``: ``[vocab]`` each for ``"last"`` (or an
    undecided layout, where every item has one token), ``[T_i, vocab]`` each for ``"all"``."""
    if layout != "all":
        return [flat[i] for i in range(len(lengths))]
    bounds = np.cumsum([0, *lengths])
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]
