"""Per-request KV caches bound to MXQ slots, saved to host and restored on demand.

A slot is ``(model_idx, cache_id)``: one KV region of one MXQ model instance. Each request
(and each prefix snapshot) owns a :class:`RequestKV`; :class:`SlotTable` records which
``RequestKV`` a slot currently holds. Binding a cache to its slot before an infer saves the
previous holder's KV to host memory (``dump_cache_memory``) and restores the new one's
(``load_cache_memory``) when needed, so a request that lost its slot resumes from its own KV.

This module calls the runtime only through :class:`vllm_npu.mblt.backend.MbltBackend`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.vllm_npu.mblt")

Slot = tuple[int, int]


class MbltCacheStateError(RuntimeError):
    """A cache cannot be restored or extended as asked (the message gives both counts)."""


@dataclass(eq=False)
class RequestKV:
    """The KV of one request or snapshot.

    Attributes:
        slot: ``(model_idx, cache_id)`` this cache runs on.
        owner: whose cache it is, as errors name it (``req_id=<id>``, ``snapshot <key>``).
        token_ids: ids whose KV the cache holds, in order; ``len(token_ids)`` is the cache length.
        host: blobs of the last save (one per ``CacheInfo``), or None.
        host_len: leading tokens of ``token_ids`` the host copy still holds correctly.
    """

    slot: Slot
    token_ids: list[int] = field(default_factory=list)
    host: list[bytes] | None = None
    host_len: int = 0
    owner: str = ""

    def describe(self) -> str:
        """``<owner> on slot (model_idx=..., cache_id=...)`` for messages."""
        return f"{self.owner or 'cache'} on slot (model_idx={self.slot[0]}, cache_id={self.slot[1]})"

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (``0 <= n``); the host copy stays valid up to ``n``."""
        del self.token_ids[n:]
        self.host_len = min(self.host_len, n)

    def note_write(self, start: int, ids: list[int]) -> None:
        """Record that positions ``[start, start + len(ids))`` were just written on the slot.

        Raises:
            MbltCacheStateError: ``start`` is past the cache's end (a gap would be read).
        """
        if start > self.length:
            raise MbltCacheStateError(
                f"Cannot infer from position {start}: the cache of {self.describe()} holds "
                f"{self.length} tokens."
            )
        del self.token_ids[start:]
        self.token_ids.extend(ids)
        self.host_len = min(self.host_len, start)


@dataclass
class SlotTable:
    """Which cache each slot holds, with save/restore through ``dump``/``load`` callables.

    Args:
        dump: ``(model_idx, cache_id) -> list[bytes]`` (the backend's dump).
        load: ``(model_idx, cache_id, blobs) -> None`` (the backend's load).
        on_dump, on_load: called with ``(cache_id, elapsed_ms)`` after each save/restore
            (the prefix-cache cost model's EWMA inputs).
        on_displaced: called with a cache that just lost its slot to another (after its save).
    """

    dump: Callable[[int, int], list[bytes]]
    load: Callable[[int, int, list[bytes]], None]
    on_dump: Callable[[int, float], None] = lambda cid, ms: None
    on_load: Callable[[int, float], None] = lambda cid, ms: None
    on_displaced: Callable[[RequestKV], None] = lambda kv: None
    owner: dict[Slot, RequestKV] = field(default_factory=dict)
    saves: int = 0
    restores: int = 0

    def holder(self, slot: Slot) -> RequestKV | None:
        return self.owner.get(slot)

    def save(self, kv: RequestKV) -> None:
        """Copy ``kv``'s KV to host if it is resident and its host copy is stale."""
        if self.owner.get(kv.slot) is not kv or kv.length == 0 or kv.host_len >= kv.length:
            return
        t0 = time.perf_counter()
        kv.host = self.dump(*kv.slot)
        self.on_dump(kv.slot[1], (time.perf_counter() - t0) * 1e3)
        kv.host_len = kv.length
        self.saves += 1

    def bind(self, kv: RequestKV) -> None:
        """Make ``kv`` the holder of its slot, saving the previous holder first.

        Raises:
            MbltCacheStateError: ``kv`` holds tokens whose KV is neither resident nor in
                its host copy.
        """
        current = self.owner.get(kv.slot)
        if current is kv:
            return
        if current is not None:
            self.save(current)
            del self.owner[kv.slot]
            self.on_displaced(current)
        if kv.length:
            if kv.host is None or kv.host_len < kv.length:
                raise MbltCacheStateError(
                    f"Cannot restore {kv.length} cached tokens of {kv.describe()}: the host copy "
                    f"holds only {kv.host_len if kv.host is not None else 0}."
                )
            t0 = time.perf_counter()
            self.load(kv.slot[0], kv.slot[1], kv.host)
            self.on_load(kv.slot[1], (time.perf_counter() - t0) * 1e3)
            self.restores += 1
        self.owner[kv.slot] = kv

    def release(self, kv: RequestKV) -> None:
        """Forget ``kv`` as its slot's holder (its KV on the device becomes garbage)."""
        if self.owner.get(kv.slot) is kv:
            del self.owner[kv.slot]

    def clear(self) -> None:
        self.owner.clear()
