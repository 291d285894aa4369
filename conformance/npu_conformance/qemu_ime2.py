"""Run the riscv64 IME2 kernel driver under ``qemu-riscv64-static`` (issue 3, section 3).

The driver (``kernels/ime2/driver/driver.c``, built by ``npu-harness ime2 build-driver``, which
``bash ci/setup.sh`` runs, into a user cache directory: :func:`driver_path`) is a static riscv64
binary holding the real kernel sources. :func:`run_driver` sends it one request (the
little-endian format documented at the top of ``driver.c``), runs it under QEMU user mode with
the requested VLEN and returns C. numpy only: no torch or vllm import.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QEMU = "qemu-riscv64-static"
DRIVER_NAME = "npu_ime2_driver"
#: The tools the cross build runs (on PATH), each with its Debian package.
CROSS_TOOLS = {"make": "make", "clang-19": "clang-19", "ld.lld-19": "lld-19"}
#: The Debian riscv64 cross glibc (headers, crt1.o, libc.a) that the static driver links against.
CROSS_SYSROOT = Path("/usr/riscv64-linux-gnu")
CROSS_GLIBC = CROSS_SYSROOT / "lib" / "libc.a"
#: The cross GCC's per-version directories (crtbeginT.o, libgcc.a), which clang also links in.
CROSS_GCC_DIR = Path("/usr/lib/gcc-cross/riscv64-linux-gnu")
#: Every Debian package of the cross build (all listed in ci/apt-packages.txt).
CROSS_PACKAGES = ("make", "clang-19", "lld-19", "gcc-riscv64-linux-gnu", "libc6-dev-riscv64-cross")
#: How to get the driver (printed wherever it is missing).
BUILD_COMMAND = ("npu-harness ime2 build-driver  (needs clang-19, lld-19 and the riscv64 cross glibc: "
                 f"sudo apt-get install {' '.join(CROSS_PACKAGES)})")
#: The cache's subdirectory holding one directory per source digest.
BUILD_SUBDIR = "ime2-riscv64"
#: Variables of the caller's environment that would change the cross build; dropped for make.
_SCRUBBED_ENV = ("MAKEFLAGS", "MFLAGS", "GNUMAKEFLAGS", "RV_CC", "RV_CFLAGS", "RV_RVV_FLAGS", "RV_IME2_FLAGS")
#: Environment variable naming the cache root (default $XDG_CACHE_HOME/npu-harness, else
#: ~/.cache/npu-harness).
CACHE_ENV = "NPU_HARNESS_CACHE_DIR"
#: Environment variable overriding the driver location.
DRIVER_ENV = "NPU_IME2_QEMU_DRIVER"
#: VLENs QEMU 7.2 accepts (bits).
VLENS = (128, 256, 512, 1024)
#: Driver flag opting in to the RVV/portable fallback of AUTO (npu_ime2_set_allow_fallback(1)).
ALLOW_FALLBACK_FLAG = "--allow-fallback"
#: GEMM paths of the C ABI; ``hp_gemm`` is the whole op (npu_ime2_hp_gemm, AUTO path).
PATHS = {"hp_gemm": -1, "auto": 0, "portable": 1, "rvv": 2, "ime2": 3, "x86": 4}
#: npu_ime2_status codes.
STATUS = {0: "OK", 1: "BAD_K", 2: "BAD_SHAPE", 3: "NULL_POINTER", 4: "NON_FINITE",
          5: "BUFFER_TOO_SMALL", 6: "WRONG_VLEN", 7: "BAD_PATH", 8: "NO_MEMORY"}

_REQ = struct.Struct("<8sIiqqqQQQQ")  # 72 bytes
_RESP = struct.Struct("<8siiiIqqQ")  # 48 bytes
assert _REQ.size == 72 and _RESP.size == 48


class QemuDriverError(RuntimeError):
    """The driver could not be run, or it failed without a response (crash, bad request, timeout)."""


class QemuDriverNotFound(QemuDriverError):
    """``qemu-riscv64-static`` or the driver binary is missing."""


class QemuDriverTimeout(QemuDriverError):
    """The QEMU run exceeded its timeout."""


class GuardCorruption(QemuDriverError):
    """The kernel wrote outside an output buffer: a 4 KiB guard region came back changed."""


class KernelStatusError(ValueError):
    """The kernel returned a nonzero ``npu_ime2_status``.

    Attributes:
        status: the numeric code; name: e.g. ``"BAD_K"``; text: the kernel's status string.
    """

    def __init__(self, status: int, text: str):
        self.status = status
        self.name = STATUS.get(status, f"STATUS_{status}")
        self.text = text
        super().__init__(f"npu_ime2 status {status} ({self.name}): {text}")


@dataclass(frozen=True)
class DriverResult:
    """One driver run: C, the kernel status, the vlenb the driver read, and QEMU wall seconds."""

    c: np.ndarray | None
    status: int
    text: str
    vlenb: int
    guards_ok: bool
    seconds: float
    stderr: str


def vlenb(vlen: int) -> int:
    """Bytes per vector register at ``vlen`` bits (what ``csrr vlenb`` reads)."""
    if vlen not in VLENS:
        raise ValueError(f"vlen must be one of {VLENS} (QEMU's range), got {vlen}")
    return vlen // 8


def cache_root() -> Path:
    """The npu-harness cache directory (absolute): ``$NPU_HARNESS_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/npu-harness``, else ``~/.cache/npu-harness``. It may not exist yet."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return Path(own).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return ((Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "npu-harness").absolute()


