"""The ``.neff`` file of the simulator: our own versioned, checksummed container (stdlib only).

Not AWS's NEFF format: a real Neuron runtime cannot load it and the simulator cannot load theirs.
Layout (all integers little-endian)::

    offset  size  field
    0       12    magic  b"NPUSIM-NEFF\\x00"
    12      4     u32    format version (FORMAT_VERSION)
    16      8     u64    H = header length
    24      H     header, UTF-8 JSON object (fields: :data:`HEADER_FIELDS`)
    24+H    32    SHA-256 of every byte before it

A reader checks, in order: the length and the magic, the digest, the version, the header
length, the header's fields. Each failure is a :class:`~npusim.neff.errors.NeffFileError`
naming the file and the fault. See ``simulators/npusim/neff/FORMAT.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from .errors import NeffFileError

__all__ = ["MAGIC", "FORMAT_VERSION", "HEADER_FIELDS", "write", "read", "encode"]

MAGIC = b"NPUSIM-NEFF\x00"
FORMAT_VERSION = 1
_DIGEST = 32
_FIXED = len(MAGIC) + 4 + 8

#: Header field -> the JSON type(s) it must have.
HEADER_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "spec": (dict,),
    "target": (str,),
    "compiler_version": (str,),
    "simulator_version": (str,),
    "compiler_args": (list,),
    "model_dir": (str,),
    "model_digest": (str,),
    "model_files": (list,),
    "inputs": (list,),
    "outputs": (list,),
    "weight_bytes": (int,),
    "kv_bytes": (int,),
    "activation_bytes": (int,),
    "simulated_seconds": (int, float),
}


def encode(header: dict[str, Any], version: int = FORMAT_VERSION) -> bytes:
    """The bytes of a NEFF file holding ``header`` (``version`` is a parameter for tests)."""
    body = json.dumps(header, sort_keys=True).encode("utf-8")
    data = MAGIC + struct.pack("<IQ", version, len(body)) + body
    return data + hashlib.sha256(data).digest()


def write(path: str | os.PathLike, header: dict[str, Any]) -> int:
    """Write ``header`` as a NEFF file (to a temporary name, then renamed); returns the file size.

    Raises:
        OSError: the file cannot be written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = encode(header)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, p)
    return len(data)


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a NEFF file; returns its header.

    Raises:
        NeffFileError: missing/unreadable, too short, bad magic, checksum mismatch, another
            format version, inconsistent header length, a header that is not a JSON object,
            or a header field missing or of the wrong type (each message names the file).
    """
    where = f"NEFF file {str(path)!r}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise NeffFileError(f"{where}: cannot be read ({exc.strerror or exc})") from exc
    if len(data) < _FIXED + _DIGEST:
        raise NeffFileError(f"{where}: truncated ({len(data)} bytes, a NEFF has at least {_FIXED + _DIGEST})")
    if data[: len(MAGIC)] != MAGIC:
        raise NeffFileError(f"{where}: bad magic {data[:len(MAGIC)]!r} (expected {MAGIC!r}); not a npusim NEFF")
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise NeffFileError(f"{where}: checksum mismatch: the file is corrupt or truncated")
    version, hlen = struct.unpack_from("<IQ", data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise NeffFileError(f"{where}: format version {version}, this simulator reads {FORMAT_VERSION}")
    if _FIXED + hlen + _DIGEST != len(data):
        raise NeffFileError(f"{where}: header length {hlen} does not match the file size {len(data)}")
    try:
        header = json.loads(data[_FIXED : _FIXED + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise NeffFileError(f"{where}: the header is not UTF-8 JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise NeffFileError(f"{where}: the header is not a JSON object")
    for field, types in HEADER_FIELDS.items():
        if field not in header:
            raise NeffFileError(f"{where}: header field {field!r} is missing")
        value = header[field]
        if isinstance(value, bool) or not isinstance(value, types):
            raise NeffFileError(f"{where}: header field {field!r} has the wrong type ({type(value).__name__})")
    return header
