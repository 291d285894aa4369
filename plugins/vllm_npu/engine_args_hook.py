"""One wrapper of vLLM's ``EngineArgs.create_engine_config`` for the devices that must see the
user's own arguments before vLLM fills its defaults (:mod:`vllm_npu.rbln.engine_args`,
:mod:`vllm_npu.mblt.engine_args`), as vllm-rbln wraps it for its own.

Each device registers a hook under its own marker; the hook runs on the ``EngineArgs``
instance (it may read or change its fields) just before vLLM's own ``create_engine_config``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["run_before_create_engine_config"]


def run_before_create_engine_config(marker: str, hook: Callable[[Any], None]) -> bool:
    """Wrap ``EngineArgs.create_engine_config`` to call ``hook(engine_args)`` first (once per
    ``marker``: a second call with the same marker does nothing). Returns True."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, marker, False):
        return True
    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        hook(self)
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config
    setattr(EngineArgs, marker, True)
    return True
