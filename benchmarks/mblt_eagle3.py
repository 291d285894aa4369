"""EAGLE-3 speculative decoding against the base alone, on a paced ``mblt-sim`` (issue 13 §3).

    PYTHONPATH=plugins:simulators:conformance .venv/bin/python benchmarks/mblt_eagle3.py \\
        [--rounds 2] [--num-prompts 8] [--input-len 32] [--output-len 64] [--base-fixed-ms 20] \\
        [--ridge-tokens 256] [--workdir DIR] [--json PATH]

What it runs. The tiny EAGLE-3 checkpoint (``npu-harness make-model --arch llama --eagle3``: a
4-layer base and a one-block draft fitted to it) is compiled twice by ``mxq compile``: as a plain
release of the base (``model.mxq``, chunk 64) and as an EAGLE-3 release (base, fc and draft
MXQs; the vendor's tree: depth 5, top-k 8, 64 nodes). Each round serves one, then the other
(alternating which goes first), through ``vllm serve`` with our plugin on
``NPU_HARNESS_TARGET=mblt-sim``, and drives it with vLLM's own ``vllm bench serve`` (random
dataset, ``--max-concurrency 1``: EAGLE-3 serves one sequence; ``--temperature 0``,
``--ignore-eos``). Figure: output tokens/s (``output_throughput``) of each; ratio = EAGLE-3 /
base alone.

The paced device. ``NPUSIM_MXQ`` turns on ``pace`` (every infer sleeps until its simulated cost
has passed) with per-kind costs (``infer_costs``) standing for a 7B board release: an infer of an
MXQ costs ``fixed + per_token * tokens``, where ``fixed`` is the time to stream the MXQ's weights
(decode on an NPU is bound by weight traffic) and ``per_token = fixed / R`` (``R``,
``--ridge-tokens``: the tokens per infer at which compute time equals weight streaming). The
base's ``fixed`` is ``--base-fixed-ms``; the others scale with their weight counts, from the
public Qwen2.5-7B configuration (hidden 3584, 28 layers, 28/4 heads of 128, intermediate 18944,
vocabulary 152064; JPharmatron-7B's base) and EAGLE-3's usual draft (one block reading
``2 * hidden``, a 32000-token draft vocabulary):

    base MXQ   28 layers + lm_head           7070 M weights   1
    draft MXQ  one 2H-input block + lm_head   364 M weights   0.0515
    fc MXQ     3H -> H                         38.5 M weights  0.00545

(the embeddings stay on the host). The tiny model's own compute is negligible beside these
sleeps, so the ratio measures the schedule of infers and the acceptance of the tiny draft.

How it relates to the board. The seed's only EAGLE-3 figure is EAGLE3-JPharmatron-7B at about
11.9 tokens/s on one Aries; the seed gives no base-alone figure and no acceptance, so neither
parameter can be fitted to it. The script prints the ratio the cost model predicts from the
measured tokens per round (``predicted``) beside the measured one, and what the board's 11.9
tokens/s implies for the base alone if the board's draft accepted as much as ours (11.9 / ratio).

Machine note: the 2-core machine is noisy; compare the ratio of one run, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from npu_conformance import vllm_server  # noqa: E402
from npu_serving import bin_path, harness_env  # noqa: E402

#: Weights per infer relative to the base MXQ (module docstring).
WEIGHT_SHARE = {"eagle3_base": 1.0, "decoder": 1.0, "eagle3_draft": 0.0515, "eagle3_fc": 0.00545}
TREE = {"depth": 5, "top_k": 8, "num_assistant_tokens": 64}
BOARD_TOK_S = 11.9
#: The plugin's per-request line (vllm_npu.mblt.eagle3_serving): rounds, tokens per round.
ROUND_LINE = re.compile(r"MBLT EAGLE-3 req_id=\S+: \d+ tokens, (\d+) rounds, (\d+) draft tokens accepted of (\d+) "
                        r"verified \([\d.]+%\), ([\d.]+) tokens per round")


def paced_env(base_fixed_ms: float, ridge_tokens: int) -> dict[str, str]:
    costs = {}
    for kind, share in WEIGHT_SHARE.items():
        fixed = base_fixed_ms * 1000 * share
        costs[kind] = {"fixed_us": round(fixed, 3), "us_per_token": round(fixed / ridge_tokens, 4)}
    return {"NPUSIM_MXQ": json.dumps({"pace": True, "infer_costs": costs})}


def predicted_ratio(tokens_per_round: float, base_fixed_ms: float, ridge_tokens: int) -> float:
    """Base-alone time per token over EAGLE-3's, from the cost model (io spans left out)."""
    def cost(kind: str, tokens: float) -> float:
        fixed = base_fixed_ms * WEIGHT_SHARE[kind]
        return fixed + fixed / ridge_tokens * tokens

    a, n, d, k = tokens_per_round, TREE["num_assistant_tokens"] - 1, TREE["depth"], TREE["top_k"]
    round_ms = (cost("eagle3_base", a + n + 1) + cost("eagle3_fc", a) + cost("eagle3_draft", a)
                + (d - 1) * cost("eagle3_draft", k))
    return cost("decoder", 1) / (round_ms / a)


