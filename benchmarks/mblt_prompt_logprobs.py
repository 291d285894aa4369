"""The cost of MBLT prompt logprobs: time per prompt token of lm-eval's loglikelihood request
(``echo`` + ``logprobs=1``) next to a normal prefill, on ``mblt-sim`` with ``pace`` on (each infer
takes its simulated device time, so wall time follows the simulator's cost model:
``2*io_fixed_us + infer_fixed_us + infer_us_per_token*tokens`` per infer).

Three rows, each on its own ``vllm serve`` of the tiny llama compiled with batch 1 and prefill
chunk 128, ``--no-enable-prefix-caching``, one request at a time, ``--requests`` distinct random
prompts of ``--prompt-len`` tokens, ``max_tokens=1``:

- ``prefill``: a plain completion on the usual last-logit MXQ (one infer per 128-token chunk);
- ``echo, last-logit MXQ``: the seed's 1-token microstep path (one infer per prompt token);
- ``echo, all-logits MXQ``: ``--output-logits all`` (one infer per chunk scores every position).

Prints the median ms per request, µs per prompt token and the ratio to ``prefill``.

    .venv/bin/python benchmarks/mblt_prompt_logprobs.py --prompt-len 256 --requests 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]

from npu_conformance import vllm_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import numpy as np

    from npusim import tinymodel
    from npusim.mxq.compile import compile_artifact

    work = Path(tempfile.mkdtemp(prefix="mblt-plp-bench-"))
    hf = tinymodel.build("llama", work / "hf")
    last = compile_artifact(hf, work / "last", prefill_chunk_size=128)
    full = compile_artifact(hf, work / "all", prefill_chunk_size=128, output_logits="all")
    rng = np.random.default_rng(0)
    rows = []
    for name, art, echo in (("prefill", last, False), ("echo, last-logit MXQ", last, True),
                            ("echo, all-logits MXQ", full, True)):
        env = vllm_server.vllm_env("mblt-sim", NPUSIM_MXQ=json.dumps({"pace": True}))
        server = vllm_server.start(art, ["--no-enable-prefix-caching"], env=env, log=work / f"{art.name}-{echo}.log")
        try:
            times = []
            for i in range(a.requests + 1):  # the first is a warm-up
                prompt = rng.integers(10, 1000, size=a.prompt_len).tolist()
                body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                if echo:
                    body.update(echo=True, logprobs=1)
                t0 = time.perf_counter()
                res = server.request("POST", "/v1/completions", body, timeout=600)
                assert res.status == 200, res.body
                if i:
                    times.append(time.perf_counter() - t0)
        finally:
            server.stop()
        ms = statistics.median(times) * 1e3
        rows.append({"path": name, "ms_per_request": ms, "us_per_prompt_token": ms * 1e3 / a.prompt_len})
    base = rows[0]["ms_per_request"]
    print(f"prompt {a.prompt_len} tokens, median of {a.requests} requests, pace on")
    print("| path | ms per request | µs per prompt token | × prefill |\n|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["ms_per_request"] / base
        print(f"| {r['path']} | {r['ms_per_request']:.1f} | {r['us_per_prompt_token']:.1f} | {r['ratio']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
