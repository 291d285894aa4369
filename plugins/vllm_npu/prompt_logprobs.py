"""Prompt logprobs for every NPU worker: per prompt position, the log-softmax of the logits
after that position, gathered for the next prompt token and the top ``k``.

vLLM wants, for a prompt of ``P`` tokens, ``P - 1`` rows: row ``p`` scores prompt token
``p + 1`` under the logits after tokens ``[0, p]``. The step engine gives a request that asks
(``prompt_logprobs``, or ``echo`` with ``logprobs``) a :class:`PromptLogprobs`
(:attr:`vllm_npu.step_engine.Request.prompt_logprobs`) and returns its rows in the step that
completes the prompt; the device fills them as it computes the prompt's positions:

* MBLT: an MXQ that emits every position's logits (``"all"`` layout) gives a chunk's rows from
  one infer; one that emits the last position's only gives them by the seed's 1-token
  microstep path (one token per infer);
* RBLN, optimum path: the compiled prefill returns the last position's logits, so the prompt's
  first token is prefilled and each later one fed through the batch-1 decoder;
  ``vllm`` path: the LM head of every row of each prefill chunk;
* Neuron: each prompt token is one 1-token prefill on the smallest prefill NEFF (the NEFFs
  return the logits at ``last_token_index`` only).

Rows are gathered as soon as they are computed (``k + 1`` values per position, not
the vocabulary-wide logits), by vLLM's own ``Sampler.compute_logprobs`` /
``Sampler.gather_logprobs``, so values, ranks and tie order are those of vLLM's GPU runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["PromptLogprobs", "PromptLogprobsStateError", "prompt_logprobs_of"]

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


def prompt_logprobs_of(req_id: str, params: object, prompt_ids: list[int], vocab_size: int) -> PromptLogprobs | None:
    """The empty :class:`PromptLogprobs` of a request whose ``params`` ask for prompt logprobs
    (top ``k`` as :func:`vllm_npu.host_sampling.num_logprobs` reads it), else None."""
    from vllm_npu.host_sampling import num_logprobs

    k = num_logprobs(params, vocab_size, "prompt_logprobs")
    return None if k is None else PromptLogprobs(req_id, list(prompt_ids), k)
