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
  itself (:meth:`SequenceTable._padding_slot`);
* **prefix caching** (``prefix_chunk`` given): the table gives out the device blocks itself
  and a prompt starts from the longest chunk-aligned prefix the device verifiably holds
  (:class:`PrefixBlocks`); vLLM's blocks are then only its sub-block accounting.

A sequence is the step engine's request record (:class:`vllm_npu.step_engine.Request`) with the
device's two facts added; ``num_computed`` is the tokens vLLM has scheduled so far. Nothing here
imports vLLM, torch or the device runtime.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_npu.step_engine import Request

__all__ = ["SequenceStateError", "Seq", "Prefill", "Decode", "DevicePlan", "SequenceTable", "PrefixBlocks",
           "select_bucket"]


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
class Seq(Request):
    """One request (:class:`vllm_npu.step_engine.Request`) and how much of it the device holds."""

    device_len: int = 0         # tokens whose KV is on the device
    phys: list[int] | None = None  # prefix mode: the device blocks the table gave it
    #: prompt embeddings (vllm_npu.prompt_embeds.PromptEmbeds), None for a token prompt
    embeds: Any = None
    #: the prompt's ids for the KV bookkeeping: embedding positions hold content-derived ids
    key_prompt_ids: list[int] | None = None

    @property
    def all_ids(self) -> list[int]:
        """The ids the table plans and compares (a prefix is reused only for the same ids):
        embedding positions hold their content-derived ids."""
        return (self.key_prompt_ids or self.prompt_ids) + self.output_ids

    def device_blocks(self, width: int) -> list[int]:
        """The device block table, ``width`` entries (unused entries are block 0)."""
        if self.phys is not None:
            return self.phys + [0] * (width - len(self.phys))
        phys = [b - 1 for b in self.blocks]
        if any(b < 0 for b in phys):
            raise SequenceStateError(f"req_id={self.req_id}: vLLM gave the null block 0 as a KV block")
        if len(phys) > width:
            raise SequenceStateError(
                f"req_id={self.req_id}: {len(phys)} KV blocks exceed the compiled table of {width}")
        return phys + [0] * (width - len(phys))


