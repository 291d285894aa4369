"""The npu-harness version: set in one place, ``pyproject.toml``'s ``[project] version``, and read
back from the installed distribution's metadata (a wheel install and an editable install alike).

``npu-harness --version``, ``npu-harness doctor`` and every conformance report print it.
"""

from __future__ import annotations

import importlib.metadata

#: The distribution name of this project (``pip install npu-harness``).
DISTRIBUTION = "npu-harness"
#: What :func:`harness_version` returns when the package runs without being installed
#: (e.g. from a source tree on ``PYTHONPATH``): then there is no metadata to read.
UNKNOWN = "unknown (not installed: no npu-harness distribution metadata)"


def harness_version() -> str:
    """The installed npu-harness version, e.g. ``"0.1.0"``, or :data:`UNKNOWN`."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def install_kind() -> str:
    """``"editable"`` (a checkout, ``pip install -e``), ``"wheel"`` or ``"not installed"``.

    Read from the distribution's ``direct_url.json`` (PEP 610): an editable install records
    ``dir_info.editable``; a wheel installed from a file or an index records no editable flag.
    """
    import json

    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    text = dist.read_text("direct_url.json")
    if text:
        try:
            if json.loads(text).get("dir_info", {}).get("editable"):
                return "editable"
        except (ValueError, AttributeError):
            pass
    return "wheel"
