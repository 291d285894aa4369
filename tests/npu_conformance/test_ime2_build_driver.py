"""The riscv64 QEMU driver built on request into the user cache (``npu-harness ime2
build-driver``, :func:`npu_conformance.qemu_ime2.build_driver`; issue 17).

The cache layout: ``<cache>/ime2-riscv64/<digest of the kernel sources>/`` holds
``npu_ime2_driver``, ``npu_ime2_emu_probe`` and ``obj-riscv64/``, where ``<cache>`` is
``$NPU_HARNESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/npu-harness``, else ``~/.cache/npu-harness``.
One test really cross-builds (a few seconds) from a copy of the sources and runs the driver under
QEMU; the others use a fake ``make``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from npu_conformance import cli, qemu_ime2
from vllm_npu.ime2 import sources

ROOT = Path(__file__).resolve().parents[2]
needs_cross = pytest.mark.skipif(
    bool(qemu_ime2.missing_build_tools()) or qemu_ime2.qemu_path() is None,
    reason=f"needs {', '.join(w for w, _ in qemu_ime2.missing_build_tools()) or qemu_ime2.QEMU} "
           "(bash ci/setup.sh installs them)")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root in ``$NPU_HARNESS_CACHE_DIR``, no driver override."""
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    root = tmp_path / "cache"
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(root))
    return root


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the kernel sources (the parts the build reads) used as kernel_source_dir()."""
    tree = tmp_path / "ime2-src"
    tree.mkdir()
    for part in sources.SOURCE_PARTS:
        src = sources.kernel_source_dir() / part
        if src.is_dir():
            shutil.copytree(src, tree / part, ignore=shutil.ignore_patterns(*sources.IGNORED))
        else:
            shutil.copy2(src, tree / part)
    monkeypatch.setattr(sources, "kernel_source_dir", lambda: tree)
    return tree


def _tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------------
# where the driver is


def test_driver_path_honours_the_override_and_the_cache_variables(tmp_path, monkeypatch):
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    monkeypatch.delenv(qemu_ime2.CACHE_ENV, raising=False)
    digest = sources.source_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert qemu_ime2.driver_path() == (tmp_path / "home" / ".cache" / "npu-harness" / "ime2-riscv64" / digest
                                       / "npu_ime2_driver")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert qemu_ime2.driver_path() == tmp_path / "xdg" / "npu-harness" / "ime2-riscv64" / digest / "npu_ime2_driver"
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(tmp_path / "mine"))
    assert qemu_ime2.driver_path() == tmp_path / "mine" / "ime2-riscv64" / digest / "npu_ime2_driver"
    assert qemu_ime2.probe_path() == tmp_path / "mine" / "ime2-riscv64" / digest / "npu_ime2_emu_probe"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, "relative")  # made absolute: make's OUT must not depend on PWD
    assert qemu_ime2.build_dir() == tmp_path / "relative" / "ime2-riscv64" / digest
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, str(tmp_path / "elsewhere"))
    assert qemu_ime2.driver_path() == tmp_path / "elsewhere"
    assert qemu_ime2.probe_path() == tmp_path / "npu_ime2_emu_probe"


def test_the_checkout_sources_are_found_relative_to_the_package():
    assert sources.CHECKOUT == ROOT / "kernels" / "ime2"
    assert sources.PACKAGED == ROOT / "plugins" / "vllm_npu" / "ime2" / "_kernel_src"
    assert not sources.PACKAGED.exists()  # an editable install: setup.py copies the sources only into a wheel
    assert sources.kernel_source_dir() == sources.CHECKOUT


def test_packaged_sources_win_and_neither_is_an_error_naming_both(tmp_path, monkeypatch):
    packaged, checkout = tmp_path / "_kernel_src", tmp_path / "kernels" / "ime2"
    monkeypatch.setattr(sources, "PACKAGED", packaged)
    monkeypatch.setattr(sources, "CHECKOUT", checkout)
    with pytest.raises(sources.KernelSourcesMissingError) as info:
        sources.kernel_source_dir()
    assert str(packaged) in str(info.value) and str(checkout) in str(info.value)
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    monkeypatch.setattr(qemu_ime2, "qemu_path", lambda: "/usr/bin/" + qemu_ime2.QEMU)
    assert qemu_ime2.missing_reason() == str(info.value)  # a reason for doctor, not a crash
    with pytest.raises(qemu_ime2.QemuDriverNotFound, match="the IME2 kernel sources are missing"):
        qemu_ime2.run_probe([0], np.zeros((1, 32, 128), dtype=np.uint8))
    checkout.mkdir(parents=True)
    (checkout / "Makefile").write_text("all:\n")
    assert sources.kernel_source_dir() == checkout
    packaged.mkdir()
    (packaged / "Makefile").write_text("all:\n")
    assert sources.kernel_source_dir() == packaged


def test_digest_changes_with_one_source_byte_and_ignores_everything_else(source_copy, cache):
    before = sources.source_digest(source_copy)
    assert before == sources.source_digest()  # the copy and the checkout are the same sources
    old_dir = qemu_ime2.build_dir()
    assert old_dir == cache / "ime2-riscv64" / before
    # Build outputs and files the build does not read change nothing.
    (source_copy / "README.md").write_text("notes\n")
    (source_copy / "build").mkdir()
    (source_copy / "build" / "libnpu_ime2.so").write_bytes(b"x")
    (source_copy / "src" / "build").mkdir()
    (source_copy / "src" / "build" / "gemm.c").write_bytes(b"x")
    (source_copy / "src" / "stale.o").write_bytes(b"x")
    (source_copy / "driver" / "probe.so").write_bytes(b"x")
    sources.clear_digest_cache()
    assert sources.source_digest() == before
    # One byte of a source changes it, and so the directory the driver is looked for in.
    src = source_copy / "src" / "dispatch.c"
    src.write_bytes(src.read_bytes() + b" ")
    assert sources.source_digest() == before  # cached per process
    sources.clear_digest_cache()
    after = sources.source_digest()
    assert after != before and qemu_ime2.build_dir() == cache / "ime2-riscv64" / after
    assert qemu_ime2.driver_path().parent != old_dir
    # A new file counts too, and so does a rename (paths are hashed, not only bytes).
    src.write_bytes(src.read_bytes()[:-1])
    sources.clear_digest_cache()
    assert sources.source_digest() == before
    (source_copy / "include" / "npu_ime2.h").rename(source_copy / "include" / "npu_ime2_renamed.h")
    sources.clear_digest_cache()
    assert sources.source_digest() not in (before, after)
    sources.clear_digest_cache()


# ---------------------------------------------------------------------------------------------
# what is missing


def _path_without(tmp_path: Path, *absent: str) -> str:
    """A PATH directory holding links to the cross build's tools, except ``absent``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("make", "clang-19", "ld.lld-19"):
        real = shutil.which(tool)
        if tool not in absent and real:
            (bindir / tool).symlink_to(real)
    return str(bindir)


