"""RBLN device identity: the NPU name, its family (ATOM or Rebel100) and family defaults.

Names follow the vendor's SKUs: ATOM cards are ``RBLN-CA*`` (``RBLN-CA22``, ``RBLN-CA25``),
Rebel100 (REBEL) cards ``RBLN-CR*`` (``RBLN-CR03``, ``RBLN-CR13``, ``RBLN-CR23``).

The ``rebel`` runtime module is an argument, never an import: the real ``rebel-compiler`` and
the ``npusim`` simulator both provide ``get_npu_name(device_id)``, and the tests pass a stub.
This module imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

#: Prefix of every ATOM (``ca``) NPU name, compared after ``strip().upper()``.
CA_NAME_PREFIX = "RBLN-CA"
#: Prefix of every Rebel100 / REBEL (``cr``) NPU name, compared after ``strip().upper()``.
CR_NAME_PREFIX = "RBLN-CR"
#: The one REBEL SKU with the multi-block KV store (CR13-only features).
CR13_NAME = "RBLN-CR13"
#: Environment variables naming the target NPU when ``rebel`` reports none, in lookup order.
NAME_ENV_VARS: tuple[str, ...] = ("RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC")
#: Prefill chunk size (tokens) per family tag: ATOM (``ca``) 128, REBEL (``cr``) 512.
PREFILL_CHUNK_SIZE_BY_FAMILY: Mapping[str, int] = MappingProxyType({"ca": 128, "cr": 512})

Family = Literal["atom", "rebel100"]


class NpuNameUnavailableError(RuntimeError):
    """Neither ``rebel`` nor the environment names the NPU (a host without an NPU mounted).

    A RuntimeError, as the vendor raises: callers that may run on a compile-only host catch
    RuntimeError and decide later.
    """


class UnknownDeviceError(ValueError, RuntimeError):
    """An NPU name that is neither ATOM (``RBLN-CA*``) nor REBEL (``RBLN-CR*``).

    Both a ValueError and a RuntimeError: the vendor raises the family error as one and the
    prefill-chunk error as the other, and either ``except`` clause catches this one.
    """


def device_name(rebel: Any, device_id: int = 0, environ: Mapping[str, str] | None = None) -> str:
    """The NPU name of device ``device_id``, e.g. ``"RBLN-CA25"``.

    ``rebel.get_npu_name(device_id)``, else ``$RBLN_FORCE_NPU_NAME``, else ``$RBLN_TARGET_SOC``
    (the first non-empty one), returned as given (not stripped or upper-cased).

    Args:
        rebel: a module or object with ``get_npu_name(device_id) -> str | None``.
        device_id: index of the NPU on this host.
        environ: the environment to read (default ``os.environ``).

    Raises:
        NpuNameUnavailableError: all three are empty; the message says how to name the target.
    """
    env = os.environ if environ is None else environ
    name = rebel.get_npu_name(device_id)
    for var in NAME_ENV_VARS:
        name = name or env.get(var)
    if not name:
        raise NpuNameUnavailableError(
            f"Could not determine the RBLN NPU name (rebel.get_npu_name({device_id}) returned "
            "None). On a host without an NPU mounted (e.g., a CPU-only compile worker running "
            "with VLLM_RBLN_COMPILE_ONLY=1), set RBLN_FORCE_NPU_NAME to the target NPU (e.g., "
            "RBLN-CA25) so compilation can target it.")
    return name


def is_ca(name: str) -> bool:
    """True for an ATOM NPU name: ``RBLN-CA*`` after ``strip().upper()`` (``" rbln-ca02 "``
    counts)."""
    return name.strip().upper().startswith(CA_NAME_PREFIX)


def is_cr(name: str) -> bool:
    """True for a Rebel100 / REBEL NPU name: ``RBLN-CR*`` after ``strip().upper()``."""
    return name.strip().upper().startswith(CR_NAME_PREFIX)


def is_cr13(name: str) -> bool:
    """True only for exactly ``"RBLN-CR13"`` (as the vendor compares; no normalisation)."""
    return name == CR13_NAME


def family(name: str) -> Family:
    """``"atom"`` for ``RBLN-CA*``, ``"rebel100"`` for ``RBLN-CR*``.

    Raises:
        UnknownDeviceError: any other name: ``invalid RBLN architecture, candidates =
            [ATOM(ca), REBEL(cr)]``.
    """
    if is_ca(name):
        return "atom"
    if is_cr(name):
        return "rebel100"
    raise UnknownDeviceError("invalid RBLN architecture, candidates = [ATOM(ca), REBEL(cr)]")


def prefill_chunk_size(name: str) -> int:
    """Default prefill chunk size in tokens for NPU ``name``: 128 on ATOM, 512 on REBEL.

    Raises:
        UnknownDeviceError: neither family: ``Unknown NPU device {name!r}; expected an ATOM
            (ca) or REBEL (cr) device.``
    """
    if is_ca(name):
        return PREFILL_CHUNK_SIZE_BY_FAMILY["ca"]
    if is_cr(name):
        return PREFILL_CHUNK_SIZE_BY_FAMILY["cr"]
    raise UnknownDeviceError(
        f"Unknown NPU device {name!r}; expected an ATOM (ca) or REBEL (cr) device.")


_GIB, _MIB = 1 << 30, 1 << 20


def dram_bytes(name: str) -> int:
    """DRAM a program may use on one card of NPU ``name``, in bytes: optimum-rbln's
    ``_dram_spec`` (reference §2): ATOM 16 GiB less a 288 MiB system reserve; Rebel100
    144 GiB in 4 chiplets less 1 GiB reserve per chiplet.

    Raises:
        UnknownDeviceError: neither family (the message of :func:`family`).
    """
    if family(name) == "atom":
        return 16 * _GIB - 288 * _MIB
    return 4 * (36 * _GIB - 1 * _GIB)
