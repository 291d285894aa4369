"""Mobilint's own vllm-mblt 0.8.0 (vLLM 0.11.2) against our MBLT plugin (vLLM 0.32), both on
``mblt-sim``, same MXQ artifact, same simulated machine.

``vllm bench throughput`` (offline ``vllm.LLM``, random dataset, 32 prompts of 128 input / 64
output tokens, seed 0) alternates between the two for ``--rounds`` rounds (which one goes first
alternates); prints output tok/s per run, ours/theirs per round and the median ratio. The
artifact is the tiny llama of ``npu-harness make-model`` compiled with batch 8, prefill chunk
128, single core, and ``--hub-proxy`` so vLLM 0.11.2 resolves its model type through
``--trust-remote-code``. Needs ``tools/vllm-mblt-env/build.sh DIR``:

    .venv/bin/python benchmarks/vllm_mblt_vs_ours.py --vendor-env DIR --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(work: Path) -> Path:
    hf, art = work / "llama", work / "llama-mxq"
    npu = str(Path(sys.executable).with_name("npu-harness"))
    subprocess.run([npu, "make-model", "--arch", "llama", "--out", str(hf)], check=True, capture_output=True)
    subprocess.run([npu, "mxq", "compile", str(hf), "--out", str(art), "--max-batch-size", "8",
                    "--prefill-chunk-size", "128", "--core-mode", "single", "--hub-proxy"], check=True,
                   capture_output=True)
    return art


def run(vllm: str, art: Path, out: Path, extra: list[str], a: argparse.Namespace) -> float:
    """One ``vllm bench throughput``; returns output tokens/s."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(NPU_HARNESS_TARGET="mblt-sim", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               TOKENIZERS_PARALLELISM="false")
    js, log = out.with_suffix(".json"), out.with_suffix(".log")
    cmd = [vllm, "bench", "throughput", "--model", str(art), "--dataset-name", "random",
           "--num-prompts", str(a.num_prompts), "--seed", "0", "--max-model-len", "1024",
           "--output-json", str(js), *extra]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text(errors="replace")
    m = re.search(r"Total num output tokens:\s+(\d+)", text)
    if rc != 0 or not js.exists() or not m:
        raise RuntimeError(f"{cmd[0]} bench throughput exited {rc}:\n{text[-3000:]}")
    return int(m.group(1)) / json.loads(js.read_text())["elapsed_time"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vendor-env", required=True, type=Path, help="a tools/vllm-mblt-env/build.sh directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vllm-mblt-bench-"))
    art = build(work)
    # vLLM 0.32 names the random dataset's lengths --random-input-len/--random-output-len;
    # 0.11.2's throughput bench takes --input-len/--output-len
    sides = {"ours": (str(Path(sys.executable).with_name("vllm")),
                      ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]),
             "vllm-mblt": (str(a.vendor_env / "bin" / "vllm"),
                           ["--input-len", str(a.input_len), "--output-len", str(a.output_len), "--trust-remote-code"])}
    rows = []
    for r in range(a.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        got = {name: run(*sides[name][:1], art, work / f"{name}-{r}", sides[name][1], a) for name in order}
        rows.append({"round": r, **got, "ratio": got["ours"] / got["vllm-mblt"]})
        print(f"round {r}: ours {got['ours']:.1f} tok/s, vllm-mblt {got['vllm-mblt']:.1f} tok/s, "
              f"ours/vllm-mblt {rows[-1]['ratio']:.2f}", flush=True)
    print(f"median ours/vllm-mblt: {statistics.median(x['ratio'] for x in rows):.2f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
