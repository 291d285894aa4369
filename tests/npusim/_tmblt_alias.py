"""``import qbruntime`` on the simulator with transformers-mblt registered, for one test module:
what the transformers-mblt test modules share (their ``qbruntime`` fixtures)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def transformers_mblt_on_simulator() -> Iterator[tuple[Any, list[str]]]:
    """Alias ``qbruntime`` to ``npusim.mxq``, register transformers-mblt, and yield ``(the
    qbruntime module, the model types transformers-mblt registered)``; afterwards reset the
    simulated machine, drop the alias and forget every imported ``qbruntime``,
    ``transformers_mblt`` and ``mblt_npu`` module."""
    from npusim import alias

    assert alias.status("qbruntime").state != "real", "a real qbruntime is installed: this module tests the alias"
    alias.activate("qbruntime")
    import qbruntime as mod

    import npusim.mxq

    assert mod is npusim.mxq, "the alias must bind the simulator module itself"
    import transformers_mblt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Qwen3-ASR needs the optional qwen-asr extra
        registered = transformers_mblt.register()
    try:
        yield mod, list(registered)
    finally:
        from npusim.mxq import machine

        machine.reset()
        alias.deactivate("qbruntime")
        for name in [n for n in sys.modules if n.split(".")[0] in ("qbruntime", "transformers_mblt", "mblt_npu")]:
            del sys.modules[name]
