"""The board build of the IME2 kernel: ``make -C kernels/ime2`` on a riscv64 host (issue 5).

On the K3 the plugin loads ``libnpu_ime2.so`` built natively by ``ci/setup.sh``'s host step, so
that shared library must hold the RVV and IME2 paths (each with its own ``-march``), not only the
portable one. Here the same Makefile rule runs with the cross compiler standing in for the
board's (``CC="clang-19 --target=riscv64-linux-gnu"``), and the driver, dynamically linked
against that library, runs under ``qemu-riscv64-static`` with the cross sysroot
(``QEMU_LD_PREFIX``): AUTO must pick IME2 at VLEN 1024 (its ``.hp`` emulated), refuse below
(WRONG_VLEN) and run RVV there only with the fallback opt-in, and every path must equal the host
library bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import qemu_ime2
from vllm_npu.ime2 import ime2_hp_gemm_cpu

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "ime2"
SYSROOT = Path("/usr/riscv64-linux-gnu")
TOOLS = ("make", "clang-19", "ld.lld-19", qemu_ime2.QEMU, "riscv64-linux-gnu-nm")
_missing = [t for t in TOOLS if shutil.which(t) is None] + ([] if SYSROOT.is_dir() else [str(SYSROOT)])
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"missing {', '.join(_missing)} (bash ci/setup.sh installs them)")

CROSS_CC = "clang-19 --target=riscv64-linux-gnu"


@pytest.fixture(scope="module")
def board_build(tmp_path_factory) -> tuple[Path, Path]:
    """(the board library, a driver dynamically linked against it)."""
    out = tmp_path_factory.mktemp("board")
    env = {k: v for k, v in os.environ.items() if k not in ("CFLAGS", "MAKEFLAGS", "MFLAGS")}
    subprocess.run(["make", "-s", "-C", str(KERNEL), f"OUT={out}", f"CC={CROSS_CC}", "LDFLAGS=-fuse-ld=lld"],
                   env=env, check=True, capture_output=True, timeout=600)
    lib = out / "libnpu_ime2.so"
    driver = out / "npu_ime2_driver_dyn"
    subprocess.run(["clang-19", "--target=riscv64-linux-gnu", "-march=rv64gcv_zvfh", "-O2", "-fuse-ld=lld",
                    "-fno-vectorize", "-fno-slp-vectorize", "-DNPU_IME2_HAVE_EMU",
                    f"-I{KERNEL / 'include'}", f"-I{KERNEL / 'src'}", f"-I{KERNEL / 'driver'}",
                    str(KERNEL / "driver" / "driver.c"), str(KERNEL / "driver" / "ime2_emu.c"),
                    f"-L{out}", "-lnpu_ime2", f"-Wl,-rpath,{out}", "-lm", "-o", str(driver)],
                   check=True, capture_output=True, timeout=600)
    return lib, driver


def test_board_library_holds_every_riscv64_path(board_build):
    lib, _ = board_build
    syms = subprocess.run(["riscv64-linux-gnu-nm", "-D", "--defined-only", str(lib)], capture_output=True,
                          text=True, check=True).stdout
    for name in ("npu_ime2_gemm_rvv", "npu_ime2_gemm_ime2", "npu_ime2_ime2_usable", "npu_ime2_gemm_mt",
                 "npu_ime2_quantize_q4_0", "npu_ime2_auto_path", "npu_ime2_vlenb", "npu_ime2_set_allow_fallback",
                 "npu_ime2_hp_gemm_on"):
        assert f" T {name}\n" in syms, f"{name} missing from the board library"


def _board_operands(vlen: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([11, vlen])
    a = rng.standard_normal((5, 288)).astype(np.float32)
    qweight, scales = q.quantize_q4_0(rng.standard_normal((70, 288)).astype(np.float32))
    return a, qweight, scales


@pytest.fixture
def board_driver(board_build, monkeypatch) -> Path:
    """The board-library driver installed as qemu_ime2's driver (cross sysroot, .hp counted)."""
    _, driver = board_build
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, str(driver))
    monkeypatch.setenv("QEMU_LD_PREFIX", str(SYSROOT))
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    return driver


@pytest.mark.parametrize("vlen, path, fallback", [(1024, "ime2", False), (1024, "rvv", False), (256, "rvv", False),
                                                  (128, "portable", False), (1024, "hp_gemm", False),
                                                  (256, "hp_gemm", True)])
def test_board_library_paths_equal_the_host_library(board_driver, vlen, path, fallback):
    a, qweight, scales = _board_operands(vlen)
    res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path, timeout=300, allow_fallback=fallback)
    assert res.status == 0 and res.guards_ok, res.text
    np.testing.assert_array_equal(res.c.view(np.uint32), np.asarray(ime2_hp_gemm_cpu(a, qweight, scales)).view(np.uint32))
    emulated = qemu_ime2.emulated_count(res.stderr) or 0
    # the whole op (AUTO) runs IME2 exactly when VLEN is 1024: its .hp instructions were emulated
    assert (emulated > 0) == (path == "ime2" or (path == "hp_gemm" and vlen == 1024)), emulated


def test_board_library_whole_op_refuses_below_vlen_1024_by_default(board_driver):
    """On the K3 build the whole op returns WRONG_VLEN at vlenb 32 (an X100 core) unless the
    fallback is opted in (previous test): no .hp run, no C, guards intact."""
    a, qweight, scales = _board_operands(256)
    res = qemu_ime2.run(a, qweight, scales, vlen=256, path="hp_gemm", timeout=300)
    assert (res.status, res.c, res.guards_ok, res.vlenb) == (6, None, True, 32), res.text
    assert (qemu_ime2.emulated_count(res.stderr) or 0) == 0
