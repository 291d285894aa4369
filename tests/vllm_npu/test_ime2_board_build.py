"""The board's host build of kernels/ime2: the compiler choice of ``ci/pick-cc.sh`` (issue 15).

On a riscv64 host (the SpacemiT K3) the host library is the K3 build, with the IME2 path, whose
``.insn r`` lines need clang's assembler: ``ci/setup.sh`` takes its compiler from
``ci/pick-cc.sh``, which picks clang >= 19 from PATH there and fails naming the apt package
without one; elsewhere it keeps ``${CC:-cc}``. The script takes the architecture as
``--arch`` / ``NPU_IME2_HOST_ARCH``, so the riscv64 branch runs here with fake PATH directories
(tiny ``#!/bin/sh`` compilers printing a version). Then the same branch picks a ``clang-19``
that stands in for the board's native clang (the cross clang with ``--target=riscv64-linux-gnu``
and lld), the Makefile builds the library with exactly that command, and a program linked
against it runs under ``qemu-riscv64-static``: at VLEN 256 the whole op refuses (WRONG_VLEN) and
runs RVV with the fallback opt-in, at VLEN 1024 it runs IME2, each result equal to the x86 host
library bit for bit. The Makefile itself refuses a riscv64 CC that is not clang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vllm_npu.ime2 import kernel

ROOT = Path(__file__).resolve().parents[2]
PICK = ROOT / "ci" / "pick-cc.sh"
KERNEL = ROOT / "kernels" / "ime2"
BASH = shutil.which("bash") or "/bin/bash"
SYSROOT = Path("/usr/riscv64-linux-gnu")
QEMU = "qemu-riscv64-static"


def fake_compiler(directory: Path, name: str, version_line: str) -> Path:
    """An executable ``directory/name`` whose ``--version`` prints ``version_line``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{version_line}'\necho 'Target: riscv64-unknown-linux-gnu'\n")
    path.chmod(0o755)
    return path


