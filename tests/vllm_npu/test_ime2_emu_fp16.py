"""The IME2 emulator's own fp16 arithmetic (``kernels/ime2/driver/ime2_emu_fp16.h``), on the host.

The SIGILL emulator checks the kernel, so it must not share the kernel's rounding code
(``kernels/ime2/src/fp16.h``): the two may overlap only in the specification (issue 15, section
2). Checked here:

* the emulator's sources include nothing from ``kernels/ime2/src``, and the header compiles with
  only ``kernels/ime2/driver`` on the include path;
* fp16 -> fp32 equals numpy's float16 -> float32 on all 65536 bit patterns (NaN payloads too);
* fp32 -> fp16 equals numpy's float32 -> float16 (round to nearest even) on every fp16 value, every
  midpoint between neighbouring fp16 values (ties) and its two fp32 neighbours, the subnormal and
  overflow boundaries, fp32 subnormals, infinities, NaN (NaN -> a NaN of the same sign) and a
  million random fp32 bit patterns;
* the per-output ``.hp`` arithmetic equals ``npusim.q4x32.hp_accumulate`` in all eight option
  combinations on random, special (inf, NaN, signed zeros, subnormals) and overflowing operands.

A tiny host program compiled here with ``cc`` drives the header: no QEMU needed.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from npusim.q4x32 import HpMode, hp_accumulate

DRIVER = Path(__file__).resolve().parents[2] / "kernels" / "ime2" / "driver"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no host C compiler (cc) on PATH")

HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ime2_emu_fp16.h"

/* argv[1]: h = fp16->fp32 of all 65536 patterns; f = fp32->fp16 of the uint32 array on stdin;
 * a = .hp outputs: stdin = uint32 n, uint16 vd[n], int32 tmp[n], uint16 scale[n], uint8 mode[n]
 * (bit 0 fused, bit 1 dot exact, bit 2 saturate). Writes the results to stdout. */
static void *read_all(size_t *len)
{
    size_t cap = 1 << 20, n = 0;
    unsigned char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, stdin)) > 0) {
        n += got;
        if (n == cap)
            buf = realloc(buf, cap *= 2);
    }
    *len = n;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    if (argv[1][0] == 'h') {
        for (uint32_t h = 0; h < 65536; h++) {
            const uint32_t f = emu_f16_to_f32((uint16_t)h);
            fwrite(&f, 4, 1, stdout);
        }
        return 0;
    }
    size_t len;
    unsigned char *in = read_all(&len);
    if (!in)
        return 3;
    if (argv[1][0] == 'f') {
        for (size_t i = 0; i + 4 <= len; i += 4) {
            uint32_t f;
            memcpy(&f, in + i, 4);
            const uint16_t h = emu_f32_to_f16(f);
            fwrite(&h, 2, 1, stdout);
        }
        return 0;
    }
    uint32_t n;
    memcpy(&n, in, 4);
    const unsigned char *vd = in + 4, *tmp = vd + 2 * (size_t)n, *sc = tmp + 4 * (size_t)n, *md = sc + 2 * (size_t)n;
    if (len != 4 + 9 * (size_t)n)
        return 4;
    for (uint32_t i = 0; i < n; i++) {
        uint16_t v, s;
        int32_t t;
        memcpy(&v, vd + 2 * i, 2);
        memcpy(&t, tmp + 4 * i, 4);
        memcpy(&s, sc + 2 * i, 2);
        const emu_hp_mode mode = {md[i] & 1, (md[i] >> 1) & 1, (md[i] >> 2) & 1};
        const uint16_t r = emu_hp_output(v, t, s, &mode);
        fwrite(&r, 2, 1, stdout);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """The host harness, built with only kernels/ime2/driver on the include path."""
    out = tmp_path_factory.mktemp("emu_fp16")
    src = out / "harness.c"
    src.write_text(HARNESS)
    exe = out / "harness"
    subprocess.run([CC, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", f"-I{DRIVER}",
                    str(src), "-o", str(exe)], check=True, capture_output=True, timeout=120)
    return exe


def run(exe: Path, mode: str, data: bytes = b"") -> bytes:
    return subprocess.run([str(exe), mode], input=data, capture_output=True, check=True, timeout=120).stdout


# ---------------------------------------------------------------------------------------------
# independence from the kernel


def test_emulator_sources_include_nothing_from_the_kernel():
    """ime2_emu.c and its headers include only system headers and the emulator's own headers."""
    own = {"ime2_emu.h", "ime2_emu_fp16.h"}
    for name in ("ime2_emu.c", "ime2_emu.h", "ime2_emu_fp16.h"):
        text = (DRIVER / name).read_text()
        local = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.M)
        assert set(local) <= own, f"{name} includes {sorted(set(local) - own)} (only {sorted(own)} allowed)"
        assert "fp16.h\"" not in text.replace("ime2_emu_fp16.h\"", ""), name


def test_emulator_has_no_floating_point_rounding_of_its_own_to_share():
    """The header computes with integers only: no float/double arithmetic for the kernel to share."""
    text = (DRIVER / "ime2_emu_fp16.h").read_text()
    code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    assert not re.search(r"\b(float|double|_Float16)\b", code), "ime2_emu_fp16.h uses a floating-point type"


# ---------------------------------------------------------------------------------------------
# conversions


