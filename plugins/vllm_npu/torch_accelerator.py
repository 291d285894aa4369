"""``torch.accelerator`` cache calls made safe on a host without an accelerator.

vLLM's ``cleanup_dist_env_and_memory()`` (which vLLM's own test ``conftest`` calls after every
test) runs ``torch.accelerator.empty_cache()`` and ``empty_host_cache()`` on every platform
whose ``is_cpu()`` is False. Our NPU platforms are not the CPU platform (claiming to be would
switch vLLM's CPU-only code paths on), yet their torch is a CPU build with no accelerator, where
both calls raise ``RuntimeError: Cannot access accelerator device when none is available``.

:func:`install` wraps the two functions so that, while torch has no accelerator, they do what
torch documents for an allocator that was never initialized: nothing. With an accelerator they
call torch's own functions unchanged. It is installed once, when an NPU platform class is
imported (:mod:`vllm_npu._platform`), i.e. when vLLM resolves ``current_platform``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

#: The wrapped ``torch.accelerator`` functions.
WRAPPED: tuple[str, ...] = ("empty_cache", "empty_host_cache")
_MARK = "_vllm_npu_no_accelerator_safe"


def _no_accelerator() -> bool:
    return torch.accelerator.current_accelerator() is None


def _safe(original: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(original)
    def call() -> None:
        if _no_accelerator():
            return None
        return original()

    setattr(call, _MARK, True)
    return call


def install() -> list[str]:
    """Wrap :data:`WRAPPED` in ``torch.accelerator`` (idempotent).

    Returns:
        The names wrapped by this call (empty when already installed or absent).
    """
    done = []
    for name in WRAPPED:
        fn = getattr(torch.accelerator, name, None)
        if fn is None or getattr(fn, _MARK, False):
            continue
        setattr(torch.accelerator, name, _safe(fn))
        done.append(name)
    return done
