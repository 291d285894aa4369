"""Vendor-name import aliases: ``import rebel`` / ``import qbruntime`` load our simulators.

Unmodified vendor code (``import rebel``, ``from rebel.compile_context import CompileContext``,
``import qbruntime``) runs on :mod:`npusim.rbln` / :mod:`npusim.mxq` when no vendor wheel is
installed. An alias is a meta-path finder placed at the front of :data:`sys.meta_path`:

* ``import rebel`` binds the *same module object* as ``npusim.rbln`` (``rebel is npusim.rbln``),
  and ``rebel.X.Y`` is the module object ``npusim.rbln.X.Y``, so every class exists once;
* a real installation always wins: when any other finder (site-packages, ``PYTHONPATH``, an
  editable install...) can import ``rebel``, the alias steps aside, and :func:`status` reports
  ``real`` with that installation's path. A bare directory named ``rebel`` without an
  ``__init__.py`` (a namespace-package portion) is not an installation and does not count;
* the simulator is imported lazily, at the first ``import rebel``, never when the alias is
  activated.

Aliases are enabled per process by environment (:func:`activate_from_env`):
``NPU_HARNESS_TARGET=rbln-sim`` enables ``rebel``, ``NPU_HARNESS_TARGET=mblt-sim`` enables
``qbruntime`` (:data:`TARGET_ALIASES`; the hardware targets enable nothing), and
``NPUSIM_ALIAS=rebel,qbruntime`` enables the named aliases whatever the target. The
``npu_harness_alias.pth`` file written by :func:`install_pth` (``npu-harness alias install``)
runs :func:`activate_from_env` at every interpreter start of that environment, so vLLM's engine
subprocesses get the alias too.

This module imports the standard library only (it runs from a ``.pth`` at interpreter start):
never numpy, torch or ``vllm_npu``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

__all__ = [
    "ALIASES", "ALIAS_ENV_VAR", "PTH_NAME", "TARGET_ALIASES", "TARGET_ENV_VAR", "AliasStatus",
    "activate", "activate_from_env", "activation_errors", "active", "deactivate", "enabled_by_env",
    "install_pth", "installed_pth", "pth_line", "remove_pth", "site_packages_of", "status",
]

#: Vendor module name -> the simulator module it aliases.
ALIASES: dict[str, str] = {"qbruntime": "npusim.mxq", "rebel": "npusim.rbln"}
#: Target name (``NPU_HARNESS_TARGET``) -> the aliases it enables. Only simulator targets.
TARGET_ALIASES: dict[str, tuple[str, ...]] = {"mblt-sim": ("qbruntime",), "rbln-sim": ("rebel",)}
#: The target variable (the same name as ``vllm_npu.targets.ENV_VAR``; read, never imported).
TARGET_ENV_VAR = "NPU_HARNESS_TARGET"
#: Comma-separated alias names to enable whatever the target (``NPUSIM_ALIAS=rebel,qbruntime``).
ALIAS_ENV_VAR = "NPUSIM_ALIAS"
#: File name of the start-up hook written into a site-packages directory.
PTH_NAME = "npu_harness_alias.pth"

State = Literal["real", "alias", "inactive", "absent"]


@dataclass(frozen=True)
class AliasStatus:
    """What ``import <name>`` gives in this interpreter.

    Attributes:
        name: the vendor module name (``rebel``, ``qbruntime``).
        state: ``real`` (a real installation is importable; it wins), ``alias`` (the alias is
            active, or would be under the environment asked about, and nothing real is
            installed), ``inactive`` (nothing real is installed and the alias is not enabled:
            ``import <name>`` fails) or ``absent`` (nothing real is installed and the simulator
            module cannot be found either).
        module: the real installation's origin path (``real``), else the simulator module name.
        detail: one line: what enabled the alias, or how to enable it, or what is missing.
    """

    name: str
    state: State
    module: str
    detail: str

    def describe(self) -> str:
        """The text after ``alias <name>:`` in ``npu-harness doctor`` and ``alias status``,
        e.g. ``alias -> npusim.rbln (enabled by NPU_HARNESS_TARGET=rbln-sim)``."""
        where = self.module if self.state == "real" else f"-> {self.module}"
        return f"{self.state} {where} ({self.detail})"


# Name -> origin path of a real installation that won over an active alias at import time.
_REAL_WON: dict[str, str] = {}
# What the last activate_from_env() could not do (it never raises).
_ENV_ERRORS: list[str] = []


def _check_name(name: str) -> str:
    if name not in ALIASES:
        raise ValueError(f"unknown alias {name!r}; expected one of: {', '.join(ALIASES)}")
    return name


def _is_namespace_portion(spec: importlib.machinery.ModuleSpec) -> bool:
    return spec.origin is None and spec.submodule_search_locations is not None and (
        spec.loader is None or isinstance(spec.loader, importlib.machinery.NamespaceLoader))


def _spec_origin(spec: importlib.machinery.ModuleSpec) -> str:
    if spec.origin:
        return spec.origin
    locations = list(spec.submodule_search_locations or ())
    return locations[0] if locations else "<unknown origin>"


def _real_spec(name: str, skip: object | None = None) -> importlib.machinery.ModuleSpec | None:
    """The spec another finder (not ``skip``, not an alias finder) gives top-level ``name``,
    ignoring namespace-package portions; None when nothing real is importable.

    Raises:
        Exception: whatever another finder's ``find_spec`` raises (the import would raise it too).
    """
    finders = [f for f in sys.meta_path if f is not skip and not isinstance(f, _AliasFinder)]
    if importlib.machinery.PathFinder not in finders:
        finders.append(importlib.machinery.PathFinder)
    for finder in finders:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, None)
        if spec is not None and not _is_namespace_portion(spec):
            return spec
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias name as the already-importable simulator module ``target``.

    ``create_module`` returns the simulator's module object itself (importing it if needed);
    ``exec_module`` runs nothing and puts back the simulator's own ``__spec__``, which the import
    system overwrote with the alias spec.
    """

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        if isinstance(spec.loader_state, dict):
            spec.loader_state["spec"] = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias_spec = getattr(module, "__spec__", None)
        state = getattr(alias_spec, "loader_state", None)
        if isinstance(state, dict) and state.get("spec") is not None:
            module.__spec__ = state["spec"]

    def __repr__(self) -> str:
        return f"<npusim alias loader of {self.target!r}>"


