"""``npu-harness ime2 predict`` (issue 12, section 2): the board performance model's command.

In-process through :func:`npu_conformance.cli.main` (fast), plus one run of the installed
script as a user runs it (exit 2 and a one-line message, no traceback, on bad input). The
measured figures checked for are the seed's visible rows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npu_conformance import cli


def _main(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["ime2", "predict", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_gemm_prints_gops_time_and_split(capsys):
    rc, out, err = _main(capsys, "--gemm", "576", "1536", "1")
    assert rc == 0 and not err
    gops = float(out.split("GOP/s")[0].split(":")[-1])
    assert abs(gops - 28.18) / 28.18 < 0.10  # the seed's visible row
    # M = 1: one row pass over 48 tiles x 3 superblocks (K 576 padded to 768): 144 passes, 9216 .hp
    assert " us" in out and "passes 144 (9216 .hp" in out and "row epilogue" in out and "bound: pass" in out


def test_model_prints_prompt_and_decode_for_both_paths(capsys):
    rc, out, _ = _main(capsys, "--model", "TinyLlama 1.1B")
    assert rc == 0 and "prompt 129 tokens" in out and "ime2 path (eight A100 cores)" in out
    decode = float(out.split("decode ")[1].split(" tokens/s")[0])
    assert abs(decode - 7.38) / 7.38 < 0.20
    rc, out, _ = _main(capsys, "--model", "SmolLM2 135M", "--path", "rvv")
    assert rc == 0 and "seven X100 cores" in out
    prompt = float(out.split("prompt ")[2].split(" tokens/s")[0])
    assert abs(prompt - 1.95) / 1.95 < 0.20


def test_model_from_an_hf_directory(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}))
    rc, out, _ = _main(capsys, "--model", str(tmp_path))
    assert rc == 0 and "prompt 128 tokens" in out and "tokens/s" in out


def test_table_and_params(capsys):
    rc, out, _ = _main(capsys, "--table", "--params")
    assert rc == 0
    for needle in ("gemm.pass_s", "host.step_s", "rvv.bytes_per_s", "| SmolLM2 135M | 576 | 1536 |",
                   "28.18 (", "95.25 (", "87.11 (", "7.38 (", "1.95 (", "0.17 (", "| Phi-2 |", "(withheld)"):
        assert needle in out, needle
    assert out.count("| Qwen2.5 3B |") == 3  # GEMM, IME2 and RVV tables


@pytest.mark.parametrize("args,needle", [
    (("--gemm", "100", "32", "1"), "K must be a multiple of 32"),
    (("--gemm", "256", "32", "0"), "M must be a positive integer, got 0"),
    (("--model", "GPT-5"), "unknown model 'GPT-5'"),
    ((), "give --gemm"),
])
def test_bad_input_exits_2_naming_the_value(capsys, args, needle):
    rc, out, err = _main(capsys, *args)
    assert rc == 2 and needle in err and "Traceback" not in err


def test_installed_script_exits_2_without_a_traceback(tmp_path):
    exe = shutil.which("npu-harness") or str(Path(sys.executable).with_name("npu-harness"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    proc = subprocess.run([exe, "ime2", "predict", "--model", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'num_hidden_layers' is missing" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    ok = subprocess.run([exe, "ime2", "predict", "--table"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "IME2 GEMM, one A100 core" in ok.stdout
