"""Markdown summary of ``benchmarks/test_bench_ime2.py``'s pytest-benchmark JSON.

    .venv/bin/python benchmarks/summarize.py /tmp/ime2-bench.json

Per (K, N, M): the median time and GOP/s (2*M*N*K / t) of each implementation, the ratio
C-kernel time / ONNX Runtime time (``c_portable`` over ``ort_1t``, the headline, and over
``ort_2t``), then the floor of issue 3, section 5: the host C kernel within 3x of ONNX Runtime's
time at M = 4 (against ``ort_1t``), PASS/FAIL per shape.
"""

from __future__ import annotations

import json
import sys

FLOOR = 3.0
COLUMNS = ("npusim_exact", "c_portable", "ort_1t", "ort_2t")
SPLIT = ("c_quantize_a", "c_gemm_only")


def _fmt_t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def main(path: str) -> int:
    data = json.load(open(path))
    rows: dict[tuple[int, int, int], dict[str, float]] = {}
    models: dict[tuple[int, int], str] = {}
    for b in data["benchmarks"]:
        x = b["extra_info"]
        rows.setdefault((x["K"], x["N"], x["M"]), {})[x["impl"]] = b["stats"]["median"]
        models[(x["K"], x["N"])] = x.get("models", "")
    mi = data.get("machine_info", {})
    print(f"Machine: {mi.get('cpu', {}).get('brand_raw', '?')}, {mi.get('cpu', {}).get('count', '?')} CPUs, "
          f"Python {mi.get('python_version', '?')}; run {data.get('datetime', '?')}\n")
    head = ["K", "N", "M"] + [f"{c} median / GOP/s" for c in COLUMNS] + ["C / ORT 1t", "C / ORT 2t"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (k, n, m), t in sorted(rows.items()):
        ops = 2.0 * m * n * k
        cells = [str(k), str(n), str(m)]
        for c in COLUMNS:
            cells.append(f"{_fmt_t(t[c])} / {ops / t[c] / 1e9:.2f}" if c in t else "-")
        for o in ("ort_1t", "ort_2t"):
            cells.append(f"{t['c_portable'] / t[o]:.1f}x" if "c_portable" in t and o in t else "-")
        print("| " + " | ".join(cells) + " |")

    print("\nC kernel split (median): quantize_a | gemm_packed (portable) | gemm share of the sum\n")
    print("| K | N | M | quantize_a | gemm_packed | gemm share |\n|---|---|---|---|---|---|")
    for (k, n, m), t in sorted(rows.items()):
        if all(s in t for s in SPLIT):
            qa, g = t["c_quantize_a"], t["c_gemm_only"]
            print(f"| {k} | {n} | {m} | {_fmt_t(qa)} | {_fmt_t(g)} | {100 * g / (qa + g):.1f}% |")

    print(f"\nFloor: host C kernel (c_portable) within {FLOOR:g}x of ONNX Runtime's time (ort_1t) at M=4\n")
    print("| K | N | models | C / ORT 1t | verdict |\n|---|---|---|---|---|")
    verdicts = []
    for (k, n, m), t in sorted(rows.items()):
        if m != 4 or "c_portable" not in t or "ort_1t" not in t:
            continue
        r = t["c_portable"] / t["ort_1t"]
        ok = r <= FLOOR
        verdicts.append(ok)
        print(f"| {k} | {n} | {models.get((k, n), '')} | {r:.1f}x | {'PASS' if ok else 'FAIL'} |")
    print(f"\nFloor: {sum(verdicts)} of {len(verdicts)} shapes PASS"
          f" -> {'PASS' if verdicts and all(verdicts) else 'FAIL'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py BENCHMARK_JSON")
    sys.exit(main(sys.argv[1]))
