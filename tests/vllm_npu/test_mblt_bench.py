"""``vllm bench throughput`` works against the MBLT plugin (``NPU_HARNESS_TARGET=mblt-sim``).

A smoke test for the command ``benchmarks/mblt_serving.py`` times (issue 4): one tiny run on
the simulator (4 random prompts, 32 in / 8 out) must exit 0 and report a positive output
token rate, with the CLI's default ``spawn`` start of the engine process (the Mobilint config
classes must pickle). About 25 s here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_vllm_bench_throughput_on_mblt_sim(tiny_model_dir, tmp_path):
    from npusim.mxq.compile import compile_artifact

    mxq = compile_artifact(tiny_model_dir("llama"), tmp_path / "llama-mxq", max_batch_size=4,
                           prefill_chunk_size=32, core_mode="single")
    env = {k: v for k, v in os.environ.items() if k != "NPU_HARNESS_TARGET"}
    env.update(NPU_HARNESS_TARGET="mblt-sim", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    vllm = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    out = tmp_path / "throughput.json"
    cmd = [vllm, "bench", "throughput", "--model", str(mxq), "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "4",
           "--max-model-len", "256", "--seed", "0", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "MBLT platform active" in text, text[-4000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4
    n_out = re.search(r"Total num output tokens:\s+(\d+)", text)
    rate = re.search(r"([\d.]+) output tokens/s", text)
    assert n_out and int(n_out.group(1)) == 4 * 8, text[-3000:]
    assert rate and float(rate.group(1)) > 0, text[-3000:]
    assert int(n_out.group(1)) / result["elapsed_time"] > 0
