"""One host BLAS thread in the engine process, as vLLM's workers keep torch at one thread
(shared by the MBLT and Neuron workers).

The MBLT worker's host work per step is small (embedding rows, sampling) and the runtime it
hosts may do its own numpy work (``npusim.mxq`` runs the whole model in numpy). An OpenBLAS
thread pool left at the core count spin-waits after each call and steals the cores the step
needs; on a 2-core machine that halves serving throughput. The worker therefore sets every
OpenBLAS already loaded in the process to one thread, unless ``OPENBLAS_NUM_THREADS`` or
``OMP_NUM_THREADS`` is set (the operator's choice wins).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

#: Exported setters of the OpenBLAS builds numpy and others ship (64-bit-int and plain).
_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _loaded_openblas(maps_path: str = "/proc/self/maps") -> list[str]:
    try:
        with open(maps_path) as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if ".so" in os.path.basename(p))


def limit_host_blas_threads(threads: int = 1, environ: Mapping[str, str] | None = None,
                            maps_path: str = "/proc/self/maps") -> list[str]:
    """Set each loaded OpenBLAS library to ``threads`` threads.

    Returns:
        The libraries changed (empty when none is loaded, when the environment already
        chooses a thread count, or off Linux).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    env = os.environ if environ is None else environ
    if env.get("OPENBLAS_NUM_THREADS") or env.get("OMP_NUM_THREADS"):
        return []
    changed = []
    for path in _loaded_openblas(maps_path):
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter(threads)
                changed.append(path)
                break
    return changed
