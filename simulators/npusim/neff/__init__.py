"""Numpy simulator of AWS Neuron NEFF programs (``nrtpy``-style surface; numpy + stdlib only).

The Neuron plugin imports this module by name (``npusim.neff`` on ``neuron-sim``; on ``neuron-hw``
the same surface comes from AWS's ``nrtpy``) and uses nothing else of :mod:`npusim`::

    import npusim.neff as nrt
    nrt.get_platform_target(); nrt.logical_nc_config(); nrt.device_info(); nrt.get_nc_count()
    nrt.get_total_available_memory(); nrt.get_vnc_memory_stats(core_id)
    nrt.configure(visible_cores); nrt.reset()
    spec = nrt.NeffSpec(kind="decode", batch=8, max_model_len=2048, block_size=32, num_blocks=512)
    report = nrt.compile_neff(spec, model_dir, "decode_b8.neff")
    kv = nrt.NrtpyTensor.from_numpy(np.zeros(nrt.kv_cache_shape(model_dir, 512, 32), np.float32))
    m = nrt.NrtpyModel.load_from_neff("decode_b8.neff")
    outs = m(inputs={"kv_cache": kv, "input_ids": ..., ...})   # {"logits": ..., "tokens": ...}

Modules: :mod:`.platform` (device model), :mod:`.config` (``$NPUSIM_NEFF``), :mod:`.compiler`
(simulated ``neuronx-cc``), :mod:`.neff_file` (the file format, ``FORMAT.md``), :mod:`.runtime`
(tensors, loading, execution), :mod:`.sampling` (on-device sampling kernel), :mod:`.errors`.
"""

from __future__ import annotations

from .compiler import COMPILER_VERSION, SIMULATOR_VERSION, CompileReport, NeffSpec, compile_neff, kv_cache_shape
from .config import ENV_VAR
from .errors import (
    NeffCompileError,
    NeffConfigError,
    NeffFileError,
    NeffRecompileError,
    NeffTargetError,
    NrtError,
    NrtpyError,
)
from .platform import (
    TARGETS,
    DeviceInfo,
    device_info,
    get_nc_count,
    get_platform_target,
    get_total_available_memory,
    logical_nc_config,
)
from .runtime import NrtpyModel, NrtpyTensor, configure, execution_counts, get_vnc_memory_stats, reset

__version__ = SIMULATOR_VERSION

__all__ = [
    "__version__",
    "COMPILER_VERSION",
    "ENV_VAR",
    "TARGETS",
    "CompileReport",
    "DeviceInfo",
    "NeffCompileError",
    "NeffConfigError",
    "NeffFileError",
    "NeffRecompileError",
    "NeffSpec",
    "NeffTargetError",
    "NrtError",
    "NrtpyError",
    "NrtpyModel",
    "NrtpyTensor",
    "compile_neff",
    "configure",
    "device_info",
    "execution_counts",
    "get_nc_count",
    "get_platform_target",
    "get_total_available_memory",
    "get_vnc_memory_stats",
    "kv_cache_shape",
    "logical_nc_config",
    "reset",
]
