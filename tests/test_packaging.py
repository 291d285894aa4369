"""The wheel a plugin engineer installs into their own environment (issue 17).

One module-scoped build: a clean clone of this checkout (its committed tree plus the tracked
files' uncommitted changes, through ``git stash create``) is built with ``python -m build
--no-isolation``, which makes the sdist and then builds the wheel *from the sdist*, so the sdist's
completeness is tested too. Then:

- the wheel checks: the ``py3-none-<platform>`` tag, the kernel library and its sources inside,
  every file the package reads at run time inside, and ``twine check``;
- the installed wheel: a fresh virtual environment outside the checkout, the wheel installed
  into it with the project's lock (offline: the lock's packages, torch and vLLM come from a view
  of this environment's site-packages that leaves out npu-harness itself, added by a ``.pth``;
  ``pip install --no-index -r requirements/lock.txt`` must then find every pin satisfied), and
  from a directory outside the repository: ``npu-harness --version``, ``doctor``,
  ``make-model``, one ``ime2_hp_gemm_cpu`` call through the installed library, and a
  conformance subset on ``ref`` and ``mblt-sim`` that starts a real ``vllm serve``.

Nothing here touches the network: pip runs with ``--no-index``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from npu_conformance.version import harness_version

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])
#: Entries of this environment's site-packages that are npu-harness itself (the editable
#: install and its alias hook): the fresh environment must get them from the wheel alone.
OWN_ENTRIES = ("__editable__", "npu_harness")
PLAT = {"x86_64": "linux_x86_64", "riscv64": "linux_riscv64", "aarch64": "linux_aarch64"}
pytestmark = pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout to clone")


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """Build the sdist and (from it) the wheel of a clean clone; return their paths."""
    base = tmp_path_factory.mktemp("packaging")
    rev = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip() or "HEAD"
    clone = base / "clone"
    _run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(clone)])
    _run(["git", "-c", "advice.detachedHead=false", "checkout", "-q", rev], cwd=clone)
    out = base / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(clone)])
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "base": base}


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_is_a_platform_wheel_of_this_version(dist):
    wheel = dist["wheel"]
    tag = PLAT.get(platform.machine(), f"linux_{platform.machine()}")
    assert wheel.name == f"npu_harness-{harness_version()}-py3-none-{tag}.whl"
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"npu_harness-{harness_version()}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in meta and f"Tag: py3-none-{tag}" in meta


def test_wheel_holds_the_library_its_sources_and_every_runtime_file(dist):
    names = _names(dist["wheel"])
    assert "vllm_npu/ime2/_build/libnpu_ime2.so" in names
    for part in ("Makefile", "include/npu_ime2.h", "src/dispatch.c", "driver/driver.c"):
        assert f"vllm_npu/ime2/_kernel_src/{part}" in names
    # Every non-Python file the packages hold in the checkout is in the wheel (the corpus of
    # make-model, the format docs), and no build output of the checkout leaked in.
    for pkg_root in ("plugins", "simulators", "conformance"):
        tracked = subprocess.run(["git", "ls-files", pkg_root], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
        for path in tracked:
            rel = Path(path).relative_to(pkg_root).as_posix()
            assert rel in names, f"{path} is not in the wheel"
    assert not [n for n in names if n.endswith(".o") or "/riscv64/" in n]


def test_sdist_holds_the_kernel_sources_and_the_compiler_pick(dist):
    import tarfile

    with tarfile.open(dist["sdist"]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for path in ("setup.py", "pyproject.toml", "ci/pick-cc.sh", "kernels/ime2/Makefile",
                 "kernels/ime2/src/gemm_x86.c", "kernels/ime2/driver/driver.c"):
        assert path in names
    assert not [n for n in names if n.endswith((".so", ".o"))]


def test_twine_check_passes(dist):
    proc = _run([sys.executable, "-m", "twine", "check", "--strict", str(dist["wheel"]), str(dist["sdist"])])
    assert proc.stdout.count("PASSED") == 2, proc.stdout


# ---- the wheel installed into a fresh environment ------------------------------------------


@pytest.fixture(scope="module")
def fresh_env(dist) -> dict[str, object]:
    """A fresh venv outside the checkout with the wheel installed; returns its paths and env."""
    base: Path = dist["base"]
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    fresh_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                           ).stdout.strip())
    # The project's dependencies without npu-harness: a directory of links to this environment's
    # site-packages entries, minus the editable install, its dist-info and the alias hook.
    view = base / "deps-view"
    view.mkdir()
    for entry in SITE.iterdir():
        if entry.name.startswith(OWN_ENTRIES) or entry.suffix == ".pth":
            continue
        (view / entry.name).symlink_to(entry)
    (fresh_site / "project_deps_view.pth").write_text(f"{view}\n", encoding="utf-8")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check"]
    offline = ["--no-index", "--no-cache-dir"]
    _run([*pip, "install", *offline, "-r", str(ROOT / "requirements" / "lock.txt"), str(dist["wheel"])])
    outside = base / "work"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "NPU_HARNESS_TARGET")}
    env["PATH"] = f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    env["HOME"] = str(base / "home")
    npu = str(venv / "bin" / "npu-harness")
    _run([npu, "alias", "install"], cwd=outside, env=env)
    return {"venv": venv, "py": py, "site": fresh_site, "cwd": outside, "env": env, "npu": npu}


def test_installed_wheel_runs_from_its_own_files(fresh_env):
    proc = _run([str(fresh_env["py"]), "-c", """
