"""Where the IME2 kernel's C sources are, and a digest of them (standard library only).

An installed wheel carries the sources as package data in ``_kernel_src`` next to this file
(``setup.py`` copies them); a checkout (an editable install) has them in ``kernels/ime2`` at the
repository root. The riscv64 QEMU driver is cross-built from them on request
(``npu-harness ime2 build-driver``) into a cache directory keyed by :func:`source_digest`, so a
driver built from other sources is never used.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["KernelSourcesMissingError", "PACKAGED", "CHECKOUT", "SOURCE_PARTS", "kernel_source_dir",
           "source_digest"]

#: The sources inside an installed wheel.
PACKAGED = Path(__file__).resolve().parent / "_kernel_src"
#: The sources of a checkout: plugins/vllm_npu/ime2 -> the repository root -> kernels/ime2.
CHECKOUT = Path(__file__).resolve().parents[3] / "kernels" / "ime2"
#: What the builds read (the Makefile's inputs).
SOURCE_PARTS = ("Makefile", "include", "src", "driver")


class KernelSourcesMissingError(FileNotFoundError):
    """Neither the packaged sources nor a checkout's ``kernels/ime2`` exist."""


def kernel_source_dir() -> Path:
    """The directory holding the kernel's ``Makefile``: :data:`PACKAGED`, else :data:`CHECKOUT`.

    Raises:
        KernelSourcesMissingError: neither holds a Makefile (both places named).
    """
    for place in (PACKAGED, CHECKOUT):
        if (place / "Makefile").is_file():
            return place
    raise KernelSourcesMissingError(
        f"the IME2 kernel sources are missing: neither {PACKAGED} (an installed wheel) nor {CHECKOUT} "
        "(a checkout) holds a Makefile; reinstall npu-harness")


@functools.lru_cache(maxsize=8)
def _digest_of(root: Path) -> str:
    h = hashlib.sha256()
    for part in SOURCE_PARTS:
        base = root / part
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if rel.parts[0] == "build" or path.suffix in (".o", ".so"):
                continue
            h.update(rel.as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_digest(root: Path | None = None) -> str:
    """16 hex digits of sha256 over the relative paths and bytes of the sources under ``root``
    (default :func:`kernel_source_dir`); cached per process and directory.

    Raises:
        KernelSourcesMissingError: ``root`` is None and no sources exist.
    """
    return _digest_of((root or kernel_source_dir()).resolve())
