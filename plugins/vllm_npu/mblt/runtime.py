"""Which ``qbruntime``-compatible module the mblt device adapter talks to.

This is the adapter's only import seam. Everything else in :mod:`vllm_npu.mblt` receives the
runtime as a module object and calls only the ``qbruntime`` 1.5.0 surface on it (``Accelerator``,
``ModelConfig``, ``Model``, ``Cluster``, ``Core``, ``CoreId``, ``BatchParam``,
``QbRuntimeError``, ``start_tracing_events``, ``stop_tracing_events``). The module is imported by
*name*, with :func:`importlib.import_module`, so that:

* ``mblt-sim`` runs on the numpy simulator ``npusim.mxq`` (same API as ``qbruntime``);
* ``mblt-hw`` runs on Mobilint's ``qbruntime`` wheel, which is needed only on a machine with an
  NPU and is never imported anywhere else;
* tests pass a fake module straight to the adapter and never come here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

__all__ = ["MbltRuntimeUnavailable", "RUNTIME_MODULES", "load_runtime"]

#: Target name -> importable module providing the qbruntime API.
RUNTIME_MODULES: dict[str, str] = {"mblt-sim": "npusim.mxq", "mblt-hw": "qbruntime"}

_INSTALL_HINTS: dict[str, str] = {
    "mblt-sim": "install npu-harness (pip install -e .) or put its simulators/ directory on "
    "PYTHONPATH",
    "mblt-hw": "pip install mobilint-qb-runtime (Mobilint's qbruntime 1.5.0 wheel: CPython 3.11, "
    "x86_64 Linux, with the NPU driver installed)",
}


class MbltRuntimeUnavailable(RuntimeError):
    """The runtime module of an mblt target cannot be imported."""


def load_runtime(
    target: str, *, import_module: Callable[[str], ModuleType] = importlib.import_module
) -> ModuleType:
    """Import and return the qbruntime-API module of an mblt target.

    Args:
        target: ``"mblt-sim"`` (``npusim.mxq``) or ``"mblt-hw"`` (``qbruntime``).
        import_module: the importer (a seam for tests; default :func:`importlib.import_module`).

    Raises:
        ValueError: ``target`` is not an mblt target.
        MbltRuntimeUnavailable: the module cannot be imported; the message names the module and
            how to install it, and the ImportError is chained.
    """
    try:
        module_name = RUNTIME_MODULES[target]
    except (KeyError, TypeError):
        raise ValueError(
            f"target {target!r} has no Mobilint runtime; expected one of: "
            f"{', '.join(RUNTIME_MODULES)}"
        ) from None
    try:
        return import_module(module_name)
    except ImportError as exc:
        raise MbltRuntimeUnavailable(
            f"target {target!r} needs the Python module {module_name!r}, which cannot be "
            f"imported ({exc}); {_INSTALL_HINTS[target]}"
        ) from exc
