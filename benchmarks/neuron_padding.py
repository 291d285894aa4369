"""Padding waste of the Neuron plugin's NEFF buckets under ``vllm bench serve`` (issue 11).

    PYTHONPATH=plugins:simulators:conformance .venv/bin/python benchmarks/neuron_padding.py \\
        [--workdir DIR] [--num-prompts 64] [--json PATH] [--png docs/img/neuron_padding.png]

Two bucket configurations of ``vllm serve`` on ``NPU_HARNESS_TARGET=neuron-sim`` (the tiny
llama of ``npu-harness make-model --arch llama --seed 0``; ``--max-model-len 1024
--max-num-batched-tokens 1024 --max-num-seqs 8 --block-size 32 --num-gpu-blocks-override 512
--no-enable-prefix-caching``, i.e. single-shot prefill):

* **A** (default ladders): prefill buckets [128, 256, 512, 1024] tokens, decode [1, 2, 4, 8];
* **B** (coarse): prefill [1024] only, decode [8] only (``--additional-config
  '{"neuron_config": {"num_batched_tokens_buckets": [1024], "num_seqs_buckets": [8]}}'``).

Each server gets one ``vllm bench serve --dataset-name random`` (seed 0, ``--num-prompts``
prompts of ``--input-len`` (256) tokens with input range ratio ``--range-ratio`` (0.75), i.e.
uniform in [len*(1-r), len*(1+r)]; ``--output-len`` (32) output tokens with range ratio
``--output-range-ratio`` (0.5), all decoded (``--ignore-eos``); ``--max-concurrency 8``; the
client's initial test request skipped), between two scrapes of ``/metrics``. Why the output
range: the scheduler admits a waiting request before it decodes, so under a closed-loop client
at concurrency 8 = ``max_num_seqs`` with equal output lengths every decode step runs 8 rows and
decode padding is 0 in both configurations; unequal lengths let batches drain.

Per bucket, from the difference of the two scrapes and the server log after the first:

* prefill ``prefill_sN``: steps = ``vllm_neuron:num_batched_tokens_padding`` count, padded
  tokens = its sum (N per step); real tokens = the sum of the scheduler's DEBUG lines
  "PADDING: Prefill request R: real -> N tokens ..." (the server runs with
  ``VLLM_LOGGING_LEVEL=DEBUG``); the log's step count must equal the histogram's;
* decode ``decode_bN``: steps = ``vllm_neuron:num_seqs_padding`` count, real rows = its sum
  (the histogram observes the real request count of each step), padded rows = N x steps;
* waste % = 100 x (padded - real) / padded: the share of the bucket's computed tokens (prefill)
  or batch rows (decode) that is padding. Totals per phase are given too.

Output tok/s is ``output_throughput`` of the client's ``--save-result`` (generated tokens per
second of wall time; the DEBUG logging of the server is included in that time). Prints a
markdown table, writes ``--json`` and a PNG bar chart (``--png``, drawn with Pillow: waste per
bucket, bars grouped by configuration). Units: tokens, rows (sequences), steps, percent, tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]

from npu_conformance import vllm_server  # noqa: E402

COMMON_ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024", "--max-num-seqs", "8",
               "--block-size", "32", "--num-gpu-blocks-override", "512", "--no-enable-prefix-caching"]
CONFIGS = {
    "A": ("default ladders: prefill [128,256,512,1024], decode [1,2,4,8]", []),
    "B": ("coarse: prefill [1024], decode [8]",
          ["--additional-config", json.dumps({"neuron_config": {
              "num_batched_tokens_buckets": [1024], "num_seqs_buckets": [8]}})]),
}
PADDING_RE = re.compile(r"PADDING: Prefill request \S+: (\d+) -> (\d+) tokens")
METRIC_RE = re.compile(r"^(vllm_neuron:\w+)\{([^}]*)\}\s+(\S+)$")


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


EXTRA_ENV: dict[str, str] = {}  # --env


def harness_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(EXTRA_ENV)
    paths = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    saved = dict(os.environ)
    try:  # vllm_env reads os.environ
        os.environ.clear()
        os.environ.update(env)
        return vllm_server.vllm_env("neuron-sim", **extra)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def scrape(server: vllm_server.Server) -> dict[tuple[str, str], float]:
    """``{(metric sample name, bucket_name): value}`` of the ``vllm_neuron:*`` samples, summed
    over the other labels (model_name, rank_id)."""
    res = server.request("GET", "/metrics", timeout=60)
    if res.status != 200 or not isinstance(res.body, str):
        raise RuntimeError(f"/metrics answered {res.status}")
    out: dict[tuple[str, str], float] = defaultdict(float)
    for line in res.body.splitlines():
        m = METRIC_RE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[(m.group(1), labels.get("bucket_name", ""))] += float(m.group(3))
    return out


def run_config(name: str, extra: list[str], model: Path, workdir: Path, a: argparse.Namespace) -> dict:
    """Serve ``model`` with configuration ``name``, benchmark it once; returns its figures."""
    prom = workdir / f"prometheus-{name}"
    shutil.rmtree(prom, ignore_errors=True)  # stale multiprocess files would show old values
    prom.mkdir(parents=True)
    env = harness_env(VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), VLLM_LOGGING_LEVEL="DEBUG",
                      PROMETHEUS_MULTIPROC_DIR=str(prom))
    log = workdir / f"server-{name}.log"
    t = time.monotonic()
    server = vllm_server.start(model, [*COMMON_ARGS, *extra], env=env, log=log)
    print(f"config {name}: server up in {time.monotonic() - t:.0f} s", flush=True)
    try:
        before, offset = scrape(server), log.stat().st_size
        port = server.base.rsplit(":", 1)[1]
        fname = f"bench-{name}.json"
        cmd = [bin_path("vllm"), "bench", "serve", "--backend", "vllm", "--model", str(model),
               "--host", "127.0.0.1", "--port", port, "--dataset-name", "random",
               "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
               "--random-range-ratio", json.dumps({"input": a.range_ratio, "output": a.output_range_ratio}),
               "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency),
               "--ignore-eos", "--seed", str(a.seed), "--ready-check-timeout-sec", "0",
               "--disable-tqdm", "--save-result", "--result-dir", str(workdir),
               "--result-filename", fname]
        with open(workdir / f"client-{name}.log", "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        result_path = workdir / fname
        if rc != 0 or not result_path.exists():
            raise RuntimeError(f"vllm bench serve (config {name}) exited {rc}; see {fh.name}")
        after = scrape(server)
        with open(log, "rb") as fh:
            fh.seek(offset)
            new_log = fh.read().decode(errors="replace")
    finally:
        server.stop()
    result = json.loads(result_path.read_text())
    if result.get("completed") != a.num_prompts:
        raise RuntimeError(f"config {name}: {result.get('completed')} of {a.num_prompts} completed")

    def delta(metric: str, bucket: str) -> float:
        return after.get((metric, bucket), 0.0) - before.get((metric, bucket), 0.0)

    real_by_bucket: dict[int, list[int]] = defaultdict(list)
    for real, padded in PADDING_RE.findall(new_log):
        real_by_bucket[int(padded)].append(int(real))
    hist = ("vllm_neuron:num_batched_tokens_padding_count", "vllm_neuron:num_seqs_padding_count")
    buckets = sorted({b for metric, b in after if metric in hist},
                     key=lambda b: (b[0] != "p", int(re.sub(r"\D", "", b))))
    rows = []
    for b in buckets:
        size = int(b.split("_")[1][1:])
        if b.startswith("prefill_s"):
            steps = delta("vllm_neuron:num_batched_tokens_padding_count", b)
            padded = delta("vllm_neuron:num_batched_tokens_padding_sum", b)
            real = sum(real_by_bucket.get(size, []))
            if len(real_by_bucket.get(size, [])) != steps:
                raise RuntimeError(f"config {name}, {b}: {len(real_by_bucket.get(size, []))} "
                                   f"PADDING log lines but {steps:.0f} histogram steps")
            phase, unit = "prefill", "tokens"
        else:
            steps = delta("vllm_neuron:num_seqs_padding_count", b)
            real = delta("vllm_neuron:num_seqs_padding_sum", b)
            padded = size * steps
            phase, unit = "decode", "rows"
        rows.append({"bucket": b, "phase": phase, "unit": unit, "size": size,
                     "steps": int(steps), "real": int(real), "padded": int(padded),
                     "waste_pct": 100.0 * (padded - real) / padded if padded else 0.0})
    totals = {}
    for phase in ("prefill", "decode"):
        real = sum(r["real"] for r in rows if r["phase"] == phase)
        padded = sum(r["padded"] for r in rows if r["phase"] == phase)
        totals[phase] = {"steps": sum(r["steps"] for r in rows if r["phase"] == phase),
                         "real": real, "padded": padded,
                         "waste_pct": 100.0 * (padded - real) / padded if padded else 0.0}
    # cross-check with the worker's NEFF counter (decode labels name the REAL row count)
    neff = {b: delta("vllm_neuron:neff_execution_count_total", b) for m, b in after
            if m == "vllm_neuron:neff_execution_count_total"}
    checks = {"prefill_steps": (totals["prefill"]["steps"],
                                sum(v for b, v in neff.items() if b.startswith("prefill_s"))),
              "decode_steps": (totals["decode"]["steps"],
                               sum(v for b, v in neff.items() if b.startswith("decode_b"))),
              "decode_real_rows": (totals["decode"]["real"],
                                   sum(int(b[8:]) * v for b, v in neff.items() if b.startswith("decode_b")))}
    for what, (ours, counter) in checks.items():
        if ours != counter:
            print(f"note: config {name}: {what} {ours} from the padding histograms, {counter:.0f} from "
                  "vllm_neuron:neff_execution_count", flush=True)
    if totals["prefill"]["real"] != result.get("total_input_tokens", totals["prefill"]["real"]):
        print(f"note: config {name}: log counts {totals['prefill']['real']} prefill tokens, the "
              f"client {result.get('total_input_tokens')} input tokens", flush=True)
    return {"config": name, "description": CONFIGS[name][0], "server_args": [*COMMON_ARGS, *extra],
            "output_tok_s": float(result["output_throughput"]),
            "total_input_tokens": result.get("total_input_tokens"),
            "total_output_tokens": result.get("total_output_tokens"),
            "duration_s": result.get("duration"), "buckets": rows, "totals": totals,
            "checks_histogram_vs_neff_counter": checks}


def markdown(results: list[dict]) -> str:
    lines = ["| config | bucket | steps | real | padded | waste % |", "|---|---|---|---|---|---|"]
    for res in results:
        for r in res["buckets"]:
            if r["steps"]:
                lines.append(f"| {res['config']} | `{r['bucket']}` | {r['steps']} | "
                             f"{r['real']} {r['unit']} | {r['padded']} {r['unit']} | {r['waste_pct']:.1f} |")
        for phase, t in res["totals"].items():
            unit = "tokens" if phase == "prefill" else "rows"
            lines.append(f"| {res['config']} | **all {phase}** | {t['steps']} | {t['real']} {unit} | "
                         f"{t['padded']} {unit} | **{t['waste_pct']:.1f}** |")
    lines += ["", "| config | buckets | output tok/s | prefill waste % | decode waste % |",
              "|---|---|---|---|---|"]
    for res in results:
        lines.append(f"| {res['config']} | {res['description']} | {res['output_tok_s']:.1f} | "
                     f"{res['totals']['prefill']['waste_pct']:.1f} | "
                     f"{res['totals']['decode']['waste_pct']:.1f} |")
    return "\n".join(lines)


def draw_png(results: list[dict], path: Path) -> None:
    """Bar chart of waste % per bucket (buckets with steps only), one group per configuration."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    colors = {"prefill": (66, 110, 180), "decode": (220, 130, 40)}
    groups = [(res, [r for r in res["buckets"] if r["steps"]]) for res in results]
    bar, gap, group_gap = 44, 12, 60
    left, right, top, bottom = 60, 20, 80, 80
    plot_w = max(sum(len(bs) * (bar + gap) for _, bs in groups) + group_gap * (len(groups) - 1), 380)
    width, height = left + plot_w + right, 450
    plot_h = height - top - bottom
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 10), "neuron-sim padding waste per bucket", fill="black", font=font)
    d.text((left, 26), "100 x (padded - real) / padded; prefill: tokens, decode: rows", fill="black",
           font=font)
    y0 = top + plot_h
    for pct in range(0, 101, 20):  # y axis, grid
        y = y0 - plot_h * pct / 100
        d.line([(left, y), (left + plot_w, y)], fill=(225, 225, 225))
        d.text((left - 8, y), f"{pct}%", fill="black", font=font, anchor="rm")
    d.line([(left, top), (left, y0), (left + plot_w, y0)], fill="black")
    x = left + gap / 2
    for res, bs in groups:
        gx = x
        for r in bs:
            h = plot_h * r["waste_pct"] / 100
            d.rectangle([x, y0 - h, x + bar, y0], fill=colors[r["phase"]])
            d.text((x + bar / 2, y0 - h - 3), f"{r['waste_pct']:.1f}", fill="black", font=font, anchor="md")
            d.text((x + bar / 2, y0 + 4), r["bucket"].split("_")[1], fill="black", font=font, anchor="ma")
            x += bar + gap
        d.text(((gx + x - gap) / 2, y0 + 22), f"config {res['config']}", fill="black", font=font, anchor="ma")
        d.text(((gx + x - gap) / 2, y0 + 38), f"{res['output_tok_s']:.0f} out tok/s", fill="black",
               font=font, anchor="ma")
        x += group_gap
    for i, (phase, c) in enumerate(colors.items()):  # legend, under the title
        lx = left + i * 170
        d.rectangle([lx, 45, lx + 10, 55], fill=c)
        label = "prefill sN (N tokens)" if phase == "prefill" else "decode bN (batch of N)"
        d.text((lx + 16, 44), label, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, help="model, logs and results (default: a temp dir)")
    p.add_argument("--model", type=Path, help="a tiny llama directory (default: built in workdir)")
    p.add_argument("--configs", default="A,B", help="comma list of A,B")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.75, help="input length range ratio")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-range-ratio", type=float, default=0.5,
                   help="output length range ratio (0: every request decodes exactly --output-len)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the vLLM processes (e.g. OPENBLAS_NUM_THREADS=1); repeatable")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, default=REPO / "docs" / "img" / "neuron_padding.png")
    a = p.parse_args(argv)
    EXTRA_ENV.update(kv.split("=", 1) for kv in a.env)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="neuron-padding-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = a.model or workdir / "llama"
    if not (model / "config.json").exists():
        subprocess.run([bin_path("npu-harness"), "make-model", "--arch", "llama", "--out", str(model),
                        "--seed", "0"], check=True, env=harness_env())
    print(f"workdir {workdir}; {a.num_prompts} prompts, random {a.input_len} in (range ratio "
          f"{a.range_ratio}) / {a.output_len} out (range ratio {a.output_range_ratio}), "
          f"concurrency {a.max_concurrency}", flush=True)
    results = [run_config(c, CONFIGS[c][1], model, workdir, a) for c in a.configs.split(",") if c]
    table = markdown(results)
    print(table)
    draw_png(results, a.png)
    print(f"chart: {a.png}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "units": {"real/padded": "tokens (prefill) or rows (decode)", "waste_pct":
                      "100 * (padded - real) / padded", "output_tok_s": "generated tokens / s wall"},
            "settings": {"num_prompts": a.num_prompts, "input_len": a.input_len,
                         "range_ratio": a.range_ratio, "output_len": a.output_len,
                         "output_range_ratio": a.output_range_ratio,
                         "max_concurrency": a.max_concurrency, "seed": a.seed, "env": EXTRA_ENV},
            "workdir": str(workdir), "results": results, "markdown": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
