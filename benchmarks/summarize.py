"""Markdown summary of ``benchmarks/test_bench_ime2.py``'s pytest-benchmark JSON.

    .venv/bin/python benchmarks/summarize.py /tmp/ime2-bench.json

Per (K, N, M): the median time and GOP/s (2*M*N*K / t) of each implementation, the ratios
C-kernel time / ONNX Runtime 1-thread time for each host C path (``c_portable``, ``c_x86_avx2``,
``c_x86``) and for ``c_auto`` (the path the library picks, i.e. the best host path) over
``ort_1t`` (the headline) and ``ort_2t``; then the floor of issue 3, section 5: the host C kernel (``c_auto``)
within 3x of ONNX Runtime's time at M = 4 (against ``ort_1t``), PASS/FAIL per shape, with the
M = 1 ratio next to it for information.
"""

from __future__ import annotations

import json
import sys

FLOOR = 3.0
COLUMNS = ("npusim_exact", "c_portable", "c_x86_avx2", "c_x86", "c_auto", "ort_1t", "ort_2t")
RATIOS = (("c_portable", "ort_1t"), ("c_x86_avx2", "ort_1t"), ("c_x86", "ort_1t"), ("c_auto", "ort_1t"),
          ("c_auto", "ort_2t"))
SPLITS = (("portable", "c_quantize_a", "c_gemm_only"), ("x86", "c_quantize_a", "c_x86_gemm_only"))
BEST = "c_auto"


def _fmt_t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def _short(name: str) -> str:
    return name.replace("c_", "C ").replace("ort_", "ORT ")


def main(path: str) -> int:
    data = json.load(open(path))
    rows: dict[tuple[int, int, int], dict[str, float]] = {}
    models: dict[tuple[int, int], str] = {}
    auto = set()
    for b in data["benchmarks"]:
        x = b["extra_info"]
        rows.setdefault((x["K"], x["N"], x["M"]), {})[x["impl"]] = b["stats"]["median"]
        models[(x["K"], x["N"])] = x.get("models", "")
        if "auto_path" in x:
            auto.add(x["auto_path"])
    mi = data.get("machine_info", {})
    print(f"Machine: {mi.get('cpu', {}).get('brand_raw', '?')}, {mi.get('cpu', {}).get('count', '?')} CPUs, "
          f"Python {mi.get('python_version', '?')}; run {data.get('datetime', '?')}; "
          f"c_auto runs path {', '.join(sorted(auto)) or '?'}\n")
    head = (["K", "N", "M"] + [f"{c} median / GOP/s" for c in COLUMNS]
            + [f"{_short(a)} / {_short(b)}" for a, b in RATIOS])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (k, n, m), t in sorted(rows.items()):
        ops = 2.0 * m * n * k
        cells = [str(k), str(n), str(m)]
        for c in COLUMNS:
            cells.append(f"{_fmt_t(t[c])} / {ops / t[c] / 1e9:.2f}" if c in t else "-")
        for a, b in RATIOS:
            cells.append(f"{t[a] / t[b]:.2f}x" if a in t and b in t else "-")
        print("| " + " | ".join(cells) + " |")

    for name, qa_key, g_key in SPLITS:
        print(f"\nC kernel split (median): quantize_a | gemm_packed ({name}) | gemm share of the sum\n")
        print("| K | N | M | quantize_a | gemm_packed | gemm share |\n|---|---|---|---|---|---|")
        for (k, n, m), t in sorted(rows.items()):
            if qa_key in t and g_key in t:
                qa, g = t[qa_key], t[g_key]
                print(f"| {k} | {n} | {m} | {_fmt_t(qa)} | {_fmt_t(g)} | {100 * g / (qa + g):.1f}% |")

    print(f"\nFloor: host C kernel ({BEST}, the best host path) within {FLOOR:g}x of ONNX Runtime's time "
          f"(ort_1t) at M=4 (M=1 ratio for information)\n")
    print("| K | N | models | C / ORT 1t, M=4 | verdict | C / ORT 1t, M=1 |\n|---|---|---|---|---|---|")
    verdicts = []
    for (k, n, m), t in sorted(rows.items()):
        if m != 4 or BEST not in t or "ort_1t" not in t:
            continue
        r = t[BEST] / t["ort_1t"]
        ok = r <= FLOOR
        verdicts.append(ok)
        t1 = rows.get((k, n, 1), {})
        r1 = f"{t1[BEST] / t1['ort_1t']:.2f}x" if BEST in t1 and "ort_1t" in t1 else "-"
        print(f"| {k} | {n} | {models.get((k, n), '')} | {r:.2f}x | {'PASS' if ok else 'FAIL'} | {r1} |")
    print(f"\nFloor: {sum(verdicts)} of {len(verdicts)} shapes PASS"
          f" -> {'PASS' if verdicts and all(verdicts) else 'FAIL'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py BENCHMARK_JSON")
    sys.exit(main(sys.argv[1]))
