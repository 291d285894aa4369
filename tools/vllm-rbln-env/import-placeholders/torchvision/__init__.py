"""An import placeholder for ``torchvision`` in the vllm-rbln environment, NOT torchvision.

Why it exists: vllm-rbln 0.12.0 imports every optimum model module at start-up
(``vllm_rbln/model_executor/models/optimum/__init__.py`` -> ``exaone4_5.py`` -> vLLM's
``qwen2_vl.py`` -> transformers' ``image_processing_qwen2_vl.py``), and that chain runs
``import torchvision``. PyPI has no CPU build of torchvision for torch 2.13.0+cpu: the 0.28.0
wheel is a CUDA build whose ``_C.so`` needs ``libtorch_cuda.so`` and ``libc10_cuda.so``, so
``import torchvision`` fails (``operator torchvision::nms does not exist``). A text model never
calls torchvision.

What it does: every import under ``torchvision`` succeeds, and every name in it is a
placeholder class. Calling or instantiating one raises :class:`NotImplementedError` naming it,
so a code path that really uses torchvision fails loudly instead of computing something wrong.
It changes nothing in vllm-rbln, vLLM or transformers. The vendor lab puts it on
``PYTHONPATH`` of the vendor server only (``npu_conformance.vendor_envs``); it is never
installed into an environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+npu-harness-placeholder"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__module__}.{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"{cls.__module__}.{cls.__qualname__} is an npu-harness import placeholder, "
                                  "not torchvision: this environment has no torchvision (tools/vllm-rbln-env/README.md)")


def _placeholder(dotted: str) -> type:
    """A placeholder class for the dotted name ``torchvision.<...>.<name>``."""
    module, _, name = dotted.rpartition(".")
    return _PlaceholderMeta(name, (), {"__qualname__": name, "__module__": module})


def _module_getattr(module: types.ModuleType):
    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{module.__name__}.{name}")

    return getattr_


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import torchvision.<anything>`` give a placeholder module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(module)
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Submodules())
__getattr__ = _module_getattr(sys.modules[__name__])
