"""Prompt logprobs for the MBLT worker: per prompt position, the log-softmax of the logits
after that position, gathered for the next prompt token and the top ``k``.

vLLM wants, for a prompt of ``P`` tokens, ``P - 1`` rows: row ``p`` scores prompt token
``p + 1`` under the logits after tokens ``[0, p]``. An MXQ that emits every position's logits
(``"all"`` layout) gives a chunk's rows from one infer. An MXQ that emits the last position's
logits only (``"last"``, the usual release) gives them by the seed's 1-token microstep path:
the request's prompt is fed one token per infer, each infer's output being the logits after
that token. Rows are gathered as soon as they are computed (``k + 1`` values per position, not
the vocabulary-wide logits), by vLLM's own ``Sampler.compute_logprobs`` /
``Sampler.gather_logprobs``, so values, ranks and tie order are those of vLLM's GPU runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

#: Logged once per worker when a last-logit MXQ serves prompt logprobs (the seed's wording).
MICROSTEP_WARNING = (
    "Prompt logprobs on last-logit MBLT/MXQ outputs use a slower 1-token microstep path. "
    "Compile the MXQ to emit every position's logits to score a prompt chunk in one infer."
)


class PromptLogprobsStateError(RuntimeError):
    """A request's prompt logprobs were asked for before every position was computed."""


@dataclass
class PromptLogprobs:
    """The prompt-logprob rows of one request, filled position by position.

    Attributes:
        req_id: the request (named in errors).
        prompt_ids: its prompt token ids (``P`` of them).
        k: top logprobs per position (besides the prompt token's own).
    """

    req_id: str
    prompt_ids: list[int]
    k: int
    ids: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)
    ranks: np.ndarray = field(init=False)
    filled: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        rows = max(len(self.prompt_ids) - 1, 0)
        self.ids = np.zeros((rows, self.k + 1), np.int64)
        self.values = np.zeros((rows, self.k + 1), np.float32)
        self.ranks = np.zeros((rows,), np.int64)
        self.filled = np.zeros((rows,), bool)

    @property
    def num_rows(self) -> int:
        """``P - 1``."""
        return len(self.filled)

    def needs_logits_at(self, position: int) -> bool:
        """Whether the logits after token ``position`` score a prompt token."""
        return 0 <= position < self.num_rows

    def record(self, start: int, logits: np.ndarray) -> None:
        """Score the positions ``start, start + 1, ...`` from their logits ``[T, vocab]`` (rows
        past ``P - 2`` are ignored: they score generated tokens, not the prompt)."""
        from vllm.v1.sample.sampler import Sampler

        logits = logits if logits.ndim == 2 else logits[None]
        stop = min(start + len(logits), self.num_rows)
        if stop <= start:
            return
        rows = torch.from_numpy(np.ascontiguousarray(logits[: stop - start], dtype=np.float32))
        targets = torch.tensor(self.prompt_ids[start + 1: stop + 1], dtype=torch.int64)
        ids, values, ranks, *_ = Sampler.gather_logprobs(Sampler.compute_logprobs(rows), self.k, targets)
        self.ids[start:stop] = ids.numpy()
        self.values[start:stop] = values.numpy()
        self.ranks[start:stop] = ranks.numpy()
        self.filled[start:stop] = True

    def tensors(self):
        """vLLM's ``LogprobsTensors`` for the whole prompt (``P - 1`` rows).

        Raises:
            PromptLogprobsStateError: a position was never computed (names the request and
                the first missing position).
        """
        from vllm.v1.outputs import LogprobsTensors

        missing = np.flatnonzero(~self.filled)
        if missing.size:
            raise PromptLogprobsStateError(
                f"req_id={self.req_id}: prompt logprobs missing from position {int(missing[0])} "
                f"({missing.size} of {self.num_rows} positions were not computed)"
            )
        return LogprobsTensors(torch.from_numpy(self.ids), torch.from_numpy(self.values),
                               torch.from_numpy(self.ranks))