class _AliasFinder(importlib.abc.MetaPathFinder):
    """The one meta-path finder behind every active alias (see the module docstring)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        top, dot, rest = fullname.partition(".")
        if top not in self.names:
            return None
        sim = ALIASES[top]
        if not dot:
            return self._find_top(top, sim)
        alias_module = sys.modules.get(top)
        if alias_module is None or alias_module is not sys.modules.get(sim):
            return None  # the real package (or nothing) is loaded under that name
        return self._spec_for(fullname, f"{sim}.{rest}")

    def _find_top(self, name: str, sim: str) -> importlib.machinery.ModuleSpec | None:
        real = _real_spec(name, skip=self)
        if real is not None:
            _REAL_WON[name] = _spec_origin(real)
            return None  # let the real installation load
        return self._spec_for(name, sim)

    def _spec_for(self, fullname: str, sim_name: str) -> importlib.machinery.ModuleSpec | None:
        """An alias spec of ``fullname`` for ``sim_name``, or None (then the import fails as a
        missing module, ``ModuleNotFoundError`` naming ``fullname``) when ``sim_name`` does not
        exist. Finds ``sim_name`` without executing it."""
        module = sys.modules.get(sim_name)
        if module is not None:
            is_package = hasattr(module, "__path__")
        else:
            try:
                sim_spec = importlib.util.find_spec(sim_name)
            except ImportError:
                sim_spec = None
            if sim_spec is None:
                return None
            is_package = sim_spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(sim_name), origin=f"npusim alias of {sim_name}",
            loader_state={}, is_package=is_package)

    def __repr__(self) -> str:
        return f"<npusim alias finder {sorted(self.names)}>"


_FINDER = _AliasFinder()


def activate(name: str) -> None:
    """Enable the alias ``name`` in this process (idempotent).

    Puts the alias finder at the front of :data:`sys.meta_path` if it is not there yet. Nothing
    is imported: the simulator loads at the first ``import <name>``, and only if no real
    installation of ``name`` is importable then.

    Raises:
        ValueError: ``name`` is not a key of :data:`ALIASES`.
    """
    _FINDER.names.add(_check_name(name))
    if not any(f is _FINDER for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def deactivate(name: str) -> None:
    """Disable the alias ``name`` in this process; the finder leaves :data:`sys.meta_path` with
    the last alias. A no-op when ``name`` is not active.

    Modules already imported through the alias stay in :data:`sys.modules` under both names
    (``rebel`` and ``npusim.rbln``): this does not unimport them, and a later ``import rebel.X``
    of a submodule not yet imported then loads a second copy of ``npusim.rbln.X`` under the name
    ``rebel.X`` (plain path lookup in ``rebel.__path__``). Delete those entries yourself if that
    matters.

    Raises:
        ValueError: ``name`` is not a key of :data:`ALIASES`.
    """
    _FINDER.names.discard(_check_name(name))
    if not _FINDER.names:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not _FINDER]


def active() -> tuple[str, ...]:
    """The aliases active in this process, sorted."""
    return tuple(sorted(_FINDER.names))


def enabled_by_env(environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """Which aliases the environment enables, and why; never raises.

    Args:
        environ: the environment to read (default :data:`os.environ`).

    Returns:
        ``({alias name: "VAR=value" that enables it}, [problems])``. ``NPU_HARNESS_TARGET``
        unset, empty, unknown or a hardware target enables nothing and is not a problem (the
        vLLM plugins report invalid targets); an unknown name in ``NPUSIM_ALIAS`` is.
    """
    enabled: dict[str, str] = {}
    problems: list[str] = []
    try:
        env = os.environ if environ is None else environ
        target = str(env.get(TARGET_ENV_VAR) or "").strip()
        for name in TARGET_ALIASES.get(target, ()):
            enabled.setdefault(name, f"{TARGET_ENV_VAR}={target}")
        raw = str(env.get(ALIAS_ENV_VAR) or "")
        for part in raw.split(","):
            name = part.strip()
            if not name:
                continue
            if name in ALIASES:
                enabled.setdefault(name, f"{ALIAS_ENV_VAR}={raw.strip()}")
            else:
                problems.append(f"{ALIAS_ENV_VAR} names unknown alias {name!r}; "
                                f"expected some of: {', '.join(ALIASES)}")
    except Exception as exc:  # noqa: BLE001 - garbage environments are a problem, not a crash
        problems.append(f"cannot read the environment: {type(exc).__name__}: {exc}")
    return enabled, problems


def activate_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Activate the aliases the environment enables (:func:`enabled_by_env`); never raises.

    This is what the ``.pth`` start-up hook runs. Problems (unknown ``NPUSIM_ALIAS`` names, an
    unreadable environment, any unexpected error) are recorded for :func:`activation_errors`
    instead of raised.

    Args:
        environ: the environment to read (default :data:`os.environ`).

    Returns:
        The alias names activated by this call, sorted.
    """
    try:
        enabled, problems = enabled_by_env(environ)
        _ENV_ERRORS[:] = problems
        for name in enabled:
            activate(name)
        return tuple(sorted(enabled))
    except Exception as exc:  # noqa: BLE001 - runs from a .pth: must never raise
        try:
            _ENV_ERRORS[:] = [f"activation failed: {type(exc).__name__}: {exc}"]
        except Exception:  # noqa: BLE001
            pass
        return ()


