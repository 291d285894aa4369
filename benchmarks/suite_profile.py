"""Where the test suite's and the conformance run's time goes: every vLLM start, and each work unit.

    python benchmarks/suite_profile.py run --out DIR [--conformance] [-- ARGS...]
    python benchmarks/suite_profile.py report DIR [--markdown]
    python benchmarks/suite_profile.py start [--target mblt-sim] [--out DIR]

``run`` runs ``./dev test ARGS`` (or ``./dev conformance ARGS`` with ``--conformance``) with
``NPU_HARNESS_START_PROFILE=DIR/starts`` (the ``start_profile`` vLLM general plugin,
:mod:`vllm_npu.start_profile`, then writes one JSON line per vLLM milestone in every vLLM
process) and a JUnit report in ``DIR/junit.xml``, samples the machine's memory in use as
``benchmarks/peak_memory.py`` does, and prints the report. ``report`` prints it again from DIR:

- the wall time, the peak memory in use, the test counts;
- vLLM's model-registry inspections (one process per architecture new to ``~/.cache/vllm``):
  how many, and their seconds from process start to exit;
- every engine start: which test or fixture started it, its target and arguments, and its
  phases (front end: process start to parsed arguments; spawn: the engine core's process start
  to its first log line, i.e. the interpreter, ``import vllm`` and the rest; engine: engine
  init to ready; serve: engine ready to the API server listening);
- the starts per test module, and the slowest work units (xdist's scheduling units).

``start`` starts one ``vllm serve`` of the tiny llama on a target (``cpu``: vLLM's own CPU
backend) three times, after one warm-up start, and splits a start into imports (``python
-X importtime`` in both processes), the engine core's spawn, model load, warm-up, tokenizer
and the first request.

Standard library and :mod:`npu_conformance` only; run it with the project's
``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "conformance"))
from npu_conformance.starts import load_procs, per_module, starts_of  # noqa: E402

GIB = 1024 ** 3
#: argv[0] of vLLM's model-registry inspection (``python -m vllm.model_executor.models.registry``).
REGISTRY_FILE = "vllm/model_executor/models/registry.py"


# ---------------------------------------------------------------------------- junit


def junit_summary(junit: Path) -> tuple[Counter, dict[str, float], list[tuple[float, str]]]:
    """Outcome counts, seconds per file, and (seconds, test) of every test case."""
    counts: Counter = Counter()
    per_file: dict[str, float] = defaultdict(float)
    cases: list[tuple[float, str]] = []
    for case in ET.parse(junit).iter("testcase"):
        t = float(case.get("time") or 0.0)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped" if "unsupported" not in (child.get("message") or "") else "unsupported"
        counts[outcome] += 1
        file = case.get("file") or case.get("classname", "").replace(".", "/")
        per_file[file] += t
        cases.append((t, f"{case.get('classname')}::{case.get('name')}"))
    return counts, dict(per_file), sorted(cases, reverse=True)


# ---------------------------------------------------------------------------- report


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}"


def report(out: Path, markdown: bool = False) -> str:
    """The report of a ``run`` directory (see the module docstring)."""
    lines: list[str] = []
    meta_path = out / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta:
        lines.append(f"command: {meta.get('command')}")
        lines.append(f"wall: {meta['wall_s']:.0f} s ({meta['wall_s'] // 60:.0f} min {meta['wall_s'] % 60:.0f} s); "
                     f"exit status {meta.get('returncode')}; peak memory in use {meta.get('peak_gib', 0):.1f} GiB "
                     f"(baseline {meta.get('baseline_gib', 0):.1f} GiB); cpu: {meta.get('cpu', '')}")
        if meta.get("cpu_busy") is not None:
            lines.append(f"cpu busy: {100 * meta['cpu_busy']:.0f} % of all cores on average")
        for row in meta.get("at_peak", []):
            lines.append(f"  at the peak: {row['rss_gib']:.2f} GiB  pid {row['pid']}  {row['argv']}  {row['test']}")
    junit = out / "junit.xml"
    if junit.exists():
        counts, per_file, cases = junit_summary(junit)
        lines.append("tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    starts = starts_of(load_procs(out / "starts")) if (out / "starts").is_dir() else []
    serves = [s for s in starts if s.kind == "serve"]
    engines = [s for s in starts if s.kind == "engine"]
    refused = [s for s in starts if s.kind == "refused"]
    lines.append(f"engine starts: {len(serves) + len(engines)} ({len(serves)} vllm serve, {len(engines)} vllm.LLM / "
                 f"bench / other); vllm serve refused before an engine: {len(refused)}; "
                 f"sum of start seconds {sum(s.total_s or 0 for s in starts):.0f}")
    for name, group in (("vllm serve", serves), ("other engines", engines), ("refused", refused)):
        for phase in ("front_s", "spawn_s", "engine_s", "serve_s", "total_s"):
            vals = [getattr(s, phase) for s in group if getattr(s, phase) is not None]
            if vals:
                lines.append(f"  {name} {phase[:-2]}: median {statistics.median(vals):.1f} s, "
                             f"max {max(vals):.1f} s, n {len(vals)}")
    procs = load_procs(out / "starts") if (out / "starts").is_dir() else {}
    with_cpu = [p for p in procs.values() if p.cpu_s is not None]
    if with_cpu:
        lines.append(f"CPU of the vLLM processes that exited normally: {sum(p.cpu_s for p in with_cpu):.0f} s "
                     f"in {len(with_cpu)} of {len(procs)} processes")
    registry = [p for p in procs.values() if p.argv and p.argv[0].endswith(REGISTRY_FILE)
                and p.created is not None and p.ended is not None]
    if registry:
        secs = [p.ended - p.created for p in registry]
        lines.append(f"vLLM model-registry inspections (a process per architecture new to ~/.cache/vllm): "
                     f"{len(registry)}, median {statistics.median(secs):.1f} s, {sum(secs):.0f} s in all")
    modules = per_module(starts)
    lines.append("")
    lines.append("| starts | module (or fixture) |" if markdown else "starts per module:")
    if markdown:
        lines.append("|---|---|")
    for mod, n in modules.most_common():
        lines.append(f"| {n} | `{mod}` |" if markdown else f"  {n:3d}  {mod}")
    lines.append("")
    if markdown:
        lines.append("| # | started by | target | arguments | front s | spawn s | engine s | serve s | total s |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
    for i, s in enumerate(sorted(starts, key=lambda s: (s.who, s.args)), 1):
        row = [str(i), s.who, s.target, s.args[:90], _fmt(s.front_s), _fmt(s.spawn_s), _fmt(s.engine_s),
               _fmt(s.serve_s), _fmt(s.total_s) + ("" if s.ok else " (refused)")]
        lines.append("| " + " | ".join(row) + " |" if markdown else "  " + " | ".join(row))
    if junit.exists():
        lines.append("")
        lines.append("slowest files:")
        for f, t in sorted(per_file.items(), key=lambda x: -x[1])[:25]:
            lines.append(f"  {t:7.1f}  {f}")
        lines.append("slowest tests:")
        for t, name in cases[:25]:
            lines.append(f"  {t:7.1f}  {name}")
    return "\n".join(lines)


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1)
        family = re.search(r"cpu family\s*:\s*(\d+)", info).group(1)
        mod = re.search(r"^model\s*:\s*(\d+)", info, re.M).group(1)
        avx512 = "avx512f" in info
        return f"{model} (family {family} model {mod}, {'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} cores"
    except (OSError, AttributeError):
        return "unknown"


def _in_use() -> int:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _top_processes(n: int) -> list[dict]:
    """The ``n`` processes with the largest resident set: pid, RSS in GiB, argv head and the
    test that started them (``PYTEST_CURRENT_TEST`` in their initial environment)."""
    rows = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, AttributeError):
            continue
        test = next((e[len(b"PYTEST_CURRENT_TEST="):].decode(errors="replace") for e in environ
                     if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
        rows.append({"pid": int(proc.name), "rss_gib": round(rss / GIB, 2),
                     "argv": " ".join(a.decode(errors="replace") for a in argv[:4])[:160], "test": test})
    return sorted(rows, key=lambda r: -r["rss_gib"])[:n]


def cmd_run(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "starts").mkdir(exist_ok=True)
    extra = list(args.args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    junit = out / "junit.xml"
    if args.conformance:
        cmd = ["./dev", "conformance", *extra] + (["--"] if "--" not in extra else []) + [f"--junitxml={junit}"]
    else:
        cmd = ["./dev", "test", *extra, f"--junitxml={junit}"]
    env = dict(os.environ, NPU_HARNESS_START_PROFILE=str(out / "starts"))
    baseline = _in_use()
    peak = [baseline]
    done = threading.Event()

    at_peak: list[dict] = []
    busy: list[float] = []

    def sample() -> None:
        last = _cpu_times()
        while not done.wait(args.every):
            now = _in_use()
            cpu = _cpu_times()
            if cpu[1] > last[1]:
                busy.append((cpu[0] - last[0]) / (cpu[1] - last[1]))
            last = cpu
            if now > peak[0]:
                peak[0] = now
                at_peak[:] = _top_processes(5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=args.root, env=env)
    wall = time.time() - t0
    done.set()
    thread.join()
    (out / "run.json").write_text(json.dumps({
        "command": " ".join(cmd), "cwd": str(args.root), "returncode": rc, "wall_s": wall,
        "peak_gib": peak[0] / GIB, "baseline_gib": baseline / GIB, "cpu": _cpu(),
        "cpu_busy": statistics.mean(busy) if busy else None, "at_peak": at_peak,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }, indent=1))
    print(report(out))
    return rc


def cmd_report(args: argparse.Namespace) -> int:
    print(report(args.dir, markdown=args.markdown))
    return 0


# ---------------------------------------------------------------------------- one start


def _import_seconds(log: str) -> list[float]:
    """Sum of top-level ``-X importtime`` cumulative times per process in a server log (s)."""
    per_proc: list[float] = []
    for line in log.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line.split("|")
        if len(parts) < 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].rstrip()
        if name.strip() == "_io" and not name[:3].strip():  # the first import of a new interpreter
            per_proc.append(0.0)
        if per_proc and not name.startswith("  ") and not name.startswith(" " * 3):
            per_proc[-1] += int(parts[1]) / 1e6
    return per_proc


def cmd_start(args: argparse.Namespace) -> int:
    from npu_conformance import vllm_server as vs

    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "llama"
    if not (model / "config.json").exists():
        subprocess.check_call([str(Path(sys.executable).with_name("npu-harness")), "make-model", "--arch", "llama",
                               "--out", str(model), "--seed", "0"])
    served, serve_args = model, ["--max-model-len", "1024"]
    target = None if args.target == "cpu" else args.target
    if args.target.startswith("mblt"):
        served = work / "llama-mxq"
        if not (served / "model.mxq").exists():
            subprocess.check_call([str(Path(sys.executable).with_name("npu-harness")), "mxq", "compile", str(model),
                                   "--out", str(served), "--max-batch-size", "4"])
    elif args.target == "cpu":
        serve_args += ["--gpu-memory-utilization", "0.2"]
    rows = []
    for i in range(args.repeat + 1):
        prof = work / f"starts-{i}"
        shutil.rmtree(prof, ignore_errors=True)
        env = vs.vllm_env(target, NPU_HARNESS_START_PROFILE=str(prof))
        if args.importtime:
            env["PYTHONPROFILEIMPORTTIME"] = "1"
        log = work / f"serve-{i}.log"
        t0 = time.time()
        srv = vs.start(served, serve_args, env=env, log=log)
        t_healthy = time.time()
        vs.greedy_ids(srv, [5, 6, 7, 8], 1)
        t_first = time.time()
        vs.greedy_ids(srv, [9, 10, 11, 12], 8)
        t_second = time.time()
        srv.stop()
        (start,) = [s for s in starts_of(load_procs(prof)) if s.kind == "serve"]
        imports = _import_seconds(log.read_text(errors="replace")) if args.importtime else []
        tok = [ln for ln in log.read_text(errors="replace").splitlines() if "tokenizer" in ln.lower() and "took" in ln]
        rows.append({"run": i, "healthy_s": t_healthy - t0, "front_s": start.front_s, "spawn_s": start.spawn_s,
                     "engine_s": start.engine_s, "serve_s": start.serve_s, "first_request_s": t_first - t_healthy,
                     "next_request_s": t_second - t_first, "imports_s": imports, "tokenizer_lines": tok[:2]})
        print(json.dumps(rows[-1]))
    kept = rows[1:] or rows
    print(f"\n{args.target}: median of {len(kept)} starts after a warm-up start (cpu: {_cpu()})")
    for key in ("healthy_s", "front_s", "spawn_s", "engine_s", "serve_s", "first_request_s", "next_request_s"):
        vals = [r[key] for r in kept if r[key] is not None]
        if vals:
            print(f"  {key[:-2]:>14}: {statistics.median(vals):6.2f} s")
    if args.importtime:
        imports = [r["imports_s"] for r in kept if r["imports_s"]]
        if imports:
            print(f"  {'imports':>14}: " + ", ".join(f"{statistics.median(x[i] for x in imports if len(x) > i):.2f} s"
                                                   for i in range(max(map(len, imports)))) + " (per process)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run ./dev test (or ./dev conformance) with the start profile")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--conformance", action="store_true")
    run.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout to run in (default: .)")
    run.add_argument("--every", type=float, default=5.0, help="memory sampling interval, seconds")
    run.add_argument("args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="print the report of a run directory")
    rep.add_argument("dir", type=Path)
    rep.add_argument("--markdown", action="store_true")
    one = sub.add_parser("start", help="where one vllm serve start's time goes")
    one.add_argument("--target", default="mblt-sim")
    one.add_argument("--out", type=Path, default=Path("/tmp/npu-harness-start-profile"))
    one.add_argument("--repeat", type=int, default=3)
    one.add_argument("--importtime", action="store_true", help="also run with python -X importtime")
    args = parser.parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "start": cmd_start}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
