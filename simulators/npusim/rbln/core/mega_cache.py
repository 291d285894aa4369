"""``rebel.core.mega_cache``: the compiled-program cache of the ``vllm`` model path.

vllm-rbln (``v1/worker/mega_cache.py``) calls ``set_dir(cache_root)`` and ``read_bundle(file)``
before its warm-up, then ``write_bundle(file)`` after it, and compiles with
``options={"cache_dir": cache_root, "mega_cache_only": True}``. On the simulator:

* a **program** is what :func:`npusim.rbln.core.torch_compile.rbln_backend` makes of one graph;
  its key is the compile's signature (a digest of the graph's code, its inputs' shapes and
  dtypes, the target NPU and the compiler version), so any change that affects the program
  misses;
* :func:`read_bundle` loads a bundle's programs into the store of the directory
  :func:`set_dir` named; a compile whose key is there is a **hit** (recorded with
  ``from_cache=True``, no compile), any other a miss, compiled and added;
* :func:`write_bundle` writes every program of the store (loaded or compiled in this process).

The bundle is our own format (the real one is rebel-compiler's and private): the magic
``NPUSIM-RBLN-MEGA``, a format version line, a JSON payload and its SHA-256. A bundle that is
truncated, corrupt, of another version or of another compiler reads as None (vllm-rbln then
logs "Ignored an unreadable rbln mega-cache bundle ... recompiling"), never as programs.
What the simulator saves is the compile's *bookkeeping*: its compile step is negligible next
to the graph capture (TorchDynamo), which every start repeats, so a warm start here is not
measurably faster, where on a board it skips the rebel compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import IO, Any

__all__ = ["set_dir", "get_dir", "read_bundle", "write_bundle", "lookup", "add", "MAGIC", "VERSION"]

MAGIC = b"NPUSIM-RBLN-MEGA\n"
VERSION = 1

_lock = threading.Lock()
_state: dict[str, Any] = {"dir": None}
_stores: dict[str, dict[str, dict[str, Any]]] = {}


def _compiler() -> str:
    from ..compiler import COMPILER

    return COMPILER


def set_dir(path: str | os.PathLike[str]) -> None:
    """Make ``path`` the cache directory of this process (created if missing).

    Raises:
        ValueError: ``path`` is empty.
    """
    if not str(path):
        raise ValueError("mega_cache.set_dir: the cache directory is empty")
    os.makedirs(path, exist_ok=True)
    with _lock:
        _state["dir"] = os.path.abspath(str(path))


def get_dir() -> str | None:
    """The directory :func:`set_dir` named last (None before)."""
    return _state["dir"]


def _store(cache_dir: str | None) -> dict[str, dict[str, Any]]:
    key = os.path.abspath(str(cache_dir)) if cache_dir else (_state["dir"] or "")
    return _stores.setdefault(key, {})


def lookup(cache_dir: str | None, signature: str) -> dict[str, Any] | None:
    """The stored program ``signature`` of ``cache_dir`` (None: a miss)."""
    with _lock:
        return _store(cache_dir).get(signature)


def add(cache_dir: str | None, signature: str, program: dict[str, Any]) -> None:
    """Store a compiled program (what :func:`write_bundle` will write)."""
    with _lock:
        _store(cache_dir)[signature] = dict(program)


def read_bundle(src: IO[bytes]) -> dict[str, Any] | None:
    """Load the bundle in ``src`` into the store of :func:`get_dir`.

    Returns:
        ``{"programs": n, "compiler": ...}``, or None for a bundle that cannot be used
        (truncated, corrupt, another format version or another compiler).

    Raises:
        RuntimeError: :func:`set_dir` was not called.
    """
    if _state["dir"] is None:
        raise RuntimeError("mega_cache.read_bundle: call set_dir first")
    raw = src.read()
    if not raw.startswith(MAGIC):
        return None
    try:
        version_line, digest, payload = raw[len(MAGIC):].split(b"\n", 2)
        if int(version_line.decode()) != VERSION or hashlib.sha256(payload).hexdigest() != digest.decode():
            return None
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if body.get("compiler") != _compiler() or not isinstance(body.get("programs"), dict):
        return None
    with _lock:
        _store(None).update(body["programs"])
    return {"programs": len(body["programs"]), "compiler": body["compiler"]}


def write_bundle(dst: IO[bytes]) -> int:
    """Write every program of the store of :func:`get_dir` to ``dst``.

    Returns:
        The bytes written; 0 (nothing written) when the store is empty.

    Raises:
        RuntimeError: :func:`set_dir` was not called.
    """
    if _state["dir"] is None:
        raise RuntimeError("mega_cache.write_bundle: call set_dir first")
    with _lock:
        programs = dict(_store(None))
    if not programs:
        return 0
    payload = json.dumps({"compiler": _compiler(), "programs": programs}, sort_keys=True).encode()
    data = MAGIC + f"{VERSION}\n".encode() + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    dst.write(data)
    return len(data)
