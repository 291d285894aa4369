"""Opt-in: Mobilint's own vLLM plugin, vllm-mblt 0.8.0 on vLLM 0.11.2, unpatched, on ``mblt-sim``.

Not in the default suite: its environment is about 11 GB (vLLM 0.11.2 is a CUDA wheel). Build it
once with ``tools/vllm-mblt-env/build.sh DIR`` and run with ``NPU_HARNESS_VLLM_MBLT_ENV=DIR``.
Greedy tokens of vllm-mblt's ``LLM.generate`` must equal the golden decoder's, one request at a
time (prefix snapshots between requests) and all at once, on a K=1 and a batch-compiled K=4 MXQ,
for prompts up to 300 tokens (several prefill chunks).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ENV = os.environ.get("NPU_HARNESS_VLLM_MBLT_ENV", "")
if not ENV:
    pytest.skip("opt-in: set NPU_HARNESS_VLLM_MBLT_ENV to a tools/vllm-mblt-env/build.sh environment",
                allow_module_level=True)

RUNNER = Path(__file__).with_name("vllm_mblt_run.py")
PROMPTS = [[1, 5, 9, 33, 70, 2, 11], [(7 * i + 3) % 1000 + 1 for i in range(130)],
           [(5 * i + 2) % 1000 + 1 for i in range(300)], [(5 * i + 2) % 1000 + 1 for i in range(260)] + [9, 9, 9]]
NEW = 12


@pytest.mark.parametrize("k", [1, 4])
def test_vllm_mblt_greedy_equals_golden(tiny_model_dir, golden_decoder, tmp_path, k):
    from npusim.mxq.compile import compile_artifact

    art = compile_artifact(tiny_model_dir("llama"), tmp_path / "art", max_batch_size=k)
    env = {key: v for key, v in os.environ.items() if not key.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(NPU_HARNESS_TARGET="mblt-sim", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    done = subprocess.run([str(Path(ENV) / "bin" / "python"), str(RUNNER), str(art), json.dumps(PROMPTS), str(NEW)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    golden = golden_decoder("llama")
    want = [golden.generate_greedy(p, NEW) for p in PROMPTS]
    assert got["one"] == want
    assert got["all"] == want
