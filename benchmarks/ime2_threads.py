"""Per-call time distribution of the IME2 host GEMM at one and two threads, beside ONNX Runtime's
``MatMulNBits`` (``accuracy_level=4``) at one and two intra-op threads (issue 12).

pytest-benchmark's medians of ``c_auto_2t`` swing between runs on a shared 2-core VM; this
prints the 5th, 25th, 50th, 75th and 95th percentiles of many back-to-back calls instead, the
four implementations interleaved in rounds so that drift hits them alike::

    .venv/bin/python benchmarks/ime2_threads.py                 # K=2048 N=5632, M = 1 and 4
    .venv/bin/python benchmarks/ime2_threads.py --k 2560 --n 10240 --calls 200 --rounds 3

Each call is ``quantize_a`` + ``gemm_packed(path="auto", threads=T)`` (weights packed once), as
``benchmarks/test_bench_ime2.py`` times it; the same weights and ORT sessions as there.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench_ime2 import _ort_session, _weights  # noqa: E402

from vllm_npu.ime2 import kernel  # noqa: E402

PERCENTILES = (5, 25, 50, 75, 95)


def _times(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--calls", type=int, default=300, help="calls per implementation per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    k, n = args.k, args.n
    qw, sc = _weights(k, n)
    b = kernel.pack_b(qw, sc)
    sessions = {threads: _ort_session(qw, sc, k, n, threads, 4) for threads in (1, 2)}
    print(f"K={k} N={n}; X86 variant {kernel.x86_variant()}; microseconds per call, percentiles {PERCENTILES}")
    for m in args.m:
        a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        impls: dict[str, Callable[[], object]] = {
            "c_auto_1t": lambda: kernel.gemm_packed(kernel.quantize_a(a), b, m, k, n, path="auto", threads=1),
            "c_auto_2t": lambda: kernel.gemm_packed(kernel.quantize_a(a), b, m, k, n, path="auto", threads=2),
            "ort4_1t": lambda: sessions[1].run(None, {"A": a}),
            "ort4_2t": lambda: sessions[2].run(None, {"A": a}),
        }
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for fn in impls.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for name, fn in impls.items():
                samples[name] += _times(fn, args.calls)
        for name, ts in samples.items():
            p = np.percentile(np.array(ts) * 1e6, PERCENTILES)
            print(f"M={m} {name:10s} " + " ".join(f"{v:8.0f}" for v in p))
        med = {name: float(np.median(ts)) for name, ts in samples.items()}
        print(f"M={m} medians: ours 2t/1t {med['c_auto_2t'] / med['c_auto_1t']:.2f}, ORT4 2t/1t "
              f"{med['ort4_2t'] / med['ort4_1t']:.2f}, ours/ORT4 at 2t {med['c_auto_2t'] / med['ort4_2t']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
