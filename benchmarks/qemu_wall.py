"""Wall time of the riscv64 IME2 driver under QEMU user mode, per VLEN (a relative measure only).

    .venv/bin/python benchmarks/qemu_wall.py

Times ``npu_conformance.qemu_ime2.run_driver(A, qweight, scales, vlen=V, path=P)``
(one QEMU process per call: start-up, request I/O, quantize A, GEMM on B packed in the driver)
on three of the seed's shapes at M = 1 and 4, paths ``portable`` and ``rvv`` at VLEN 128 and
1024; the median of 3 calls after one warm-up. The first row (K=32, N=1) is the fixed cost of a
call. The portable path is scalar C, so VLEN makes little difference to it; the RVV path
strip-mines 16 columns at VLEN 128 and whole 32-column tiles at VLEN >= 256 (QEMU's per-element
emulation cost makes these a relative measure, not a hardware prediction). A second table (:func:`ime2_table`)
times the IME2 path at VLEN 1024 (its .hp instructions emulated) with the emulated count. Also
checks each result against the host C library bit for bit.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from npu_conformance import qemu_ime2
from vllm_npu.ime2 import kernel

SHAPES = [(32, 1), (576, 1536), (896, 4864), (2048, 5632)]
VLENS = (128, 1024)
PATHS = ("portable", "rvv")
COLUMNS = [(p, v) for p in PATHS for v in VLENS]
REPEATS = 3


def cases():
    """(K, N, M, A, qweight, scales, host C result) for every shape at M = 1 and 4."""
    for k, n in SHAPES:
        rng = np.random.default_rng(k + n)
        qw = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        sc = (rng.uniform(0.5, 1.5, (n, k // 32)) / 8).astype(np.float16).astype(np.float32)
        for m in (1, 4):
            a = rng.standard_normal((m, k)).astype(np.float32)
            yield k, n, m, a, qw, sc, kernel.ime2_hp_gemm_cpu(a, qw, sc)


def main() -> None:
    print("| K | N | M | " + " | ".join(f"{p} VLEN {v} wall (median of {REPEATS})" for p, v in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for k, n, m, a, qw, sc, host in cases():
        cells = []
        for p, v in COLUMNS:
            c = qemu_ime2.run_driver(a, qw, sc, vlen=v, path=p, timeout=600)
            assert np.array_equal(c, host), f"QEMU {p} VLEN {v} differs from the host library"
            ts = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                qemu_ime2.run_driver(a, qw, sc, vlen=v, path=p, timeout=600)
                ts.append(time.perf_counter() - t0)
            cells.append(f"{statistics.median(ts):.3f} s")
        print(f"| {k} | {n} | {m} | " + " | ".join(cells) + " |", flush=True)


# ---- the IME2 path: vmadot*.hp run through the driver's SIGILL emulator (VLEN 1024 only)


def ime2_table() -> None:
    """Second table: the IME2 path at VLEN 1024 next to the portable path at VLEN 1024, with the
    number of emulated .hp instructions (the driver prints it when NPU_IME2_EMU_COUNT is set).
    Under QEMU each .hp is a trapped SIGILL decoded and computed in C, so this measures the
    emulator, not the A100; checked against the host C library bit for bit."""
    os.environ[qemu_ime2.EMU_ENV["count"]] = "1"
    print()
    print(f"| K | N | M | portable VLEN 1024 (median of {REPEATS}) | ime2 VLEN 1024 (median of {REPEATS}) "
          "| emulated .hp | µs per .hp (difference / count) |")
    print("|---|---|---|---|---|---|---|")
    for k, n, m, a, qw, sc, host in cases():
        med, count = {}, 0
        for path in ("portable", "ime2"):
            res = qemu_ime2.run(a, qw, sc, vlen=1024, path=path, timeout=600)
            assert res.status == 0 and np.array_equal(res.c, host), f"{path} differs from the host library"
            if path == "ime2":
                count = qemu_ime2.emulated_count(res.stderr) or 0
            med[path] = statistics.median(
                qemu_ime2.run(a, qw, sc, vlen=1024, path=path, timeout=600).seconds for _ in range(REPEATS))
        # N < 32: no full tile, only the scalar tail runs (no .hp to divide by)
        per = f"{(med['ime2'] - med['portable']) / count * 1e6:.1f}" if count else "– (tail only)"
        print(f"| {k} | {n} | {m} | {med['portable']:.3f} s | {med['ime2']:.3f} s | {count} | {per} |",
              flush=True)


if __name__ == "__main__":
    main()
    ime2_table()
