"""Run this environment's Python as another x86-64 CPU under ``qemu-x86_64-static -cpu MODEL``
(QEMU's user mode emulates no AVX-512), for the ISA-matrix tests.

QEMU's user mode does not follow ``execve``: a process the emulated Python starts (vLLM's
engine core, spawned with ``sys.executable``) would run natively. :func:`emulated_python`
therefore writes a small venv whose ``bin/python`` is a shell script that starts QEMU with
``-0`` set to that script's own path, so the emulated interpreter's ``sys.executable`` is the
script again and every child it spawns is emulated too. The venv's ``lib`` is this venv's.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

QEMU = "qemu-x86_64-static"
#: Lines QEMU prints for CPUID bits its TCG does not emulate (noise in every child's stderr).
NOISE = "TCG doesn't support"


def unavailable_reason() -> str | None:
    """Why the ISA matrix cannot run here, or None."""
    if platform.machine() != "x86_64":
        return f"the ISA matrix emulates x86-64 CPUs; this host is {platform.machine()}"
    if shutil.which(QEMU) is None:
        return f"{QEMU} is not on PATH (Debian package qemu-user-static; bash ci/setup.sh installs it)"
    return None


def emulated_python(root: Path, cpu: str) -> Path:
    """``root/bin/python``: this environment's interpreter under ``qemu-x86_64-static -cpu
    cpu``, with this venv's packages and children emulated too (see the module docstring)."""
    venv = Path(sys.prefix)
    real = Path(os.path.realpath(sys.executable))
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(venv / "pyvenv.cfg", root / "pyvenv.cfg")
    for name in ("lib", "lib64"):
        if (venv / name).exists() and not (root / name).exists():
            (root / name).symlink_to((venv / name).resolve())
    script = root / "bin" / "python"
    script.write_text(f'#!/bin/sh\nexec {shutil.which(QEMU)} -cpu {cpu} -0 "$0" {real} "$@"\n')
    script.chmod(0o755)
    return script
