"""The RVV path sets frm to round-to-nearest-even for the call and restores the caller's frm,
and it reads packed operands at any address.

A small riscv64 C program (written here, built into tmp_path against the objects of the real
riscv64 build) packs one input under RNE, computes C with the portable path under RNE, then runs
the RVV path with the caller's frm set to each other rounding mode (RTZ, RDN, RUP, RMM) and checks
that C is bit-identical and that frm reads back unchanged after the call; then it runs the RVV
path on copies of the packed operands at odd addresses (same C expected). Runs under
qemu-riscv64-static at VLEN 128 and 1024. Note: QEMU 7.2 user mode does not trap misaligned
vector loads (a vle16 of the fp16 scales at an odd address was tried and passes here), so the
odd-address run checks the results only; that the path makes no misaligned access at all is by
construction (byte loads, gemm_rvv.c).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from npu_conformance import qemu_ime2

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "ime2"
TOOLS = ("make", "clang-19", qemu_ime2.QEMU)
_missing = [t for t in TOOLS if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"missing {', '.join(_missing)} (bash ci/setup.sh installs them)")

PROGRAM = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npu_ime2.h"

static unsigned long get_frm(void) { unsigned long v; __asm__ volatile("frrm %0" : "=r"(v)); return v; }
static void set_frm(unsigned long v) { __asm__ volatile("fsrm %0" ::"r"(v)); }

static uint32_t lcg = 12345u;
static uint32_t next(void) { lcg = lcg * 1664525u + 1013904223u; return lcg >> 8; }

int main(void)
{
    enum { M = 5, K = 288, N = 70 };
    static float a[M * K], scales[N * (K / 32)], c_ref[M * N], c[M * N];
    static uint8_t qw[N * (K / 32) * 16];
    for (int i = 0; i < M * K; i++) a[i] = (float)((int)(next() % 20001) - 10000) / 2500.0f;
    for (int i = 0; i < N * (K / 32) * 16; i++) qw[i] = (uint8_t)next();
    for (int i = 0; i < N * (K / 32); i++) scales[i] = (float)(next() % 1000 + 1) / 7919.0f;
    size_t ab, bb;
    if (npu_ime2_a_packed_size(M, K, &ab) || npu_ime2_b_packed_size(N, K, &bb)) return 10;
    void *ap = malloc(ab), *bp = malloc(bb);
    if (!ap || !bp) return 11;
    if (npu_ime2_quantize_a(a, M, K, ap, ab) || npu_ime2_pack_b(qw, scales, N, K, bp, bb)) return 12;
    if (npu_ime2_gemm(ap, ab, bp, bb, M, K, N, c_ref, sizeof c_ref, NPU_IME2_PATH_PORTABLE)) return 13;
    int bad = 0;
    for (unsigned long mode = 0; mode <= 4; mode++) {
        memset(c, 0xA5, sizeof c);
        set_frm(mode);
        const int st = npu_ime2_gemm(ap, ab, bp, bb, M, K, N, c, sizeof c, NPU_IME2_PATH_RVV);
        const unsigned long after = get_frm();
        set_frm(0);
        int diff = 0;
        for (int i = 0; i < M * N; i++) diff += memcmp(&c[i], &c_ref[i], sizeof(float)) != 0;
        printf("frm=%lu status=%d frm_after=%lu differing=%d\n", mode, st, after, diff);
        bad += st != 0 || after != mode || diff != 0;
    }
    /* the packed operands at odd addresses: the RVV path uses byte loads only */
    uint8_t *ap1 = malloc(ab + 1), *bp1 = malloc(bb + 1);
    if (!ap1 || !bp1) return 11;
    memcpy(ap1 + 1, ap, ab);
    memcpy(bp1 + 1, bp, bb);
    memset(c, 0xA5, sizeof c);
    const int st = npu_ime2_gemm(ap1 + 1, ab, bp1 + 1, bb, M, K, N, c, sizeof c, NPU_IME2_PATH_RVV);
    int diff = 0;
    for (int i = 0; i < M * N; i++) diff += memcmp(&c[i], &c_ref[i], sizeof(float)) != 0;
    printf("odd addresses: status=%d differing=%d\n", st, diff);
    bad += st != 0 || diff != 0;
    return bad ? 1 : 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("rvv_frm")
    env = {k: v for k, v in os.environ.items() if k not in ("RV_RVV_FLAGS", "MAKEFLAGS", "MFLAGS")}
    subprocess.run(["make", "-s", "-C", str(KERNEL), "riscv64", f"OUT={base}"], env=env, check=True,
                   capture_output=True, timeout=600)
    objs = [base / "obj-riscv64" / f"{name}.o" for name in ("pack", "gemm_portable", "dispatch", "gemm_rvv")]
    # the other kernel sources (e.g. gemm_ime2.c, which dispatch.o links to); not the driver's
    # programs (driver.c, ime2_probe.c have their own main) nor the emulator
    extra = sorted(base / "obj-riscv64" / f"{src.stem}.o" for src in (KERNEL / "src").glob("*.c"))
    extra = [p for p in extra if p not in objs and p.is_file()]  # gemm_x86.c: host builds only
    src = base / "frm.c"
    src.write_text(PROGRAM)
    exe = base / "frm"
    subprocess.run(["clang-19", "--target=riscv64-linux-gnu", "-march=rv64gcv_zvfh", "-O1", "-fuse-ld=lld", "-static",
                    f"-I{KERNEL / 'include'}", "-o", str(exe), str(src), *map(str, objs + extra), "-lm"],
                   check=True, capture_output=True, timeout=600)
    return exe


@pytest.mark.parametrize("vlen", [128, 1024])
def test_rvv_path_rounds_to_nearest_even_and_restores_frm(program, vlen):
    cmd = [qemu_ime2.qemu_path(), "-cpu", f"rv64,v=true,Zfh=true,vlen={vlen},vext_spec=v1.0", str(program)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    lines = proc.stdout.splitlines()
    assert len(lines) == 6, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
