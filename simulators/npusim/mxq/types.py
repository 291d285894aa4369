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
    """Minimum severity printed to stderr (``Off`` prints nothing)."""

    Debug = 0
    Info = 1
    Warn = 2
    Err = 3
    Fatal = 4
    Off = 5


@dataclass(frozen=True)
class CoreId:
    """One NPU core: ``(cluster, core)``; ordered by cluster, then core."""

    cluster: Cluster
    core: Core

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

    cache_type: CacheType
    name: str
    layer_hash: str
    size: int
    num_batches: int


@dataclass(frozen=True)
class BufferInfo:
    """Geometry of one input or output buffer (HWC), in elements.

    ``width`` is the dynamic (token) axis: ``max_width`` is its upper bound per call.
    ``max_cache_size`` is the KV capacity in tokens per cache id (0 for outputs).
    """

    height: int
    width: int
    channel: int
    max_height: int
    max_width: int
    max_channel: int
    max_cache_size: int = 0

    @property
    def original_height(self) -> int:
        return self.height

    @property
    def original_width(self) -> int:
        return self.width

    @property
    def original_channel(self) -> int:
        return self.channel

    @property
    def reshaped_height(self) -> int:
        return self.height

    @property
    def reshaped_width(self) -> int:
        return self.width

    @property
    def reshaped_channel(self) -> int:
        return self.channel

    def size(self) -> int:
        """Elements of the buffer at its maximum geometry."""
        return self.max_height * self.max_width * self.max_channel

    def shape(self) -> tuple[int, int, int]:
        """``(height, width, channel)``."""
        return (self.height, self.width, self.channel)
