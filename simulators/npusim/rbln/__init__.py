"""``npusim.rbln``: a drop-in ``rebel`` (rebel-compiler 0.12) that the real optimum-rbln runs on.

``rebel`` is a torch compiler, so this simulator needs torch: it is the one exception to the
numpy-only rule of ``npusim``. Its device model (parts and inventory :mod:`.parts`, DRAM
:mod:`.memory`, the ``.rbln`` file :mod:`.rblnfile`, errors :mod:`.errors`) is stdlib-only;
the torch parts are the compiler (:mod:`.compiler`), the runtime (:mod:`.runtime`) and the
custom operators (:mod:`.ops`, registered on import).

With the alias active (``NPU_HARNESS_TARGET=rbln-sim``, see :mod:`npusim.alias`),
``import rebel`` is this module. The surface is the decoder path of the table in
``docs/rbln.md`` (every name optimum-rbln 0.12.0 uses to compile, load and run a decoder).
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.rbln_custom_ops)
from . import sampler_ops  # noqa: F401  (registers torch.ops.rbln.argmax / top_k_top_p)
from . import core  # noqa: F401  (rebel.core.torch_compile, rebel.core.mega_cache)
from . import compile_context, parts
from .compile_context import CompileContext
from .compiler import COMPILER, RBLNCompiledModel, compile, compile_from_torch
from .errors import (RBLNCompileError, RBLNDeviceError, RBLNFileError, RBLNInputError,
                     RBLNOutOfMemoryError, RBLNRuntimeFault, RBLNSimError)
from .runtime import Runtime

__version__ = "0.12.0"
#: Marks this module as the simulator (the doctor and the alias report it).
SIMULATOR = COMPILER

__all__ = [
    "__version__", "SIMULATOR", "CompileContext", "RBLNCompiledModel", "Runtime", "compile",
    "compile_from_torch", "compile_context", "device_count", "get_npu_name", "manual_seed",
    "npu_is_available", "RBLNSimError", "RBLNDeviceError", "RBLNFileError", "RBLNInputError",
    "RBLNOutOfMemoryError", "RBLNRuntimeFault", "RBLNCompileError",
]


def get_npu_name(device_id: int = 0) -> str | None:
    """The SKU of device ``device_id`` (``RBLN-CA25``), None when no such device is present."""
    part = parts.settings().part(device_id)
    return part.name if part is not None else None


def npu_is_available(device_id: int = 0) -> bool:
    """Whether device ``device_id`` is present."""
    return parts.settings().part(device_id) is not None


def device_count() -> int:
    """The number of present devices."""
    return len(parts.settings().devices)


def manual_seed(seed: int) -> None:
    """Seed the device's random number generator (the simulator's is torch's)."""
    torch.manual_seed(int(seed))
