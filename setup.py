"""The native part of the npu-harness wheel: the host IME2 kernel library, and its sources.

Everything declarative (name, version, dependencies, entry points) is in ``pyproject.toml``; this
file adds only two build steps to setuptools' ``build_py``, and makes the wheel a platform wheel.

1. The host kernel library ``vllm_npu/ime2/_build/libnpu_ime2.so`` is compiled by
   ``kernels/ime2/Makefile``, the one source of truth for the kernel's flags (the cross build of
   the riscv64 QEMU driver uses the same file). The compiler is ``ci/pick-cc.sh``'s pick:
   ``${CC:-cc}`` on x86-64, clang >= 19 on riscv64 (whose library holds the IME2 path). On x86-64
   the library picks its instruction sets at run time (per-function target attributes, CPUID),
   so one ``linux_x86_64`` wheel runs on AVX2-only and AVX-512 CPUs alike. On riscv64 the board's
   ``npu_ime2_hp_probe`` is built too and lies beside the library.
2. The kernel's sources (``Makefile``, ``include/``, ``src/``, ``driver/``) are copied to
   ``vllm_npu/ime2/_kernel_src``, so that ``npu-harness ime2 build-driver`` can cross-build the
   riscv64 QEMU driver into a user cache directory from an installed wheel.

An editable install (``pip install -e .``, as ``ci/setup.sh`` does) skips both: there the package
is the checkout, whose ``kernels/ime2`` is the source and whose library ``ci/setup.sh`` builds in
place with ``make``.

Building needs a C compiler and GNU make: from a clone (``pip wheel .``, ``python -m build``) or
from the sdist, which holds ``kernels/ime2`` and ``ci/pick-cc.sh``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE / "kernels" / "ime2"
PICK_CC = HERE / "ci" / "pick-cc.sh"
#: Where the library and the sources go inside the wheel (relative to its root).
LIBRARY_DIR = Path("vllm_npu", "ime2", "_build")
SOURCE_DIR = Path("vllm_npu", "ime2", "_kernel_src")
#: What of kernels/ime2 the builds read (the Makefile's inputs); build outputs never go in.
SOURCE_PARTS = ("Makefile", "include", "src", "driver")
LIBRARY_NAME = "libnpu_ime2.so"
HP_PROBE_NAME = "npu_ime2_hp_probe"


class KernelBuildError(RuntimeError):
    """The host kernel library could not be built (no compiler, no make, a compile error)."""


def _host_cc() -> str:
    """The C compiler ``ci/pick-cc.sh`` picks for this host.

    Raises:
        KernelBuildError: the script refuses (on riscv64: no clang >= 19), naming the fix.
    """
    proc = subprocess.run(["bash", str(PICK_CC)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelBuildError(f"no C compiler for the IME2 kernel: {proc.stderr.strip()}")
    return proc.stdout.strip()


def build_kernel(out: Path) -> list[Path]:
    """Compile the host kernel library (and, on riscv64, the board's .hp probe) into ``out``.

    Returns the built files. Raises:
        KernelBuildError: make or the compiler is missing, or the build fails (make's output is
        in the message).
    """
    if shutil.which("make") is None:
        raise KernelBuildError("building the IME2 kernel library needs GNU make "
                               "(Debian/Ubuntu: apt-get install make)")
    cc = _host_cc()
    with tempfile.TemporaryDirectory(prefix="npu-ime2-build-") as tmp:
        cmd = ["make", "-s", "-C", str(KERNEL_DIR), f"CC={cc}", f"OUT={tmp}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                                   f"{proc.stdout}{proc.stderr}")
        out.mkdir(parents=True, exist_ok=True)
        built = []
        for name in (LIBRARY_NAME, HP_PROBE_NAME):
            src = Path(tmp) / name
            if src.is_file():
                shutil.copy2(src, out / name)
                built.append(out / name)
    if not any(p.name == LIBRARY_NAME for p in built):
        raise KernelBuildError(f"make built no {LIBRARY_NAME} in {out}")
    return built


def copy_sources(out: Path) -> None:
    """Copy the kernel's sources (:data:`SOURCE_PARTS`) into ``out``, replacing what was there."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for part in SOURCE_PARTS:
        src = KERNEL_DIR / part
        if src.is_dir():
            shutil.copytree(src, out / part, ignore=shutil.ignore_patterns("build", "*.o", "*.so"))
        else:
            shutil.copy2(src, out / part)


class BuildPyWithKernel(build_py):
    """``build_py``, then the kernel library and its sources into the build tree."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        root = Path(self.build_lib)
        for path in build_kernel(root / LIBRARY_DIR):
            self.announce(f"built {path}", level=2)
        copy_sources(root / SOURCE_DIR)


class NativeDistribution(Distribution):
    """A distribution with native code: installed into platlib, its wheel not pure."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """A ``py3-none-<platform>`` wheel: no Python ABI (the library is loaded with ctypes, and
    holds no CPython extension), but native code, so never ``none-any``."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=NativeDistribution,
      cmdclass={"build_py": BuildPyWithKernel, "bdist_wheel": PlatformWheel})