import json, importlib.metadata as md
import npusim, vllm_npu, npu_conformance
from vllm_npu.ime2 import kernel
print(json.dumps({"files": [m.__file__ for m in (npusim, vllm_npu, npu_conformance)],
                  "lib": str(kernel.LIBRARY_PATH), "direct_url": md.distribution("npu-harness").read_text("direct_url.json")}))
"""], cwd=fresh_env["cwd"], env=fresh_env["env"])
    got = json.loads(proc.stdout)
    site = str(fresh_env["site"])
    assert all(f.startswith(site) for f in got["files"]), got
    assert got["lib"] == f"{site}/vllm_npu/ime2/_build/libnpu_ime2.so"
    assert "editable" not in (got["direct_url"] or "")


def test_installed_version_and_doctor(fresh_env):
    cwd, env, npu = fresh_env["cwd"], fresh_env["env"], fresh_env["npu"]
    assert _run([npu, "--version"], cwd=cwd, env=env).stdout.strip() == f"npu-harness {harness_version()}"
    doctor = _run([npu, "doctor"], cwd=cwd, env=env).stdout
    assert f"npu-harness:" in doctor and f"{harness_version()} (wheel)" in doctor
    assert "mblt-sim    available" in doctor, doctor
    # The QEMU driver is not in the wheel: doctor names the command that builds it.
    assert "npu-harness ime2 build-driver" in doctor, doctor


def test_installed_make_model_and_one_gemm_through_the_installed_library(fresh_env):
    cwd, env = fresh_env["cwd"], fresh_env["env"]
    out = _run([fresh_env["npu"], "make-model", "--arch", "llama", "--out", "tiny-llama"], cwd=cwd, env=env)
    assert "llama model (seed 0) written to" in out.stdout
    assert (cwd / "tiny-llama" / "config.json").is_file()
    proc = _run([str(fresh_env["py"]), "-c", """
import numpy as np
from npusim import q4x32
from vllm_npu.ime2 import kernel
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 256)).astype(np.float32)
qweight, scales = kernel.quantize_q4_0(w)
a = rng.standard_normal((4, 256)).astype(np.float32)
c = kernel.ime2_hp_gemm_cpu(a, qweight, scales)
ref = q4x32.ime2_hp_gemm(a, qweight, scales, level="hardware")
assert c.shape == (4, 64) and np.array_equal(c, ref), float(np.abs(c - ref).max())
print("bit-identical", kernel.LIBRARY_PATH)
"""], cwd=cwd, env=env)
    assert proc.stdout.startswith("bit-identical ") and str(fresh_env["site"]) in proc.stdout


@pytest.mark.slow
def test_installed_conformance_subset_on_ref_and_mblt_sim(fresh_env):
    cwd, env = fresh_env["cwd"], fresh_env["env"]
    proc = subprocess.run(
        [fresh_env["npu"], "conformance", "--target", "ref", "--target", "mblt-sim", "--report", "report", "--",
         "-k", "test_greedy_vs_transformers and llama or test_completions_greedy"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((cwd / "report" / "report.json").read_text())
    assert report["harness"]["version"] == harness_version()
    got = {(r["scenario"], r["target"]): r["status"] for r in report["results"]}
    assert got[("llm_reference.greedy_vs_transformers[llama]", "ref")] == "pass", got
    assert got[("serving.completions_greedy", "mblt-sim")] == "pass", got
