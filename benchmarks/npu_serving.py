"""An NPU simulator target vs vLLM's native CPU backend: output tokens/s under vLLM's own benchmarks.

    PYTHONPATH=plugins:simulators:conformance .venv/bin/python benchmarks/npu_serving.py \\
        [--device mblt|rbln|neuron] [--rbln-impl optimum|vllm] [--rounds 3] [--workdir DIR] [--json PATH]

``--device neuron`` (issue 11's floor, the same 0.5): the tiny llama of ``npu-harness
make-model --arch llama`` served by the Neuron plugin on ``neuron-sim`` (NEFFs on
``npusim.neff``; ``--max-model-len 1024 --max-num-batched-tokens 1024
--no-enable-prefix-caching``, i.e. single-shot prefill with the default buckets: prefill 128,
256, 512, 1024 tokens, decode batches 1, 2, 4, 8; ``--max-num-seqs 8 --block-size 32
--num-gpu-blocks-override 512``; the NEFF compile cache, ``VLLM_CACHE_ROOT`` in the workdir, is
warmed before round 1) against the native backend on the same directory with the same
``--max-model-len 1024 --max-num-seqs 8``. Padding waste per bucket: ``neuron_padding.py``.

``--device rbln`` (issue 16's floor, the same 0.5): the tiny llama with 64-wide heads served by
the RBLN plugin on ``rbln-sim`` (optimum-rbln compiled on ``npusim.rbln``, ``--block-size 1024
--max-num-seqs 8``, decoders for batches 8, 4, 2, 1; the compile cache is warmed before round
1, so rounds measure serving, not compiling) against the native backend on the same directory.
``--rbln-impl vllm``: the RBLN ``vllm`` model path instead (vLLM's own model code compiled with
``rebel``'s torch.compile backend on ``RBLN-CR13``: ``--block-size 128 --max-num-batched-tokens
128``, decode buckets 8, 4, 2, 1; its graphs compile at every start's warm-up).
The rest of this docstring describes ``--device mblt`` (the default, issue 4).

Issue 4's floor: "the simulator-backed server reaches at least half the native backend's
output tokens/s on that model". The script builds the tiny llama model
(``npu-harness make-model --arch llama``) and its MXQ artifact (``npu-harness mxq compile
--max-batch-size 8 --prefill-chunk-size 128 --core-mode single``), then for each round runs,
alternating the two backends so that both see the same machine load:

(a) ``vllm bench throughput`` (offline ``vllm.LLM``, random dataset, 32 prompts of 128 input
    and 64 output tokens, ``--max-model-len 1024``) on ``NPU_HARNESS_TARGET=mblt-sim`` with the
    MXQ artifact, then on the native CPU backend (``NPU_HARNESS_TARGET`` unset) with the plain
    HF directory (same weights). Output tok/s = ``Total num output tokens`` / ``elapsed_time``
    of ``--output-json`` (the JSON's ``tokens_per_second`` counts prompt tokens too).
(b) ``vllm bench serve`` (random dataset, 128 in / 64 out, 32 prompts, ``--max-concurrency
    8``, ``--ignore-eos``) against a ``vllm serve`` of each backend; reads
    ``output_throughput`` from ``--save-result``.

The native side gets ``--max-num-seqs 8`` to match the artifact's batch size 8 (the MBLT
platform clamps ``max_num_seqs`` to it). Units: output (generated) tokens per second of wall
time; ratio = mblt-sim / native. Prints a table (round, bench, backend, output tok/s, ratio)
and the median ratio per bench; exits 1 when a median ratio is below ``--floor`` (0.5).
Writes a JSON summary with ``--json``.

Machine note: the figures of ``docs/benchmarks.md`` come from a 2-core shared machine; absolute
throughputs swing by tens of percent between runs, so compare only the ratios of one run.

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]

from npu_conformance import vllm_server  # noqa: E402

DEVICE = {"name": "mblt"}  # set by --device


def backends() -> tuple[str, str]:
    return (f"{DEVICE['name']}-sim", "native")
BENCHES = ("throughput", "serve")


def harness_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / p) for p in ("plugins", "simulators", "conformance")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


NEURON_ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024",
               "--no-enable-prefix-caching", "--max-num-seqs", "8", "--block-size", "32",
               "--num-gpu-blocks-override", "512"]
RBLN_ARGS = ["--max-model-len", "1024", "--block-size", "1024", "--max-num-seqs", "8",
             "--additional-config", json.dumps({"optimum_overrides": {"decoder_batch_sizes": [8, 4, 2, 1]}})]
#: ``--rbln-impl vllm``: vLLM's own model code compiled with rbln_backend on a Rebel100 (the
#: path is refused on ATOM): prefill chunks of 128, KV blocks of 128, decode buckets 8, 4, 2, 1.
RBLN_VLLM_ARGS = ["--model-impl", "vllm", "--max-model-len", "1024", "--block-size", "128", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "128", "--rbln-decode-batch-bucket-limit", "4"]
RBLN_VLLM_ENV = {"RBLN_FORCE_NPU_NAME": "RBLN-CR13", "NPUSIM_RBLN": json.dumps({"devices": ["RBLN-CR13"]})}


def build(workdir: Path) -> tuple[Path, Path]:
    """The tiny llama HF directory and the device artifact: for mblt its MXQ artifact (batch 8,
    chunk 128, single core); for rbln and neuron the HF directory itself (compiled at engine
    start)."""
    env = harness_env()
    if DEVICE["name"] == "neuron":
        hf = workdir / "llama"
        if not (hf / "config.json").exists():
            subprocess.run([bin_path("npu-harness"), "make-model", "--arch", "llama", "--out", str(hf),
                            "--seed", "0"], check=True, env=env)
        return hf, hf
    if DEVICE["name"] == "rbln":
        hf = workdir / "llama-hd64"
        if not (hf / "config.json").exists():
            subprocess.run([sys.executable, "-c", "import sys; from npusim import tinymodel; "
                            "tinymodel.build('llama', sys.argv[1], head_dim=64)", str(hf)], check=True, env=env)
        return hf, hf
    hf, mxq = workdir / "llama", workdir / "llama-mxq"
    if not (hf / "config.json").exists():
        subprocess.run([bin_path("npu-harness"), "make-model", "--arch", "llama", "--out", str(hf)],
                       check=True, env=env)
    if not (mxq / "config.json").exists():
        subprocess.run([bin_path("npu-harness"), "mxq", "compile", str(hf), "--out", str(mxq),
                        "--max-batch-size", "8", "--prefill-chunk-size", "128",
                        "--core-mode", "single"], check=True, env=env)
    return hf, mxq


EXTRA_ENV: dict[str, str] = {}
CACHE_ROOT = {"path": ""}  # the rbln / neuron compile cache of this run (set in main)


def backend_env(backend: str) -> dict[str, str]:
    base = harness_env()
    base.update(EXTRA_ENV)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(base)
        target = backend if backend != "native" else None
        extra = {"VLLM_CACHE_ROOT": CACHE_ROOT["path"]} if target in ("rbln-sim", "neuron-sim") else {}
        return vllm_server.vllm_env(target, **extra)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def model_and_args(backend: str, hf: Path, mxq: Path) -> tuple[Path, list[str]]:
    if backend == "mblt-sim":
        return mxq, ["--max-model-len", "1024"]
    if backend == "rbln-sim":
        return hf, list(RBLN_VLLM_ARGS if DEVICE.get("impl") == "vllm" else RBLN_ARGS)
    if backend == "neuron-sim":
        return hf, list(NEURON_ARGS)
    return hf, ["--max-model-len", "1024", "--max-num-seqs", "8"]


def run_throughput(backend: str, hf: Path, mxq: Path, out: Path, a: argparse.Namespace) -> float:
    """``vllm bench throughput``; returns output tokens/s."""
    model, extra = model_and_args(backend, hf, mxq)
    js, log = out.with_suffix(".json"), out.with_suffix(".log")
    cmd = [bin_path("vllm"), "bench", "throughput", "--model", str(model),
           "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
           "--seed", "0", "--output-json", str(js), *extra]
    env = backend_env(backend)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text(errors="replace")
    if rc != 0 or not js.exists():
        raise RuntimeError(f"vllm bench throughput ({backend}) exited {rc}:\n{text[-3000:]}")
    result = json.loads(js.read_text())
    m = re.search(r"Total num output tokens:\s+(\d+)", text)
    if not m:
        raise RuntimeError(f"no 'Total num output tokens' in {log}")
    return int(m.group(1)) / result["elapsed_time"]


def run_serve(backend: str, hf: Path, mxq: Path, out: Path, a: argparse.Namespace) -> float:
    """``vllm serve`` + ``vllm bench serve``; returns ``output_throughput`` (tokens/s)."""
    model, extra = model_and_args(backend, hf, mxq)
    env = backend_env(backend)
    server = vllm_server.start(model, extra, env=env, log=out.with_suffix(".server.log"))
    try:
        port = server.base.rsplit(":", 1)[1]
        result_dir = out.parent
        fname = out.name + ".result.json"
        cmd = [bin_path("vllm"), "bench", "serve", "--backend", "vllm", "--model", str(model),
               "--tokenizer", str(model), "--host", "127.0.0.1", "--port", port,
               "--dataset-name", "random", "--random-input-len", str(a.input_len),
               "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
               "--max-concurrency", "8", "--ignore-eos", "--seed", "0", "--disable-tqdm",
               "--save-result", "--result-dir", str(result_dir), "--result-filename", fname]
        log = out.with_suffix(".client.log")
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env=backend_env(backend)).returncode
        path = result_dir / fname
        if rc != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve ({backend}) exited {rc}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        result = json.loads(path.read_text())
        if result.get("completed") != a.num_prompts:
            raise RuntimeError(f"vllm bench serve ({backend}): {result.get('completed')} of "
                               f"{a.num_prompts} requests completed")
        return float(result["output_throughput"])
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("mblt", "rbln", "neuron"), default="mblt")
    p.add_argument("--rbln-impl", choices=("optimum", "vllm"), default="optimum",
                   help="--device rbln: the model path (optimum: optimum-rbln's compiled decoders; vllm: "
                        "vLLM's own model code compiled with rbln_backend, on RBLN-CR13)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", type=Path, help="model, artifact and logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--floor", type=float, default=0.5)
    p.add_argument("--benches", default="throughput,serve", help="comma list of throughput,serve")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for both backends' vLLM processes (diagnostics, "
                        "e.g. OMP_NUM_THREADS=1); repeatable")
    a = p.parse_args(argv)
    DEVICE["name"] = a.device
    DEVICE["impl"] = a.rbln_impl
    if a.device == "rbln" and a.rbln_impl == "vllm":
        EXTRA_ENV.update(RBLN_VLLM_ENV)
    sim = f"{a.device}-sim"
    EXTRA_ENV.update(kv.split("=", 1) for kv in a.env)
    benches = [b for b in a.benches.split(",") if b]
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix=f"{a.device}-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    CACHE_ROOT["path"] = str(workdir / "vllm-cache")
    hf, mxq = build(workdir)
    if a.device in ("rbln", "neuron"):  # warm the compile cache: rounds measure serving, not compiling
        t = time.monotonic()
        warm_args = model_and_args(sim, hf, mxq)[1]
        warm = vllm_server.start(hf, warm_args, env=backend_env(sim), log=workdir / "warm-cache.log")
        warm.stop()
        print(f"{a.device} compile cache warmed in {time.monotonic() - t:.1f} s (cold start)", flush=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    runners = {"throughput": run_throughput, "serve": run_serve}
    rows: list[dict] = []
    print(f"workdir {workdir}; {a.num_prompts} prompts, random {a.input_len} in / {a.output_len} out",
          flush=True)
    print(f"{'round':>5}  {'bench':<10}  {'backend':<9}  {'output tok/s':>12}  {'wall s':>7}  ratio",
          flush=True)
    for r in range(1, a.rounds + 1):
        for bench in benches:
            pair = {}
            # alternate which backend goes first, so neither always runs on a warmer machine
            order = backends() if r % 2 else backends()[::-1]
            for backend in order:
                t = time.monotonic()
                tps = runners[bench](backend, hf, mxq, logs / f"r{r}-{bench}-{backend}", a)
                wall = time.monotonic() - t
                pair[backend] = tps
                print(f"{r:>5}  {bench:<10}  {backend:<9}  {tps:>12.1f}  {wall:>7.1f}", flush=True)
            ratio = pair[sim] / pair["native"]
            rows.append({"round": r, "bench": bench, "sim_output_tok_s": pair[sim],
                         "native_output_tok_s": pair["native"], "ratio": ratio})
            print(f"{r:>5}  {bench:<10}  {'ratio':<9}  {'':>12}  {'':>7}  {ratio:.3f}", flush=True)
    print()
    print(f"| round | bench | {sim} output tok/s | native output tok/s | ratio {sim}/native |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['bench']} | {row['sim_output_tok_s']:.1f} | "
              f"{row['native_output_tok_s']:.1f} | {row['ratio']:.3f} |")
    medians = {b: statistics.median(x["ratio"] for x in rows if x["bench"] == b) for b in benches}
    failed = [b for b, m in medians.items() if m < a.floor]
    for b, m in medians.items():
        print(f"median ratio {b}: {m:.3f} ({'meets' if m >= a.floor else 'BELOW'} floor {a.floor})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "units": f"output tokens/s (wall time); ratio = {sim} / native", "device": a.device,
            "settings": {"env": EXTRA_ENV, "input_len": a.input_len, "output_len": a.output_len,
                         "num_prompts": a.num_prompts, "max_concurrency": 8,
                         "max_model_len": 1024, "native_max_num_seqs": 8, "rounds": a.rounds,
                         "sim_server_args": model_and_args(sim, hf, mxq)[1]},
            "workdir": str(workdir), "rows": rows, "median_ratio": medians,
            "floor": a.floor, "meets_floor": not failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
