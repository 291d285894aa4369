"""Drop-in numpy simulator of Mobilint's ``qbruntime`` 1.5.0 Python API (text LLM subset).

Use it where ``import qbruntime`` would go::

    import npusim.mxq as qbruntime
    acc = qbruntime.Accelerator()
    model = qbruntime.Model("artifact/model.mxq")
    model.launch(acc)
    [logits] = model.infer([embeds], None, cache_size)

Modules: :mod:`~npusim.mxq.types` (enums, value classes), :mod:`~npusim.mxq.errors`
(``QbRuntimeError`` and glog detail lines), :mod:`~npusim.mxq.config` (``ModelConfig``),
:mod:`~npusim.mxq.machine` (simulated cards, clock, costs, faults; env ``NPUSIM_MXQ``),
:mod:`~npusim.mxq.accelerator`, :mod:`~npusim.mxq.model`, :mod:`~npusim.mxq.mxqfile` (our
``.mxq`` format, ``FORMAT.md``), :mod:`~npusim.mxq.tracing`, :mod:`~npusim.mxq.compile`
(``compile_artifact``, behind ``npu-harness mxq compile``), :mod:`~npusim.mxq.npu_data`
(``NPUData``, the Mixture-of-Experts path's host/card tensors), :mod:`~npusim.mxq.advanced` (the
buffer / pinned-memory / async names, real signatures, ``NotImplementedError``; ``Scale``).
"""

from __future__ import annotations

from .accelerator import Accelerator, get_available_device_numbers, get_available_devices
from .advanced import Buffer, Future, PinnedMemory, Scale
from .config import ModelConfig
from .errors import QbRuntimeError, set_log_threshold
from .model import Model, ModelVariantHandle, get_model_summary, load
from .npu_data import NPUData
from .tracing import start_tracing_events, stop_tracing_events
from .types import (
    BatchParam, BufferInfo, CacheInfo, CacheType, Cluster, Core, CoreAllocationPolicy, CoreId, CoreMode, DataType, LogLevel,
)

__version__ = "v1.5.0"
__git_version__ = "npusim"
__vendor__ = "Mobilint"
__product__ = "qbruntime (npusim.mxq simulator)"


def set_log_level(level: LogLevel) -> None:
    """Minimum severity of the detail lines printed to stderr (``LogLevel.Off`` silences them)."""
    set_log_threshold(LogLevel(level).value if not isinstance(level, LogLevel) else level.value)


__all__ = [
    "Accelerator", "BatchParam", "Buffer", "BufferInfo", "Future", "NPUData", "PinnedMemory", "Scale", "CacheInfo", "CacheType", "Cluster", "Core", "CoreAllocationPolicy",
    "CoreId", "CoreMode", "DataType", "LogLevel", "Model", "ModelConfig", "ModelVariantHandle", "QbRuntimeError",
    "__version__", "get_available_device_numbers", "get_available_devices", "get_model_summary", "load",
    "set_log_level", "start_tracing_events", "stop_tracing_events",
]
