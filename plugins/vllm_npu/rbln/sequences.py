"""A request's life inside the RBLN optimum worker: :class:`SequenceTable`.

The device holds each sequence's KV in its compiled runtime's paged buffers; vLLM's block
manager hands out the blocks. This module owns the per-request state and turns a step's
scheduled tokens into device work that obeys the compiled programs' static shapes:

* **one prefill at a time, in chunks.** vLLM may schedule a prompt in pieces over several
  steps; the device program runs a prompt from a chunk boundary only, so the table defers the
  prefill until the step that schedules the prompt's last token, then hands the whole prompt
  to the prefill program (optimum-rbln's ``prefill_decoder`` splits it into
  ``prefill_chunk_size`` chunks and zero-pads the last). Steps before that compute nothing and
  sample nothing, exactly as a partial prefill samples nothing in vLLM;
* **decodes batched, never mixed with a prefill**: every request at its next token forms one
  decode call, padded to the smallest compiled decode batch that fits;
* **block ids**: vLLM's block 0 is its null block, so device block = vLLM block - 1; unused
  table entries are device block 0 (a valid id, as the kernel reads every slot of a live
  partition); padding rows of a decode write a slot no sequence will read before writing it
  itself (:meth:`SequenceTable._padding_slot`).

Nothing here imports vLLM, torch or the device runtime.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SequenceStateError", "Seq", "Prefill", "Decode", "StepPlan", "SequenceTable", "select_bucket"]


class SequenceStateError(RuntimeError):
    """The scheduler's view and the table's disagree (names the request and both numbers)."""


def select_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n`` (``buckets`` ascending).

    Raises:
        SequenceStateError: ``n`` exceeds the largest bucket.
    """
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise SequenceStateError(f"a decode batch of {n} exceeds the largest compiled decoder ({buckets[-1]})")
    return buckets[i]


@dataclass(eq=False)
class Seq:
    """One request: its token ids, vLLM block ids and how much of it the device holds."""

    req_id: str
    prompt_ids: list[int]
    params: Any
    generator: Any
    blocks: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    scheduled_end: int = 0      # tokens vLLM has scheduled so far
    device_len: int = 0         # tokens whose KV is on the device

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def device_blocks(self, width: int) -> list[int]:
        """The device block table, ``width`` entries (unused entries are block 0)."""
        phys = [b - 1 for b in self.blocks]
        if any(b < 0 for b in phys):
            raise SequenceStateError(f"req_id={self.req_id}: vLLM gave the null block 0 as a KV block")
        if len(phys) > width:
            raise SequenceStateError(
                f"req_id={self.req_id}: {len(phys)} KV blocks exceed the compiled table of {width}")
        return phys + [0] * (width - len(phys))


@dataclass(frozen=True)
class Prefill:
    """Run the prefill program on ``ids`` from position 0 into ``table``."""

    seq: Seq
    ids: list[int]
    table: list[int]


@dataclass(frozen=True)
class Decode:
    """Run the decoder of ``batch`` rows; rows past ``len(seqs)`` are padding.

    Attributes:
        seqs: the live rows.
        batch: the compiled decoder's batch size.
        ids, positions: one token and its position per row (padding: 0, 0).
        tables: one device block table per row (padding: a block no live sequence uses).
    """

    seqs: tuple[Seq, ...]
    batch: int
    ids: list[int]
    positions: list[int]
    tables: list[list[int]]


@dataclass(frozen=True)
class StepPlan:
    """A step's device work: prefills one at a time, then one decode call (or none)."""

    prefills: tuple[Prefill, ...]
    decode: Decode | None

    def sampled(self) -> list[Seq]:
        """The sequences that sample a token this step, prefills first."""
        return [p.seq for p in self.prefills] + list(self.decode.seqs if self.decode else ())


