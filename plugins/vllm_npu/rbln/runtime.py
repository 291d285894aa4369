"""Which ``rebel`` the RBLN plugin talks to, and optimum-rbln's model classes: the plugin's only
import seam (the rbln row of :data:`vllm_npu.targets.RUNTIME_SEAMS`).

``rebel`` is imported by the vendor's name on both targets: the real rebel-compiler on
``rbln-hw``; on ``rbln-sim``, ``npusim.rbln`` through ``npusim.alias`` (the vendor's optimum-rbln
imports ``rebel`` itself, so the plugin and optimum-rbln must get the one module object). The
plugin calls only rebel's public surface on it (``docs/rbln.md``), never ``npusim`` by its own
name, except :func:`load_rebel_for_compile`, the ``npu-harness rbln compile`` command's import,
which may switch the alias on itself where the target allows the simulator.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from vllm_npu.targets import ENV_VAR, RUNTIME_SEAMS, RuntimeUnavailable, load_runtime, selected_target

__all__ = ["RblnRuntimeUnavailable", "SEAM", "SIM_TARGETS", "load_rebel", "load_rebel_for_compile", "model_class"]

#: The rbln row of the runtime seam table.
SEAM = RUNTIME_SEAMS["rbln"]
#: Targets under which the compile command may let the simulator stand in for rebel-compiler.
SIM_TARGETS = ("", "rbln-sim")


class RblnRuntimeUnavailable(RuntimeUnavailable):
    """``rebel`` or optimum-rbln cannot be imported (the message names how to get it)."""


def load_rebel(target: str | None = None, *,
               import_module: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    """``import rebel`` for ``target`` (default: ``NPU_HARNESS_TARGET``, else ``rbln-hw``).

    Raises:
        ValueError: ``target`` is not an rbln target.
        RblnRuntimeUnavailable: it cannot be imported; the message says how to get a rebel on
            the target (the compiler on hw; the alias start-up hook and the target on sim).
    """
    return load_runtime("rbln", target or selected_target() or SEAM.targets[1], import_module=import_module,
                        error=RblnRuntimeUnavailable)


def model_class(name: str) -> Any:
    """optimum-rbln's class ``name`` (``RBLNLlamaForCausalLM``).

    Raises:
        RblnRuntimeUnavailable: optimum-rbln is missing or has no such class.
    """
    try:
        orbln = importlib.import_module("optimum.rbln")
        return getattr(orbln, name)
    except (ImportError, AttributeError) as exc:
        raise RblnRuntimeUnavailable(f"optimum-rbln provides no {name} ({exc}); pip install optimum-rbln==0.12.0") from exc


def load_rebel_for_compile(environ: Mapping[str, str], *,
                           error: type[Exception] = RblnRuntimeUnavailable) -> tuple[Any, str]:
    """``import rebel`` for ``npu-harness rbln compile``, switching the ``npusim.alias`` alias on
    when no rebel-compiler is installed and ``NPU_HARNESS_TARGET`` is unset or ``rbln-sim``;
    returns ``(module, description)``: ``simulator npusim.rbln ...`` or ``rebel-compiler
    <version> (<path>)``.

    Raises:
        error: no ``rebel`` is importable and the simulator may not stand in (a real
            installation that fails to import, the target naming another device, or the
            simulator's own import failing).
    """
    try:
        module = importlib.import_module(SEAM.vendor_module)
    except ImportError as exc:
        from npusim import alias

        state = alias.status(SEAM.vendor_module, environ)
        if state.state == "real":
            raise error(f"import rebel failed ({exc}), and a rebel-compiler is installed "
                        f"({state.module}): fix that installation") from exc
        target = str(environ.get(ENV_VAR) or "").strip()
        if target not in SIM_TARGETS:
            raise error(f"import rebel failed ({exc}): {SEAM.hw_install}; the npusim simulator stands in "
                        f"only when {ENV_VAR} is unset or rbln-sim, not {target!r}") from exc
        alias.activate(SEAM.vendor_module)
        try:
            module = importlib.import_module(SEAM.vendor_module)
        except ImportError as sim_exc:
            raise error(f"import rebel failed ({exc}), and so did the npusim.rbln simulator "
                        f"({sim_exc})") from sim_exc
    sim = getattr(module, "SIMULATOR", None)
    if sim:
        return module, f"simulator {sim} (npusim.alias: no rebel-compiler is installed)"
    where = getattr(module, "__file__", None) or "?"
    return module, f"rebel-compiler {getattr(module, '__version__', '?')} ({where})"