@dataclass(frozen=True)
class Prefill:
    """Run the prefill program on ``ids[start:]`` at positions ``start ..`` into ``table``,
    after copying ``copies`` (``(src_block, dst_block, slots)``: the reused prefix
    ``ids[:start]``, prefix mode only; ``start`` is a multiple of the prefill chunk)."""

    seq: Seq
    ids: list[int]
    table: list[int]
    start: int = 0
    copies: tuple[tuple[int, int, int], ...] = ()


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
class DevicePlan:
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
                 decoder_buckets: Iterable[int], prefix_chunk: int | None = None,
                 shared_blocks: bool = False) -> None:
        self.num_device_blocks = int(num_device_blocks)
        self.block_size = int(block_size)
        self.width = int(max_seq_len) // int(block_size)
        self.buckets = sorted(set(int(b) for b in decoder_buckets))
        self.seqs: dict[str, Seq] = {}
        #: Prefix mode (``prefix_chunk`` = the granularity a reused prefix is rounded down to):
        #: the table gives out device blocks itself and remembers what each holds.
        self.prefix = PrefixBlocks(self.num_device_blocks, self.block_size, int(prefix_chunk)) \
            if prefix_chunk else None
        #: vLLM's own prefix caching over KV indexed by vLLM block id (the ``vllm`` model
        #: path): a new request's first ``num_computed_tokens`` tokens are already in the
        #: blocks vLLM hands it, and its prefill starts there.
        self.shared_blocks = bool(shared_blocks)

    # ------------------------------------------------------------------ scheduler events

    def add(self, req_id: str, prompt_ids: Sequence[int], params: Any, generator: Any,
            block_ids: Sequence[int], num_computed_tokens: int) -> Seq:
        """A new request. In prefix mode ``num_computed_tokens`` is vLLM's own prefix-cache hit:
        it only tells how much of the prompt vLLM will not schedule; the device reuses what
        :class:`PrefixBlocks` verifies.

        Raises:
            SequenceStateError: vLLM says part of it is already computed while prefix caching
                is off (vLLM and the worker disagree about the configuration).
        """
        # prefix mode: vLLM's own hit in num_computed is advisory
        seq = Seq(req_id, list(prompt_ids), params, generator, list(block_ids), num_computed=int(num_computed_tokens))
        return self.admit(seq)

    def admit(self, seq: Seq) -> Seq:
        """Take ``seq`` (a new request's record) into the table (see :meth:`add`).

        Raises:
            SequenceStateError: as :meth:`add`.
        """
        if seq.num_computed and self.prefix is None and not self.shared_blocks:
            raise SequenceStateError(
                f"req_id={seq.req_id}: starts with {seq.num_computed} computed tokens, but prefix "
                "caching is off (--no-enable-prefix-caching)")
        if self.prefix is not None:
            seq.phys = []
        if self.shared_blocks:
            seq.device_len = seq.num_computed  # vLLM's hit: its blocks hold them
        self.seqs[seq.req_id] = seq
        return seq

    def update(self, req_id: str, new_block_ids: Sequence[int] | None, resumed: bool,
               num_computed_tokens: int, all_token_ids: Sequence[int] | None = None) -> Seq:
        """A running (or resumed) request's new blocks and computed-token count."""
        seq = self.seqs[req_id]
        seq.apply_cached(new_block_ids, resumed, num_computed_tokens, all_token_ids)
        if resumed:
            self.resumed(seq)
        return seq

    def resumed(self, seq: Seq) -> None:
        """``seq`` resumes after a preemption: its blocks were freed, so the device KV is gone
        (but for vLLM's own prefix hit)."""
        seq.device_len = seq.num_computed if self.shared_blocks else 0
        if self.prefix is not None:
            self.prefix.release(seq)

    def finish(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None and self.prefix is not None:
            self.prefix.release(seq, keep=True)  # its blocks stay readable as a cached prefix

    def preempt(self, req_id: str) -> None:
        seq = self.seqs.get(req_id)
        if seq is not None:
            if self.prefix is not None:
                self.prefix.release(seq)
            seq.device_len = 0
            seq.blocks = []

    # ------------------------------------------------------------------ a step

    def plan(self, num_scheduled: dict[str, int]) -> DevicePlan:
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
            end = seq.num_computed + n
            seq.num_computed = end
            total = len(seq.prompt_ids) + len(seq.output_ids)
            if end < total:
                continue  # a piece of a prompt: deferred to the step that schedules its end
            if end != total:
                raise SequenceStateError(f"req_id={rid}: scheduled up to {end}, but it has {total} tokens")
            if seq.device_len == end - 1 and seq.device_len > 0 and (
                    not self.shared_blocks or end - 1 >= len(seq.prompt_ids)):
                if self.prefix is not None:
                    self.prefix.grow(seq, end)
                decodes.append(seq)
            elif self.shared_blocks and seq.device_len < len(seq.prompt_ids):
                # vLLM's prefix hit: the prefill runs from the first token it did not find
                prefills.append(Prefill(seq, seq.all_ids[:end], self._table(seq), seq.device_len))
            else:
                if seq.device_len:
                    raise SequenceStateError(
                        f"req_id={rid}: the device holds {seq.device_len} tokens, the step needs "
                        f"{end - 1}: a prefill restarts from position 0 only")
                if self.prefix is not None:
                    start, copies = self.prefix.place(seq, seq.all_ids[:end], self.seqs.values())
                    prefills.append(Prefill(seq, seq.all_ids[:end], self._table(seq), start, copies))
                else:
                    prefills.append(Prefill(seq, seq.all_ids[:end], self._table(seq)))
        done = {p.seq.req_id for p in prefills}
        return DevicePlan(tuple(prefills), self._decode(decodes, done) if decodes else None)

    def _table(self, seq: Seq) -> list[int]:
        return seq.device_blocks(self.width)

    def _nblocks(self, seq: Seq) -> int:
        return len(seq.phys) if seq.phys is not None else len(seq.blocks)

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
        if self.prefix is not None:
            used = {b for s in self.seqs.values() for b in (s.phys or ())}
            spare = self.prefix.spare(used)
        else:
            used = {b - 1 for s in self.seqs.values() for b in s.blocks}
            spare = next((b for b in range(self.num_device_blocks) if b not in used), None)
        if spare is not None:
            return [spare] + [0] * (self.width - 1), 0
        rows = {s.req_id for s in decoding}
        for s in self.seqs.values():
            if self._nblocks(s) and s.device_len == 0 and s.req_id not in rows and s.req_id not in prefilled:
                return self._table(s), 0
        for s in decoding:
            nxt = s.device_len + 1
            if nxt < self._nblocks(s) * self.block_size:
                return self._table(s), nxt
        for s in self.seqs.values():
            if not self._nblocks(s) or s.req_id in rows:
                continue
            # A prefill of this step runs before the decode and fills [0, len(all_ids)).
            nxt = len(s.all_ids) if s.req_id in prefilled else s.device_len
            if nxt < self._nblocks(s) * self.block_size:
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

    def done(self, plan: DevicePlan) -> None:
        """Record that ``plan`` ran: every prefilled and decoded token is on the device."""
        for p in plan.prefills:
            p.seq.device_len = len(p.ids)
            if self.prefix is not None:
                self.prefix.wrote(p.seq)
        if plan.decode is not None:
            for s in plan.decode.seqs:
                s.device_len += 1
                if self.prefix is not None:
                    self.prefix.wrote(s)


class PrefixBlocks:
    """Prefix mode of :class:`SequenceTable`: the device blocks, given out by the table, and the
    token prefix each one holds, so a new prompt can start from KV already on the device.

    vLLM's own prefix cache (blocks of ``sub_block_size`` tokens) only decides how many prompt
    tokens vLLM schedules; which KV the device reuses is decided here, from what the blocks
    verifiably hold, so a prefix vLLM believes cached but the device has overwritten is
    recomputed, never read. A prompt reuses the longest prefix any block chain holds, rounded
    down to ``chunk`` (the prefill program starts at chunk boundaries only) and leaving at least
    one token to compute. Block ``j`` of the prompt is the holder's own block when that block
    is free (taken over in place), else a fresh block the prefix is copied into with the
    runtime's KV block copy. Free blocks are reused least recently freed first; a free block
    keeps its content until it is given out again.

    Args:
        num_blocks: device KV blocks.
        block_size: tokens per device block.
        chunk: the reuse granularity in tokens (the prefill chunk).
    """

    def __init__(self, num_blocks: int, block_size: int, chunk: int) -> None:
        self.block_size, self.chunk = int(block_size), int(chunk)
        self.free: list[int] = list(range(int(num_blocks)))      # least recently freed first
        self.holder: dict[int, tuple[int, Seq]] = {}             # block -> (index j, sequence)
        #: A block taken over in place by a prefill planned but not yet run keeps its old
        #: holder's tokens only below that prefill's start (block -> tokens): a later prefill of
        #: the same step runs after it and must not copy what it overwrites.
        self.limit: dict[int, int] = {}
        self.reused_tokens = 0
        self.copied_blocks = 0
        self.adopted_blocks = 0

    def _held(self, block: int) -> list[int]:
        """The token prefix whose KV ``block`` holds (up to the end of its slots)."""
        entry = self.holder.get(block)
        if entry is None:
            return []
        j, seq = entry
        n = min(seq.device_len, (j + 1) * self.block_size)
        return seq.all_ids[:min(n, self.limit.get(block, n))]

    def _take(self, prefer: int | None = None) -> int:
        if prefer is not None and prefer in self.free:
            self.free.remove(prefer)
            return prefer
        if not self.free:
            raise SequenceStateError("no free device KV block: the scheduler admitted more than the "
                                     "device holds")
        return self.free.pop(0)

    def release(self, seq: Seq, keep: bool = False) -> None:
        """Return ``seq``'s blocks; with ``keep`` their content stays readable until reused."""
        for b in seq.phys or ():
            if not keep:
                self.holder.pop(b, None)
            self.free.append(b)
        if seq.phys is not None:
            seq.phys = []

    def spare(self, used: set[int]) -> int | None:
        """A free block a padding row may write (its cached content is dropped), the one
        holding the least useful prefix first."""
        for b in self.free:
            if b not in self.holder:
                return b
        if self.free:
            b = self.free[-1 if len(self.free) == 1 else 0]
            self.holder.pop(b, None)
            return b
        return None

    def grow(self, seq: Seq, end: int) -> None:
        """Give ``seq`` blocks for positions ``< end``."""
        assert seq.phys is not None
        while len(seq.phys) * self.block_size < end:
            b = self._take()
            self.holder.pop(b, None)
            seq.phys.append(b)

    def place(self, seq: Seq, ids: list[int], others: Iterable[Seq]) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """Blocks for a prefill of ``ids`` from the longest reusable prefix.

        Returns:
            ``(start, copies)`` for :class:`Prefill`.
        """
        assert seq.phys is not None and not seq.phys
        bs = self.block_size
        best_blocks: list[int] = []
        reuse = 0
        for j in range(-(-len(ids) // bs)):
            want = ids[:min(len(ids), (j + 1) * bs)]
            cand, got = None, j * bs
            for b, (bj, _owner) in self.holder.items():
                if bj != j:
                    continue
                held = self._held(b)
                n = 0
                for a, c in zip(held, want):
                    if a != c:
                        break
                    n += 1
                if n > got or (n == got and cand is not None and b in self.free and cand not in self.free):
                    cand, got = b, n
            if cand is None or got <= j * bs:
                break
            best_blocks.append(cand)
            reuse = got
            if got < (j + 1) * bs:
                break
        start = min(reuse, len(ids) - 1) // self.chunk * self.chunk
        nblk = -(-len(ids) // bs)
        srcs = [best_blocks[j] if j < len(best_blocks) and j * bs < start else None for j in range(nblk)]
        # First take over the free holders, so no fresh block is one a copy still reads.
        chosen: list[int | None] = []
        for src in srcs:
            if src is not None and src in self.free:
                chosen.append(self._take(prefer=src))
                self.limit[src] = start  # the prefill overwrites it from `start` on
                self.adopted_blocks += 1
            else:
                chosen.append(None)
        copies: list[tuple[int, int, int]] = []
        for j, src in enumerate(srcs):
            if chosen[j] is None:
                b = self._take()
                self.holder.pop(b, None)
                chosen[j] = b
                if src is not None:
                    copies.append((src, b, min(bs, start - j * bs)))
                    self.copied_blocks += 1
        seq.phys.extend(int(b) for b in chosen)
        self.reused_tokens += start
        return start, tuple(copies)

    def wrote(self, seq: Seq) -> None:
        """``seq``'s blocks now hold its tokens ``[0, device_len)``."""
        for j, b in enumerate(seq.phys or ()):
            if j * self.block_size < seq.device_len:
                self.holder[b] = (j, seq)
                self.limit.pop(b, None)