def test_missing_clang_is_named_with_its_package(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("PATH", _path_without(tmp_path, "clang-19"))
    with pytest.raises(qemu_ime2.DriverBuildError) as info:
        qemu_ime2.build_driver()
    msg = str(info.value)
    assert "missing clang-19 (package clang-19)" in msg and "sudo apt-get install clang-19" in msg
    assert " ".join(qemu_ime2.CROSS_PACKAGES) in msg
    assert not cache.exists()  # checked before anything is created


def test_missing_cross_glibc_and_libgcc_are_named(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(qemu_ime2, "CROSS_GLIBC", tmp_path / "no-sysroot" / "lib" / "libc.a")
    monkeypatch.setattr(qemu_ime2, "CROSS_GCC_DIR", tmp_path / "no-gcc-cross")
    monkeypatch.setattr(qemu_ime2.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(qemu_ime2.DriverBuildError) as info:
        qemu_ime2.build_driver()
    msg = str(info.value)
    assert f"the riscv64 cross glibc ({tmp_path / 'no-sysroot' / 'lib' / 'libc.a'}) (package libc6-dev-riscv64-cross)" in msg
    assert "(package gcc-riscv64-linux-gnu)" in msg
    assert "sudo apt-get install libc6-dev-riscv64-cross gcc-riscv64-linux-gnu " in msg


def test_the_packages_named_are_the_set_ups():
    listed = {line.strip() for line in (ROOT / "ci" / "apt-packages.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")}
    assert set(qemu_ime2.CROSS_PACKAGES) <= listed
    assert set(qemu_ime2.CROSS_TOOLS.values()) <= set(qemu_ime2.CROSS_PACKAGES)
    assert qemu_ime2.BUILD_COMMAND == (
        "npu-harness ime2 build-driver  (needs clang-19, lld-19 and the riscv64 cross glibc: "
        "sudo apt-get install make clang-19 lld-19 gcc-riscv64-linux-gnu libc6-dev-riscv64-cross)")


def test_cli_exits_2_naming_the_missing_tool(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setenv("PATH", _path_without(tmp_path, "clang-19", "ld.lld-19"))
    assert cli.main(["ime2", "build-driver", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("npu-harness ime2 build-driver: cannot build the riscv64 QEMU driver: missing clang-19 "
                          "(package clang-19); ld.lld-19 (package lld-19)")


# ---------------------------------------------------------------------------------------------
# the build, with a fake make


class FakeMake:
    """Stands in for ``subprocess.run`` of make: writes the outputs into OUT (or fails)."""

    def __init__(self, *, fail: bool = False, outputs: tuple[str, ...] = ("npu_ime2_driver", "npu_ime2_emu_probe")):
        self.fail, self.outputs, self.calls = fail, outputs, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        out = Path(next(a for a in cmd if a.startswith("OUT="))[4:])
        assert out.is_dir() and out.is_absolute()
        for name in self.outputs:
            (out / name).write_bytes(f"built {len(self.calls)}".encode())
        (out / "obj-riscv64").mkdir(exist_ok=True)
        if self.fail:
            return subprocess.CompletedProcess(cmd, 2, "", "src/pack.c:1: error: boom\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def fake_make(cache, monkeypatch) -> FakeMake:
    monkeypatch.setattr(qemu_ime2, "missing_build_tools", lambda: [])
    fake = FakeMake()
    monkeypatch.setattr(qemu_ime2.subprocess, "run", fake)
    return fake


def test_build_runs_make_riscv64_into_a_temporary_dir_then_renames_it(fake_make, cache, monkeypatch):
    monkeypatch.setenv("MAKEFLAGS", "-j8 --jobserver-auth=3,4")
    monkeypatch.setenv("RV_CFLAGS", "-O0")
    driver = qemu_ime2.build_driver()
    assert driver == qemu_ime2.driver_path() and driver.read_bytes() == b"built 1"
    assert qemu_ime2.is_built() and (driver.parent / "obj-riscv64").is_dir()
    (cmd, kw), = fake_make.calls
    assert cmd[:5] == ["make", "-s", "-C", str(sources.kernel_source_dir()), "riscv64"]
    assert Path(cmd[5][4:]).parent == driver.parent.parent  # built beside, then renamed
    assert "MAKEFLAGS" not in kw["env"] and "RV_CFLAGS" not in kw["env"] and kw["env"]["PATH"] == os.environ["PATH"]
    assert sorted(p.name for p in driver.parent.parent.iterdir()) == [sources.source_digest()]  # no leftovers
    # Built: a no-op. --force: rebuilt in place of the old directory.
    assert qemu_ime2.build_driver() == driver and len(fake_make.calls) == 1
    assert qemu_ime2.build_driver(force=True) == driver and driver.read_bytes() == b"built 2"
    assert sorted(p.name for p in driver.parent.parent.iterdir()) == [sources.source_digest()]


def test_a_missing_probe_is_rebuilt(fake_make):
    driver = qemu_ime2.build_driver()
    qemu_ime2.probe_path().unlink()
    assert not qemu_ime2.is_built()
    assert qemu_ime2.build_driver() == driver and len(fake_make.calls) == 2 and qemu_ime2.probe_path().is_file()


def test_a_failed_build_leaves_nothing_that_looks_built(cache, monkeypatch, capsys):
    monkeypatch.setattr(qemu_ime2, "missing_build_tools", lambda: [])
    monkeypatch.setattr(qemu_ime2.subprocess, "run", FakeMake(fail=True))
    with pytest.raises(qemu_ime2.DriverBuildError, match=r"riscv64 OUT=.* failed \(exit 2\):\nsrc/pack.c:1: error: boom"):
        qemu_ime2.build_driver()
    assert not qemu_ime2.build_dir().exists() and list((cache / "ime2-riscv64").iterdir()) == []
    monkeypatch.setattr(qemu_ime2.subprocess, "run", FakeMake(outputs=("npu_ime2_driver",)))
    with pytest.raises(qemu_ime2.DriverBuildError, match="built no npu_ime2_emu_probe"):
        qemu_ime2.build_driver()
    assert cli.main(["ime2", "build-driver"]) == 2
    assert "built no npu_ime2_emu_probe" in capsys.readouterr().err


def test_an_unwritable_cache_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.delenv(qemu_ime2.DRIVER_ENV, raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(qemu_ime2.CACHE_ENV, str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(qemu_ime2, "missing_build_tools", lambda: [])
    with pytest.raises(qemu_ime2.DriverBuildError, match=f"set {qemu_ime2.CACHE_ENV} to a writable directory"):
        qemu_ime2.build_driver()


def test_another_processs_finished_build_is_kept(fake_make, cache, monkeypatch):
    """Two builders at once: the second rename finds the first one's directory and keeps it."""
    real_run = fake_make.__call__

    def racing(cmd, **kw):
        res = real_run(cmd, **kw)
        other = qemu_ime2.build_dir()
        other.mkdir(parents=True)
        (other / qemu_ime2.DRIVER_NAME).write_bytes(b"the other one")
        (other / qemu_ime2.PROBE_NAME).write_bytes(b"the other one")
        return res

    monkeypatch.setattr(qemu_ime2.subprocess, "run", racing)
    driver = qemu_ime2.build_driver()
    assert driver.read_bytes() == b"the other one"
    assert sorted(p.name for p in cache.joinpath("ime2-riscv64").iterdir()) == [sources.source_digest()]


def test_cli_prints_the_path_and_notes_an_override(fake_make, monkeypatch, capsys):
    assert cli.main(["ime2", "build-driver"]) == 0
    out, err = capsys.readouterr()
    assert out == f"riscv64 IME2 driver: {qemu_ime2.driver_path()}\n" and "cross-building" in err
    assert cli.main(["ime2", "build-driver"]) == 0  # built: a no-op, no progress line
    assert capsys.readouterr() == (out, "")
    assert cli.main(["ime2", "build-driver", "--quiet", "--force"]) == 0 and len(fake_make.calls) == 2
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, "/opt/my-driver")
    assert cli.main(["ime2", "build-driver"]) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and f"${qemu_ime2.DRIVER_ENV}=/opt/my-driver is set" in err2


# ---------------------------------------------------------------------------------------------
# the real cross build


@needs_cross
def test_build_driver_builds_a_runnable_driver_once(source_copy, cache, capsys):
    """From a copy of the sources: make writes nothing beside them (objects included), the
    driver runs the real kernel under QEMU, and a second call is a no-op."""
    before = _tree_state(source_copy)
    assert cli.main(["ime2", "build-driver"]) == 0
    out, _ = capsys.readouterr()
    driver = qemu_ime2.driver_path()
    assert out == f"riscv64 IME2 driver: {driver}\n"
    assert driver.parent == cache / "ime2-riscv64" / sources.source_digest(source_copy)
    assert driver.is_file() and qemu_ime2.probe_path().is_file()
    assert {p.name for p in (driver.parent / "obj-riscv64").glob("*.o")} >= {"driver.o", "gemm_ime2.o", "ime2_emu.o"}
    assert _tree_state(source_copy) == before
    assert sorted(p.name for p in driver.parent.parent.iterdir()) == [driver.parent.name]
    mtime = driver.stat().st_mtime_ns
    assert qemu_ime2.build_driver() == driver and driver.stat().st_mtime_ns == mtime
    # The built driver runs the real kernel under QEMU: the portable path equals the reference.
    from npusim import q4x32

    rng = np.random.default_rng(1)
    qweight, scales = q4x32.quantize_q4_0(rng.standard_normal((40, 64)).astype(np.float32))
    a = rng.standard_normal((5, 64)).astype(np.float32)
    got = qemu_ime2.run_driver(a, qweight, scales, path="portable", vlen=256)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  q4x32.ime2_hp_gemm(a, qweight, scales, level="hardware").view(np.uint32))
    # And the probe next to it emulates one .hp word (its own tests: test_ime2_qemu_ime2.py).
    res = qemu_ime2.run_probe([q4x32.encode_hp(16, 3, 4, imm3=4, signedness="su")],
                              np.zeros((1, 32, 128), dtype=np.uint8), vlen=1024)
    assert res.returncode == 0 and res.regs is not None, res.stderr


def test_the_boards_hp_probe_is_beside_the_host_library(monkeypatch):
    from npu_conformance import ime2_board
    from vllm_npu.ime2 import kernel

    monkeypatch.delenv(ime2_board.HP_PROBE_ENV, raising=False)
    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, "/elsewhere/npu_ime2_driver")  # the QEMU driver plays no part
    assert ime2_board.hp_probe_path() == kernel.LIBRARY_PATH.parent / "npu_ime2_hp_probe"
    monkeypatch.setenv(ime2_board.HP_PROBE_ENV, "/opt/probe")
    assert ime2_board.hp_probe_path() == Path("/opt/probe")
