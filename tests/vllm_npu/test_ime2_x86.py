"""The X86 host path of kernels/ime2 (src/gemm_x86.c: AVX2 + F16C) against the portable C path
and npusim.q4x32 hardware level, on adversarial inputs: fp16 accumulator overflow to inf, fp16
subnormal scales and products, all-zero sub-blocks, N tails, K not a multiple of 256, M = 1..9
(4-row groups and lone rows), and a caller's MXCSR FTZ/DAZ.

Every comparison with the portable path is on float32 bit patterns (NaN payloads and signed
zeros included); the comparison with npusim is value for value with NaN positions.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npusim.q4x32 as q
import npusim.q4x32.layout as L
from vllm_npu.ime2 import kernel


def _cpu_flags() -> set[str]:
    """The CPU features this process sees, by CPUID and XGETBV (numpy's run-time dispatch table:
    only features the OS saves state for). Not /proc/cpuinfo, which shows the host's flags under
    ``qemu-x86_64-static -cpu Haswell`` while CPUID shows the emulated CPU's."""
    from numpy._core._multiarray_umath import __cpu_features__

    return {name for name, present in __cpu_features__.items() if present}


CPU_HAS_AVX2_F16C = {"AVX2", "F16C"} <= _cpu_flags()
needs_x86 = pytest.mark.skipif(not CPU_HAS_AVX2_F16C, reason="this CPU lacks AVX2 or F16C (or is not x86-64 Linux)")


AVX512_VNNI_FLAGS = {"AVX512F", "AVX512BW", "AVX512VL", "AVX512VNNI"}
AVX512_FLAGS = AVX512_VNNI_FLAGS | {"AVX512FP16"}


