"""Where the IME2 kernel's C sources are, and a digest of them (standard library only).

An installed wheel carries the sources as package data in ``_kernel_src`` next to this file
(``setup.py`` copies them: ``Makefile``, ``include/``, ``src/``, ``driver/``); a checkout (an
editable install) has them in ``kernels/ime2`` at the repository root. The riscv64 QEMU driver is
cross-built from them on request (``npu-harness ime2 build-driver``,
:func:`npu_conformance.qemu_ime2.build_driver`) into a cache directory keyed by
:func:`source_digest`, so a driver built from other sources is never used.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
from pathlib import Path

__all__ = ["KernelSourcesMissingError", "PACKAGED", "CHECKOUT", "SOURCE_PARTS", "IGNORED",
           "kernel_source_dir", "source_digest", "clear_digest_cache"]

#: The sources inside an installed wheel.
PACKAGED = Path(__file__).resolve().parent / "_kernel_src"
#: The sources of a checkout: plugins/vllm_npu/ime2 -> the repository root -> kernels/ime2.
CHECKOUT = Path(__file__).resolve().parents[3] / "kernels" / "ime2"
#: What of the source directory the builds read (the Makefile and its inputs).
SOURCE_PARTS = ("Makefile", "include", "src", "driver")
#: Names left out of the digest at any depth: build outputs. The same patterns as ``setup.py``'s
#: copy into ``_kernel_src``, so a wheel's sources and the checkout they came from have one digest.
IGNORED = ("build", "*.o", "*.so")
#: Hex digits of the digest (64 bits of sha256).
DIGEST_CHARS = 16


class KernelSourcesMissingError(FileNotFoundError):
    """Neither the packaged sources nor a checkout's ``kernels/ime2`` exist."""


def kernel_source_dir() -> Path:
    """The directory holding the kernel's ``Makefile``: :data:`PACKAGED` when present, else
    :data:`CHECKOUT`.

    Raises:
        KernelSourcesMissingError: neither holds a Makefile (the message names both places).
    """
    for place in (PACKAGED, CHECKOUT):
        if (place / "Makefile").is_file():
            return place
    raise KernelSourcesMissingError(
        f"the IME2 kernel sources are missing: neither {PACKAGED} (an installed wheel's package data) "
        f"nor {CHECKOUT} (a checkout's kernels/ime2) holds a Makefile; reinstall npu-harness, or run "
        "from a checkout")


def _ignored(rel: Path) -> bool:
    return any(fnmatch.fnmatch(part, pattern) for part in rel.parts for pattern in IGNORED)


@functools.cache
def _compute(root: Path) -> str:
    h = hashlib.sha256()
    files: list[Path] = []
    for part in SOURCE_PARTS:
        base = root / part
        if base.is_file():
            files.append(base)
        elif base.is_dir():
            files.extend(p for p in base.rglob("*") if p.is_file())
    rels = sorted((p.relative_to(root) for p in files), key=lambda r: r.as_posix())
    for rel in rels:
        if _ignored(rel):
            continue
        data = (root / rel).read_bytes()
        h.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:DIGEST_CHARS]


def source_digest(root: Path | None = None) -> str:
    """:data:`DIGEST_CHARS` (16) hex digits of sha256 over the relative paths, sizes and bytes of
    the files the riscv64 build reads under ``root`` (:data:`SOURCE_PARTS`, without
    :data:`IGNORED`); ``root`` defaults to :func:`kernel_source_dir`.

    Computed once per process and directory (the sources of an installed package do not change
    under a running process); :func:`clear_digest_cache` forgets the results.

    Raises:
        KernelSourcesMissingError: ``root`` is None and no sources exist.
        OSError: a source file cannot be read.
    """
    return _compute((root if root is not None else kernel_source_dir()).resolve())


def clear_digest_cache() -> None:
    """Forget every digest :func:`source_digest` computed in this process."""
    _compute.cache_clear()
