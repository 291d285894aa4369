"""qbruntime's enums and value classes: ``CoreMode, Cluster, Core, CoreId, CacheType, CacheInfo,
BufferInfo, DataType, BatchParam, LogLevel, CoreAllocationPolicy``.

Enums behave like qbruntime's pybind11 enums: ``str(CoreMode.Single) == "CoreMode.Single"``,
``int(CoreMode.Auto) == 14``, hashable, ``.name``/``.value``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "BatchParam", "BufferInfo", "CacheInfo", "CacheType", "Cluster", "Core", "CoreAllocationPolicy",
    "CoreId", "CoreMode", "DataType", "LogLevel",
]


class _QbEnum(enum.Enum):
    """An enum printed as ``Type.Name`` and convertible with ``int()``."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)


class CoreMode(_QbEnum):
    """How a model uses NPU cores (raw values of qbruntime 1.5.0)."""

    Single = 0
    Multi = 1
    Global = 2
    Global4 = 3
    Global8 = 4
    Auto = 14
    Error = 15


class Cluster(_QbEnum):
    """One of an Aries card's two clusters of 4 cores."""

    Cluster0 = 0x10000
    Cluster1 = 0x20000
    Error = 0x7FFF0000


class Core(_QbEnum):
    """A core within a cluster; ``All`` and ``GlobalCore`` are pseudo-cores."""

    Core0 = 1
    Core1 = 2
    Core2 = 3
    Core3 = 4
    All = 65532
    GlobalCore = 65534
    Error = 65535


class CacheType(_QbEnum):
    """Kind of a KV cache region: ``Batch`` when the model has several cache ids."""

    Default = 0
    Batch = 1
    FixedTailCache = 2
    Error = 15


class CoreAllocationPolicy(_QbEnum):
    Auto = 0
    Manual = 1


class DataType(_QbEnum):
    Float32 = 0
    Float16 = 1
    Int8 = 2
    Uint8 = 3
    BInt16 = 4
    Error = 15


class LogLevel(_QbEnum):
    """Minimum severity printed to stderr (``Off`` prints nothing). Values as the real core's
    (Debug..Off = 1..6)."""

    Debug = 1
    Info = 2
    Warn = 3
    Err = 4
    Fatal = 5
    Off = 6


@dataclass(frozen=True)
class CoreId:
    """One NPU core: ``(cluster, core)``; ordered by cluster, then core."""

    cluster: Cluster
    core: Core

    #: unhashable, as the real ``qbruntime.CoreId`` (it defines ``__eq__`` only): code that
    #: keys dicts or sets by ``CoreId`` breaks on the board, so it breaks here first
    __hash__ = None  # type: ignore[assignment]

    def __lt__(self, other: CoreId) -> bool:
        if not isinstance(other, CoreId):
            return NotImplemented
        return (self.cluster.value, self.core.value) < (other.cluster.value, other.core.value)

    def __repr__(self) -> str:
        return f"CoreId(cluster={self.cluster}, core={self.core})"


class BatchParam:
    """One item of a batched ``infer``: ``sequence_length`` new tokens for KV slot ``cache_id``,
    written at positions ``[cache_size, cache_size + sequence_length)``."""

    def __init__(self, sequence_length: int = 0, cache_size: int = 0, cache_id: int = 0) -> None:
        self.sequence_length = sequence_length
        self.cache_size = cache_size
        self.cache_id = cache_id

    def __repr__(self) -> str:
        return f"BatchParam(sequence_length={self.sequence_length}, cache_size={self.cache_size}, cache_id={self.cache_id})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchParam):
            return NotImplemented
        return (self.sequence_length, self.cache_size, self.cache_id) == (other.sequence_length, other.cache_size, other.cache_id)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the pybind11 class


def core_key(core: CoreId) -> tuple[Cluster, Core]:
    """A hashable key for ``core`` (``CoreId`` itself is unhashable, as in qbruntime)."""
    return (core.cluster, core.core)


@dataclass(frozen=True)
class CacheInfo:
    """One KV cache region of a model (one per decoder layer in the simulator).

    Attributes:
        cache_type: ``Batch`` if the model has several cache ids, else ``Default``.
        name: ``"layer{i}.kv"``.
        layer_hash: stable hex id of the region (same for every load of the same artifact).
        size: bytes of this layer's keys and values for ONE cache id at full capacity.
        num_batches: number of cache ids (K).
    """

    cache_type: CacheType = CacheType.Error
    name: str = ""
    layer_hash: str = ""
    size: int = 0
    num_batches: int = 0


@dataclass(frozen=True)
class BufferInfo:
    """Geometry of one input or output buffer (HWC), in elements; the real constructor's
    fields, in its order, every one defaulting to 0 (``BufferInfo(max_width=128)`` works).

    ``width`` is the dynamic (token) axis: ``max_width`` is its upper bound per call.
    ``max_cache_size`` is the KV capacity in tokens per cache id (0 for outputs). The
    simulator's buffers are not reshaped: ``original_*`` and ``reshaped_*`` equal the plain ones.
    """

    original_height: int = 0
    original_width: int = 0
    original_channel: int = 0
    reshaped_height: int = 0
    reshaped_width: int = 0
    reshaped_channel: int = 0
    height: int = 0
    width: int = 0
    channel: int = 0
    max_height: int = 0
    max_width: int = 0
    max_channel: int = 0
    max_cache_size: int = 0

    def size(self) -> int:
        """Elements of the buffer at its maximum geometry."""
        return self.max_height * self.max_width * self.max_channel

    def shape(self) -> tuple[int, int, int]:
        """``(height, width, channel)``."""
        return (self.height, self.width, self.channel)