@pytest.fixture(scope="module", autouse=True, params=["best", "avx512-vnni", "avx2"])
def x86_isa(request):
    """Every test here runs three times: with the X86 path's best variant for this CPU (AVX-512
    VNNI + FP16 where present), capped at the AVX-512 VNNI + F16C variant (NPU_IME2_X86_ISA=
    avx512-vnni: what a CPU with AVX-512 VNNI and no AVX512-FP16, such as AMD Zen 4, runs; the
    AVX2 variant where the CPU has no AVX-512 VNNI) and with its AVX2 + F16C variant forced
    (NPU_IME2_X86_ISA=avx2)."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "best":
            mp.delenv("NPU_IME2_X86_ISA", raising=False)
        else:
            mp.setenv("NPU_IME2_X86_ISA", request.param)
        yield request.param


def expected_variant(isa: str, flags: set[str]) -> str:
    """The variant the GEMM picks for the NPU_IME2_X86_ISA setting ``isa`` on a CPU with ``flags``."""
    if isa == "best" and AVX512_FLAGS <= flags:
        return "avx512-vnni-fp16"
    if isa in ("best", "avx512-vnni") and AVX512_VNNI_FLAGS <= flags:
        return "avx512-vnni-f16c"
    return "avx2-f16c"


def bits(c: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(c, dtype=np.float32).view(np.uint32)


def run_all(a: np.ndarray, qw: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """X86 == portable bit pattern for bit pattern, both == npusim hardware, and the whole op
    (AUTO) == X86. Returns the X86 result."""
    m, k = a.shape
    n = qw.shape[0]
    ap, bp = kernel.quantize_a(a), kernel.pack_b(qw, sc)
    hw = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    portable = kernel.gemm_packed(ap, bp, m, k, n, path="portable")
    x86 = kernel.gemm_packed(ap, bp, m, k, n, path="x86")
    assert np.array_equal(portable, hw, equal_nan=True), "portable vs npusim hardware"
    diff = bits(x86) != bits(portable)
    assert not diff.any(), (f"x86 vs portable: {int(diff.sum())} of {diff.size} differ, first at "
                            f"{tuple(np.argwhere(diff)[0])}: {x86[tuple(np.argwhere(diff)[0])]!r} vs "
                            f"{portable[tuple(np.argwhere(diff)[0])]!r}")
    np.testing.assert_array_equal(bits(kernel.ime2_hp_gemm_cpu(a, qw, sc)), bits(x86))
    return x86


def rand_weights(rng: np.random.Generator, n: int, k: int, scale: float = 1 / 8) -> tuple[np.ndarray, np.ndarray]:
    qw = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    sc = rng.uniform(0.5, 1.5, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32)) * scale
    return qw, sc.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# availability and dispatch


def test_x86_path_status_follows_the_cpu_flags():
    assert (kernel.path_status("x86") == kernel.Status.OK) == CPU_HAS_AVX2_F16C
    assert ("x86" in kernel.usable_paths()) == CPU_HAS_AVX2_F16C


@needs_x86
def test_auto_picks_x86_on_this_machine():
    assert kernel.auto_path() == "x86"
    assert kernel.usable_paths() == ["portable", "x86"]


# ---------------------------------------------------------------------------------------------
# adversarial inputs


@needs_x86
@pytest.mark.parametrize("m", [1, 4, 5])
def test_fp16_accumulator_overflow_to_inf(m):
    """Large weight scales and outlier activations: the fp16 d16 accumulator (and sc, zp)
    overflow to +/-inf, inf - inf gives NaN; positions and bits as the portable path."""
    rng = np.random.default_rng(100 + m)
    k, n = 512, 100
    qw, sc = rand_weights(rng, n, k, scale=1.0)
    qw[0::5] = qw[1::5] = 0x0F  # even K code 15, odd K code 0: dot = 15 * sum(q over even K) > 0
    qw[2::5] = 0xFF
    sc = sc * np.float32(2000.0)
    sc[0::5], sc[1::5] = 3000.0, -3000.0  # d16 overflows to +inf / -inf, zp stays 0 (rows with asum 0)
    sc[2::5, 3] = 65504.0  # the largest fp16
    sc[3::5] = 90000.0  # beyond fp16: the tile's scale is inf, inf * 0 = NaN
    v = np.abs(rng.standard_normal((m, k // 2))).astype(np.float32) + 1
    a = np.empty((m, k), np.float32)
    a[:, 0::2], a[:, 1::2] = v, -v  # every sub-block sums to 0: asum8 = 0
    if m == 5:  # a lone row after the group
        a[4] = rng.standard_normal(k).astype(np.float32)
        a[4, 5] = 400.0  # outlier: its sub-block's codes are large
    c = run_all(a, qw, sc)
    assert np.isposinf(c).any() and np.isneginf(c).any() and np.isnan(c).any() and np.isfinite(c).any()


@needs_x86
@pytest.mark.parametrize("m", [1, 4, 5])
def test_the_rounding_shortcut_guards(m):
    """The AVX2 + F16C and the AVX-512 VNNI + F16C variants skip rounding fp16(dot_hi) when
    |dot_hi| <= 2048 and, for a lone row, fp16(sc * 16) when |sc| < 4096, and rerun a block of
    8 / 16 columns exactly when a lane breaks either guard. Single columns break them here, among ordinary ones:

    - sub-block 0: 31 activations quantize to 127 (a_hi = 7) and one to 100 (a_hi = 6); against
      all-15 codes (columns 0..31, each with its own scale) dot_hi = 15 * 223 = 3345, which fp16
      rounds to 3344;
    - column 40, sub-block 9: scale 30000, so sc * 16 is beyond fp16 (inf); the sub-block's
      activations all have a_hi = 0 except the largest, whose code is 0, so dot_hi = 0 and the
      exact product 0 * inf is NaN where the unguarded shortcut would give 0.
    """
    rng = np.random.default_rng(300 + m)
    k, n = 512, 64
    qw, sc = rand_weights(rng, n, k)
    qw[0:32, 0] = 0xFF  # columns 0..31, sub-block 0: every code 15
    sc[40, 9] = 30000.0
    qw[40, 9, 0] &= 0xF0  # column 40, sub-block 9, K 0: code 0
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[:, 0:32] = 3.0
    a[:, 7] = 3.0 * 100 / 127  # quantizes to 100
    a[:, 288:320] = 0.05  # sub-block 9: quantizes to 6 (a_hi = 0) ...
    a[:, 288] = 1.0  # ... but for its largest, 127, at K 0
    c = run_all(a, qw, sc)
    assert np.isfinite(c[:, :40]).all()


@needs_x86
@pytest.mark.parametrize("m", [1, 4, 7])
@pytest.mark.parametrize("exp", [-17, -20, -24])
def test_fp16_subnormal_scales_and_products(m, exp):
    """Weight scales in fp16's subnormal range (< 2**-14): sc = fp16(d * rel), sc16, zp and the
    products are fp16 subnormals (or round to zero); m1's fp16(sc * 16) and m4's
    fp16(d * fp16(rel * 16)) differ here."""
    rng = np.random.default_rng(200 + m - exp)
    k, n = 320, 70
    qw, sc = rand_weights(rng, n, k, scale=2.0**exp)
    h = np.abs(sc.astype(np.float16))
    assert ((h < 2.0**-14) & (h > 0)).mean() > 0.9  # the scales really are fp16 subnormals
    a = rng.standard_normal((m, k)).astype(np.float32)
    c = run_all(a, qw, sc)
    assert np.isfinite(c).all() and (c != 0).any()


@needs_x86
def test_tiny_activations_subnormal_scale_avg():
    rng = np.random.default_rng(9)
    qw, sc = rand_weights(rng, 40, 576, scale=2.0**-10)
    for m in (1, 4, 6):
        a = rng.standard_normal((m, 576)).astype(np.float32) * np.float32(2e-5)
        run_all(a, qw, sc)


@needs_x86
@pytest.mark.parametrize("m", [1, 4, 6])
def test_all_zero_subblocks(m):
    """Zero activation sub-blocks (scale 0, rel 0, q 0), zero-point-only weight blocks (code 8),
    zero scales: zero dots, zero and negative-zero products."""
    rng = np.random.default_rng(300 + m)
    k, n = 544, 75
    qw, sc = rand_weights(rng, n, k)
    qw[:, 2] = 0x88
    qw[::3, 5] = 0x88
    sc[:, 7] = 0.0
    sc[4::5, 1] = -0.0
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[:, 0:32] = 0.0  # a whole sub-block of every row
    a[:, 256:512] = 0.0  # a whole superblock
    a[-1, 64:96] = 0.0  # one row only (in a group: the group's scale stays)
    run_all(a, qw, sc)
    run_all(np.zeros((m, k), np.float32), qw, sc)
    run_all(-np.zeros((m, k), np.float32), qw, sc)


@needs_x86
@pytest.mark.parametrize("k", [32, 96, 288, 2048])
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 64, 95])
def test_shapes_m_1_to_9(k, n):
    """N tails (N % 32 != 0, N < 32: the scalar tail's arithmetic), K not a multiple of 256,
    every M from 1 to 9 (4-row groups followed by 0..3 lone rows)."""
    rng = np.random.default_rng(k * 1000 + n)
    qw, sc = rand_weights(rng, n, k)
    for m in range(1, 10):
        run_all(rng.standard_normal((m, k)).astype(np.float32), qw, sc)


@needs_x86
@given(
    m=st.integers(1, 9),
    kb=st.integers(1, 40),  # K = 32 .. 1280
    n=st.integers(1, 80),
    w_exp=st.integers(-26, 14),  # weight scale magnitude 2**w_exp: fp16 subnormal .. overflow
    a_exp=st.integers(-30, 25),  # activation magnitude
    zero_blocks=st.booleans(),
    outlier=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_x86_equals_portable_property(m, kb, n, w_exp, a_exp, zero_blocks, outlier, seed):
    rng = np.random.default_rng(seed)
    k = 32 * kb
    qw, sc = rand_weights(rng, n, k, scale=2.0**w_exp)
    a = (rng.standard_normal((m, k)) * 2.0**a_exp).astype(np.float32)
    if zero_blocks:
        a[:, rng.integers(0, kb) * 32:][:, :32] = 0.0
        sc[rng.integers(0, n), rng.integers(0, kb)] = 0.0
        qw[:, rng.integers(0, kb)] = 0x88
    if outlier:
        a[rng.integers(m), rng.integers(k)] = np.float32(300.0 * 2.0**a_exp)
    run_all(a, qw, sc)


# ---------------------------------------------------------------------------------------------
# v16: the .hp roundings as Veltkamp splits, and their guards (src/gemm_x86.c)


@pytest.mark.parametrize("m", [1, 4])
def test_d16_overflow_in_the_middle_of_a_superblock(m):
    """An fp16 d16 that overflows in sub-block 2 and would come back below 65504 by sub-block 7:
    on the .hp instructions it stays inf (inf - x = inf). Every other guard holds (|dot_hi| =
    1680 <= 2048, |sc| = 1, asum8 = 0), so only v16's overflow bound sends the block to the exact
    conversions; without it the X86 result would be finite (checked by removing the bound)."""
    k, n = 256, 64
    qw = np.full((n, k // 32, 16), 0x0F, np.uint8)  # even K code 15, odd K code 0
    sc = np.tile(np.array([1, 1, 1, -1, -1, -1, -1, -1], np.float32), (n, 1))
    sc[32:] *= np.float32(0.01)  # the second tile stays finite
    a = np.empty((m, k), np.float32)
    a[:, 0::2], a[:, 1::2] = 1.0, -1.0  # q = +-127 in every sub-block: rel = 1, asum8 = 0
    c = run_all(a, qw, sc)
    assert np.isposinf(c[:, :32]).all() and np.isfinite(c[:, 32:]).all()


def _a_offset(m: int, k: int, row: int, s: int, field: str, j: int = 0) -> int:
    """Byte offset of ``field`` ("rel" of sub-block j, "asum8" of sub-block j, "sa") of (row,
    superblock s) in quantize_a's output, from npusim.q4x32.layout (pack.c's layout: 4-row groups
    first, then lone rows)."""
    s_count = L.n_superblocks(k)
    if row < m // 4 * 4:
        base = (row - row % 4) * s_count * L.A_BLOCK_BYTES + s * L.A_GROUP_BLOCK_BYTES
        return base + {"rel": L.A_GROUP_SUBBLOCK_STRIDE * j,
                       "asum8": L.A_GROUP_ASUM_OFFSET + 2 * (L.SUBBLOCKS * (row % 4) + j),
                       "sa": L.A_GROUP_SCALE_AVG_OFFSET}[field]
    base = row * s_count * L.A_BLOCK_BYTES + s * L.A_BLOCK_BYTES
    return base + {"rel": L.A_ROW_SUBBLOCK_STRIDE * j, "asum8": L.A_ROW_ASUM_OFFSET + 2 * j,
                   "sa": L.A_ROW_SCALE_AVG_OFFSET}[field]


def _b_scale_offset(k: int, col: int, s: int, j: int) -> int:
    """Byte offset of column ``col``'s fp16 scale for (superblock s, sub-block j) in pack_b's output."""
    t, c = divmod(col, L.TILE_N)
    return (t * L.n_superblocks(k) + s) * L.B_SUPERBLOCK_BYTES + j * L.B_BLOCK_BYTES + 2 * c


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("asum8", [0.33325, 60000.0], ids=["non-integer", "beyond-2**15"])
def test_packed_a_from_elsewhere_with_unusual_asum8(m, asum8):
    """gemm_packed takes any packed A. quantize_a's asum8 are integers of magnitude <= 32768; a
    non-integer one makes zp_j = fp16(sc * asum8_j) a value off the fp16 subnormal grid (where
    v16 is not fp16's rounding) and a larger one can overflow zp alone: the per-row asum8 guard
    sends both to the exact conversions. X86 == portable bit for bit."""
    rng = np.random.default_rng(17)
    k, n = 512, 64
    qw = np.full((n, k // 32, 16), 0x88, np.uint8)  # code 8 everywhere: the dots are the zero point's
    sc = np.full((n, k // 32), 2.0**-20 if asum8 < 1 else 1.2, np.float32)  # fp16 subnormal d / a large one
    a = rng.standard_normal((m, k)).astype(np.float32)
    ap = bytearray(kernel.quantize_a(a))
    for row in range(m):
        for s in range(k // 256):
            off = _a_offset(m, k, row, s, "asum8")
            ap[off:off + 16] = np.full(8, asum8, np.float16).tobytes()
    bp = kernel.pack_b(qw, sc)
    portable = kernel.gemm_packed(bytes(ap), bp, m, k, n, path="portable")
    x86 = kernel.gemm_packed(bytes(ap), bp, m, k, n, path="x86")
    np.testing.assert_array_equal(bits(x86), bits(portable))
    if asum8 > 1:
        assert np.isinf(portable).all()  # zp = fp16(1.2 * 60000) = inf


@pytest.mark.parametrize("m", [1, 4, 5])
def test_k_padding_skipped_only_where_it_adds_exact_zeros(m):
    """K = 576: the last superblock's sub-blocks 2..7 are padding, which the variants without
    AVX512-FP16 skip when it adds exact zeros (rel = asum8 = 0 from quantize_a, finite sa and
    scales). Where it would not, nothing is skipped and the result is the portable path's:
    a packed A whose padding holds a non-zero rel_j and asum8_j (it then adds sa * zp_j), a
    packed B with inf / NaN scales in its padding (inf * 0 = NaN in that column), and an inf
    scale_avg (sa * 0 = NaN). Each case fails when its check is removed."""
    rng = np.random.default_rng(23 + m)
    k, n = 576, 70
    qw, sc = rand_weights(rng, n, k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    run_all(a, qw, sc)  # the skipping case itself
    ap, bp = kernel.quantize_a(a), bytearray(kernel.pack_b(qw, sc))
    s_last = k // 256
    for col, j, val in ((3, 5, np.inf), (40, 7, np.nan), (65, 2, -np.inf)):  # full tiles and the tail
        off = _b_scale_offset(k, col, s_last, j)
        bp[off:off + 2] = np.array([val], np.float16).tobytes()
    bp = bytes(bp)
    portable = kernel.gemm_packed(ap, bp, m, k, n, path="portable")
    np.testing.assert_array_equal(bits(kernel.gemm_packed(ap, bp, m, k, n, path="x86")), bits(portable))
    assert np.isnan(portable[:, [3, 40, 65]]).all() and np.isfinite(np.delete(portable, [3, 40, 65], 1)).all()
    garbage = bytearray(ap)
    for row in range(m):
        off = _a_offset(m, k, row, s_last, "rel", 6)
        garbage[off:off + 2] = np.array([0.5], np.float16).tobytes()
        aoff = _a_offset(m, k, row, s_last, "asum8", 6)
        garbage[aoff:aoff + 2] = np.array([-64.0], np.float16).tobytes()
    garbage = bytes(garbage)
    bp1 = bytearray(kernel.pack_b(qw, sc))  # padding scales of sub-block 6: 1.0 (pack_b writes 0)
    for col0 in range(0, n, L.TILE_N):
        off = _b_scale_offset(k, col0, s_last, 6)
        bp1[off:off + 64] = np.ones(32, np.float16).tobytes()
    bp1 = bytes(bp1)
    clean = kernel.gemm_packed(ap, bp1, m, k, n, path="portable")  # rel_6 = 0: still exact zeros
    np.testing.assert_array_equal(bits(kernel.gemm_packed(ap, bp1, m, k, n, path="x86")), bits(clean))
    portable = kernel.gemm_packed(garbage, bp1, m, k, n, path="portable")
    np.testing.assert_array_equal(bits(kernel.gemm_packed(garbage, bp1, m, k, n, path="x86")), bits(portable))
    assert not np.array_equal(portable, clean)  # the padding of this A does add something
    inf_sa = bytearray(ap)  # scale_avg inf in the last superblock: the padding's 0 * inf is NaN
    for row in range(m):
        off = _a_offset(m, k, row, s_last, "sa")
        inf_sa[off:off + 2] = np.array([np.inf], np.float16).tobytes()
    inf_sa = bytes(inf_sa)
    portable = kernel.gemm_packed(inf_sa, bp1, m, k, n, path="portable")
    np.testing.assert_array_equal(bits(kernel.gemm_packed(inf_sa, bp1, m, k, n, path="x86")), bits(portable))


# ---------------------------------------------------------------------------------------------
# the caller's MXCSR


def test_flush_denormal_leaves_results_unchanged_and_is_restored():
    """torch.set_flush_denormal(True) sets MXCSR FTZ and DAZ for this thread; every path (and the
    whole op and the torch op) must give the same bits as without it, and the caller's setting
    must still be in force after the calls."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    k, n = 320, 70
    qw, sc = rand_weights(rng, n, k, scale=2.0**-20)  # fp16 subnormal scales
    a = rng.standard_normal((5, k)).astype(np.float32)
    ap, bp = kernel.quantize_a(a), kernel.pack_b(qw, sc)
    paths = ["auto", *kernel.usable_paths()]
    before = {p: bits(kernel.gemm_packed(ap, bp, 5, k, n, path=p)) for p in paths}
    whole = bits(kernel.ime2_hp_gemm_cpu(a, qw, sc))
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # an fp32 subnormal
    assert (tiny * 1.0).item() != 0.0
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert (tiny * 1.0).item() == 0.0  # FTZ/DAZ in force
        for p in paths:
            np.testing.assert_array_equal(bits(kernel.gemm_packed(ap, bp, 5, k, n, path=p)), before[p], err_msg=p)
            assert (tiny * 1.0).item() == 0.0, f"path {p!r} did not restore the caller's MXCSR"
        np.testing.assert_array_equal(bits(kernel.ime2_hp_gemm_cpu(a, qw, sc)), whole)
        kernel.register_torch_op()
        out = torch.ops.npu_harness.ime2_hp_gemm_cpu(torch.from_numpy(a), torch.from_numpy(qw), torch.from_numpy(sc))
        np.testing.assert_array_equal(bits(out.numpy()), whole)
        assert (tiny * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert (tiny * 1.0).item() != 0.0
    assert np.array_equal(whole.view(np.float32), q.ime2_hp_gemm(a, qw, sc, level="hardware"), equal_nan=True)


def test_the_reported_variant_is_the_one_this_cpu_gets(x86_isa):
    """``kernel.x86_variant()`` (``npu-harness doctor``'s ``ime2-x86`` line) names the variant
    from the CPU's flags and the NPU_IME2_X86_ISA knob, as the GEMM chooses it."""
    if not CPU_HAS_AVX2_F16C:
        assert kernel.x86_variant() == "none"
        return
    assert kernel.x86_variant() == expected_variant(x86_isa, _cpu_flags())