def activation_errors() -> tuple[str, ...]:
    """The problems the last :func:`activate_from_env` recorded (empty when it had none)."""
    return tuple(_ENV_ERRORS)


def _hint(name: str) -> str:
    targets = [t for t, names in TARGET_ALIASES.items() if name in names]
    how = [f"{TARGET_ENV_VAR}={t}" for t in targets] + [f"{ALIAS_ENV_VAR}={name}"]
    return " or ".join(how)


def status(name: str, environ: Mapping[str, str] | None = None) -> AliasStatus:
    """What ``import <name>`` gives in this interpreter, with ``environ`` deciding enablement.

    The real-installation check is of this interpreter's import path (:data:`sys.meta_path`,
    :data:`sys.path`). A module already imported under ``name`` decides: the simulator module
    means ``alias``, anything else ``real``. Never imports the simulator (only its parent
    package ``npusim``, to find it).

    Args:
        name: a key of :data:`ALIASES`.
        environ: the environment to judge enablement by (default :data:`os.environ`); the alias
            counts as enabled when it is active in this process or ``environ`` enables it.

    Raises:
        ValueError: ``name`` is not a key of :data:`ALIASES`.
    """
    sim = ALIASES[_check_name(name)]
    loaded = sys.modules.get(name)
    if loaded is not None and loaded is not sys.modules.get(sim):
        spec = getattr(loaded, "__spec__", None)
        origin = getattr(loaded, "__file__", None) or (_spec_origin(spec) if spec else "<unknown origin>")
        return AliasStatus(name, "real", str(origin), f"imported from a real installation, not {sim}")
    if loaded is None:
        try:
            real = _real_spec(name)
        except Exception as exc:  # noqa: BLE001 - a broken finder is reported, not raised
            return AliasStatus(name, "absent", sim, f"looking for a real {name} failed: "
                                                    f"{type(exc).__name__}: {exc}")
        if real is not None:
            return AliasStatus(name, "real", _spec_origin(real),
                               f"a real installation; it wins over the {sim} alias")
        if name in _REAL_WON:
            return AliasStatus(name, "real", _REAL_WON[name],
                               f"a real installation won over the {sim} alias at import")
    try:
        found = loaded is not None or importlib.util.find_spec(sim) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return AliasStatus(name, "absent", sim, f"no real {name} installed and no {sim} simulator")
    enabled, problems = enabled_by_env(environ)
    if loaded is not None:
        return AliasStatus(name, "alias", sim, "imported through the alias in this process")
    if name in enabled:
        return AliasStatus(name, "alias", sim, f"enabled by {enabled[name]}")
    if name in _FINDER.names:
        return AliasStatus(name, "alias", sim, "activated in this process")
    detail = f"active when {_hint(name)}"
    if problems:
        detail += "; " + "; ".join(problems)
    return AliasStatus(name, "inactive", sim, detail)


