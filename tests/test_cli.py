"""The ``npu-harness`` command, run as a user runs it (a subprocess of the installed script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npu_conformance.targets import TARGETS


def _cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("npu-harness") or str(Path(sys.executable).with_name("npu-harness"))
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def test_doctor_lists_every_target_with_a_reason():
    proc = _cli("doctor")
    assert proc.returncode == 0, proc.stderr
    host, targets = proc.stdout.strip().split("\n\n")
    assert [line.split(":")[0] for line in host.splitlines()] == [
        "npu-harness", "vllm", "cpu", "vllm-kernels", "ime2-x86", "runtime mblt", "runtime rbln", "runtime neuron",
        "alias qbruntime", "alias rebel"]
    assert host.splitlines()[1].startswith("vllm:") and "supported by mblt, rbln, neuron, ime2" in host
    runtime = {k: v.strip() for k, v in (line.split(": ", 1) for line in host.splitlines() if line.startswith("runtime "))}
    # read from the runtime seam table: this machine has the simulators and no vendor runtime
    assert runtime["runtime mblt"] == "mblt-sim imports npusim.mxq: found; mblt-hw imports qbruntime: not installed"
    assert runtime["runtime rbln"].startswith("rbln-sim imports rebel (-> npusim.rbln by npusim.alias): found; "
                                              "rbln-hw imports rebel: not installed")  # "(an active npusim.alias ...)"
    assert runtime["runtime neuron"] == "neuron-sim imports npusim.neff: found; neuron-hw imports nrtpy: not installed"

    lines = targets.splitlines()
    assert [line.split()[0] for line in lines] == list(TARGETS)
    for line in lines:
        name, state, reason = line.split(maxsplit=2)
        assert state in ("available", "unavailable") and reason


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"npu-harness {version('npu-harness')}"


def test_make_model_is_deterministic_for_a_seed(tmp_path):
    pytest.importorskip("tokenizers")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, "3"), (b, "3"), (c, "4")):
        proc = _cli("make-model", "--arch", "qwen2", "--out", str(out), "--seed", seed)
        assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in a.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["model_type"] == "qwen2"


def test_make_model_rejects_an_unknown_arch(tmp_path):
    proc = _cli("make-model", "--arch", "gpt2", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "invalid choice: 'gpt2'" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--seed", "-1"], "seed -1 must be an integer in [0, 2**32)"),
     (["--seed", "x"], "invalid int value: 'x'"),
     (["--out-is-a-file"], "exists and is not a directory")],
)
def test_make_model_bad_input_is_a_clear_error(tmp_path, args, message):
    out = tmp_path / "out"
    if args == ["--out-is-a-file"]:
        out.write_text("not a directory")
        args = []
    proc = _cli("make-model", "--arch", "llama", "--out", str(out), *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_conformance_runs_and_writes_both_reports(tmp_path):
    proc = _cli("conformance", "--target", "sim", "--report", str(tmp_path / "rep"),
                "--", "-k", "chunked_prefill or kv_capacity", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    ref = [r for r in report["results"] if r["target"] == "ref"]
    from npusim.tinymodel import ARCHES

    assert len(ref) == 2 * len(ARCHES) and all(r["status"] == "pass" for r in ref)  # 2 scenarios per family
    assert "| scenario | ref | mblt-sim |" in (tmp_path / "rep" / "report.md").read_text()
    assert "llm_reference.chunked_prefill[llama]" in proc.stdout
    assert "mblt-sim    available   npusim.mxq (qbruntime surface)" in proc.stdout
    assert "bringing up nodes" in proc.stdout  # the default: pytest-xdist workers (two)


def test_conformance_runs_on_two_xdist_workers_unless_told_otherwise():
    from npu_conformance.cli import worker_args

    assert worker_args([], {}) == ["-n", "2", "--dist", "loadfile"]
    assert worker_args([], {"NPU_HARNESS_TEST_WORKERS": "3"}) == ["-n", "3", "--dist", "loadfile"]
    assert worker_args([], {"NPU_HARNESS_TEST_WORKERS": "0"}) == []
    for own in (["-n", "1"], ["-n4"], ["--numprocesses=2"], ["-k", "x", "-p", "no:xdist"], ["--dist", "load"]):
        assert worker_args(own, {}) == [], own
    with pytest.raises(ValueError, match="NPU_HARNESS_TEST_WORKERS='two'"):
        worker_args([], {"NPU_HARNESS_TEST_WORKERS": "two"})


def test_conformance_refuses_a_bad_worker_count(tmp_path):
    exe = shutil.which("npu-harness") or str(Path(sys.executable).with_name("npu-harness"))
    import os

    proc = subprocess.run([exe, "conformance", "--report", str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, NPU_HARNESS_TEST_WORKERS="-1"), timeout=120)
    assert proc.returncode == 2
    assert "NPU_HARNESS_TEST_WORKERS='-1': expected a whole number of workers" in proc.stderr


def test_conformance_rejects_an_unknown_target(tmp_path):
    proc = _cli("conformance", "--target", "mblt", "--report", str(tmp_path))
    assert proc.returncode == 2
    assert "unknown target 'mblt'" in proc.stderr


def test_doctor_require_fails_on_an_unavailable_target_with_its_reason():
    proc = _cli("doctor", "--require", "rbln-hw")
    assert proc.returncode == 1
    assert "required target rbln-hw is unavailable: import rebel failed" in proc.stderr
    assert _cli("doctor", "--require", "rbln").returncode == 2


def _tiny_hf_dir(path: Path) -> Path:
    from npusim.llm import ModelConfig, save_safetensors
    from npusim.tinymodel import make_config, make_weights

    path.mkdir()
    cfg = make_config("qwen2", vocab_size=64, num_hidden_layers=1, max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps(cfg))
    save_safetensors(path / "model.safetensors", make_weights(ModelConfig.from_dict(cfg)))
    (path / "generation_config.json").write_text("{}")
    return path


def test_mxq_compile_writes_an_artifact_directory(tmp_path):
    hf = _tiny_hf_dir(tmp_path / "hf")
    out = tmp_path / "art"
    proc = _cli("mxq", "compile", str(hf), "--out", str(out), "--max-batch-size", "2", "--max-cache-size", "32",
                "--core-mode", "auto", "--prefill-chunk-size", '{"single": 16}', "--output-logits", "all")
    assert proc.returncode == 0, proc.stderr
    assert f"MXQ artifact written to {out}" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.mxq", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["max_batch_size"], cfg["core_mode"], cfg["npu_prefill_chunk_size"]) == (
        "mobilint-qwen2", 2, "auto", {"single": 16})
    from npusim.mxq.mxqfile import read_mxq

    header, _ = read_mxq(out / "model.mxq")
    assert (header["max_cache_size"], header["max_width"], header["output_logits"]) == (32, 128, "all")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--max-batch-size", "0"], "npu-harness mxq compile: max_batch_size 0 must be an integer >= 1"),
     (["--max-cache-size", "65"], "max_cache_size 65 must be <= max_position_embeddings 64"),
     (["--prefill-chunk-size", "x"], "--prefill-chunk-size 'x' must be an integer or a JSON object"),
     (["--core-mode", "global8", "--max-batch-size", "4"], "core_mode 'global8' is not allowed with max_batch_size 4"),
     (["--output-logits", "first"], "invalid choice: 'first'")],
)
def test_mxq_compile_bad_input_exits_2(tmp_path, args, message):
    hf = _tiny_hf_dir(tmp_path / "hf")
    proc = _cli("mxq", "compile", str(hf), "--out", str(tmp_path / "art"), *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
