"""Read and write the simulator's ``.mxq`` files (format: ``FORMAT.md`` next to this module).

Layout: ``b"NPUSIMXQ"`` | u16 LE format version (1) | u16 reserved (0) | u64 LE header length N |
N bytes of UTF-8 JSON header | ``payload_bytes`` bytes of safetensors (the decoder weights) |
32-byte sha256 of everything before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..llm.errors import CheckpointError
from ..llm.safetensors import load_safetensors, save_safetensors

__all__ = ["FORMAT_VERSION", "MAGIC", "MxqFormatError", "read_mxq", "write_mxq"]

MAGIC = b"NPUSIMXQ"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHQ")  # magic, version, reserved, header length
_DIGEST = 32
REQUIRED_KEYS: tuple[str, ...] = (
    "format", "version", "llm_config", "max_batch_size", "max_cache_size", "max_width",
    "core_modes", "output_logits", "target_device", "payload_bytes",
)
#: Optional header keys and their defaults.
OPTIONAL_KEYS: dict[str, object] = {"memory_flexible": True}
BAD_MAGIC = "Invalid magic value detected. The MXQ file may be broken or corrupeted."  # (sic), qbruntime's text


class MxqFormatError(ValueError):
    """The file is not a valid simulator ``.mxq``; the message is the precise reason."""


def _payload_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="npusim-mxq-") as d:
        p = save_safetensors(Path(d) / "payload.safetensors", tensors)
        return p.read_bytes()


def write_mxq(path: str | os.PathLike, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Path:
    """Write an ``.mxq``: ``header`` (``payload_bytes``, ``format`` and ``version`` are filled in) and weights.

    Raises:
        ValueError: the header is not JSON-serialisable, or a tensor cannot be stored.
    """
    payload = _payload_bytes(tensors)
    head = {**header, "format": "npusim-mxq", "version": FORMAT_VERSION, "payload_bytes": len(payload)}
    raw = json.dumps(head, sort_keys=True, separators=(",", ":")).encode("utf-8")
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(raw)) + raw + payload
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(body + hashlib.sha256(body).digest())
    os.replace(tmp, p)
    return p


def read_mxq(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse and verify an ``.mxq``; returns ``(header, tensors)``.

    Checks, in order: readable file, magic, format version, sizes, sha256, header JSON and keys,
    payload.

    Raises:
        MxqFormatError: the first check that fails, with the values involved.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise MxqFormatError(f"Failed to open MXQ file '{p}': {exc.strerror or exc}.") from exc
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise MxqFormatError(BAD_MAGIC)
    if len(data) < _PREFIX.size + _DIGEST:
        raise MxqFormatError(f"MXQ file '{p}' is truncated: {len(data)} bytes, less than the {_PREFIX.size + _DIGEST}-byte minimum.")
    _, version, _, n = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise MxqFormatError(f"Unsupported MXQ format version {version} (supported: {FORMAT_VERSION}).")
    if _PREFIX.size + n + _DIGEST > len(data):
        raise MxqFormatError(f"MXQ header length {n} runs past the end of the {len(data)}-byte file '{p}' (truncated?).")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    actual = hashlib.sha256(body).digest()
    if actual != digest:
        raise MxqFormatError(f"MXQ checksum mismatch in '{p}': stored sha256 {digest.hex()[:16]}..., computed {actual.hex()[:16]}... (file modified or truncated).")
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MxqFormatError(f"MXQ header of '{p}' is not valid UTF-8 JSON: {exc}.") from exc
    if not isinstance(header, dict):
        raise MxqFormatError(f"MXQ header of '{p}' must be a JSON object.")
    missing = [k for k in REQUIRED_KEYS if k not in header]
    if missing:
        raise MxqFormatError(f"MXQ header of '{p}' lacks keys {missing}.")
    for key, default in OPTIONAL_KEYS.items():
        if not isinstance(header.get(key, default), type(default)):
            raise MxqFormatError(f"MXQ header of '{p}': {key}={header[key]!r} must be a {type(default).__name__}.")
    payload = body[_PREFIX.size + n :]
    if header["payload_bytes"] != len(payload):
        raise MxqFormatError(f"MXQ payload of '{p}' is {len(payload)} bytes but the header says {header['payload_bytes']}.")
    with tempfile.TemporaryDirectory(prefix="npusim-mxq-") as d:
        tmp = Path(d) / "payload.safetensors"
        tmp.write_bytes(payload)
        try:
            tensors = load_safetensors(tmp)
        except CheckpointError as exc:
            raise MxqFormatError(f"MXQ payload of '{p}' is not valid safetensors: {exc}.") from exc
    return header, tensors
