"""Which Neuron runtime module the Neuron worker talks to: the plugin's only import seam.

The worker receives the runtime as a module object and calls only this surface on it, modelled
on AWS's documented ``nrtpy`` (Neuron SDK ``neuron-runtime/nrtpy``) plus the platform queries
of ``libtorch_neuronx_lite.compile.platform``:

* device: ``get_platform_target()``, ``logical_nc_config()``, ``device_info()``,
  ``get_nc_count()``, ``get_vnc_memory_stats(core_id)``, ``configure(visible_cores)``, ``reset()``;
* programs: ``NeffSpec`` (one compile target), ``compile_neff(spec, model_dir, path, target=...,
  compiler_args=...)``, ``COMPILER_VERSION``;
* execution: ``NrtpyModel.load_from_neff(path, core_id=...)`` called as
  ``model(inputs={name: NrtpyTensor})``, ``NrtpyTensor.from_numpy(array, core_id=...)``,
  ``kv_cache_shape(...)``, and the errors ``NrtpyError`` / ``NrtError``.

The module is imported by *name* (the runtime seam table, :data:`vllm_npu.targets.RUNTIME_SEAMS`): ``neuron-sim`` is the numpy
simulator ``npusim.neff``; ``neuron-hw`` is ``nrtpy`` from the Neuron SDK. Nothing else in
:mod:`vllm_npu.neuron` imports either.

On ``neuron-hw`` one piece is missing: a real NEFF is compiled by ``neuronx-cc`` from the HLO of
the traced model, and the plugin has no torch model to trace (the device worker runs the model
only as compiled programs). :func:`compiler_of` therefore raises ``NotImplementedError``
(issue 11) on ``neuron-hw`` unless every NEFF is already in the compile cache or
``NEURON_COMPILED_ARTIFACTS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_npu.targets import RUNTIME_SEAMS, RuntimeUnavailable
from vllm_npu.targets import load_runtime as _load_runtime

__all__ = ["NeuronRuntimeUnavailable", "SEAM", "compiler_of", "load_runtime"]

#: The neuron row of the runtime seam table (:data:`vllm_npu.targets.RUNTIME_SEAMS`).
SEAM = RUNTIME_SEAMS["neuron"]

HW_COMPILE_PENDING = (
    "compiling NEFFs on neuron-hw needs the model traced to HLO for neuronx-cc, which the Neuron "
    "plugin does not build yet (issue 11); compile on neuron-sim is simulated only. Point "
    "NEURON_COMPILED_ARTIFACTS at NEFFs compiled for this configuration instead")


#: The names the worker and platform call on the runtime module.
SURFACE: tuple[str, ...] = ("device_info", "get_platform_target", "NrtpyModel", "NrtpyTensor", "NeffSpec", "NrtError",
                            "kv_cache_shape", "COMPILER_VERSION", "reset")
HW_ADAPTER_PENDING = (
    "the runtime module {module!r} lacks {missing}: nrtpy loads and runs NEFFs, but the device queries "
    "(target, logical cores, HBM per core), the KV layout and the NEFF specs come from the Neuron "
    "runtime's torch classes and libtorch_neuronx_lite on a real host, and that neuron-hw adapter is not "
    "built yet (issue 11)")


class NeuronRuntimeUnavailable(RuntimeUnavailable):
    """The runtime module of a Neuron target cannot be imported (names it and how to get it)."""


def load_runtime(target: str, *,
                 import_module: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    """Import and return the runtime module of ``target``.

    Raises:
        ValueError: ``target`` is not a Neuron target.
        NeuronRuntimeUnavailable: the module cannot be imported (the ImportError is chained).
    """
    module = _load_runtime("neuron", target, import_module=import_module, error=NeuronRuntimeUnavailable)
    name = SEAM.import_name(target)
    missing = [n for n in SURFACE if not hasattr(module, n)]
    if missing:
        raise NotImplementedError(HW_ADAPTER_PENDING.format(module=name, missing=missing))
    return module


def compiler_of(target: str, runtime: ModuleType) -> Callable[..., Any]:
    """The NEFF compiler of ``target``: ``runtime.compile_neff`` on ``neuron-sim``.

    Raises:
        NotImplementedError: on ``neuron-hw`` (see the module docstring; issue 11).
    """
    if target == "neuron-hw":
        raise NotImplementedError(HW_COMPILE_PENDING)
    return runtime.compile_neff