# ---- the .pth start-up hook -----------------------------------------------------------------


def pth_line() -> str:
    """The one line of ``npu_harness_alias.pth`` (without its newline).

    At interpreter start, when ``NPUSIM_ALIAS`` or ``NPU_HARNESS_TARGET`` is set, it runs
    :func:`activate_from_env` inside ``try``/``except ImportError``, so an interpreter where
    ``npusim`` is not importable is unaffected; with both unset it imports nothing.
    """
    body = ("try:\\n from npusim.alias import activate_from_env\\nexcept ImportError:\\n pass\\n"
            "else:\\n activate_from_env()")
    return (f'import os; exec("{body}") if os.environ.get("{ALIAS_ENV_VAR}") '
            f'or os.environ.get("{TARGET_ENV_VAR}") else None')


def install_pth(site_dir: Path) -> Path:
    """Write ``npu_harness_alias.pth`` (:func:`pth_line`) into the site-packages directory
    ``site_dir``; rewriting an existing one is harmless.

    Returns:
        The path of the written file.

    Raises:
        NotADirectoryError: ``site_dir`` is not a directory.
        OSError: the file cannot be written.
    """
    site_dir = Path(site_dir)
    if not site_dir.is_dir():
        raise NotADirectoryError(f"{site_dir} is not a directory (expected a site-packages directory)")
    path = site_dir / PTH_NAME
    path.write_text(pth_line() + "\n", encoding="utf-8")
    return path


def remove_pth(site_dir: Path) -> Path | None:
    """Delete ``npu_harness_alias.pth`` from ``site_dir``.

    Returns:
        The deleted file's path, or None when there was none.

    Raises:
        OSError: the file exists but cannot be deleted.
    """
    path = Path(site_dir) / PTH_NAME
    if not path.exists():
        return None
    path.unlink()
    return path


def installed_pth(site_dir: Path) -> Path | None:
    """The path of ``npu_harness_alias.pth`` in ``site_dir``, or None when it is not there."""
    path = Path(site_dir) / PTH_NAME
    return path if path.is_file() else None


def site_packages_of(env_dir: Path) -> Path:
    """The ``lib/python3.*/site-packages`` directory of the virtual environment ``env_dir``.

    When there are several, the one of this interpreter's ``major.minor`` is chosen.

    Raises:
        FileNotFoundError: ``env_dir`` has no such directory, or several and none is this
            interpreter's version.
    """
    env_dir = Path(env_dir)
    found = sorted(p for p in env_dir.glob("lib/python3.*/site-packages") if p.is_dir())
    if len(found) == 1:
        return found[0]
    mine = env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    if mine in found:
        return mine
    if not found:
        raise FileNotFoundError(f"{env_dir} has no lib/python3.*/site-packages (not a virtual environment?)")
    raise FileNotFoundError(f"{env_dir} has several site-packages ({', '.join(map(str, found))}) and "
                            f"none is for Python {sys.version_info[0]}.{sys.version_info[1]}")
