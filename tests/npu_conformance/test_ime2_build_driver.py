"""The riscv64 QEMU driver built on request into the user cache (``npu-harness ime2
build-driver``, :func:`npu_conformance.qemu_ime2.build_driver`; issue 17)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from npu_conformance import qemu_ime2
from vllm_npu.ime2 import sources

needs_cross = pytest.mark.skipif(
    any(shutil.which(t) is None for t in qemu_ime2.CROSS_TOOLS) or qemu_ime2.qemu_path() is None,
    reason="needs clang-19, ld.lld-19 and qemu-riscv64-static (bash ci/setup.sh installs them)")


def test_driver_path_honours_the_override_and_the_cache_variables(tmp_path, monkeypatch):
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    monkeypatch.delenv(qemu_ime2.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    digest = sources.source_digest()
    assert qemu_ime2.driver_path() == tmp_path / "xdg" / "npu-harness" / "ime2-riscv64" / digest / "npu_ime2_driver"
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(tmp_path / "mine"))
    assert qemu_ime2.driver_path() == tmp_path / "mine" / "ime2-riscv64" / digest / "npu_ime2_driver"
    assert qemu_ime2.probe_path().parent == qemu_ime2.driver_path().parent
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, str(tmp_path / "elsewhere"))
    assert qemu_ime2.driver_path() == tmp_path / "elsewhere"


def test_digest_changes_with_one_source_byte_and_ignores_build_outputs(tmp_path):
    tree = tmp_path / "ime2"
    shutil.copytree(sources.kernel_source_dir(), tree, ignore=shutil.ignore_patterns("build"))
    before = sources.source_digest(tree)
    assert before == sources.source_digest(sources.kernel_source_dir())
    (tree / "build").mkdir()
    (tree / "build" / "libnpu_ime2.so").write_bytes(b"x")
    (tree / "src" / "stale.o").write_bytes(b"x")
    assert sources.source_digest(tree) == sources._digest_of.__wrapped__(tree.resolve()) == before
    src = tree / "src" / "dispatch.c"
    src.write_bytes(src.read_bytes() + b" ")
    assert sources._digest_of.__wrapped__(tree.resolve()) != before


def test_missing_tool_is_named_with_the_packages(tmp_path, monkeypatch):
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(qemu_ime2.shutil, "which", lambda name: None if name == "clang-19" else "/usr/bin/" + name)
    with pytest.raises(qemu_ime2.DriverBuildError, match=r"missing clang-19; install with: apt-get install clang-19 lld-19"):
        qemu_ime2.build_driver()
    assert not (tmp_path / "ime2-riscv64").exists() or not any((tmp_path / "ime2-riscv64").rglob("npu_ime2_driver"))


@needs_cross
def test_build_driver_builds_a_runnable_driver_once(tmp_path, monkeypatch):
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "npu_conformance.cli", "ime2", "build-driver"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    driver = qemu_ime2.driver_path()
    assert proc.stdout.strip() == f"riscv64 IME2 driver: {driver}" and driver.is_file()
    assert qemu_ime2.probe_path().is_file()
    mtime = driver.stat().st_mtime_ns
    assert qemu_ime2.build_driver() == driver and driver.stat().st_mtime_ns == mtime
    # The built driver runs the real kernel under QEMU: the portable path equals the reference.
    from npusim import q4x32

    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    qweight, scales = q4x32.quantize_q4_0(w)
    a = rng.standard_normal((2, 64)).astype(np.float32)
    got = qemu_ime2.run_driver(a, qweight, scales, path="portable", vlen=256)
    assert np.array_equal(got, q4x32.ime2_hp_gemm(a, qweight, scales, level="hardware"))