def build_dir() -> Path:
    """``<cache_root>/ime2-riscv64/<digest>``: where :func:`build_driver` puts the driver, its
    emulator probe and their objects. ``<digest>`` is
    :func:`vllm_npu.ime2.sources.source_digest` of the kernel sources this package would build
    from, so a driver built from other sources lives in another directory and is never used.

    Raises:
        vllm_npu.ime2.sources.KernelSourcesMissingError: no kernel sources to take a digest of.
    """
    from vllm_npu.ime2 import sources

    return cache_root() / BUILD_SUBDIR / sources.source_digest()


def driver_path() -> Path:
    """Where the riscv64 driver is (it may not exist; see :data:`BUILD_COMMAND`):
    ``$NPU_IME2_QEMU_DRIVER`` when set, else ``build_dir() / npu_ime2_driver``.

    Raises:
        vllm_npu.ime2.sources.KernelSourcesMissingError: no override and no kernel sources.
    """
    env = os.environ.get(DRIVER_ENV)
    if env:
        return Path(env)
    return build_dir() / DRIVER_NAME


class DriverBuildError(RuntimeError):
    """The riscv64 driver could not be built: a tool of the cross build is missing, the cache
    directory is not writable, or ``make`` failed or timed out."""


def missing_build_tools() -> list[tuple[str, str]]:
    """What the cross build needs and this machine lacks, as (what, Debian package) pairs;
    empty when everything is there. Checks :data:`CROSS_TOOLS` on ``PATH``, the cross glibc
    (:data:`CROSS_GLIBC`) and the cross GCC's start files and libgcc (:data:`CROSS_GCC_DIR`),
    which clang links a static riscv64 program against."""
    missing = [(tool, package) for tool, package in CROSS_TOOLS.items() if shutil.which(tool) is None]
    if not CROSS_GLIBC.is_file():
        missing.append((f"the riscv64 cross glibc ({CROSS_GLIBC})", "libc6-dev-riscv64-cross"))
    if not any((d / "crtbeginT.o").is_file() and (d / "libgcc.a").is_file()
               for d in (CROSS_GCC_DIR.glob("*") if CROSS_GCC_DIR.is_dir() else ())):
        missing.append((f"the riscv64 cross libgcc ({CROSS_GCC_DIR}/<version>/libgcc.a, crtbeginT.o)",
                        "gcc-riscv64-linux-gnu"))
    return missing


def _expected_outputs(source_dir: Path) -> tuple[str, ...]:
    """The binaries ``make riscv64`` builds from ``source_dir`` (the probe only with the emulator)."""
    with_emu = (source_dir / "driver" / "ime2_emu.c").is_file()
    return (DRIVER_NAME, PROBE_NAME) if with_emu else (DRIVER_NAME,)


def is_built() -> bool:
    """True when :func:`build_dir` holds the driver (and, when the sources have the emulator,
    its probe): :func:`build_driver` would then do nothing.

    Raises:
        vllm_npu.ime2.sources.KernelSourcesMissingError: no kernel sources.
    """
    from vllm_npu.ime2 import sources

    return _holds(build_dir(), _expected_outputs(sources.kernel_source_dir()))


def _holds(out: Path, names: tuple[str, ...]) -> bool:
    """Whether every one of ``names`` is a file in ``out``."""
    return all((out / name).is_file() for name in names)


