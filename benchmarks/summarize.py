"""Markdown summary of ``benchmarks/test_bench_ime2.py``'s pytest-benchmark JSON.

    .venv/bin/python benchmarks/summarize.py /tmp/ime2-bench.json

Prints, per (K, N, M):

1. the median time and GOP/s (2*M*N*K / t) of each implementation;
2. the headline of issue 12: C-kernel time / ONNX Runtime ``MatMulNBits`` ``accuracy_level=4``
   time (ORT's fastest CPU path) at one thread for the AVX2 variant (``c_x86_avx2``) and the
   best variant (``c_auto``), and at two threads (``c_auto_2t`` / ``ort4_2t``), with the
   ``accuracy_level=0`` ratio as a second column; the goal is a ratio <= 1.0 everywhere, and
   each row says whether it is met;
3. the weight traffic: packed-weight bytes / median time in GB/s for ``c_auto`` and ``ort4_1t``
   beside the single-core STREAM-like copy bandwidth of the same run (``test_stream_copy``);
4. the quantize_a / gemm split of the C paths.

Ratios below 1 mean the C kernel is faster.
"""

from __future__ import annotations

import json
import sys

GOAL = 1.0
COLUMNS = ("npusim_exact", "c_portable", "c_x86_avx2", "c_x86_vnni", "c_x86", "c_auto", "c_auto_2t", "ort4_1t", "ort4_2t",
           "ort0_1t", "ort0_2t")
#: (label, ours, peer, counts toward the goal)
HEADLINE = (("AVX2 1t / ORT4 1t", "c_x86_avx2", "ort4_1t", True),
            ("VNNI 1t / ORT4 1t", "c_x86_vnni", "ort4_1t", False),
            ("best 1t / ORT4 1t", "c_auto", "ort4_1t", True),
            ("best 2t / ORT4 2t", "c_auto_2t", "ort4_2t", True),
            ("AVX2 1t / ORT0 1t", "c_x86_avx2", "ort0_1t", False),
            ("best 1t / ORT0 1t", "c_auto", "ort0_1t", False))
SPLITS = (("portable", "c_quantize_a", "c_gemm_only"), ("x86", "c_quantize_a", "c_x86_gemm_only"))


def _fmt_t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def main(path: str) -> int:
    data = json.load(open(path))
    rows: dict[tuple[int, int, int], dict[str, float]] = {}
    wbytes: dict[tuple[int, int, int, str], int] = {}
    models: dict[tuple[int, int], str] = {}
    auto, variants = set(), set()
    stream = None
    for b in data["benchmarks"]:
        x = b["extra_info"]
        if x.get("impl") == "stream_copy":
            stream = x["bytes_moved"] / b["stats"]["median"] / 1e9
            continue
        key = (x["K"], x["N"], x["M"])
        rows.setdefault(key, {})[x["impl"]] = b["stats"]["median"]
        if "weight_bytes" in x:
            wbytes[key + (x["impl"],)] = x["weight_bytes"]
        models[(x["K"], x["N"])] = x.get("models", "")
        auto.add(x.get("auto_path", "?"))
        if x["impl"] == "c_auto":
            variants.add(x.get("x86_variant", "?"))
    mi = data.get("machine_info", {})
    print(f"Machine: {mi.get('cpu', {}).get('brand_raw', '?')}, {mi.get('cpu', {}).get('count', '?')} CPUs, "
          f"Python {mi.get('python_version', '?')}; run {data.get('datetime', '?')}; c_auto runs path "
          f"{', '.join(sorted(auto))}, X86 variant {', '.join(sorted(variants)) or '?'}")
    print(f"Single-core STREAM-like copy: {stream:.1f} GB/s (read + write)\n" if stream else
          "Single-core STREAM-like copy: not in this run\n")

    head = ["K", "N", "M"] + [f"{c} median / GOP/s" for c in COLUMNS]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (k, n, m), t in sorted(rows.items()):
        ops = 2.0 * m * n * k
        cells = [str(k), str(n), str(m)] + [f"{_fmt_t(t[c])} / {ops / t[c] / 1e9:.2f}" if c in t else "-"
                                             for c in COLUMNS]
        print("| " + " | ".join(cells) + " |")

    print(f"\nHeadline (issue 12): C time / ONNX Runtime MatMulNBits time; goal <= {GOAL:g} for the first three "
          "columns (accuracy_level=4)\n")
    head = ["K", "N", "M", "models"] + [h[0] for h in HEADLINE] + ["goal"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    met = []
    for (k, n, m), t in sorted(rows.items()):
        cells, ok = [str(k), str(n), str(m), models.get((k, n), "")], True
        for _, a, b, goal in HEADLINE:
            if a in t and b in t:
                r = t[a] / t[b]
                cells.append(f"{r:.2f}x")
                ok = ok and (r <= GOAL or not goal)
            else:
                cells.append("-")
        met.append(ok)
        print("| " + " | ".join(cells + ["met" if ok else "not met"]) + " |")
    print(f"\nGoal met on {sum(met)} of {len(met)} (K, N, M) rows")

    print("\nWeight traffic at M = 1 (weight bytes / median time)" +
          (f", against the {stream:.1f} GB/s copy bandwidth" if stream else "") + "\n")
    print("| K | N | C auto GB/s | ORT4 1t GB/s | C auto share of copy bw | ORT4 share of copy bw |\n"
          "|---|---|---|---|---|---|")
    for (k, n, m), t in sorted(rows.items()):
        if m != 1:
            continue
        cells = [str(k), str(n)]
        gbs = {}
        for impl in ("c_auto", "ort4_1t"):
            if impl in t and (k, n, m, impl) in wbytes:
                gbs[impl] = wbytes[(k, n, m, impl)] / t[impl] / 1e9
        cells += [f"{gbs[i]:.1f}" if i in gbs else "-" for i in ("c_auto", "ort4_1t")]
        cells += [f"{100 * gbs[i] / stream:.0f}%" if i in gbs and stream else "-" for i in ("c_auto", "ort4_1t")]
        print("| " + " | ".join(cells) + " |")

    for name, qa_key, g_key in SPLITS:
        print(f"\nC kernel split (median): quantize_a | gemm_packed ({name}) | gemm share of the sum\n")
        print("| K | N | M | quantize_a | gemm_packed | gemm share |\n|---|---|---|---|---|---|")
        for (k, n, m), t in sorted(rows.items()):
            if qa_key in t and g_key in t:
                qa, g = t[qa_key], t[g_key]
                print(f"| {k} | {n} | {m} | {_fmt_t(qa)} | {_fmt_t(g)} | {100 * g / (qa + g):.1f}% |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py BENCHMARK_JSON")
    sys.exit(main(sys.argv[1]))
