"""The vendor environments (``npu_conformance.vendor_envs``), the vendor columns' probes and
labs, and ``npu-harness vendor-env`` / ``conformance --vendor``, with build scripts of the test's
own (the real builds take minutes and PyPI: ``.ci/vendor`` runs them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from npu_conformance import cli, devices, vendor_envs
from npu_conformance import targets as tg
from npu_conformance import vllm_server as vs

#: A stand-in build script: makes ``DIR/bin/vllm`` and counts its runs in ``DIR/../runs``.
_BUILD = """#!/usr/bin/env bash
set -eu
mkdir -p "$1/bin"; printf '#!/bin/sh\\n' > "$1/bin/vllm"; chmod +x "$1/bin/vllm"
echo x >> "$(dirname "$1")/runs"
"""


def _env(tmp_path: Path, script: str = _BUILD, lock: str | None = "a==1\n") -> vendor_envs.VendorEnv:
    tool = tmp_path / "tool"
    tool.mkdir(exist_ok=True)
    (tool / "build.sh").write_text(script)
    if lock is not None:
        (tool / "lock.txt").write_text(lock)
    (tool / "import-placeholders").mkdir(exist_ok=True)
    # tool_dir is absolute: source_root() / "/abs" is "/abs"
    return vendor_envs.VendorEnv("fake", "vllm-fake 1.0", "rbln-sim", str(tool), "tiny",
                                 server_env={"SWITCH": "0"}, placeholders=True)


def _runs(tmp_path: Path) -> int:
    f = tmp_path / "envs" / "runs"
    return len(f.read_text().split()) if f.exists() else 0


def test_build_is_cached_by_the_digest_of_script_and_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    env = _env(tmp_path)
    out = tmp_path / "envs" / "e"
    assert env.build(out) == (out, True)
    marker = json.loads((out / vendor_envs.MARKER).read_text())
    assert marker["digest"] == env.digest() and marker["plugin"] == "vllm-fake 1.0"
    assert env.build(out) == (out, False) and _runs(tmp_path) == 1
    (out / "stale").write_text("from the old lock")
    (tmp_path / "tool" / "lock.txt").write_text("a==2\n")  # a new pin: a new digest, built again from scratch
    assert env.build(out) == (out, True) and _runs(tmp_path) == 2 and not (out / "stale").exists()
    shared = tmp_path / "vendor-env.sh"
    shared.write_text("# v1\n")
    monkeypatch.setattr(vendor_envs, "SHARED_SCRIPT", str(shared))  # source_root() / "/abs" is "/abs"
    assert env.build(out) == (out, True) and _runs(tmp_path) == 3
    shared.write_text("# v2\n")  # the script every build sources changed: built again
    assert env.build(out) == (out, True) and _runs(tmp_path) == 4
    assert env.build(out, force=True) == (out, True) and _runs(tmp_path) == 5
    default = env.default_dir()
    assert default == tmp_path / "cache" / "vendor-envs" / f"fake-{env.digest()}"


def test_a_failed_build_names_the_script_and_status_and_a_foreign_dir_is_refused(tmp_path):
    env = _env(tmp_path, "exit 7\n", lock=None)
    with pytest.raises(vendor_envs.VendorEnvError, match=r"build\.sh .* failed with exit status 7"):
        env.build(tmp_path / "envs" / "e")
    assert not (tmp_path / "envs" / "e" / vendor_envs.MARKER).exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep")
    with pytest.raises(vendor_envs.VendorEnvError, match="exists and is not a vendor environment"):
        _env(tmp_path).build(tmp_path / "other")
    assert (tmp_path / "other" / "mine.txt").read_text() == "keep"


def test_locate_names_the_command_or_the_bad_override(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    env = _env(tmp_path)
    monkeypatch.delenv(env.override_var, raising=False)
    with pytest.raises(vendor_envs.VendorEnvError, match=r"no vllm-fake 1\.0 environment at .*: run "
                                                         r"`npu-harness vendor-env fake` \(tiny, needs PyPI\)"):
        env.locate()
    monkeypatch.setenv(env.override_var, str(tmp_path))
    with pytest.raises(vendor_envs.VendorEnvError, match=r"NPU_HARNESS_VENDOR_ENV_FAKE=.*: no bin/vllm there"):
        env.locate()
    built, _ = env.build(tmp_path / "envs" / "e")
    monkeypatch.setenv(env.override_var, str(built))
    assert env.locate() == built and env.vllm_command() == [str(built / "bin" / "vllm")]
    monkeypatch.delenv(env.override_var)
    env.build()
    assert env.locate() == env.default_dir()


def test_server_environment_puts_this_checkouts_simulators_first(tmp_path):
    env = _env(tmp_path)
    got = env.server_environ()
    paths = got["PYTHONPATH"].split(os.pathsep)
    assert paths == [str(vendor_envs.source_root() / "simulators"), str(tmp_path / "tool" / "import-placeholders")]
    assert got["NPU_HARNESS_TARGET"] == "rbln-sim" and got["SWITCH"] == "0"
    assert (vendor_envs.source_root() / "simulators" / "npusim" / "rbln").is_dir()


def test_the_registered_environments_have_their_scripts_and_placeholder():
    rbln = vendor_envs.VENDOR_ENVS["rbln"]
    assert rbln.column == "vllm-rbln@rbln-sim" and vendor_envs.by_column(rbln.column) is rbln
    assert (rbln.tool_path() / "lock.txt").is_file()
    assert (rbln.tool_path() / "import-placeholders" / "torchvision" / "__init__.py").is_file()
    assert rbln.server_env == {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    assert (vendor_envs.VENDOR_ENVS["mblt"].tool_path() / "lock.txt").is_file()
    for env in vendor_envs.VENDOR_ENVS.values():  # both build scripts source the shared one
        assert 'source "$ROOT/tools/vendor-env.sh"' in (env.tool_path() / "build.sh").read_text()
    with pytest.raises(KeyError):
        vendor_envs.by_column("rbln-sim")


def test_the_torchvision_placeholder_imports_and_refuses_every_use(tmp_path):
    import subprocess
    import sys

    where = vendor_envs.VENDOR_ENVS["rbln"].tool_path() / "import-placeholders"
    code = ("import torchvision, torchvision.transforms.v2.functional as F\n"
            "from torchvision.transforms import InterpolationMode\n"
            "print(InterpolationMode.BICUBIC.__qualname__)\n"
            "try:\n    F.resize(1)\nexcept NotImplementedError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(where)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["BICUBIC", "torchvision.transforms.v2.functional.resize is an npu-harness import placeholder, "
                              "not torchvision: this environment has no torchvision (tools/vllm-rbln-env/README.md)"]


def test_vendor_probes_and_labs(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("rbln", "mblt"):
        monkeypatch.delenv(f"NPU_HARNESS_VENDOR_ENV_{name.upper()}", raising=False)
        column = vendor_envs.VENDOR_ENVS[name].column
        got = tg.TARGETS[column].probe()
        if tg.availability(f"{name}-sim").available:
            assert not got.available and f"run `npu-harness vendor-env {name}`" in got.reason, got
        else:
            assert got.reason.startswith(f"{name}-sim unavailable: ")
    built, _ = _env(tmp_path).build(tmp_path / "envs" / "e")
    monkeypatch.setenv("NPU_HARNESS_VENDOR_ENV_MBLT", str(built))
    got = tg.TARGETS["vllm-mblt@mblt-sim"].probe()
    assert got == tg.Availability(True, f"vllm-mblt 0.8.0, unpatched, in {built}, on npusim.mxq")
    from npu_conformance.devices.mblt import MbltLab
    from npu_conformance.devices.mblt_vendor import VllmMbltLab
    from npu_conformance.devices.rbln import RblnLab
    from npu_conformance.devices.rbln_vendor import VllmRblnLab

    assert devices.lab_class_for("rbln-sim") is RblnLab and devices.lab_class_for("mblt-sim") is MbltLab
    assert devices.lab_class_for("vllm-rbln@rbln-sim") is VllmRblnLab
    assert devices.lab_class_for("vllm-mblt@mblt-sim") is VllmMbltLab


def test_mblt_vendor_lab_serves_hub_proxy_artifacts_with_remote_code(tmp_path, monkeypatch):
    from npu_conformance.devices.mblt_vendor import VllmMbltLab

    built, _ = _env(tmp_path).build(tmp_path / "envs" / "e")
    monkeypatch.setenv("NPU_HARNESS_VENDOR_ENV_MBLT", str(built))
    seen = []
    monkeypatch.setattr(vs, "start", lambda model, args, **kw: seen.append((list(args), kw)) or "server")
    lab = VllmMbltLab("vllm-mblt@mblt-sim", tmp_path / "lab")
    lab.start(Path("a"), ["--max-model-len", "64"], tmp_path / "a.log")
    [(args, kw)] = seen
    assert args == ["--max-model-len", "64", "--trust-remote-code"] and kw["command"] == [str(built / "bin" / "vllm")]
    assert kw["env"]["NPU_HARNESS_TARGET"] == "mblt-sim"
    assert kw["env"]["PYTHONPATH"] == str(vendor_envs.source_root() / "simulators")
    pytest.importorskip("tokenizers")
    art = lab.artifact(k=1)
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["auto_map"] and all((art / f"{ref.split('.')[0]}.py").is_file() for ref in cfg["auto_map"].values())


def test_mblt_vendor_lab_gives_a_qwen3_asr_release_its_absolute_mxq_paths(tmp_path):
    # vllm-mblt's Qwen3-ASR config does not pass the release directory to its sub-configs: a local
    # release needs absolute encoder_/decoder_mxq_path, merged into the scenario's own loader config.
    from npu_conformance.devices.mblt_vendor import asr_loader_args

    rel = tmp_path / "rel"
    rel.mkdir()
    (rel / "config.json").write_text(json.dumps({"model_type": "mobilint-qwen3_asr", "thinker_config": {
        "audio_config": {"mxq_path": "audio_encoder.mxq"}, "text_config": {"mxq_path": "decoder.mxq"}}}))
    paths = {"encoder_mxq_path": str((rel / "audio_encoder.mxq").resolve()),
             "decoder_mxq_path": str((rel / "decoder.mxq").resolve())}
    args = asr_loader_args(rel, ["--max-num-seqs", "1"])
    assert args[:3] == ("--max-num-seqs", "1", "--model-loader-extra-config") and json.loads(args[3]) == paths
    args = asr_loader_args(rel, ["--model-loader-extra-config", json.dumps({"mxq_path": "decoder.mxq"}), "-x"])
    assert args[0] == "--model-loader-extra-config" and args[2:] == ("-x",)
    assert json.loads(args[1]) == {**paths, "mxq_path": "decoder.mxq"}
    (rel / "config.json").write_text(json.dumps({"model_type": "mobilint-llama"}))
    assert asr_loader_args(rel, ["--max-num-seqs", "1"]) == ("--max-num-seqs", "1")
    assert asr_loader_args(tmp_path / "none", ["a"]) == ("a",)


def test_mblt_vendor_lab_names_the_qwen2_tokenizer_class_of_its_simulated_asr_release(tmp_path, monkeypatch):
    # qwen-asr's Qwen3ASRProcessor under transformers 4.57.6 accepts Qwen2Tokenizer(Fast) only
    from npu_conformance.devices.mblt import MbltLab
    from npu_conformance.devices.mblt_vendor import VllmMbltLab

    lab = VllmMbltLab("vllm-mblt@mblt-sim", tmp_path / "lab")
    rel = lab.workdir / "rel"
    rel.mkdir(parents=True)
    (rel / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "x": 1}))
    monkeypatch.setattr(MbltLab, "asr_release", lambda self: rel)
    assert lab.asr_release() == rel == lab.asr_release()
    assert json.loads((rel / "tokenizer_config.json").read_text()) == {"tokenizer_class": "Qwen2TokenizerFast", "x": 1}
    board = tmp_path / "board"  # a release not built by the lab is left as it is
    board.mkdir()
    (board / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    monkeypatch.setattr(MbltLab, "asr_release", lambda self: board)
    lab.asr_release()
    assert json.loads((board / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_mblt_vendor_lab_serves_its_vlm_releases_as_the_hub_ships_them(tmp_path):
    # vLLM 0.11.2 needs the remote-code entry, text_config.architectures (transformers 4.57's Qwen2VLConfig reads
    # architectures from text_config) and the Qwen2 tokenizer class; it has no --trust-request-mm-kwargs
    from npu_conformance.devices import mblt_vendor
    from npu_conformance.devices.mblt_vendor import VllmMbltLab

    lab = VllmMbltLab("vllm-mblt@mblt-sim", tmp_path / "lab")
    rel = lab.workdir / "rel"
    rel.mkdir(parents=True)
    (rel / "config.json").write_text(json.dumps({"model_type": "mobilint-qwen2_vl", "architectures": ["A"],
                                                 "text_config": {"mxq_path": "text.mxq"}}))
    (rel / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert lab._hub_release(rel) == rel
    cfg = json.loads((rel / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForImageTextToText"] == "proxy_qwen2_vl.MobilintQwen2VLForConditionalGeneration"
    assert (rel / "proxy_qwen2_vl.py").is_file() and cfg["text_config"]["architectures"] == ["A"]
    assert json.loads((rel / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2TokenizerFast"
    board = tmp_path / "board"  # a release not built by the lab is left as it is
    board.mkdir()
    (board / "config.json").write_text(json.dumps({"model_type": "mobilint-qwen3_vl", "text_config": {}}))
    lab._hub_release(board)
    assert "auto_map" not in json.loads((board / "config.json").read_text())
    assert "--trust-request-mm-kwargs" in mblt_vendor._NOT_IN_VLLM_0_11


def test_vendor_lab_runs_the_vendor_vllm_in_float32_with_its_environment(tmp_path, monkeypatch):
    from npu_conformance.devices.rbln_vendor import VllmRblnLab

    built, _ = _env(tmp_path).build(tmp_path / "envs" / "e")
    monkeypatch.setenv("NPU_HARNESS_VENDOR_ENV_RBLN", str(built))
    seen = []
    monkeypatch.setattr(vs, "start", lambda model, args, **kw: seen.append((list(args), kw)) or "server")
    lab = VllmRblnLab("vllm-rbln@rbln-sim", tmp_path / "lab")
    assert lab.simulated and lab.python == str(built / "bin" / "python")
    lab.start(Path("m"), ["--max-model-len", "64"], tmp_path / "a.log")
    lab.start(Path("m"), ["--dtype", "bfloat16"], tmp_path / "b.log", EXTRA="1")
    (args0, kw0), (args1, kw1) = seen
    assert args0 == ["--max-model-len", "64", "--dtype", "float32"] and args1 == ["--dtype", "bfloat16"]
    assert kw0["command"] == [str(built / "bin" / "vllm")]
    env = kw1["env"]
    assert env["NPU_HARNESS_TARGET"] == "rbln-sim" and env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert env["EXTRA"] == "1" and env["VLLM_CACHE_ROOT"] == str(lab.cache_root)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(vendor_envs.source_root() / "simulators")


def test_cli_vendor_env_and_conformance_vendor(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NPU_HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    fake = _env(tmp_path)
    monkeypatch.setitem(vendor_envs.VENDOR_ENVS, "rbln", fake)
    assert cli.main(["vendor-env", "rbln", "--out", str(tmp_path / "envs" / "e")]) == 0
    out = capsys.readouterr().out
    assert "vllm-fake 1.0 environment built: " in out and "export NPU_HARNESS_VENDOR_ENV_FAKE=" in out
    assert cli.main(["vendor-env", "rbln", "--out", str(tmp_path / "envs" / "e")]) == 0
    assert "already built (same lock)" in capsys.readouterr().out
    assert cli.main(["conformance", "--target", "neuron-sim", "--vendor"]) == 2
    assert "--vendor: no vendor column runs on neuron-sim" in capsys.readouterr().err
