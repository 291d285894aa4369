"""The native ``.hp`` probe the board scenarios run on a K3 (``npu_ime2_hp_probe``, issue 15).

``make -C kernels/ime2`` on a riscv64 host builds ``driver/ime2_probe.c`` without the SIGILL
emulator, so on the board every word it runs executes on the real matrix unit (and a word the
core does not execute is a real SIGILL, never an emulated answer). Here the same Makefile rule
runs with the cross compiler standing in for the board's, and the probe runs under
``qemu-riscv64-static`` with the cross sysroot:

* it links no emulator, and an ``.hp`` word dies with SIGILL (QEMU has no IME2);
* an ordinary RVV word (``vadd.vv``) runs on the given register file and the file comes back;
* ``--ai-cores`` (the seed's fence) fails with a message naming ``set_ai_thread`` or the cores.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from npu_conformance import ime2_board, qemu_ime2

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "ime2"
SYSROOT = Path("/usr/riscv64-linux-gnu")
TOOLS = ("make", "clang-19", "ld.lld-19", qemu_ime2.QEMU, "riscv64-linux-gnu-nm")
_missing = [t for t in TOOLS if shutil.which(t) is None] + ([] if SYSROOT.is_dir() else [str(SYSROOT)])
pytestmark = pytest.mark.skipif(bool(_missing),
                                reason=f"missing {', '.join(_missing)} (bash ci/setup.sh installs them)")

QEMU_LAUNCHER = (qemu_ime2.QEMU, "-cpu", "rv64,v=true,Zfh=true,vlen=1024,vext_spec=v1.0", "-L", str(SYSROOT))


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """npu_ime2_hp_probe built by the Makefile's riscv64-host rule (cross compiler as the host's)."""
    out = tmp_path_factory.mktemp("hp_probe")
    subprocess.run(["make", "-s", "-C", str(KERNEL), f"OUT={out}", "CC=clang-19 --target=riscv64-linux-gnu",
                    "LDFLAGS=-fuse-ld=lld", "hp-probe"], check=True, capture_output=True, timeout=300)
    path = out / ime2_board.HP_PROBE_NAME
    assert path.is_file()
    return path


def vadd_case() -> ime2_board.HpCase:
    """vadd.vv v16, v12, v8 (e16, vl 64: the probe's vtype) on random registers."""
    word = (1 << 25) | (12 << 20) | (8 << 15) | (16 << 7) | 0x57
    regs = np.random.default_rng(5).integers(0, 256, (32, 128), dtype=np.uint8)
    return ime2_board.HpCase("vadd", word, regs)


def test_probe_links_no_emulator(probe):
    syms = subprocess.run(["riscv64-linux-gnu-nm", str(probe)], capture_output=True, text=True, check=True).stdout
    assert "npu_ime2_emu" not in syms and "on_sigill" not in syms


def test_probe_runs_a_vector_word_on_the_given_registers(probe):
    case = vadd_case()
    files = ime2_board.run_hp_native([case], probe=probe, ai_cores=False, launcher=QEMU_LAUNCHER)
    want = case.regs.copy()
    want[16] = (case.regs[12].view("<u2") + case.regs[8].view("<u2")).astype("<u2").view(np.uint8)
    np.testing.assert_array_equal(files[0], want)


def test_an_hp_word_is_a_real_sigill_without_the_emulator(probe):
    question = ime2_board.rounding_question()
    with pytest.raises(ime2_board.BoardRunError, match="SIGILL: this core does not execute the .hp word"):
        ime2_board.run_hp_native(question.cases[:1], probe=probe, ai_cores=False, launcher=QEMU_LAUNCHER)


def test_ai_cores_without_set_ai_thread_names_the_file(probe, tmp_path):
    with pytest.raises(ime2_board.BoardRunError, match=rf"cannot write the process id to {tmp_path}/set_ai_thread"):
        ime2_board.run_hp_native([vadd_case()], probe=probe, launcher=QEMU_LAUNCHER,
                                 env={"NPU_IME2_PROBE_PROC": str(tmp_path)})


def test_ai_cores_registers_the_pid_then_moves_or_names_the_cores(probe, tmp_path):
    (tmp_path / "set_ai_thread").write_text("")
    try:
        files = ime2_board.run_hp_native([vadd_case()], probe=probe, launcher=QEMU_LAUNCHER,
                                         env={"NPU_IME2_PROBE_PROC": str(tmp_path)})
    except ime2_board.BoardRunError as exc:  # fewer than 16 CPUs here: cores 8-15 do not exist
        assert "sched_setaffinity(cores 8-15) failed" in str(exc)
    else:
        assert files.shape == (1, 32, 128)
    assert (tmp_path / "set_ai_thread").read_text().strip().isdigit()


def test_unknown_argument_is_refused(probe):
    proc = subprocess.run([*QEMU_LAUNCHER, str(probe), "--bogus"], input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 2 and b"npu_ime2_hp_probe: unknown argument --bogus" in proc.stderr
