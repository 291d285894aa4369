"""The ``.rbln`` file of the simulator: our own versioned, checksummed container (stdlib only).

Layout (all integers little-endian)::

    offset  size  field
    0       12    magic  b"NPUSIM-RBLN\\x00"
    12      4     u32    format version (FORMAT_VERSION)
    16      8     u64    H = header length
    24      H     header, UTF-8 JSON object (see :class:`Header`)
    24+H    8     u64    P = program length
    32+H    P     program bytes (a ``torch.export`` archive; opaque here)
    32+H+P  32    SHA-256 of every byte before it

The header holds what the device needs without the program: the target NPU, device count,
the static input/output signature, the compile context id and its static-address buffer
names, buffer multipliers, and the byte sizes of weights and activations. A reader checks the
magic, the version, the lengths and the digest before it trusts anything; every failure is an
:class:`~npusim.rbln.errors.RBLNFileError` naming the file and what is wrong. See
``simulators/npusim/rbln/FORMAT.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import RBLNFileError

__all__ = ["MAGIC", "FORMAT_VERSION", "Header", "write", "read"]

MAGIC = b"NPUSIM-RBLN\x00"
FORMAT_VERSION = 1
_DIGEST = 32


@dataclass(frozen=True)
class Header:
    """The metadata of one compiled program.

    Attributes:
        compiler: the compiler that wrote it (``npusim.rbln <version>``).
        npu: the SKU it targets (``RBLN-CA25``).
        num_devices: devices (RSD nodes) it spans.
        input_info: ``[(name, shape, dtype), ...]`` in call order, static-address buffers included.
        outputs: ``[(shape, dtype), ...]`` of the results.
        context_id: the compile context it belongs to (runtimes of one context share buffers).
        static_names: the input names that are static-address buffers of the context.
        multipliers: buffer name -> first-dimension multiplier set after compile.
        weight_bytes: bytes of parameters and constants.
        activation_bytes: bytes of working buffers (a rough estimate: the largest output x 4).
    """

    compiler: str
    npu: str
    num_devices: int
    input_info: list[tuple[str, list[int], str]]
    outputs: list[tuple[list[int], str]]
    context_id: str
    static_names: list[str] = field(default_factory=list)
    multipliers: dict[str, int] = field(default_factory=dict)
    weight_bytes: int = 0
    activation_bytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Header":
        try:
            obj = json.loads(raw.decode())
            obj["input_info"] = [(str(n), [int(d) for d in s], str(t)) for n, s, t in obj["input_info"]]
            obj["outputs"] = [([int(d) for d in s], str(t)) for s, t in obj["outputs"]]
            return cls(**obj)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise RBLNFileError(f"{where}: the header is not a valid program header ({exc})") from exc


def write(path: str | os.PathLike, header: Header, program: bytes) -> Path:
    """Write a ``.rbln`` file atomically (a temporary file renamed over ``path``)."""
    path = Path(path)
    head = header.to_json()
    body = (MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(head)) + head
            + struct.pack("<Q", len(program)) + program)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body + hashlib.sha256(body).digest())
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike) -> tuple[Header, bytes]:
    """Read and verify a ``.rbln`` file.

    Raises:
        RBLNFileError: missing, truncated, wrong magic or version, bad digest, bad header.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RBLNFileError(f"{path}: cannot read the compiled model ({exc.strerror})") from exc
    where = str(path)
    if len(data) < len(MAGIC) + 12 + 8 + _DIGEST or not data.startswith(MAGIC):
        raise RBLNFileError(f"{where}: not an npusim .rbln file (bad magic or too short, {len(data)} bytes)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise RBLNFileError(f"{where}: checksum mismatch: the file is corrupt or truncated")
    version, hlen = struct.unpack_from("<IQ", body, len(MAGIC))
    if version != FORMAT_VERSION:
        raise RBLNFileError(f"{where}: format version {version}, this simulator reads {FORMAT_VERSION}")
    start = len(MAGIC) + 12
    if start + hlen + 8 > len(body):
        raise RBLNFileError(f"{where}: header length {hlen} runs past the end of the file")
    header = Header.from_json(body[start:start + hlen], where)
    (plen,) = struct.unpack_from("<Q", body, start + hlen)
    prog = body[start + hlen + 8:]
    if len(prog) != plen:
        raise RBLNFileError(f"{where}: program length {plen} != {len(prog)} bytes present")
    return header, prog

