"""The set-up makes the commands users type work: ``vllm --version``, ``vllm serve`` (vLLM's
native CPU backend serving a tiny model built here) and ``vllm bench serve`` against it.

One server for the module (engine start-up dominates: ~35 s). Greedy completions are checked
token for token against the golden numpy decoder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow



def _vllm() -> str:
    return shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NPU_HARNESS_TARGET"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               TOKENIZERS_PARALLELISM="false")
    return env



def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_vllm_version_command():
    proc = subprocess.run([_vllm(), "--version"], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("0.32.0")


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve_vllm):
    return serve_vllm(tiny_model_dir("llama"), "--max-model-len", "512", "--max-num-seqs", "8",
                      "--dtype", "float32", "--gpu-memory-utilization", "0.1", "--seed", "0")


def test_vllm_serve_greedy_completion_equals_the_golden_decoder(server, golden_decoder):
    dec = golden_decoder("llama")
    prompt = [5, 17, 99, 250, 7, 64, 300, 12]
    expected = dec.generate_greedy(prompt, 12)
    out = _post(server["base"] + "/v1/completions", {
        "model": str(server["model"]), "prompt": prompt, "max_tokens": 12,
        "temperature": 0.0, "ignore_eos": True, "return_tokens_as_token_ids": True,
        "logprobs": 0,
    })
    tokens = out["choices"][0]["logprobs"]["tokens"]
    got = [int(t.removeprefix("token_id:")) for t in tokens]
    assert got == expected


def test_vllm_serve_rejects_an_over_length_request_with_400(server):
    req = urllib.request.Request(
        server["base"] + "/v1/completions",
        data=json.dumps({"model": str(server["model"]), "prompt": [1] * 600,
                         "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400
    assert "512" in info.value.read().decode()


def test_vllm_bench_serve_against_the_server(server):
    cmd = [_vllm(), "bench", "serve", "--base-url", server["base"], "--model",
           str(server["model"]), "--tokenizer", str(server["model"]), "--dataset-name",
           "random", "--random-input-len", "32", "--random-output-len", "8",
           "--num-prompts", "8", "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"Successful requests:\s+(\d+)", proc.stdout)
    assert match and int(match.group(1)) == 8, proc.stdout[-3000:]


def test_the_start_profile_records_this_server(server):
    """The ``start_profile`` general plugin, loaded by the real vLLM processes of the server above,
    recorded its start (the run's start budget counts these records): the API server and its
    engine core joined into one start of this module, with every phase seen."""
    from npu_conformance import starts

    directory = os.environ.get(starts.ENV_DIR)
    assert directory, f"{starts.ENV_DIR} is not set: the npu_conformance plugin sets it for every run"
    mine = [s for s in starts.starts_of(starts.load_procs(Path(directory)))
            if s.module == "tests/test_vllm_commands.py" and s.kind == "serve"]
    assert mine, "no start of this module's vllm serve was recorded"
    s = mine[0]
    assert s.ok and s.target == "cpu" and s.args.startswith(f"serve {Path(server['model']).name} --max-model-len 512")
    assert all(v is not None and v >= 0 for v in (s.front_s, s.spawn_s, s.engine_s, s.serve_s, s.total_s)), s
    assert s.total_s >= s.front_s + s.spawn_s, s