def build_driver(force: bool = False, *, timeout: float = 600.0) -> Path:
    """Cross-build the riscv64 driver and its emulator probe into :func:`build_dir` and return
    the driver's path; a no-op returning it when they are already built (unless ``force``).

    Runs ``make -s -C <kernel_source_dir()> riscv64 OUT=<temporary directory beside
    build_dir()>`` (the Makefile writes only under ``OUT``, objects included, so read-only
    sources such as an installed wheel's are fine), then renames the finished directory into
    place: an interrupted or failed build leaves nothing that looks built, and of two processes
    building at once the first rename wins. ``make``'s inherited ``MAKEFLAGS`` and the
    ``RV_*`` flag variables are dropped from its environment, so the build is a function of the
    sources alone (the directory's digest). A build takes a few seconds.

    Args:
        force: rebuild even when the driver exists (the old directory is replaced).
        timeout: seconds allowed for ``make``.

    Raises:
        DriverBuildError: a tool is missing (each named with its Debian package), the cache
            directory cannot be written, or ``make`` failed or timed out (its output in the
            message).
        vllm_npu.ime2.sources.KernelSourcesMissingError: no kernel sources.
    """
    from vllm_npu.ime2 import sources

    source_dir = sources.kernel_source_dir()
    names = _expected_outputs(source_dir)
    out = build_dir()
    driver = out / DRIVER_NAME
    if not force and _holds(out, names):
        return driver
    missing = missing_build_tools()
    if missing:
        packages = " ".join(dict.fromkeys(p for _, p in missing))
        raise DriverBuildError(
            f"cannot build the riscv64 QEMU driver: missing {'; '.join(f'{w} (package {p})' for w, p in missing)}. "
            f"Install with: sudo apt-get install {packages}  (all the cross build needs: "
            f"{' '.join(CROSS_PACKAGES)})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building.", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
    except OSError as exc:
        raise DriverBuildError(f"cannot create the driver's cache directory under {out.parent}: {exc} "
                               f"(set {CACHE_ENV} to a writable directory)") from exc
    try:
        cmd = ["make", "-s", "-C", str(source_dir), "riscv64", f"OUT={tmp}"]
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise DriverBuildError(f"{' '.join(cmd)} timed out after {timeout} s") from exc
        absent = [n for n in names if not (tmp / n).is_file()]
        if proc.returncode != 0 or absent:
            raise DriverBuildError(
                f"{' '.join(cmd)} failed (exit {proc.returncode}"
                f"{', built no ' + ', '.join(absent) if absent else ''}):\n{(proc.stdout + proc.stderr)[-8000:]}")
        _install(tmp, out, names, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return driver


def _install(tmp: Path, out: Path, names: tuple[str, ...], *, force: bool) -> None:
    """Rename the finished build ``tmp`` to ``out``. An existing ``out`` is replaced when
    ``force`` or when it lacks one of ``names`` (a build from before this rename scheme, or
    emptied by hand); a complete one that another process renamed there meanwhile is kept.

    Raises:
        DriverBuildError: ``out`` could not be replaced.
    """
    old = None
    if out.exists() and (force or not _holds(out, names)):
        old = out.with_name(f".{out.name}.old.{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(out, old)
        except OSError as exc:
            raise DriverBuildError(f"cannot replace {out}: {exc}") from exc
    try:
        os.rename(tmp, out)
    except OSError as exc:  # another process renamed its finished build first
        if not _holds(out, names):
            raise DriverBuildError(f"cannot move the built driver from {tmp} to {out}: {exc}") from exc
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


#: Why the QEMU target cannot run when :data:`QEMU` is not on PATH.
QEMU_MISSING = f"{QEMU} is not on PATH (Debian package qemu-user-static; bash ci/setup.sh installs it)"


def qemu_path() -> str | None:
    """Absolute path of ``qemu-riscv64-static`` on PATH, or None."""
    return shutil.which(QEMU)


def missing_reason() -> str | None:
    """None when QEMU and the driver are both present; else what is missing and how to get it
    (never raises for missing kernel sources: their error's text is the reason)."""
    from vllm_npu.ime2.sources import KernelSourcesMissingError

    if qemu_path() is None:
        return QEMU_MISSING
    try:
        drv = driver_path()
    except KernelSourcesMissingError as exc:
        return str(exc)
    if not drv.is_file():
        return f"the riscv64 driver {drv} is not built: {BUILD_COMMAND}"
    return None


def encode_request(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray, path: int) -> bytes:
    """The request bytes (see driver.c). Shapes come from ``a`` [M, K] and ``qweight`` [N, ...]."""
    a = np.ascontiguousarray(a, dtype="<f4")
    qweight = np.ascontiguousarray(qweight, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype="<f4")
    if a.ndim != 2:
        raise ValueError(f"A must be 2-D [M, K], got shape {a.shape}")
    m, k = a.shape
    n = qweight.shape[0] if qweight.ndim >= 1 else 0
    header = _REQ.pack(b"NPUIME2Q", 1, path, m, k, n, a.nbytes, qweight.nbytes, scales.nbytes, 0)
    return header + a.tobytes() + qweight.tobytes() + scales.tobytes()


def decode_response(out: bytes) -> tuple[int, int, bool, str, np.ndarray | None]:
    """(status, vlenb, guards_ok, text, C or None) from the driver's stdout."""
    if len(out) < _RESP.size:
        raise QemuDriverError(f"short driver response ({len(out)} bytes)")
    magic, status, vb, guards, tlen, m, n, cbytes = _RESP.unpack_from(out)
    if magic != b"NPUIME2R":
        raise QemuDriverError(f"bad driver response magic {magic!r}")
    if len(out) != _RESP.size + tlen + cbytes:
        raise QemuDriverError(f"driver response is {len(out)} bytes, header says {_RESP.size + tlen + cbytes}")
    text = out[_RESP.size:_RESP.size + tlen].decode("utf-8", "replace")
    c = None
    if status == 0:
        if cbytes != m * n * 4:
            raise QemuDriverError(f"driver returned {cbytes} bytes of C for [{m}, {n}]")
        c = np.frombuffer(out[_RESP.size + tlen:], dtype="<f4").astype(np.float32).reshape(m, n)
    return status, vb, bool(guards), text, c


def run(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray, *, vlen: int, path: str = "portable",
        timeout: float = 60.0, allow_fallback: bool = False) -> DriverResult:
    """Run the driver once under QEMU at ``vlen`` bits; never raises for a kernel status.

    ``allow_fallback``: pass ``--allow-fallback`` (AUTO and ``hp_gemm`` then run RVV below VLEN
    1024 instead of returning WRONG_VLEN; the kernel's default is to refuse).

    Raises:
        QemuDriverNotFound, QemuDriverTimeout, GuardCorruption, QemuDriverError (crash or no
        response), ValueError (bad vlen or path name).
    """
    vlenb(vlen)
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
    reason = missing_reason()
    if reason:
        raise QemuDriverNotFound(reason)
    cmd = [qemu_path(), "-cpu", f"rv64,v=true,Zfh=true,vlen={vlen},vext_spec=v1.0", str(driver_path())]
    if allow_fallback:
        cmd.append(ALLOW_FALLBACK_FLAG)
    req = encode_request(a, qweight, scales, PATHS[path])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, input=req, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise QemuDriverTimeout(f"{' '.join(cmd)} timed out after {timeout} s") from exc
    seconds = time.perf_counter() - t0
    stderr = proc.stderr.decode("utf-8", "replace").strip()
    if proc.returncode not in (0, 3):
        raise QemuDriverError(f"{' '.join(cmd)} exited with {proc.returncode}: {stderr or '(no stderr)'}")
    status, vb, guards_ok, text, c = decode_response(proc.stdout)
    if proc.returncode == 3 or not guards_ok:
        raise GuardCorruption(f"vlen={vlen} path={path}: {stderr or 'guard region touched'}")
    return DriverResult(c, status, text, vb, guards_ok, seconds, stderr)


def run_driver(a: np.ndarray, qweight: np.ndarray, scales: np.ndarray, *, vlen: int, path: str = "portable",
               timeout: float = 60.0, allow_fallback: bool = False) -> np.ndarray:
    """C [M, N] float32 computed by the riscv64 kernel under QEMU at ``vlen`` bits.

    ``path``: ``portable`` (default), ``auto``, ``rvv``, ``ime2`` (npu_ime2_gemm with that path
    after packing in C) or ``hp_gemm`` (the whole op, npu_ime2_hp_gemm). ``allow_fallback``: as
    in :func:`run` (below VLEN 1024, ``auto`` and ``hp_gemm`` return WRONG_VLEN without it).

    Raises:
        KernelStatusError: the kernel returned a nonzero status (``.name``, e.g. ``BAD_K``).
        GuardCorruption, QemuDriverTimeout, QemuDriverNotFound, QemuDriverError: see :func:`run`.
    """
    res = run(a, qweight, scales, vlen=vlen, path=path, timeout=timeout, allow_fallback=allow_fallback)
    if res.status != 0:
        raise KernelStatusError(res.status, res.text)
    assert res.c is not None
    return res.c


# ---------------------------------------------------------------------------------------------
# The IME2 instruction emulator's probe (kernels/ime2/driver/ime2_probe.c): single .hp words on
# given register files, for testing the SIGILL emulator against npusim.q4x32.execute_hp.

PROBE_NAME = "npu_ime2_emu_probe"
#: Environment variables of the emulator (kernels/ime2/driver/ime2_emu.h), read at start-up.
EMU_ENV = {"rounding": "NPU_IME2_EMU_ROUNDING", "dot": "NPU_IME2_EMU_DOT", "overflow": "NPU_IME2_EMU_OVERFLOW",
           "count": "NPU_IME2_EMU_COUNT"}


def probe_path() -> Path:
    """The probe binary, next to the driver (built with it by :func:`build_driver`).

    Raises:
        vllm_npu.ime2.sources.KernelSourcesMissingError: see :func:`driver_path`.
    """
    return driver_path().with_name(PROBE_NAME)


def emulated_count(stderr: str) -> int | None:
    """The ``npu_ime2_emu: emulated=<n>`` figure printed when ``NPU_IME2_EMU_COUNT`` is set."""
    for line in stderr.splitlines():
        if line.startswith("npu_ime2_emu: emulated="):
            return int(line.split("=", 1)[1])
    return None


@dataclass(frozen=True)
class ProbeResult:
    """One probe run: the register files after each word (None unless the run succeeded)."""

    regs: np.ndarray | None  # uint8 [count, 32, vlenb]
    returncode: int
    stderr: str


def run_probe(words: list[int], regs: np.ndarray, *, vlen: int = 1024, env: dict[str, str] | None = None,
              timeout: float = 60.0) -> ProbeResult:
    """Execute ``words[i]`` on register file ``regs[i]`` (uint8 [count, 32, vlen/8]) under QEMU.

    ``env`` adds environment variables (e.g. ``{EMU_ENV["rounding"]: "fused"}``). A word the
    emulator rejects makes the probe die with SIGILL (``returncode == -signal.SIGILL``).

    Raises:
        QemuDriverNotFound: QEMU or the probe is missing (or no kernel sources). QemuDriverTimeout.
    """
    vb = vlenb(vlen)
    regs = np.ascontiguousarray(regs, dtype=np.uint8)
    if regs.shape != (len(words), 32, vb):
        raise ValueError(f"regs must have shape ({len(words)}, 32, {vb}), got {regs.shape}")
    from vllm_npu.ime2.sources import KernelSourcesMissingError

    if qemu_path() is None:
        raise QemuDriverNotFound(QEMU_MISSING)
    try:
        probe = probe_path()
    except KernelSourcesMissingError as exc:
        raise QemuDriverNotFound(str(exc)) from exc
    if not probe.is_file():
        raise QemuDriverNotFound(f"the emulator probe {probe} is not built: {BUILD_COMMAND}")
    body = b"".join(struct.pack("<I", w) + r.tobytes() for w, r in zip(words, regs))
    req = b"NPUIME2E" + struct.pack("<I", len(words)) + body
    cmd = [qemu_path(), "-cpu", f"rv64,v=true,Zfh=true,vlen={vlen},vext_spec=v1.0", str(probe)]
    try:
        proc = subprocess.run(cmd, input=req, capture_output=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        raise QemuDriverTimeout(f"{' '.join(cmd)} timed out after {timeout} s") from exc
    stderr = proc.stderr.decode("utf-8", "replace").strip()
    out = None
    if proc.returncode == 0:
        expect = 12 + len(words) * 32 * vb
        if len(proc.stdout) != expect or proc.stdout[:8] != b"NPUIME2F":
            raise QemuDriverError(f"probe response is {len(proc.stdout)} bytes, expected {expect}")
        out = np.frombuffer(proc.stdout[12:], dtype=np.uint8).reshape(len(words), 32, vb).copy()
    return ProbeResult(out, proc.returncode, stderr)