def test_f16_to_f32_equals_numpy_on_all_65536_patterns(harness):
    got = np.frombuffer(run(harness, "h"), dtype="<u4")
    want = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(int(h)), hex(int(got[h])), hex(int(want[h]))) for h in bad[:8]]


def _f32_cases(seed: int = 0) -> np.ndarray:
    """fp32 values around every fp16 rounding decision, boundaries, specials and random bits."""
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # all finite >= 0
    nxt = np.append(h[1:], 65536.0)  # the next fp16 step (65536: the overflow threshold's partner)
    mid = ((h + nxt) / 2).astype(np.float32)  # ties (exact in fp32: 12 significant bits)
    assert np.array_equal(mid.astype(np.float64), (h + nxt) / 2)
    parts = [h.astype(np.float32), mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))]
    special = np.array([0.0, 2.0**-24, 2.0**-25, 2.0**-26, 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25,
                        2.0**-14 - 2.0**-24, 65504.0, 65519.0, 65520.0, 65521.0, 65536.0, 1e10,
                        np.finfo(np.float32).max, np.finfo(np.float32).tiny, np.inf], dtype=np.float32)
    bits = np.concatenate([p.view(np.uint32) for p in parts + [special]])
    fp32_subnormals = np.array([1, 2, 0x7FFFFF, 0x400000, 0x12345], dtype=np.uint32)
    rand = np.random.default_rng(seed).integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    nans = np.array([0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000], dtype=np.uint32)
    pos = np.concatenate([bits, fp32_subnormals, nans])
    return np.concatenate([pos, pos | np.uint32(0x80000000), rand])


def test_f32_to_f16_equals_numpy_rne(harness):
    cases = _f32_cases()
    got = np.frombuffer(run(harness, "f", cases.astype("<u4").tobytes()), dtype="<u2")
    with np.errstate(over="ignore"):
        want = cases.view(np.float32).astype(np.float16).view(np.uint16)
    nan_in = np.isnan(cases.view(np.float32))
    got_nan = ((got & 0x7C00) == 0x7C00) & ((got & 0x03FF) != 0)
    assert np.array_equal(got_nan, nan_in), "NaN must map to NaN and nothing else"
    assert np.array_equal(got[nan_in] >> 15, cases[nan_in] >> 31), "NaN keeps its sign"
    bad = np.flatnonzero((got != want) & ~nan_in)
    assert bad.size == 0, [(float(cases.view(np.float32)[i]), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]
    # the set has teeth: ties went both ways, subnormals and infinities were produced
    assert np.count_nonzero((want & 0x7C00) == 0) > 10_000 and np.count_nonzero((want & 0x7FFF) == 0x7C00) > 100


# ---------------------------------------------------------------------------------------------
# the .hp per-output arithmetic

MODES = list(itertools.product((False, True), repeat=3))  # (fused, dot exact, saturate)


def _hp_cases(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vd fp16 bits, tmp int32, scale fp16 bits): random values over the whole fp16 range, raw bit
    patterns (NaN, inf, subnormals), exact zeros of both signs, and i4 dot products."""
    rng = np.random.default_rng(seed)
    n = 20_000

    def mags(lo: float, hi: float) -> np.ndarray:
        v = np.exp2(rng.uniform(lo, hi, n)) * rng.choice([-1.0, 1.0], n)
        return v.astype(np.float16).view(np.uint16)

    vd = np.concatenate([mags(-26, 16), rng.integers(0, 65536, n, dtype=np.uint16),
                         rng.choice(np.array([0, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x7BFF], np.uint16), n)])
    sc = np.concatenate([mags(-26, 13), rng.integers(0, 65536, n, dtype=np.uint16), mags(-16, 4)])
    tmp = np.concatenate([rng.integers(-7200, 7201, n), rng.integers(-3840, 3841, n),
                          rng.choice(np.array([0, 1, -1, 2049, 2051, -4097, 7199, 7200]), n)]).astype(np.int32)
    return vd, tmp, sc


def test_hp_output_equals_hp_accumulate_in_every_mode(harness):
    vd, tmp, sc = _hp_cases(seed=3)
    n = vd.size
    for fused, exact, sat in MODES:
        mode_byte = np.full(n, int(fused) | int(exact) << 1 | int(sat) << 2, dtype=np.uint8)
        req = (np.uint32(n).tobytes() + vd.astype("<u2").tobytes() + tmp.astype("<i4").tobytes()
               + sc.astype("<u2").tobytes() + mode_byte.tobytes())
        got = np.frombuffer(run(harness, "a", req), dtype="<u2")
        mode = HpMode(rounding="fused" if fused else "unfused", dot="exact" if exact else "fp16",
                      overflow="saturate" if sat else "inf")
        want = hp_accumulate(vd.view(np.float16), tmp, sc.view(np.float16), mode).view(np.uint16)
        is_nan = lambda x: ((x & 0x7C00) == 0x7C00) & ((x & 0x03FF) != 0)  # noqa: E731
        both_nan = is_nan(got) & is_nan(want)
        bad = np.flatnonzero((got != want) & ~both_nan)
        assert bad.size == 0, (mode, [(hex(int(vd[i])), int(tmp[i]), hex(int(sc[i])), hex(int(got[i])),
                                       hex(int(want[i]))) for i in bad[:6]])
        assert np.count_nonzero(both_nan) < n // 2