def build(workdir: Path) -> dict[str, Path]:
    from npusim.mxq.compile import compile_artifact
    from npusim.tinymodel.eagle3 import build_eagle3

    hf = build_eagle3(workdir / "tiny-eagle3")
    return {"base": compile_artifact(hf, workdir / "base-release", prefill_chunk_size=64),
            "eagle3": compile_artifact(hf, workdir / "eagle3-release", prefill_chunk_size=64,
                                       eagle3={"tree_depth": TREE["depth"], "tree_top_k": TREE["top_k"],
                                               "num_assistant_tokens": TREE["num_assistant_tokens"]})}


def run(release: Path, out: Path, a: argparse.Namespace) -> tuple[float, str]:
    """Serve ``release`` and drive it with ``vllm bench serve``; returns (output tok/s, server log)."""
    env = vllm_server.vllm_env("mblt-sim", **paced_env(a.base_fixed_ms, a.ridge_tokens))
    env["PYTHONPATH"] = harness_env()["PYTHONPATH"]
    server = vllm_server.start(release, ["--max-model-len", "512"], env=env, log=out.with_suffix(".server.log"))
    try:
        port = server.base.rsplit(":", 1)[1]
        fname = out.name + ".result.json"
        cmd = [bin_path("vllm"), "bench", "serve", "--backend", "vllm", "--model", str(release),
               "--tokenizer", str(release), "--host", "127.0.0.1", "--port", port,
               "--dataset-name", "random", "--random-input-len", str(a.input_len),
               "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
               "--max-concurrency", "1", "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
               "--save-result", "--result-dir", str(out.parent), "--result-filename", fname]
        log = out.with_suffix(".client.log")
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        path = out.parent / fname
        if rc != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve ({release.name}) exited {rc}:\n{log.read_text(errors='replace')[-3000:]}")
        result = json.loads(path.read_text())
        if result.get("completed") != a.num_prompts:
            raise RuntimeError(f"vllm bench serve ({release.name}): {result.get('completed')} of {a.num_prompts} completed")
        return float(result["output_throughput"]), server.log_text()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--base-fixed-ms", type=float, default=20.0,
                   help="the base MXQ's per-infer weight-streaming time, ms (the others scale from it)")
    p.add_argument("--ridge-tokens", type=int, default=256,
                   help="tokens per infer at which an MXQ's compute equals its weight streaming")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="mblt-eagle3-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    releases = build(workdir)
    print(f"workdir {workdir}; {a.num_prompts} prompts, random {a.input_len} in / {a.output_len} out, "
          f"max concurrency 1, greedy; NPUSIM_MXQ={paced_env(a.base_fixed_ms, a.ridge_tokens)['NPUSIM_MXQ']}", flush=True)
    print(f"{'round':>5}  {'release':<7}  {'output tok/s':>12}  {'wall s':>7}  ratio", flush=True)
    rows, ratios, per_round, accepted = [], [], [], []
    for r in range(1, a.rounds + 1):
        order = ["base", "eagle3"] if r % 2 else ["eagle3", "base"]
        got = {}
        for name in order:
            t = time.monotonic()
            tps, log = run(releases[name], workdir / "logs" / f"r{r}-{name}", a)
            got[name] = tps
            if name == "eagle3":
                done = [(int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4)))
                        for m in ROUND_LINE.finditer(log)]
                if done and sum(d[0] for d in done):
                    per_round.append(sum(d[0] * d[3] for d in done) / sum(d[0] for d in done))
                    accepted.append(sum(d[1] for d in done) / max(1, sum(d[2] for d in done)))
            rows.append({"round": r, "release": name, "output_tok_s": tps, "wall_s": time.monotonic() - t})
            print(f"{r:>5}  {name:<7}  {tps:>12.2f}  {rows[-1]['wall_s']:>7.1f}", flush=True)
        ratios.append(got["eagle3"] / got["base"])
        print(f"{r:>5}  {'ratio':<7}  {'':>12}  {'':>7}  {ratios[-1]:.3f}", flush=True)
    ratio = statistics.median(ratios)
    tpr = statistics.median(per_round) if per_round else None
    summary = {"rows": rows, "ratios": ratios, "median_ratio": ratio, "tokens_per_round": tpr,
               "accepted_of_verified": statistics.median(accepted) if accepted else None,
               "predicted_ratio": predicted_ratio(tpr, a.base_fixed_ms, a.ridge_tokens) if tpr else None,
               "board_tok_s": BOARD_TOK_S, "implied_board_base_tok_s": BOARD_TOK_S / ratio,
               "base_fixed_ms": a.base_fixed_ms, "ridge_tokens": a.ridge_tokens, "tree": TREE}
    share = summary["accepted_of_verified"]
    print(f"median ratio EAGLE-3 / base alone: {ratio:.3f}; tokens per round {tpr if tpr is None else round(tpr, 2)} "
          f"(draft tokens accepted of those verified: {share if share is None else f'{100 * share:.1f}%'}); "
          f"cost model predicts {summary['predicted_ratio'] and round(summary['predicted_ratio'], 3)}; "
          f"the board's {BOARD_TOK_S} tok/s would mean {summary['implied_board_base_tok_s']:.2f} tok/s for its base "
          "alone at our acceptance", flush=True)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