def pick(path_dirs: list[Path], *args: str, cc: str | None = None, arch_env: str | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """Run ci/pick-cc.sh with PATH = ``path_dirs`` only (the script needs no other tool)."""
    env = {"PATH": os.pathsep.join(map(str, path_dirs)) or "/nonexistent"}
    if cc is not None:
        env["CC"] = cc
    if arch_env is not None:
        env["NPU_IME2_HOST_ARCH"] = arch_env
    return subprocess.run([BASH, str(PICK), *args], env=env, capture_output=True, text=True, timeout=30,
                          check=False)


# ---------------------------------------------------------------------------------------------
# the selection, on fake PATH directories


def test_other_hosts_keep_the_default_compiler(tmp_path):
    fake_compiler(tmp_path / "bin", "clang-19", "Debian clang version 19.1.7")
    assert pick([tmp_path / "bin"], "--arch", "x86_64").stdout == "cc\n"
    assert pick([tmp_path / "bin"], "--arch", "x86_64", cc="gcc-12").stdout == "gcc-12\n"


def test_riscv64_picks_clang_19_from_path(tmp_path):
    clang = fake_compiler(tmp_path / "bin", "clang-19", "Debian clang version 19.1.7 (6)")
    fake_compiler(tmp_path / "bin", "cc", "cc (Debian 14.2.0-19) 14.2.0")
    res = pick([tmp_path / "bin"], "--arch", "riscv64")
    assert (res.returncode, res.stdout, res.stderr) == (0, f"{clang}\n", "")


def test_riscv64_picks_the_newest_clang_and_ignores_other_tools(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    fake_compiler(one, "clang-19", "Debian clang version 19.1.7")
    fake_compiler(one, "clang-cpp-23", "Debian clang version 23.0.0")  # not a compiler driver name
    newest = fake_compiler(two, "clang-22", "Debian clang version 22.1.8")
    fake_compiler(two, "clang", "Ubuntu clang version 20.1.2")
    assert pick([one, two], "--arch=riscv64").stdout == f"{newest}\n"


def test_riscv64_architecture_from_the_environment(tmp_path):
    clang = fake_compiler(tmp_path / "bin", "clang", "clang version 21.1.0")
    assert pick([tmp_path / "bin"], arch_env="riscv64").stdout == f"{clang}\n"
    assert pick([tmp_path / "bin"], arch_env="x86_64").stdout == "cc\n"


def test_riscv64_without_clang_19_fails_naming_the_package(tmp_path):
    old = fake_compiler(tmp_path / "bin", "clang-18", "Ubuntu clang version 18.1.3")
    fake_compiler(tmp_path / "bin", "gcc", "gcc (Debian 12.2.0-14) 12.2.0")
    res = pick([tmp_path / "bin"], "--arch", "riscv64")
    assert res.returncode == 1 and res.stdout == ""
    assert "needs clang >= 19" in res.stderr and "GNU as rejects" in res.stderr
    assert f"found: {old} (clang 18)" in res.stderr
    assert "sudo apt-get install clang-19" in res.stderr
    empty = pick([], "--arch", "riscv64")
    assert empty.returncode == 1 and "found: no clang at all" in empty.stderr


def test_riscv64_checks_a_given_cc(tmp_path):
    gcc = fake_compiler(tmp_path / "bin", "gcc", "gcc (Debian 14.2.0-19) 14.2.0")
    old = fake_compiler(tmp_path / "bin", "clang-17", "Debian clang version 17.0.6")
    good = fake_compiler(tmp_path / "bin", "clang-20", "Debian clang version 20.1.8")
    bad = pick([tmp_path / "bin"], "--arch", "riscv64", cc=str(gcc))
    assert bad.returncode == 2 and f"CC='{gcc}' is not clang" in bad.stderr and "apt-get install clang-19" in bad.stderr
    too_old = pick([tmp_path / "bin"], "--arch", "riscv64", cc=str(old))
    assert too_old.returncode == 2 and "is clang 17" in too_old.stderr
    assert pick([tmp_path / "bin"], "--arch", "riscv64", cc=f"{good} -O2").stdout == f"{good} -O2\n"


def test_bad_usage_is_named():
    res = pick([], "--arch")
    assert res.returncode == 2 and "--arch needs a value" in res.stderr
    res = pick([], "--frobnicate")
    assert res.returncode == 2 and "unknown argument '--frobnicate'" in res.stderr


def test_setup_builds_the_host_library_with_the_picked_compiler():
    setup = (ROOT / "ci" / "setup.sh").read_text()
    assert 'HOST_CC=$(bash ci/pick-cc.sh) || exit 1' in setup
    assert 'make -s -C kernels/ime2 CC="$HOST_CC" OUT="$ROOT/plugins/vllm_npu/ime2/_build"' in setup
    assert "ci/pick-cc.sh" in setup.split("inputs_hash()")[1].split("}")[0]  # a change re-runs the set-up


# ---------------------------------------------------------------------------------------------
# the picked command builds the K3 library, which runs under QEMU

_TOOLS = ("make", "clang-19", "riscv64-linux-gnu-gcc", QEMU)
_missing = [t for t in _TOOLS if shutil.which(t) is None] + ([] if SYSROOT.is_dir() else [str(SYSROOT)])
needs_cross = pytest.mark.skipif(bool(_missing),
                                 reason=f"missing {', '.join(_missing)} (bash ci/setup.sh installs them)")

PROBE = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "npu_ime2.h"

int main(void)
{
    float a[64], s[2 * 2], c[2] = {0, 0}, f[2] = {0, 0};
    uint8_t q[2 * 2 * 16];
    for (int i = 0; i < 64; i++) a[i] = (float)((i * 7) % 11) - 5.0f;
    for (int i = 0; i < 64; i++) q[i] = (uint8_t)(i * 37);
    for (int i = 0; i < 4; i++) s[i] = 0.25f * (float)(i + 1);
    int def = npu_ime2_hp_gemm(a, q, s, 1, 64, 2, c, sizeof c);
    int auto_status = (int)npu_ime2_path_status(NPU_IME2_PATH_AUTO);
    npu_ime2_set_allow_fallback(1);
    int fb = npu_ime2_hp_gemm(a, q, s, 1, 64, 2, f, sizeof f);
    uint32_t cb[2], fbits[2];
    memcpy(cb, def == 0 ? c : f, sizeof cb);
    memcpy(fbits, f, sizeof fbits);
    printf("abi=%d vlenb=%d ime2=%d default=%d auto_status=%d fallback=%d auto=%d c=%08x,%08x f=%08x,%08x\n",
           npu_ime2_abi_version(), npu_ime2_vlenb(), (int)npu_ime2_path_status(NPU_IME2_PATH_IME2), def,
           auto_status, fb, npu_ime2_auto_path(), cb[0], cb[1], fbits[0], fbits[1]);
    return 0;
}
"""


def probe_operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The probe's inputs (M = 1, K = 64, N = 2: the scalar tail only, no .hp to emulate)."""
    a = (((np.arange(64) * 7) % 11) - 5.0).astype(np.float32).reshape(1, 64)
    q = (np.arange(64) * 37 % 256).astype(np.uint8).reshape(2, 2, 16)
    s = (0.25 * np.arange(1, 5)).astype(np.float32).reshape(2, 2)
    return a, q, s


@pytest.fixture(scope="module")
def board_probe(tmp_path_factory) -> Path:
    """ci/pick-cc.sh --arch riscv64 -> the board's clang stand-in; the Makefile's host rule builds
    libnpu_ime2.so with it; the probe is linked against that library with the same command."""
    base = tmp_path_factory.mktemp("board-cc")
    bindir = base / "bin"
    bindir.mkdir()
    stand_in = bindir / "clang-19"  # the board's native clang: targets riscv64 and links there
    stand_in.write_text(f"#!/bin/sh\nexec {shutil.which('clang-19')} --target=riscv64-linux-gnu -fuse-ld=lld "
                        "-Wno-unused-command-line-argument \"$@\"\n")
    stand_in.chmod(0o755)
    gnu = bindir / "cc"  # a GNU cc on the same PATH must not be chosen
    gnu.write_text(f"#!/bin/sh\nexec {shutil.which('riscv64-linux-gnu-gcc')} \"$@\"\n")
    gnu.chmod(0o755)
    picked = pick([bindir], "--arch", "riscv64")
    assert picked.returncode == 0, picked.stderr
    cc = picked.stdout.strip()
    assert cc == str(stand_in)
    out = base / "lib"
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CFLAGS", "MAKEFLAGS", "MFLAGS")}
    subprocess.run(["make", "-s", "-C", str(KERNEL), f"OUT={out}", f"CC={cc}"], env=env, check=True,
                   capture_output=True, timeout=300)
    (base / "probe.c").write_text(PROBE)
    probe = base / "probe"
    subprocess.run([cc, "-O2", f"-I{KERNEL / 'include'}", str(base / "probe.c"), f"-L{out}", "-lnpu_ime2",
                    f"-Wl,-rpath,{out}", "-o", str(probe)], check=True, capture_output=True, timeout=120)
    return probe


def run_probe(probe: Path, vlen: int) -> dict[str, str]:
    cmd = [QEMU, "-L", str(SYSROOT), "-cpu", f"rv64,v=true,Zfh=true,vlen={vlen},vext_spec=v1.0", str(probe)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return dict(field.split("=", 1) for field in res.stdout.split())


def host_bits() -> str:
    c = np.asarray(kernel.ime2_hp_gemm_cpu(*probe_operands())).view(np.uint32).ravel()
    return ",".join(f"{int(v):08x}" for v in c)


@needs_cross
def test_picked_compiler_builds_the_k3_library_that_refuses_below_vlen_1024(board_probe):
    got = run_probe(board_probe, 256)
    assert got["abi"] == str(kernel.ABI_VERSION) and got["vlenb"] == "32"
    assert got["ime2"] == got["default"] == got["auto_status"] == str(kernel.Status.WRONG_VLEN)  # no silent fallback
    assert got["fallback"] == "0" and got["auto"] == str(kernel.PATHS["rvv"])  # opted in: RVV
    assert got["f"] == host_bits()


@needs_cross
def test_picked_compiler_builds_the_k3_library_that_runs_ime2_at_vlen_1024(board_probe):
    got = run_probe(board_probe, 1024)
    statuses = (got["ime2"], got["default"], got["auto_status"], got["fallback"])
    assert got["vlenb"] == "128" and statuses == ("0", "0", "0", "0")
    assert got["auto"] == str(kernel.PATHS["ime2"])
    assert got["c"] == got["f"] == host_bits()


@needs_cross
def test_makefile_refuses_a_riscv64_cc_that_is_not_clang(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CFLAGS", "MAKEFLAGS", "MFLAGS")}
    res = subprocess.run(["make", "-s", "-C", str(KERNEL), f"OUT={tmp_path}", "CC=riscv64-linux-gnu-gcc"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode != 0
    assert "CC='riscv64-linux-gnu-gcc' is not clang" in res.stderr and "bash ci/pick-cc.sh" in res.stderr
    assert "apt-get install clang-19" in res.stderr
    assert not (tmp_path / "obj-host").exists() and not (tmp_path / "libnpu_ime2.so").exists()  # nothing compiled