class SequenceTable:
    """Per-request state of the worker (see the module docstring).

    Args:
        num_device_blocks: KV blocks in the compiled runtime.
        block_size: tokens per KV block.
        max_seq_len: compiled sequence length (the block table is ``max_seq_len // block_size``).
        decoder_buckets: compiled decode batch sizes.
    """

    def __init__(self, num_device_blocks: int, block_size: int, max_seq_len: int,
                 decoder_buckets: Iterable[int]) -> None:
        self.num_device_blocks = int(num_device_blocks)
        self.block_size = int(block_size)
        self.width = int(max_seq_len) // int(block_size)
        self.buckets = sorted(set(int(b) for b in decoder_buckets))
        self.seqs: dict[str, Seq] = {}

    # ------------------------------------------------------------------ scheduler events

    def add(self, req_id: str, prompt_ids: Sequence[int], params: Any, generator: Any,
            block_ids: Sequence[int], num_computed_tokens: int) -> Seq:
        """A new request.

        Raises:
            SequenceStateError: vLLM says part of it is already computed (a prefix-cache hit,
                which this worker does not take: prefix caching is off on this path).
        """
        if num_computed_tokens:
            raise SequenceStateError(
                f"req_id={req_id}: starts with {num_computed_tokens} computed tokens, but prefix "
                "caching is off on the RBLN optimum path")
        seq = Seq(req_id, list(prompt_ids), params, generator, list(block_ids))
        self.seqs[req_id] = seq
        return seq

    def update(self, req_id: str, new_block_ids: Sequence[int] | None, resumed: bool,
               num_computed_tokens: int, all_token_ids: Sequence[int] | None = None) -> Seq:
        """A running (or resumed) request's new blocks and computed-token count."""
        seq = self.seqs[req_id]
        if resumed:
            seq.blocks = list(new_block_ids or [])
            seq.device_len = 0  # its blocks were freed: the device KV is gone
            if all_token_ids is not None:
                seq.output_ids = list(all_token_ids[len(seq.prompt_ids):])
        elif new_block_ids:
            seq.blocks.extend(new_block_ids)
        seq.scheduled_end = num_computed_tokens
        return seq

    def finish(self, req_id: str) -> None:
        self.seqs.pop(req_id, None)

    def preempt(self, req_id: str) -> None:
        seq = self.seqs.get(req_id)
        if seq is not None:
            seq.device_len = 0
            seq.blocks = []

    # ------------------------------------------------------------------ a step

    def plan(self, num_scheduled: dict[str, int]) -> StepPlan:
        """The device work of a step that schedules ``num_scheduled[req_id]`` tokens each.

        Raises:
            SequenceStateError: a request the table does not know, or a decode batch larger
                than every compiled decoder.
        """
        prefills: list[Prefill] = []
        decodes: list[Seq] = []
        for rid, n in num_scheduled.items():
            seq = self.seqs.get(rid)
            if seq is None:
                raise SequenceStateError(f"req_id={rid} is scheduled but was never added")
            end = seq.scheduled_end + n
            seq.scheduled_end = end
            total = len(seq.prompt_ids) + len(seq.output_ids)
            if end < total:
                continue  # a piece of a prompt: deferred to the step that schedules its end
            if end != total:
                raise SequenceStateError(f"req_id={rid}: scheduled up to {end}, but it has {total} tokens")
            if seq.device_len == end - 1 and seq.device_len > 0:
                decodes.append(seq)
            else:
                if seq.device_len:
                    raise SequenceStateError(
                        f"req_id={rid}: the device holds {seq.device_len} tokens, the step needs "
                        f"{end - 1}: a prefill restarts from position 0 only")
                prefills.append(Prefill(seq, seq.all_ids[:end], self._table(seq)))
        done = {p.seq.req_id for p in prefills}
        return StepPlan(tuple(prefills), self._decode(decodes, done) if decodes else None)

    def _table(self, seq: Seq) -> list[int]:
        return seq.device_blocks(self.width)

    def _padding_slot(self, decoding: list[Seq], prefilled: set[str]) -> tuple[list[int], int]:
        """A (block table, position) a padding row may write without touching any token a
        sequence will read: every slot is written by its owner before the owner reads it, so
        a safe slot is one no sequence has written yet or will write again before reading.

        In order: slot 0 of a device block no sequence holds; slot 0 of a sequence whose
        prefill is still deferred; the slot after a decoding row's new token; the next slot of
        any other sequence with room in its blocks (one prefilled this step: the slot after its
        prompt; one not scheduled this step: the slot of its next token).

        Raises:
            SequenceStateError: none exists (every block held, every sequence at the end of its
                blocks once this step ran).
        """
        used = {b - 1 for s in self.seqs.values() for b in s.blocks}
        spare = next((b for b in range(self.num_device_blocks) if b not in used), None)
        if spare is not None:
            return [spare] + [0] * (self.width - 1), 0
        rows = {s.req_id for s in decoding}
        for s in self.seqs.values():
            if s.blocks and s.device_len == 0 and s.req_id not in rows and s.req_id not in prefilled:
                return self._table(s), 0
        for s in decoding:
            nxt = s.device_len + 1
            if nxt < len(s.blocks) * self.block_size:
                return self._table(s), nxt
        for s in self.seqs.values():
            if not s.blocks or s.req_id in rows:
                continue
            # A prefill of this step runs before the decode and fills [0, len(all_ids)).
            nxt = len(s.all_ids) if s.req_id in prefilled else s.device_len
            if nxt < len(s.blocks) * self.block_size:
                return self._table(s), nxt
        raise SequenceStateError(
            f"no KV slot to pad a decode of {len(decoding)} rows: all {self.num_device_blocks} "
            "blocks are held and every sequence is at the end of its blocks")

    def _decode(self, seqs: list[Seq], prefilled: set[str]) -> Decode:
        batch = select_bucket(len(seqs), self.buckets)
        tables = [self._table(s) for s in seqs]
        ids = [s.all_ids[-1] for s in seqs]
        positions = [s.device_len for s in seqs]
        if batch > len(seqs):
            table, pos = self._padding_slot(seqs, prefilled)
            for _ in range(batch - len(seqs)):
                tables.append(table)
                ids.append(0)
                positions.append(pos)
        return Decode(tuple(seqs), batch, ids, positions, tables)

    def done(self, plan: StepPlan) -> None:
        """Record that ``plan`` ran: every prefilled and decoded token is on the device."""
        for p in plan.prefills:
            p.seq.device_len = len(p.ids)
        if plan.decode is not None:
            for s in plan.decode.seqs:
                s.device_len += 1
