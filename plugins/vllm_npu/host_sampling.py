"""Host-side sampling for the device workers: vLLM's own ``Sampler`` on the device's logits.

The device returns logits; sampling (temperature, top-p, top-k, seeds, logprobs, bad words and
the frequency / presence / repetition penalties) runs on the CPU with vLLM's sampler, as
vllm-mblt and vllm-rbln (with ``--no-rbln-use-custom-sampler``) do. ``allowed_token_ids`` is
vLLM's mask of the sampler's metadata (as are ``logprob_token_ids``, the logprobs of named
tokens), and ``min_p``, ``min_tokens`` and ``logit_bias`` are vLLM's
own built-in logits processors (with the server's ``--logits-processors`` beside them), built by
vLLM's ``build_logitsprocs``. They keep per-request state by batch row: each step the sampler
hands them the step's rows as vLLM's ``BatchUpdate`` (row ``i`` of the logits is request ``i``,
re-added every step with its output so far; rows past the step's batch are removed), so a
processor sees every request it serves at every step. A device whose vendor has a
switch for the penalties passes its value and its name (MBLT: ``VLLM_MBLT_ENABLE_SAMPLING_PENALTIES=0``,
see :mod:`vllm_npu.mblt.sampling`); the sampler then logs once which ones it dropped. The
sampler reads no switch itself, so one device's switch never reaches another's sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.vllm_npu")

_GREEDY_EPS = 1e-5
#: Rows a step may sample when the sampler is built without the server's config (tests).
DEFAULT_MAX_ROWS = 256


def num_logprobs(params: object, vocab_size: int, field: str = "logprobs") -> int | None:
    """How many top logprobs a request asked for in ``field`` (``logprobs`` or
    ``prompt_logprobs``): None when it asked for none, the whole vocabulary for -1 (vLLM's
    meaning of -1, as its own input batch reads it), else the number, at most ``vocab_size``."""
    n = getattr(params, field, None) if params is not None else None
    if n is None:
        return None
    n = int(n)
    return int(vocab_size) if n == -1 else min(n, int(vocab_size))


def request_generator(params: object) -> torch.Generator | None:
    """The CPU generator a request samples with: seeded with ``params.seed`` when the request
    set one (its samples then repeat run to run), else None (the sampler's shared stream)."""
    seed = getattr(params, "seed", None) if params is not None else None
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


@dataclass
class SampleRequest:
    """What the sampler needs of one request: its params, ids so far and its generator."""

    params: object  # vllm.SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None


class HostSampler:
    """Builds vLLM ``SamplingMetadata`` per step and runs vLLM's ``Sampler``.

    Args:
        vocab_size: logits width.
        vllm_config: the server's config: its ``max_num_seqs`` sizes the logits processors, its
            ``--logits-processors`` join vLLM's built-in ones and its ``--logprobs-mode`` is the
            sampler's (None: the built-ins alone, for at most :data:`DEFAULT_MAX_ROWS` rows a
            step, and raw logprobs; tests).
        enable_penalties: apply frequency/presence/repetition penalties (default on; a device
            with a vendor switch passes its value, e.g. MBLT's :func:`vllm_npu.mblt.sampling.penalties_enabled`).
        switch: the setting that turned them off, named in the warning (required when
            ``enable_penalties`` is False).
        log: where the warning goes (default ``vllm.vllm_npu``).

    Raises:
        ValueError: penalties off without the ``switch`` that turned them off.
    """

    def __init__(self, vocab_size: int, enable_penalties: bool = True,
                 switch: str | None = None, log: logging.Logger | None = None, vllm_config: Any = None) -> None:
        from vllm.v1.sample.sampler import Sampler

        if not enable_penalties and not switch:
            raise ValueError("HostSampler(enable_penalties=False) needs the switch that turned them off")
        self.vocab_size = int(vocab_size)
        self.enable_penalties = bool(enable_penalties)
        self.switch = switch
        self.log = log or logger
        self._warned: set[str] = set()
        if vllm_config is None:
            config: Any = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=DEFAULT_MAX_ROWS),
                                          speculative_config=None)
            custom: Sequence[Any] = ()
            mode = "raw_logprobs"
        else:
            config, custom = vllm_config, getattr(vllm_config.model_config, "logits_processors", None) or ()
            mode = str(getattr(vllm_config.model_config, "logprobs_mode", None) or "raw_logprobs")
        #: vLLM's ``--logprobs-mode``: raw_logprobs, raw_logits, processed_logprobs or processed_logits.
        self.logprobs_mode = getattr(mode, "value", mode)
        self._sampler = Sampler(logprobs_mode=self.logprobs_mode)
        self._config, self._custom = config, tuple(custom)
        self._build_logitsprocs(int(config.scheduler_config.max_num_seqs))

    def _dropped_penalties(self, params: object) -> None:
        dropped = [name for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                                              ("repetition_penalty", 1.0))
                   if getattr(params, name) != neutral and name not in self._warned]
        if dropped:
            self._warned.update(dropped)
            self.log.warning(
                "Sampling penalties are disabled by %s. Ignoring %s: the output is then generated "
                "under different sampling than a reference run that applies them.",
                self.switch, ", ".join(dropped),
            )

    def metadata(self, reqs: Sequence[SampleRequest]):
        from vllm.v1.sample.metadata import SamplingMetadata

        n = len(reqs)
        temps, top_p, top_k, gens = [], [], [], {}
        freq, pres, rep = [], [], []
        for i, r in enumerate(reqs):
            p = r.params
            greedy = p.temperature < _GREEDY_EPS or p.top_k == 1
            temps.append(0.0 if greedy else float(p.temperature))
            top_p.append(float(p.top_p))
            top_k.append(int(p.top_k) if p.top_k and p.top_k > 0 else self.vocab_size)
            if not greedy and r.generator is not None:
                gens[i] = r.generator
            if self.enable_penalties:
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
                rep.append(p.repetition_penalty)
            else:
                self._dropped_penalties(p)
                freq.append(0.0)
                pres.append(0.0)
                rep.append(1.0)
        all_greedy = all(t == 0.0 for t in temps)
        all_random = all(t != 0.0 for t in temps)
        no_penalties = all(f == 0.0 and q == 0.0 and r_ == 1.0 for f, q, r_ in zip(freq, pres, rep))
        prompt_tensor = None
        if not no_penalties:
            width = max(len(r.prompt_ids) for r in reqs)
            arr = np.full((n, max(width, 1)), self.vocab_size, dtype=np.int64)
            for i, r in enumerate(reqs):
                arr[i, : len(r.prompt_ids)] = r.prompt_ids
            prompt_tensor = torch.from_numpy(arr)
        logprobs = [n for r in reqs if (n := num_logprobs(r.params, self.vocab_size)) is not None]
        bad_words = {i: r.params.bad_words_token_ids for i, r in enumerate(reqs)
                     if getattr(r.params, "bad_words_token_ids", None)}
        return SamplingMetadata(
            temperature=None if all_greedy else torch.tensor(temps, dtype=torch.float32),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=None if all(v == 1.0 for v in top_p) else torch.tensor(top_p, dtype=torch.float32),
            top_k=None if all(v == self.vocab_size for v in top_k) else torch.tensor(top_k, dtype=torch.int32),
            generators=gens,
            max_num_logprobs=max(logprobs) if logprobs else None,
            no_penalties=no_penalties,
            prompt_token_ids=prompt_tensor,
            frequency_penalties=torch.tensor(freq, dtype=torch.float32),
            presence_penalties=torch.tensor(pres, dtype=torch.float32),
            repetition_penalties=torch.tensor(rep, dtype=torch.float32),
            output_token_ids=[list(r.output_ids) for r in reqs],
            allowed_token_ids_mask=self._allowed_mask(reqs),
            logprob_token_ids={i: list(r.params.logprob_token_ids) for i, r in enumerate(reqs)
                               if getattr(r.params, "logprob_token_ids", None)} or None,
            bad_words_token_ids=bad_words,
            logitsprocs=self._step_logitsprocs(reqs),
        )

    def _allowed_mask(self, reqs: Sequence[SampleRequest]) -> torch.Tensor | None:
        """vLLM's ``allowed_token_ids_mask``: True where a row's token is *not* allowed (None
        when no request restricts its tokens)."""
        rows = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs)
                if getattr(r.params, "allowed_token_ids", None)]
        if not rows:
            return None
        mask = torch.zeros((len(reqs), self.vocab_size), dtype=torch.bool)
        for i, allowed in rows:
            mask[i] = True
            mask[i, torch.as_tensor(list(allowed), dtype=torch.long)] = False
        return mask

    def _build_logitsprocs(self, max_rows: int) -> None:
        """vLLM's ``build_logitsprocs`` for ``max_rows`` rows a step (state starts empty: every
        step re-adds its rows)."""
        from vllm.v1.sample.logits_processor import build_logitsprocs

        config = self._config
        if max_rows != int(config.scheduler_config.max_num_seqs):
            config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
                                     speculative_config=getattr(config, "speculative_config", None))
        self.max_rows = max_rows
        self.logitsprocs = build_logitsprocs(config, torch.device("cpu"), False, False, self._custom)
        self._rows = 0  # the batch size the logits processors hold state for

    def _step_logitsprocs(self, reqs: Sequence[SampleRequest]):
        """The logits processors, told this step's rows (see the module docstring)."""
        from vllm.v1.sample.logits_processor import BatchUpdate

        n = len(reqs)
        if n > self.max_rows:  # a step past max_num_seqs (a test driving the worker directly)
            self._build_logitsprocs(n)
        update = BatchUpdate(
            batch_size=n,
            removed=list(range(self._rows - 1, n - 1, -1)),  # rows past this batch, descending
            added=[(i, r.params, list(r.prompt_ids), list(r.output_ids)) for i, r in enumerate(reqs)],
            moved=[])
        for proc in self.logitsprocs.all:
            proc.update_state(update)
        self._rows = n
        return self.logitsprocs

    def sample(self, logits: np.ndarray, reqs: Sequence[SampleRequest], *, grammar: Any = None):
        """Sample one token per row of ``logits`` ``[len(reqs), vocab]``.

        Args:
            grammar: ``(scheduler_output, grammar_output, row_req_ids)``: vLLM's grammar bitmask
                of the step's structured-output requests, applied to the rows of
                ``row_req_ids`` before sampling with vLLM's own ``apply_grammar_bitmask``
                (``-inf`` on every token the grammar forbids), as vLLM's model runner does.

        Returns:
            ``(token_ids: list[int], logprobs_tensors or None)`` (vLLM's ``LogprobsTensors``).
        """
        # a copy: vLLM's sampler masks and biases the logits in place, and they are the caller's
        t = torch.from_numpy(np.array(logits, dtype=np.float32, order="C", copy=True))
        if grammar is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask

            scheduler_output, grammar_output, row_req_ids = grammar
            apply_grammar_bitmask(scheduler_output, grammar_output, SimpleNamespace(req_ids=list(row_req_ids)), t)
        out = self._sampler.forward(t, self.metadata(reqs))
        return out.sampled_token_ids.view(-1).tolist(), out.logprobs_tensors


def scatter_logprobs(logprobs_tensors, rows: Sequence[int], num_reqs: int):
    """vLLM's ``LogprobsLists`` for a step of ``num_reqs`` requests, from the sampler's
    ``LogprobsTensors`` of the sampled ones: sampled row ``k`` is request ``rows[k]``; the
    requests that sampled nothing get zero rows. None when there are no logprobs."""
    if logprobs_tensors is None:
        return None
    from vllm.v1.outputs import LogprobsLists

    lists = logprobs_tensors.tolists()
    width = lists.logprobs.shape[1]
    ids = np.zeros((num_reqs, width), lists.logprob_token_ids.dtype)
    vals = np.zeros((num_reqs, width), lists.logprobs.dtype)
    ranks = np.zeros((num_reqs,), lists.sampled_token_ranks.dtype)
    for k, i in enumerate(rows):
        ids[i], vals[i], ranks[i] = lists.logprob_token_ids[k], lists.logprobs[k], lists.sampled_token_ranks[k]
    return LogprobsLists(ids, vals, ranks, None)
