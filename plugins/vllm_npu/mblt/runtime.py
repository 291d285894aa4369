"""Which ``qbruntime``-compatible module the mblt device adapter talks to.

This is the adapter's only import seam. Everything else in :mod:`vllm_npu.mblt` receives the
runtime as a module object and calls only the ``qbruntime`` 1.5.0 surface on it (``Accelerator``,
``ModelConfig``, ``Model``, ``Cluster``, ``Core``, ``CoreId``, ``BatchParam``,
``QbRuntimeError``, ``start_tracing_events``, ``stop_tracing_events``). The module is imported by
*name*, with :func:`importlib.import_module`, as the runtime seam table
(:data:`vllm_npu.targets.RUNTIME_SEAMS`) says, so that:

* ``mblt-sim`` runs on the numpy simulator ``npusim.mxq`` (same API as ``qbruntime``);
* ``mblt-hw`` runs on Mobilint's ``qbruntime`` wheel, which is needed only on a machine with an
  NPU and is never imported anywhere else;
* tests pass a fake module straight to the adapter and never come here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from vllm_npu.targets import RUNTIME_SEAMS, RuntimeUnavailable
from vllm_npu.targets import load_runtime as _load_runtime

__all__ = ["MbltRuntimeUnavailable", "SEAM", "load_runtime"]

#: The mblt row of the runtime seam table (:data:`vllm_npu.targets.RUNTIME_SEAMS`).
SEAM = RUNTIME_SEAMS["mblt"]


class MbltRuntimeUnavailable(RuntimeUnavailable):
    """The runtime module of an mblt target cannot be imported."""


def load_runtime(
    target: str, *, import_module: Callable[[str], ModuleType] = importlib.import_module
) -> ModuleType:
    """Import and return the qbruntime-API module of an mblt target
    (:func:`vllm_npu.targets.load_runtime`).

    Args:
        target: ``"mblt-sim"`` (``npusim.mxq``) or ``"mblt-hw"`` (``qbruntime``).
        import_module: the importer (a seam for tests; default :func:`importlib.import_module`).

    Raises:
        ValueError: ``target`` is not an mblt target.
        MbltRuntimeUnavailable: the module cannot be imported; the message names the module and
            how to install it, and the ImportError is chained.
    """
    return _load_runtime("mblt", target, import_module=import_module, error=MbltRuntimeUnavailable)
