"""Prefix-snapshot policy for the mblt worker (pure policy, standard library only).

A finished request's KV cache becomes a *prefix snapshot* that a later request with the same
prompt prefix may load instead of recomputing it (vllm-mblt README "Cache Behavior"). This
module holds the decisions around that, with no runtime calls:

* :func:`prefix_cache_settings`: the knobs, from the loader extra config and environment.
* :func:`finished_snapshot_cap`: how many finished snapshots fit (at most 16, and the host
  memory budget).
* :class:`PrefixCacheCostModel`: load a matched snapshot only when loading is expected to beat
  recomputing the matched prefix (``load_ms < prefill_ms * margin``), from EWMA timings.
* :class:`SnapshotIndex`: the LRU set of finished snapshots and longest-prefix matching.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from vllm_npu.mblt.settings import PREFIX_CACHE_KEYS, PREFIX_CACHE_PARSERS, MbltConfigError

logger = logging.getLogger("vllm.vllm_npu.mblt")

#: Most finished snapshots kept, whatever the host budget.
MAX_FINISHED_SNAPSHOTS = 16
#: Host-memory budget for finished snapshots (MiB).
DEFAULT_MAX_HOST_MIB = 4096
#: A snapshot is loaded only when ``load_ms < prefill_ms * margin``.
DEFAULT_MARGIN = 0.9
#: Weight of a new sample in the EWMA timings: ``prev * (1 - a) + sample * a``.
DEFAULT_EWMA_ALPHA = 0.3
#: KV-block counts whose prefill the worker times at warmup (buckets of ``block_size * n``).
CALIBRATION_BLOCKS: tuple[int, ...] = (1, 2, 4, 8)

#: Environment variable per loader-extra-config key.
ENV_VARS: Mapping[str, str] = {
    "prefix_cache_auto_threshold": "VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD",
    "prefix_cache_min_hit_tokens": "VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS",
    "prefix_cache_load_margin": "VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN",
    "prefix_cache_calibrate": "VLLM_MBLT_PREFIX_CACHE_CALIBRATE",
    "prefix_cache_max_host_mib": "VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB",
}
_FIELD_FOR_KEY = {
    "prefix_cache_auto_threshold": "auto_threshold",
    "prefix_cache_min_hit_tokens": "min_hit_tokens",
    "prefix_cache_load_margin": "margin",
    "prefix_cache_calibrate": "calibrate",
    "prefix_cache_max_host_mib": "max_host_mib",
}


@dataclass(frozen=True)
class PrefixCacheSettings:
    """Prefix-snapshot knobs.

    Attributes:
        auto_threshold: decide loads by measured cost (False: load every usable match).
        min_hit_tokens: matched tokens below this never load (tokens, >= 0).
        margin: load only when ``load_ms < prefill_ms * margin`` (> 0).
        calibrate: time prefill of :data:`CALIBRATION_BLOCKS` blocks at warmup.
        max_host_mib: host-memory budget for finished snapshots (MiB, >= 0).
    """

    auto_threshold: bool = True
    min_hit_tokens: int = 0
    margin: float = DEFAULT_MARGIN
    calibrate: bool = True
    max_host_mib: int = DEFAULT_MAX_HOST_MIB


def prefix_cache_settings(
    environ: Mapping[str, str], overrides: Mapping[str, object]
) -> PrefixCacheSettings:
    """Resolve the prefix-snapshot knobs.

    Each knob is read from the loader extra config key (``overrides``, i.e.
    ``LayoutOverrides.prefix_cache``) when present, else from its environment variable
    (:data:`ENV_VARS`) when set to a non-blank value, else its default: **the loader extra
    config wins over the environment**. Flags take 0/1/true/false/yes/no/on/off
    (case-insensitive).

    Raises:
        MbltConfigError: an unknown ``prefix_cache_*`` key, or a value breaking its rule
            (flag; ``min_hit_tokens`` and ``max_host_mib`` ints >= 0; ``load_margin`` a finite
            number > 0); the message names the key or variable and the value.
    """
    for key in overrides:
        if key not in PREFIX_CACHE_KEYS:
            raise MbltConfigError(
                f"unknown prefix cache key {key!r}: expected one of {list(PREFIX_CACHE_KEYS)}"
            )
    values: dict[str, object] = {}
    for key, env_var in ENV_VARS.items():
        parse = PREFIX_CACHE_PARSERS[key]
        if key in overrides:
            values[_FIELD_FOR_KEY[key]] = parse(overrides[key], key)
        elif environ.get(env_var, "").strip():
            values[_FIELD_FOR_KEY[key]] = parse(environ[env_var], env_var)
    return PrefixCacheSettings(**values)  # type: ignore[arg-type]


def finished_snapshot_cap(max_host_mib: int, kv_nbytes_per_cache: int) -> int:
    """How many finished snapshots to keep: ``min(16, max_host_mib * 2**20 // kv_nbytes)``.

    Args:
        max_host_mib: host-memory budget (MiB, >= 0); 0 keeps none.
        kv_nbytes_per_cache: host bytes of one snapshot (one slot's KV buffers, > 0).

    Raises:
        ValueError: ``kv_nbytes_per_cache <= 0`` or ``max_host_mib < 0``.
    """
    if kv_nbytes_per_cache <= 0:
        raise ValueError(f"kv_nbytes_per_cache={kv_nbytes_per_cache!r} must be > 0 bytes")
    if max_host_mib < 0:
        raise ValueError(f"max_host_mib={max_host_mib!r} must be >= 0")
    return min(MAX_FINISHED_SNAPSHOTS, max_host_mib * 2**20 // kv_nbytes_per_cache)


def _mib_text(nbytes: int) -> str:
    if nbytes % 2**20 == 0:
        return str(nbytes // 2**20)
    return f"{nbytes / 2**20:.2f}"


def snapshot_cap_log_line(cap: int, kv_nbytes_per_cache: int, max_host_mib: int) -> str:
    """The startup log line for :func:`finished_snapshot_cap`'s result.

    The snapshot size is in MiB, whole when exact, else with two decimals.
    """
    return "MBLT keeps up to %d finished prefix snapshots (%s MiB each, budget %d MiB)." % (
        cap, _mib_text(kv_nbytes_per_cache), max_host_mib,
    )


def _check_elapsed(elapsed_ms: float) -> float:
    if isinstance(elapsed_ms, bool) or not isinstance(elapsed_ms, (int, float)):
        raise ValueError(f"elapsed_ms={elapsed_ms!r} must be a number")
    if not math.isfinite(elapsed_ms) or elapsed_ms < 0:
        raise ValueError(f"elapsed_ms={elapsed_ms!r} must be finite and >= 0")
    return float(elapsed_ms)


class PrefixCacheCostModel:
    """Expected cost of loading a snapshot vs. recomputing its matched prefix.

    Timings are milliseconds, kept as EWMAs (``prev * (1 - alpha) + sample * alpha``; the first
    sample is taken as is): prefill per prompt-token count (bucket), load and dump per
    ``cache_id``.
    """

    def __init__(self, settings: PrefixCacheSettings, alpha: float = DEFAULT_EWMA_ALPHA) -> None:
        """Raises: ValueError: ``alpha`` is not in (0, 1]."""
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1]")
        self.settings = settings
        self.alpha = float(alpha)
        self._prefill: dict[int, float] = {}
        self._load: dict[Hashable, float] = {}
        self._dump: dict[Hashable, float] = {}

    def _ewma(self, table: dict, key: Hashable, sample: float) -> None:
        prev = table.get(key)
        table[key] = sample if prev is None else prev * (1 - self.alpha) + sample * self.alpha

    def observe_prefill(self, tokens: int, elapsed_ms: float) -> None:
        """Record a prefill of ``tokens`` tokens taking ``elapsed_ms``.

        Raises:
            ValueError: ``tokens`` is not an int > 0, or ``elapsed_ms`` is not finite and >= 0.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"tokens={tokens!r} must be an int > 0")
        self._ewma(self._prefill, tokens, _check_elapsed(elapsed_ms))

    def observe_load(self, cache_id: Hashable, elapsed_ms: float) -> None:
        """Record a snapshot load into ``cache_id`` taking ``elapsed_ms``.

        Raises:
            ValueError: ``elapsed_ms`` is not finite and >= 0.
        """
        self._ewma(self._load, cache_id, _check_elapsed(elapsed_ms))

    def observe_dump(self, cache_id: Hashable, elapsed_ms: float) -> None:
        """Record a snapshot dump from ``cache_id`` taking ``elapsed_ms``.

        Raises:
            ValueError: ``elapsed_ms`` is not finite and >= 0.
        """
        self._ewma(self._dump, cache_id, _check_elapsed(elapsed_ms))

    @staticmethod
    def _lookup(table: dict, cache_id: Hashable) -> float | None:
        if cache_id in table:
            return table[cache_id]
        if None in table:
            return table[None]
        if table:
            return float(statistics.median(table.values()))
        return None

    def load_ms(self, cache_id: Hashable) -> float | None:
        """Expected load time (ms) into ``cache_id``: its own EWMA, else key None's, else the
        median over all cache ids; None with no load measured."""
        return self._lookup(self._load, cache_id)

    def dump_ms(self, cache_id: Hashable) -> float | None:
        """Expected dump time (ms) from ``cache_id``, with :meth:`load_ms`'s fallbacks."""
        return self._lookup(self._dump, cache_id)

    def prefill_ms(self, tokens: int) -> float | None:
        """Expected time (ms) to prefill ``tokens`` tokens.

        From the smallest measured bucket with at least ``tokens`` tokens, scaled linearly
        (``elapsed * tokens / bucket``); past the largest bucket, extrapolated linearly from it.
        None with no prefill measured; 0.0 for 0 tokens.

        Raises:
            ValueError: ``tokens`` is negative.
        """
        if tokens < 0:
            raise ValueError(f"tokens={tokens!r} must be >= 0")
        if not self._prefill:
            return None
        buckets = sorted(self._prefill)
        bucket = next((b for b in buckets if b >= tokens), buckets[-1])
        return self._prefill[bucket] * (tokens / bucket)

    def should_load(self, matched_tokens: int, cache_id: Hashable) -> tuple[bool, str]:
        """Whether to load a snapshot matching ``matched_tokens`` prompt tokens into
        ``cache_id`` instead of recomputing them, and why.

        No when nothing matched or fewer than ``min_hit_tokens``; yes when the auto threshold
        is off or a load or prefill timing is missing; else yes iff
        ``load_ms < prefill_ms(matched) * margin``.
        """
        s = self.settings
        if matched_tokens <= 0:
            return False, f"no matched tokens (matched={matched_tokens})"
        if matched_tokens < s.min_hit_tokens:
            return False, f"matched {matched_tokens} tokens < min_hit_tokens {s.min_hit_tokens}"
        if not s.auto_threshold:
            return True, f"auto threshold off; loading {matched_tokens} matched tokens"
        load = self.load_ms(cache_id)
        prefill = self.prefill_ms(matched_tokens)
        if load is None or prefill is None:
            return True, (f"missing measurements (load_ms={load}, prefill_ms={prefill}); "
                          f"loading {matched_tokens} matched tokens")
        budget = prefill * s.margin
        if load < budget:
            return True, (f"load_ms {load:.3f} < prefill_ms({matched_tokens}) {prefill:.3f} * "
                          f"margin {s.margin} = {budget:.3f}")
        return False, (f"load_ms {load:.3f} >= prefill_ms({matched_tokens}) {prefill:.3f} * "
                       f"margin {s.margin} = {budget:.3f}")


T = TypeVar("T")


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


#: Suffix of a displaced snapshot's key in :meth:`SnapshotIndex.best_match` results.
DISPLACED_SUFFIX = "@displaced"


def displaced_key(req_id: str) -> str:
    """The match key of ``req_id``'s displaced snapshot."""
    return req_id + DISPLACED_SUFFIX


class SnapshotIndex(Generic[T]):
    """Finished-request prefix snapshots, least recently used first, at most ``cap`` of them,
    plus at most one *displaced* snapshot per running request.

    Each snapshot has a key (a request id), the prompt token ids its KV holds, and a value
    (the cache object). Matching does not touch; the caller touches what it uses.

    Displaced snapshots (a non-batch request that lost the shared slot, the seed's switch-out
    copy) are not in the LRU: vllm-mblt's ``finished_snapshot_lru`` holds finished snapshots
    only, so they neither count toward ``cap`` nor evict a finished one. A request's newer
    displaced snapshot replaces its older one; it is dropped when the request finishes.
    """

    def __init__(self, cap: int) -> None:
        """Raises: ValueError: ``cap`` is not an int >= 0."""
        self._cap = self._check_cap(cap)
        self._entries: OrderedDict[str, tuple[tuple[int, ...], T]] = OrderedDict()
        self._displaced: dict[str, tuple[tuple[int, ...], T]] = {}

    @staticmethod
    def _check_cap(cap: int) -> int:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"cap={cap!r} must be an int >= 0")
        return cap

    @property
    def cap(self) -> int:
        """Most snapshots kept."""
        return self._cap

    def _evict(self) -> list[tuple[str, T]]:
        evicted: list[tuple[str, T]] = []
        while len(self._entries) > self._cap:
            key, (_, value) = self._entries.popitem(last=False)
            evicted.append((key, value))
        return evicted

    def add(self, key: str, token_ids: Sequence[int], value: T) -> list[tuple[str, T]]:
        """Add (or replace) ``key`` as most recently used; return the evicted ``(key, value)``
        pairs, oldest first (with cap 0, the new entry itself)."""
        self._entries.pop(key, None)
        self._entries[key] = (tuple(token_ids), value)
        return self._evict()

    def best_match(self, token_ids: Sequence[int], limit: int) -> tuple[str, T, int] | None:
        """The snapshot sharing the longest prefix with ``token_ids``, counting at most
        ``limit`` tokens: ``(key, value, matched)``. Ties go to the most recently used; None
        when nothing matches a token.

        Raises:
            ValueError: ``limit`` is negative.
        """
        if limit < 0:
            raise ValueError(f"limit={limit!r} must be >= 0")
        best: tuple[str, T, int] | None = None
        candidates = [*reversed(self._entries.items()),
                      *((displaced_key(k), v) for k, v in self._displaced.items())]
        for key, (tokens, value) in candidates:
            matched = _common_prefix(tokens, token_ids, limit)
            if matched > 0 and (best is None or matched > best[2]):
                best = (key, value, matched)
        return best

    def touch(self, key: str) -> None:
        """Mark ``key`` most recently used (a displaced snapshot's key: nothing to do).

        Raises:
            KeyError: ``key`` is not held.
        """
        if key.endswith(DISPLACED_SUFFIX) and key[: -len(DISPLACED_SUFFIX)] in self._displaced:
            return
        self._entries.move_to_end(key)

    def add_displaced(self, req_id: str, token_ids: Sequence[int], value: T) -> T | None:
        """Hold ``value`` as ``req_id``'s displaced snapshot; return the one it replaces."""
        old = self._displaced.pop(req_id, None)
        self._displaced[req_id] = (tuple(token_ids), value)
        return None if old is None else old[1]

    def pop_displaced(self, req_id: str) -> T | None:
        """Drop ``req_id``'s displaced snapshot and return it; None when it has none."""
        entry = self._displaced.pop(req_id, None)
        return None if entry is None else entry[1]

    def displaced_keys(self) -> list[str]:
        """Request ids holding a displaced snapshot."""
        return list(self._displaced)

    def pop(self, key: str) -> T | None:
        """Remove ``key`` and return its value; None when not held."""
        entry = self._entries.pop(key, None)
        return None if entry is None else entry[1]

    def set_cap(self, cap: int) -> list[tuple[str, T]]:
        """Change the cap; return the evicted ``(key, value)`` pairs, oldest first.

        Raises:
            ValueError: ``cap`` is not an int >= 0.
        """
        self._cap = self._check_cap(cap)
        return self._evict()

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
