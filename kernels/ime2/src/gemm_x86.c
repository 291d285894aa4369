/*
 * gemm_x86.c - the X86 GEMM path: AVX2 + F16C, the same results as gemm_portable.c bit for bit.
 * Where the CPU also has AVX-512 (F, BW, VL, VNNI, FP16) a 16-column variant runs instead (see
 * block16 below); where it has AVX-512 F/BW/VL/VNNI without FP16 (AMD Zen 4), a 16-column variant
 * with VNNI dots and block8's fp32-emulated fp16 steps (block16f). NPU_IME2_X86_ISA=avx2 in the
 * environment forces the AVX2 one, =avx512-vnni caps it at block16f (tests, benchmarks).
 * All are built with per-function target attributes: the library needs no -m flags and loads on
 * any x86-64; npu_ime2_x86_usable() and the variant choice check the CPU at run time.
 *
 * Arithmetic (see the top of gemm_portable.c for the sequence the model rounds): every fp16
 * rounding is done as fp32 -> fp16 -> fp32 with VCVTPS2PH (immediate rounding: to nearest even,
 * fp16 subnormals kept, beyond 65504 -> +/-inf) and VCVTPH2PS (exact). The fp32 value that gets
 * rounded is always the exact value or rounds like it:
 *   - a product of two fp16 values has at most 22 significant bits and lies in [2**-48, 2**32]:
 *     exact in fp32;
 *   - a sum of two fp16 values computed in fp32 (24 bits) then rounded to fp16 (11 bits) equals
 *     the directly rounded sum, since 24 >= 2 * 11 + 2 (double rounding is innocuous);
 *   - the int dots are |x| <= 7200: exact in fp32.
 * fp32 steps of the model are plain fp32 vector multiplies and adds, one rounding each (this file
 * never asks for FMA, and the build has -ffp-contract=off). MXCSR: FTZ/DAZ set by a caller (e.g.
 * torch.set_flush_denormal(True)) must not change a result, so the call runs with FTZ and DAZ
 * clear, rounding to nearest and exceptions masked, then restores the caller's MXCSR (sticky
 * flags raised during the call are kept).
 *
 * Int dots. Per K32 sub-block j and column, dot_hi = sum(a_hi * code) and dot_lo = sum(a_lo *
 * code), a_hi = a >> 4 (signed -8..7), a_lo = a & 15, code = the unsigned nibble 0..15. A column's
 * 16 code bytes in a B block are 4 dwords; dword g holds K 8g .. 8g+7 (low nibble = even K, high
 * nibble = odd K). A 4x4 dword transpose of 8 columns gives, per g, one ymm holding dword g of
 * columns 0..7; masking it (& 0x0f) gives the even-K codes, shifting it (>> 4, & 0x0f) the odd-K
 * codes, 4 per column. The activations are re-laid once per row group (a_prep) so that one
 * broadcast dword holds the 4 matching a values; VPMADDUBSW (u8 code x s8 a) then gives 16-bit
 * pair sums per column, 8 of which (|sum| <= 16 * 15 * 15 = 3600) add up in 16 bits before one
 * VPMADDWD by 1 makes the int32 dot of 8 columns, in column order, with no horizontal reduction.
 * A 4-row group shares the transposed codes.
 *
 * Speed (issue 12). The .hp steps round to fp16 seven or eight times per row, column and
 * sub-block; a VCVTPS2PH + VCVTPH2PS pair costs about 1.9 cycles per 8 lanes on AMD Zen 4, as much
 * as four VPMADDUBSW (benchmarks/x86_throughput.c). Wherever the value rounded is a product of
 * an integer (dot_hi, fp16(dot_lo), asum8_j) and an fp16 value, or a sum of two fp16 values, the
 * variants without AVX512-FP16 round it with v16() (three plain fp32 operations, Veltkamp's
 * split) under an overflow guard; only sc and m4's sc16 (products of two fp16 values) keep the
 * conversions. A block whose guards do not all hold is rerun with conversions only (exact). The
 * int dots of a superblock are computed before its fp steps, and a lone row runs a whole 32-column
 * tile at once (block8: four 8-column groups, block16f: two 16-column groups) so that the fp16
 * chains through the sub-blocks, one per group, overlap.
 *
 * Single-threaded and reentrant: a per-call workspace of 4 * ceil(K/256) * sizeof(a_prep) bytes
 * (about 660: the re-laid activations of one row group), plus the cached CPU-feature answers.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#include "internal.h"

#define X86_TARGET __attribute__((target("avx2,f16c")))
#define X86_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* ------------------------------------------------------------------------------------------ */
/* CPU check */

/* XCR0 bits 1 and 2: the OS saves SSE and AVX (YMM upper halves) state on context switches. */
static int os_saves_ymm(void)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    if (!(ecx & bit_OSXSAVE))
        return 0;
    unsigned int xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    (void)xcr0_hi;
    return (xcr0_lo & 6u) == 6u;
}

/* CPUID and XGETBV can trap to the hypervisor in a VM (microseconds each), so the checks run
 * once and their answers are cached: 0 = not checked yet, 1 = no, 2 = yes. The answer never
 * changes during a process, so racing first callers only repeat the check. */
static int cached_check(int *cache, int (*check)(void))
{
    int v = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (v == 0) {
        v = check() ? 2 : 1;
        __atomic_store_n(cache, v, __ATOMIC_RELAXED);
    }
    return v == 2;
}

static int x86_check(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && os_saves_ymm();
}

int npu_ime2_x86_usable(void)
{
    static int cache;
    return cached_check(&cache, x86_check);
}

/* ------------------------------------------------------------------------------------------ */
/* Activations, re-laid once per row group */

/* One row's superblock. hi/lo[j]: the 32 a_hi / a_lo of sub-block j in dot order: for
 * g = 0..3, the dword of K 8g, 8g+2, 8g+4, 8g+6 (even) then of K 8g+1, 8g+3, 8g+5, 8g+7 (odd). */
typedef struct {
    int8_t hi[SUBBLOCKS][QK];
    int8_t lo[SUBBLOCKS][QK];
    float rel[SUBBLOCKS];   /* fp16 rel_j, exact */
    float rel16[SUBBLOCKS]; /* fp16(rel_j * 16) */
    float asum8[SUBBLOCKS]; /* fp16 asum8_j of this row */
    float sa;               /* fp16 scale_avg */
    float asum_max;         /* max_j |asum8_j|; +inf when one is not an integer (see v16()) */
    int pad_from;           /* sub-blocks pad_from..7 hold only K padding that adds exactly 0
                               (see pad_skippable); SUBBLOCKS when none can be skipped */
    unsigned hi_safe;       /* bit j: 15 * sum |a_hi| of sub-block j <= 2048, so |dot_hi| <= 2048
                               for any codes and the lane check of that guard can be skipped */
    uint16_t rel_h[SUBBLOCKS], rel16_h[SUBBLOCKS], asum8_h[SUBBLOCKS]; /* the same as fp16 bits */
} a_prep;

static inline f16_t get_f16(const uint8_t *p) { return (f16_t)(p[0] | (p[1] << 8)); }

/* Position of K index i (0..31) of a sub-block in a_prep.hi/lo. */
static inline int dot_pos(int i) { return (i / 8) * 8 + (i & 1) * 4 + ((i % 8) >> 1); }

static void prep_row(const uint8_t *a_packed, int64_t m, int64_t row, int64_t s, int64_t s_count, a_prep *out)
{
    a_row_ptrs ptrs;
    a_row_locate(a_packed, m, row, s, s_count, &ptrs);
    const uint8_t *const *rel_p = ptrs.rel, *const *q_p = ptrs.q, *asum_p = ptrs.asum, *sa_p = ptrs.sa;
    for (int j = 0; j < SUBBLOCKS; j++) {
        const f16_t rel = get_f16(rel_p[j]);
        out->rel_h[j] = rel;
        out->rel16_h[j] = f16_mul(rel, 0x4c00u /* 16.0 */);
        out->asum8_h[j] = get_f16(asum_p + 2 * j);
        out->rel[j] = f16_to_float(rel);
        out->rel16[j] = f16_to_float(out->rel16_h[j]);
        out->asum8[j] = f16_to_float(out->asum8_h[j]);
        for (int i = 0; i < QK; i++) {
            const int8_t v = (int8_t)q_p[j][i];
            out->hi[j][dot_pos(i)] = (int8_t)(v >> 4); /* arithmetic shift, as the portable path */
            out->lo[j][dot_pos(i)] = (int8_t)(v & 15);
        }
    }
    out->sa = f16_to_float(get_f16(sa_p));
    out->pad_from = SUBBLOCKS;
    out->hi_safe = 0;
    for (int j = 0; j < SUBBLOCKS; j++) {
        int hsum = 0;
        for (int i = 0; i < QK; i++)
            hsum += out->hi[j][i] < 0 ? -out->hi[j][i] : out->hi[j][i];
        if (15 * hsum <= 2048)
            out->hi_safe |= 1u << j;
    }
    /* quantize_a's asum8 are integers (8 * a sum of int8); a packed A from elsewhere may hold
     * anything, and a non-integer (or non-finite) asum8 makes zp_j's rounding one that v16()
     * does not reproduce: +inf trips the guard, and the block runs the exact conversions */
    float amax = 0.0f;
    for (int j = 0; j < SUBBLOCKS; j++) {
        const float v = out->asum8[j] < 0.0f ? -out->asum8[j] : out->asum8[j];
        if (!(v <= 65504.0f) || v != (float)(int32_t)v)
            amax = __builtin_inff();
        else if (v > amax)
            amax = v;
    }
    out->asum_max = amax;
}

/* ------------------------------------------------------------------------------------------ */
/* Vector pieces */

/* fp32 -> nearest fp16 (RNE, subnormals, overflow to inf) -> fp32. */
X86_INLINE __m256 r16(__m256 x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }

/*
 * v16(x): the same rounding as r16(x) by three plain fp32 operations instead of two conversions
 * (Veltkamp's split: c = x * (2**13 + 1), x rounded to 24 - 13 = 11 significant bits =
 * c - (c - x)): a VCVTPS2PH + VCVTPH2PS pair costs about 1.9 cycles of throughput per 8 lanes on
 * AMD Zen 4, these three operations about 1.2 (zmm: 3.7 and 2.0; benchmarks/x86_throughput.c). Equal to r16(x) when:
 *   - |x| < 65520 (beyond, r16 gives inf and v16 a finite value): the caller's overflow guard;
 *   - |x| >= 2**-14 (fp16 normal: rounding to 11 bits, to nearest even, is fp16's; checked on
 *     every fp32 value of [2**-14, 65520) by tests/vllm_npu/test_ime2_x86_rounding.py), or x is a
 *     multiple of 2**-24 (then |x| < 2**-14 has at most 10 significant bits and both leave it
 *     unchanged). The .hp steps only round such values: the products of an integer (fp16(dot_lo),
 *     dot_hi, asum8_j) by an fp16 value and the sums of two fp16 values. sc and m4's sc16 (products
 *     of two fp16 values) keep r16; an asum8_j that is not an integer (a packed A quantize_a did
 *     not write) sets a_prep.asum_max to inf, which trips the guard.
 */
X86_INLINE __m256 v16(__m256 x)
{
    const __m256 c = _mm256_mul_ps(x, _mm256_set1_ps(8193.0f));
    return _mm256_sub_ps(c, _mm256_sub_ps(c, x));
}

/*
 * The sub-blocks of the last superblock past K (K % 256 != 0: K = 576, 896, 960 among the seed's
 * shapes) are zero padding: quantize_a writes rel_j = 0 and asum8_j = 0 there, and every step of
 * both arithmetics then adds an exact zero (sc = fp16(d * 0), zp = fp16(sc * 0), the products
 * h * sc16 and l * sc, and the scalar tail's fp32(sa * 0) * d), provided d and sa are finite:
 * an fp32 or fp16 sum never becomes -0 from +0, so adding +-0 leaves acc and d16 unchanged.
 * gemm_rows sets a_prep.pad_from of a group's last superblock when all its rows qualify; a block
 * skips those sub-blocks when its columns' scales there are finite too (a packed B from elsewhere
 * may hold inf or NaN in its padding, and inf * 0 is NaN). Returns the sub-blocks to compute.
 */
X86_INLINE int pad_skippable(const a_prep *ar0, int64_t s, int64_t s_count, const uint8_t *sup, int col, int width)
{
    if (s != s_count - 1 || ar0->pad_from >= SUBBLOCKS)
        return SUBBLOCKS;
    const __m256i expo = _mm256_set1_epi16(0x7c00);
    for (int j = ar0->pad_from; j < SUBBLOCKS; j++)
        for (int c = 0; c < width; c += 16) {
            const __m256i d = _mm256_loadu_si256((const __m256i *)(sup + (size_t)j * B_BLOCK + 2 * (col + c)));
            __m256i e = _mm256_cmpeq_epi16(_mm256_and_si256(d, expo), expo); /* inf or NaN */
            if (width - c < 16) /* only the first width - c of these 16 columns are ours */
                e = _mm256_and_si256(e, _mm256_cmpgt_epi16(_mm256_set1_epi16((short)(width - c)),
                                                           _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                             12, 13, 14, 15)));
            if (!_mm256_testz_si256(e, e))
                return SUBBLOCKS;
        }
    return ar0->pad_from;
}

X86_INLINE __m256i load_2x128(const uint8_t *lo, const uint8_t *hi)
{
    const __m256i v = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    return _mm256_inserti128_si256(v, _mm_loadu_si128((const __m128i *)hi), 1);
}

X86_INLINE __m256i bcast32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Codes of 8 columns (code bytes of column 0 at p, 16 bytes per column) for one sub-block:
 * even[g] / odd[g] hold, per column c (dword c), the codes of K 8g+{0,2,4,6} / 8g+{1,3,5,7}. */
X86_INLINE void codes8(const uint8_t *p, __m256i even[4], __m256i odd[4])
{
    const __m256i r0 = load_2x128(p + 0 * 16, p + 4 * 16);
    const __m256i r1 = load_2x128(p + 1 * 16, p + 5 * 16);
    const __m256i r2 = load_2x128(p + 2 * 16, p + 6 * 16);
    const __m256i r3 = load_2x128(p + 3 * 16, p + 7 * 16);
    const __m256i t0 = _mm256_unpacklo_epi32(r0, r1); /* c0g0 c1g0 c0g1 c1g1 | c4.. c5.. */
    const __m256i t1 = _mm256_unpackhi_epi32(r0, r1); /* c0g2 c1g2 c0g3 c1g3 | ... */
    const __m256i t2 = _mm256_unpacklo_epi32(r2, r3);
    const __m256i t3 = _mm256_unpackhi_epi32(r2, r3);
    const __m256i g[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    const __m256i nib = _mm256_set1_epi8(0x0f);
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++) {
        even[i] = _mm256_and_si256(g[i], nib);
        odd[i] = _mm256_and_si256(_mm256_srli_epi16(g[i], 4), nib);
    }
}

/* dot_hi and dot_lo (int32, columns 0..7 in order) of R rows for one sub-block j. */
X86_INLINE void dots8(const __m256i even[4], const __m256i odd[4], const a_prep *const ar[ROW_GROUP], const int R,
                      int j, __m256i dhi[ROW_GROUP], __m256i dlo[ROW_GROUP])
{
    __m256i sh[ROW_GROUP], sl[ROW_GROUP]; /* 16-bit sums, |x| <= 3600 */
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        sh[r] = _mm256_setzero_si256();
        sl[r] = _mm256_setzero_si256();
    }
    _Pragma("GCC unroll 4")
    for (int g = 0; g < 4; g++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            const int8_t *h = ar[r]->hi[j] + 8 * g, *l = ar[r]->lo[j] + 8 * g;
            sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(even[g], bcast32(h)));
            sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(odd[g], bcast32(h + 4)));
            sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(even[g], bcast32(l)));
            sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(odd[g], bcast32(l + 4)));
        }
    const __m256i ones = _mm256_set1_epi16(1);
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        dhi[r] = _mm256_madd_epi16(sh[r], ones);
        dlo[r] = _mm256_madd_epi16(sl[r], ones);
    }
}

/*
 * NG groups of 8 columns (col8 = first column within tile t; group g = columns col8 + 8g ..
 * col8 + 8g + 7) x R rows (R = 4: a row group, the m4 rules; R = 1: a lone row, the m1 rules) over
 * all superblocks; writes the first `ncols` of the 8 * NG columns. full: the tile is a full
 * 32-column tile (.hp arithmetic), else the scalar tail's (NG = 1 there).
 *
 * Why NG groups at once: the d16 accumulation of a .hp step is a chain of dependent fp16
 * roundings (an add, then a rounding: two conversions or v16's three dependent operations; twice
 * per sub-block). One 8-column group of a lone row (R = 1) is a single such chain and leaves the
 * vector units idle most of that time; NG = 4 independent chains (the whole 32-column tile)
 * fill them. A 4-row group already has 4 chains (NG = 1).
 *
 * shortcut = 1 takes the cheap roundings block16f() takes, under the same guards (|dot_hi| <= 2048,
 * unless the row's hi_safe bit says so already; the v16() overflow bound below, which also keeps
 * m1's |sc| < 4096), kept as vector masks and tested once at the end: 1 = a lane broke a guard and nothing was stored (the caller reruns with shortcut = 0,
 * conversions only), 0 = stored.
 */
#define NG_MAX 4
/*
 * v16()'s overflow guard, per lane and superblock. Every value the shortcut rounds is bounded:
 * |fp16(h * sc16)| <= 2048 |sc16| (h = dot_hi, |dot_hi| <= 2048 by its own guard), |fp16(l * sc)|
 * <= 7200 |sc| (l = fp16(dot_lo), 0 <= dot_lo <= 32 * 15 * 15), each partial sum of d16 by the sum
 * of the terms so far, and each rounding grows a bound by at most a factor 1 + 2**-11 (16 steps:
 * < 1.009), so 2048 * sum_j |sc16_j| + 7200 * sum_j |sc_j| < D16_LIMIT keeps all of them below
 * 65520; |zp_j| <= |sc_j| * max_j |asum8_j| < ZP_LIMIT the same. A NaN or inf anywhere trips it.
 */
#define DOT_HI_MAX 2048.0f
#define DOT_LO_MAX 7200.0f
#define D16_LIMIT 64800.0f
#define ZP_LIMIT 64900.0f
X86_INLINE int block8(const uint8_t *b_packed, const a_prep *prep, int64_t s_count, int64_t t, int col8,
                      const int R, const int NG, int full, float *c, int64_t ldc, int ncols, const int shortcut)
{
    __m256i bad = _mm256_setzero_si256();
    const __m256i hi_limit = _mm256_set1_epi32(2048);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 acc[NG_MAX][ROW_GROUP];
    _Pragma("GCC unroll 4")
    for (int g = 0; g < NG; g++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++)
            acc[g][r] = _mm256_setzero_ps();
    const __m256 sixteen = _mm256_set1_ps(16.0f);
    for (int64_t s = 0; s < s_count; s++) {
        const a_prep *ar[ROW_GROUP];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++)
            ar[r] = prep + r * s_count + s;
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        __m256 d16[NG_MAX][ROW_GROUP]; /* fp16 values */
        __m256 sc_sum[NG_MAX], sc16_sum[NG_MAX]; /* sum_j |sc_j|, sum_j |sc16_j| (the overflow guard) */
        _Pragma("GCC unroll 4")
        for (int g = 0; g < NG; g++) {
            sc_sum[g] = _mm256_setzero_ps();
            sc16_sum[g] = _mm256_setzero_ps();
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++)
                d16[g][r] = _mm256_setzero_ps();
        }
        const int j_end = pad_skippable(ar[0], s, s_count, sup, col8, 8 * NG);
        /* the int dots of the whole superblock first (no dependencies between them), then the
         * fp steps (chains through j): the two kinds of work do not wait for each other */
        __m256i dots[SUBBLOCKS][NG_MAX][2][ROW_GROUP];
        for (int j = 0; j < j_end; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                __m256i even[4], odd[4];
                codes8(blk + B_SCALES + (QK / 2) * (col8 + 8 * g), even, odd);
                dots8(even, odd, ar, R, j, dots[j][g][0], dots[j][g][1]);
            }
        }
        for (int j = 0; j < j_end; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                const int cg = col8 + 8 * g;
                const __m256i *dhi = dots[j][g][0], *dlo = dots[j][g][1];
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * cg)));
                if (full) {
                    /* a row group shares rel_j: sc and sc16 are the same for its rows */
                    const __m256 sc = r16(_mm256_mul_ps(d, _mm256_set1_ps(ar[0]->rel[j])));
                    __m256 sc16;
                    if (R == ROW_GROUP) {
                        sc16 = r16(_mm256_mul_ps(d, _mm256_set1_ps(ar[0]->rel16[j]))); /* m4 */
                    } else if (shortcut) { /* m1: |sc| < 4096 follows from the bound below */
                        sc16 = _mm256_mul_ps(sc, sixteen);
                    } else {
                        sc16 = r16(_mm256_mul_ps(sc, sixteen));
                    }
                    if (shortcut) {
                        sc_sum[g] = _mm256_add_ps(sc_sum[g], _mm256_and_ps(sc, abs_mask));
                        if (R == ROW_GROUP)
                            sc16_sum[g] = _mm256_add_ps(sc16_sum[g], _mm256_and_ps(sc16, abs_mask));
                    }
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++) {
                        /* acc = fp32(acc + sa * zp_j), zp_j = fp16(sc * asum8_j); the product is exact */
                        const __m256 zp0 = _mm256_mul_ps(sc, _mm256_set1_ps(ar[r]->asum8[j]));
                        const __m256 zp = shortcut ? v16(zp0) : r16(zp0);
                        acc[g][r] = _mm256_add_ps(acc[g][r], _mm256_mul_ps(_mm256_set1_ps(ar[r]->sa), zp));
                        /* vmadotsu.hp: d16 = fp16(d16 + fp16(fp16(dot_hi) * sc16)) */
                        __m256 h = _mm256_cvtepi32_ps(dhi[r]);
                        if (shortcut) {
                            if (!(ar[r]->hi_safe >> j & 1u))
                                bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(_mm256_abs_epi32(dhi[r]), hi_limit));
                            d16[g][r] = v16(_mm256_add_ps(d16[g][r], v16(_mm256_mul_ps(h, sc16))));
                        } else {
                            h = r16(h);
                            d16[g][r] = r16(_mm256_add_ps(d16[g][r], r16(_mm256_mul_ps(h, sc16))));
                        }
                        /* vmadotu.hp: d16 = fp16(d16 + fp16(fp16(dot_lo) * sc)) */
                        if (shortcut) {
                            const __m256 l = v16(_mm256_cvtepi32_ps(dlo[r]));
                            d16[g][r] = v16(_mm256_add_ps(d16[g][r], v16(_mm256_mul_ps(l, sc))));
                        } else {
                            const __m256 l = r16(_mm256_cvtepi32_ps(dlo[r]));
                            d16[g][r] = r16(_mm256_add_ps(d16[g][r], r16(_mm256_mul_ps(l, sc))));
                        }
                    }
                } else {
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++) {
                        /* acc = fp32(acc + fp32(fp32(fp32(sa * rel_j) * d) * fp32(dot + asum8_j))),
                         * dot = 16 * dot_hi + dot_lo (exact) */
                        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dhi[r], 4), dlo[r]);
                        const float sa_rel = ar[r]->sa * ar[r]->rel[j];
                        const __m256 coef = _mm256_mul_ps(_mm256_set1_ps(sa_rel), d);
                        const __m256 tt = _mm256_add_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ar[r]->asum8[j]));
                        acc[g][r] = _mm256_add_ps(acc[g][r], _mm256_mul_ps(coef, tt));
                    }
                }
            }
        }
        if (full) {
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                if (shortcut) {
                    /* v16's overflow guard: every .hp value of this superblock stays below 65520 */
                    const __m256 s16 = R == ROW_GROUP ? sc16_sum[g] : _mm256_mul_ps(sc_sum[g], sixteen);
                    const __m256 bound = _mm256_add_ps(_mm256_mul_ps(s16, _mm256_set1_ps(DOT_HI_MAX)),
                                                       _mm256_mul_ps(sc_sum[g], _mm256_set1_ps(DOT_LO_MAX)));
                    bad = _mm256_or_si256(bad, _mm256_castps_si256(_mm256_cmp_ps(bound, _mm256_set1_ps(D16_LIMIT),
                                                                                 _CMP_NLT_UQ)));
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++)
                        bad = _mm256_or_si256(bad, _mm256_castps_si256(_mm256_cmp_ps(
                                                       _mm256_mul_ps(sc_sum[g], _mm256_set1_ps(ar[r]->asum_max)),
                                                       _mm256_set1_ps(ZP_LIMIT), _CMP_NLT_UQ)));
                }
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++)
                    acc[g][r] = _mm256_add_ps(acc[g][r], _mm256_mul_ps(_mm256_set1_ps(ar[r]->sa), d16[g][r]));
            }
        }
    }
    if (!_mm256_testz_si256(bad, bad))
        return 1;
    _Pragma("GCC unroll 4")
    for (int g = 0; g < NG; g++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            const int w = ncols - 8 * g;
            if (w >= 8) {
                _mm256_storeu_ps(c + r * ldc + 8 * g, acc[g][r]);
            } else if (w > 0) {
                float tmp[8];
                _mm256_storeu_ps(tmp, acc[g][r]);
                memcpy(c + r * ldc + 8 * g, tmp, sizeof(float) * (size_t)w);
            }
        }
    return 0;
}

X86_TARGET static void block8_m4(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col8, int full,
                                 float *c, int64_t ldc, int ncols)
{
    if (block8(b, prep, s_count, t, col8, ROW_GROUP, 1, full, c, ldc, ncols, full))
        block8(b, prep, s_count, t, col8, ROW_GROUP, 1, full, c, ldc, ncols, 0);
}

X86_TARGET static void block8_m1(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col8, int full,
                                 float *c, int64_t ldc, int ncols)
{
    if (block8(b, prep, s_count, t, col8, 1, 1, full, c, ldc, ncols, full))
        block8(b, prep, s_count, t, col8, 1, 1, full, c, ldc, ncols, 0);
}

/* A lone row on a whole full tile: four 8-column groups at once (see block8). */
X86_TARGET static void block8_m1_tile(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, float *c)
{
    if (block8(b, prep, s_count, t, 0, 1, NG_MAX, 1, c, 0, TILE_N, 1))
        block8(b, prep, s_count, t, 0, 1, NG_MAX, 1, c, 0, TILE_N, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* AVX-512 variant: VNNI int dots over 16 columns, native fp16 arithmetic (AVX512-FP16)
 *
 * Same arithmetic as block8(), 16 columns per vector: VPDPBUSD accumulates (u8 code x s8 a) sums
 * of 4 straight into int32, and the .hp steps run on fp16 lanes (VMULPH / VADDPH round once to
 * fp16, to nearest even with the MXCSR set by the caller of gemm_rows, subnormals and overflow
 * to inf as IEEE says; VCVTDQ2PH rounds the int32 dot once to fp16). fp32 steps are VMULPS /
 * VADDPS on 16 lanes, as block8's. The 4x4 dword transpose of 16 columns loaded as 4 zmm of 4
 * consecutive columns leaves vector lane L = 4i + q holding column i + 4q; the fp16 scales are
 * permuted into that order and the result permuted back on the store (the map is its own
 * inverse). Used when the CPU has AVX512F/BW/VL, AVX512-VNNI and AVX512-FP16 and the OS saves
 * ZMM state, unless NPU_IME2_X86_ISA=avx2 (a test and benchmark knob) asks for block8.
 */
#define X512_TARGET __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512fp16")))
#define X512_INLINE \
    static inline __attribute__((always_inline, target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512fp16")))
/* The same without AVX512-FP16: the VNNI + F16C variant, and the helpers both variants share. */
#define X5V_TARGET __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define X5V_INLINE static inline __attribute__((always_inline, target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* XCR0 bits 5..7: the OS saves opmask and ZMM state. */
static int os_saves_zmm(void)
{
    if (!os_saves_ymm())
        return 0;
    unsigned int xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    (void)xcr0_hi;
    return (xcr0_lo & 0xe0u) == 0xe0u;
}

static int vnni_check(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && os_saves_zmm();
}

static int fp16_check(void)
{
    __builtin_cpu_init();
    return vnni_check() && __builtin_cpu_supports("avx512fp16");
}

/* The variant of the X86 path: VARIANT_FP16 (AVX-512 VNNI dots, AVX512-FP16 arithmetic: block16),
 * VARIANT_VNNI (AVX-512 VNNI dots, fp16 rounding by F16C-style conversions on 16 fp32 lanes:
 * block16f; e.g. AMD Zen 4, which has AVX-512 VNNI and no AVX512-FP16) or VARIANT_AVX2 (block8).
 * NPU_IME2_X86_ISA caps it (a test and benchmark knob): "avx2" -> VARIANT_AVX2, "avx512-vnni" ->
 * at most VARIANT_VNNI. The environment is read on every call (so that a test can switch). */
enum { VARIANT_AVX2 = 0, VARIANT_FP16 = 1, VARIANT_VNNI = 2 };

static int x86_variant(void)
{
    static int vnni_cache, fp16_cache;
    const char *isa = getenv("NPU_IME2_X86_ISA");
    if (isa && strcmp(isa, "avx2") == 0)
        return VARIANT_AVX2;
    if (!(isa && strcmp(isa, "avx512-vnni") == 0) && cached_check(&fp16_cache, fp16_check))
        return VARIANT_FP16;
    return cached_check(&vnni_cache, vnni_check) ? VARIANT_VNNI : VARIANT_AVX2;
}

const char *npu_ime2_x86_variant_name(void)
{
    if (!npu_ime2_x86_usable())
        return "none";
    static const char *const names[] = {"avx2-f16c", "avx512-vnni-fp16", "avx512-vnni-f16c"};
    return names[x86_variant()];
}

/* Lane L <-> column (L / 4) + 4 * (L % 4), both ways. */
X5V_INLINE __m512i lane_map32(void)
{
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

X5V_INLINE __m256i lane_map16(void)
{
    return _mm256_setr_epi16(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

/* Codes of 16 columns (p: code bytes of the first column) of one sub-block, lanes in the
 * transposed column order: even[g] / odd[g] = codes of K 8g+{0,2,4,6} / 8g+{1,3,5,7}. */
X5V_INLINE void codes16(const uint8_t *p, __m512i even[4], __m512i odd[4])
{
    const __m512i z0 = _mm512_loadu_si512(p), z1 = _mm512_loadu_si512(p + 64);
    const __m512i z2 = _mm512_loadu_si512(p + 128), z3 = _mm512_loadu_si512(p + 192);
    const __m512i t0 = _mm512_unpacklo_epi32(z0, z1), t1 = _mm512_unpackhi_epi32(z0, z1);
    const __m512i t2 = _mm512_unpacklo_epi32(z2, z3), t3 = _mm512_unpackhi_epi32(z2, z3);
    const __m512i g[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                          _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const __m512i nib = _mm512_set1_epi8(0x0f);
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++) {
        even[i] = _mm512_and_si512(g[i], nib);
        odd[i] = _mm512_and_si512(_mm512_srli_epi16(g[i], 4), nib);
    }
}

X5V_INLINE __m512i bcast32_512(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

X5V_INLINE void dots16(const __m512i even[4], const __m512i odd[4], const a_prep *const ar[ROW_GROUP], const int R,
                        int j, __m512i dhi[ROW_GROUP], __m512i dlo[ROW_GROUP])
{
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        dhi[r] = _mm512_setzero_si512();
        dlo[r] = _mm512_setzero_si512();
    }
    _Pragma("GCC unroll 4")
    for (int g = 0; g < 4; g++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            const int8_t *h = ar[r]->hi[j] + 8 * g, *l = ar[r]->lo[j] + 8 * g;
            dhi[r] = _mm512_dpbusd_epi32(dhi[r], even[g], bcast32_512(h));
            dhi[r] = _mm512_dpbusd_epi32(dhi[r], odd[g], bcast32_512(h + 4));
            dlo[r] = _mm512_dpbusd_epi32(dlo[r], even[g], bcast32_512(l));
            dlo[r] = _mm512_dpbusd_epi32(dlo[r], odd[g], bcast32_512(l + 4));
        }
}

/* The scalar tail's fp32 step of sub-block j for R rows on 16 columns (d: their fp32 scales):
 * acc = fp32(acc + fp32(fp32(fp32(sa * rel_j) * d) * fp32(dot + asum8_j))), dot = 16 * dot_hi +
 * dot_lo (exact). Shared by block16() and block16f(). */
X5V_INLINE void tail16(__m512 acc[ROW_GROUP], const a_prep *const ar[ROW_GROUP], const int R, int j, __m512 d,
                       const __m512i dhi[ROW_GROUP], const __m512i dlo[ROW_GROUP])
{
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dhi[r], 4), dlo[r]);
        const float sa_rel = ar[r]->sa * ar[r]->rel[j];
        const __m512 coef = _mm512_mul_ps(_mm512_set1_ps(sa_rel), d);
        const __m512 tt = _mm512_add_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(ar[r]->asum8[j]));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(coef, tt));
    }
}

/* Stores the first ncols of R rows of 16-column accumulators (lanes in the transposed order of
 * codes16, permuted back to column order). Shared by block16() and block16f(). */
X5V_INLINE void store16(const __m512 acc[ROW_GROUP], const int R, float *c, int64_t ldc, int ncols)
{
    const __m512i map32 = lane_map32();
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(c + r * ldc, keep, _mm512_permutexvar_ps(map32, acc[r]));
}

X512_INLINE __m256h ph1(uint16_t bits) { return _mm256_castsi256_ph(_mm256_set1_epi16((short)bits)); }

/* block8() for 16 columns (col16 = 0 or 16 within tile t); writes the first ncols of them. */
X512_INLINE void block16(const uint8_t *b_packed, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                         const int R, int full, float *c, int64_t ldc, int ncols)
{
    __m512 acc[ROW_GROUP];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    const __m256i map16 = lane_map16();
    for (int64_t s = 0; s < s_count; s++) {
        const a_prep *ar[ROW_GROUP];
        for (int r = 0; r < R; r++)
            ar[r] = prep + r * s_count + s;
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        __m256h d16[ROW_GROUP];
        for (int r = 0; r < R; r++)
            d16[r] = _mm256_setzero_ph();
        for (int j = 0; j < SUBBLOCKS; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            __m512i even[4], odd[4], dhi[ROW_GROUP], dlo[ROW_GROUP];
            codes16(blk + B_SCALES + (QK / 2) * col16, even, odd);
            dots16(even, odd, ar, R, j, dhi, dlo);
            const __m256i d_bits =
                _mm256_permutexvar_epi16(map16, _mm256_loadu_si256((const __m256i *)(blk + 2 * col16)));
            if (full) {
                const __m256h d = _mm256_castsi256_ph(d_bits);
                const __m256h sc = _mm256_mul_ph(d, ph1(ar[0]->rel_h[j]));                   /* fp16(d * rel_j) */
                const __m256h sc16 = R == ROW_GROUP ? _mm256_mul_ph(d, ph1(ar[0]->rel16_h[j])) /* m4 */
                                                    : _mm256_mul_ph(sc, ph1(0x4c00u));          /* m1: sc * 16 */
                for (int r = 0; r < R; r++) {
                    const __m256h zp = _mm256_mul_ph(sc, ph1(ar[r]->asum8_h[j]));
                    const __m512 zp32 = _mm512_cvtph_ps(_mm256_castph_si256(zp));
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(ar[r]->sa), zp32));
                    d16[r] = _mm256_add_ph(d16[r], _mm256_mul_ph(_mm512_cvtepi32_ph(dhi[r]), sc16));
                    d16[r] = _mm256_add_ph(d16[r], _mm256_mul_ph(_mm512_cvtepi32_ph(dlo[r]), sc));
                }
            } else {
                tail16(acc, ar, R, j, _mm512_cvtph_ps(d_bits), dhi, dlo);
            }
        }
        if (full)
            for (int r = 0; r < R; r++) {
                const __m512 d16_32 = _mm512_cvtph_ps(_mm256_castph_si256(d16[r]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(ar[r]->sa), d16_32));
            }
    }
    store16(acc, R, c, ldc, ncols);
}

X512_TARGET static void block16_m4(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                                   int full, float *c, int64_t ldc, int ncols)
{
    block16(b, prep, s_count, t, col16, ROW_GROUP, full, c, ldc, ncols);
}

X512_TARGET static void block16_m1(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                                   int full, float *c, int64_t ldc, int ncols)
{
    block16(b, prep, s_count, t, col16, 1, full, c, ldc, ncols);
}

/* fp32 -> nearest fp16 (RNE, subnormals, overflow to inf) -> fp32 on 16 lanes, as r16(). */
X5V_INLINE __m512 r16z(__m512 x)
{
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* v16() on 16 lanes (same conditions). */
X5V_INLINE __m512 v16z(__m512 x)
{
    const __m512 c = _mm512_mul_ps(x, _mm512_set1_ps(8193.0f));
    return _mm512_sub_ps(c, _mm512_sub_ps(c, x));
}

/* block16() without AVX512-FP16: the VNNI int dots of block16 (same lane order), and block8()'s
 * fp32-emulated fp16 steps on 16 lanes, NG groups of 16 columns at once (NG = 2 for a lone row's
 * full tile, see block8). Bit-identical to both.
 *
 * shortcut = 1 takes the cheap roundings wherever a guard makes them exact, and reports through
 * the return value whether every guard held for every lane (0: the result is exact and stored) or
 * not (1: nothing was stored; the caller runs shortcut = 0, conversions only):
 *   - h = r16z(dot_hi) is dot_hi itself when |dot_hi| <= 2048 (an integer of at most 11 bits):
 *     a lane check, skipped for a row's sub-block whose hi_safe bit is set;
 *   - m1: sc16 = r16z(sc * 16) is sc * 16 itself (a power-of-two scaling of an fp16 value) unless
 *     |sc| >= 4096 (or sc is NaN), which the overflow bound below already excludes;
 *   - zp, both products and both sums of the .hp steps are v16z() roundings, under block8's
 *     overflow bound (D16_LIMIT, ZP_LIMIT) checked once per superblock.
 * The guards are lane masks (compares into k registers), much cheaper than the two conversions
 * each rounding costs. Typical activations and weights never trip them; an adversarial block costs
 * a rerun. */
X5V_INLINE int block16f(const uint8_t *b_packed, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                        const int R, const int NG, int full, float *c, int64_t ldc, int ncols, const int shortcut)
{
    __m512 acc[NG_MAX][ROW_GROUP];
    _Pragma("GCC unroll 4")
    for (int g = 0; g < NG; g++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++)
            acc[g][r] = _mm512_setzero_ps();
    const __m256i map16 = lane_map16();
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    const __m512i hi_bias = _mm512_set1_epi32(2048), hi_span = _mm512_set1_epi32(4096);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __mmask16 bad = 0;
    for (int64_t s = 0; s < s_count; s++) {
        const a_prep *ar[ROW_GROUP];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++)
            ar[r] = prep + r * s_count + s;
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        __m512 d16[NG_MAX][ROW_GROUP]; /* fp16 values */
        __m512 sc_sum[NG_MAX], sc16_sum[NG_MAX]; /* v16z's overflow guard, as block8's */
        _Pragma("GCC unroll 4")
        for (int g = 0; g < NG; g++) {
            sc_sum[g] = _mm512_setzero_ps();
            sc16_sum[g] = _mm512_setzero_ps();
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++)
                d16[g][r] = _mm512_setzero_ps();
        }
        const int j_end = pad_skippable(ar[0], s, s_count, sup, col16, 16 * NG);
        /* the int dots of the superblock first, then the fp steps (see block8) */
        __m512i dots[SUBBLOCKS][NG_MAX][2][ROW_GROUP];
        for (int j = 0; j < j_end; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                __m512i even[4], odd[4];
                codes16(blk + B_SCALES + (QK / 2) * (col16 + 16 * g), even, odd);
                dots16(even, odd, ar, R, j, dots[j][g][0], dots[j][g][1]);
            }
        }
        for (int j = 0; j < j_end; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                const int cg = col16 + 16 * g;
                const __m512i *dhi = dots[j][g][0], *dlo = dots[j][g][1];
                const __m512 d = _mm512_cvtph_ps(
                    _mm256_permutexvar_epi16(map16, _mm256_loadu_si256((const __m256i *)(blk + 2 * cg))));
                if (full) {
                    const __m512 sc = r16z(_mm512_mul_ps(d, _mm512_set1_ps(ar[0]->rel[j])));
                    const __m512 sc_abs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(sc), abs_mask));
                    __m512 sc16;
                    if (R == ROW_GROUP) {
                        sc16 = r16z(_mm512_mul_ps(d, _mm512_set1_ps(ar[0]->rel16[j]))); /* m4 */
                        if (shortcut)
                            sc16_sum[g] = _mm512_add_ps(sc16_sum[g], _mm512_castsi512_ps(_mm512_and_si512(
                                                                         _mm512_castps_si512(sc16), abs_mask)));
                    } else if (shortcut) { /* m1: |sc| < 4096 follows from the bound below */
                        sc16 = _mm512_mul_ps(sc, sixteen);
                    } else {
                        sc16 = r16z(_mm512_mul_ps(sc, sixteen));
                    }
                    if (shortcut)
                        sc_sum[g] = _mm512_add_ps(sc_sum[g], sc_abs);
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++) {
                        const __m512 zp0 = _mm512_mul_ps(sc, _mm512_set1_ps(ar[r]->asum8[j]));
                        const __m512 zp = shortcut ? v16z(zp0) : r16z(zp0);
                        acc[g][r] = _mm512_add_ps(acc[g][r], _mm512_mul_ps(_mm512_set1_ps(ar[r]->sa), zp));
                        const __m512 h = _mm512_cvtepi32_ps(dhi[r]);
                        const __m512 l = _mm512_cvtepi32_ps(dlo[r]);
                        if (shortcut) {
                            if (!(ar[r]->hi_safe >> j & 1u))
                                bad |= _mm512_cmpgt_epu32_mask(_mm512_add_epi32(dhi[r], hi_bias), hi_span);
                            d16[g][r] = v16z(_mm512_add_ps(d16[g][r], v16z(_mm512_mul_ps(h, sc16))));
                            d16[g][r] = v16z(_mm512_add_ps(d16[g][r], v16z(_mm512_mul_ps(v16z(l), sc))));
                        } else {
                            d16[g][r] = r16z(_mm512_add_ps(d16[g][r], r16z(_mm512_mul_ps(r16z(h), sc16))));
                            d16[g][r] = r16z(_mm512_add_ps(d16[g][r], r16z(_mm512_mul_ps(r16z(l), sc))));
                        }
                    }
                } else {
                    tail16(acc[g], ar, R, j, d, dhi, dlo);
                }
            }
        }
        if (full) {
            _Pragma("GCC unroll 4")
            for (int g = 0; g < NG; g++) {
                if (shortcut) {
                    const __m512 s16 = R == ROW_GROUP ? sc16_sum[g] : _mm512_mul_ps(sc_sum[g], sixteen);
                    const __m512 bound = _mm512_add_ps(_mm512_mul_ps(s16, _mm512_set1_ps(DOT_HI_MAX)),
                                                       _mm512_mul_ps(sc_sum[g], _mm512_set1_ps(DOT_LO_MAX)));
                    bad |= _mm512_cmp_ps_mask(bound, _mm512_set1_ps(D16_LIMIT), _CMP_NLT_UQ);
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++)
                        bad |= _mm512_cmp_ps_mask(_mm512_mul_ps(sc_sum[g], _mm512_set1_ps(ar[r]->asum_max)),
                                                  _mm512_set1_ps(ZP_LIMIT), _CMP_NLT_UQ);
                }
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++)
                    acc[g][r] = _mm512_add_ps(acc[g][r], _mm512_mul_ps(_mm512_set1_ps(ar[r]->sa), d16[g][r]));
            }
        }
    }
    if (bad)
        return 1;
    _Pragma("GCC unroll 4")
    for (int g = 0; g < NG; g++) {
        const int w = ncols - 16 * g;
        if (w > 0)
            store16(acc[g], R, c + 16 * g, ldc, w > 16 ? 16 : w);
    }
    return 0;
}

X5V_TARGET static void block16f_m4(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                                   int full, float *c, int64_t ldc, int ncols)
{
    if (block16f(b, prep, s_count, t, col16, ROW_GROUP, 1, full, c, ldc, ncols, full))
        block16f(b, prep, s_count, t, col16, ROW_GROUP, 1, full, c, ldc, ncols, 0);
}

X5V_TARGET static void block16f_m1(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, int col16,
                                   int full, float *c, int64_t ldc, int ncols)
{
    if (block16f(b, prep, s_count, t, col16, 1, 1, full, c, ldc, ncols, full))
        block16f(b, prep, s_count, t, col16, 1, 1, full, c, ldc, ncols, 0);
}

/* A lone row on a whole full tile: both 16-column groups at once (see block8). */
X5V_TARGET static void block16f_m1_tile(const uint8_t *b, const a_prep *prep, int64_t s_count, int64_t t, float *c)
{
    if (block16f(b, prep, s_count, t, 0, 1, 2, 1, c, 0, TILE_N, 1))
        block16f(b, prep, s_count, t, 0, 1, 2, 1, c, 0, TILE_N, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* The path */

#define MXCSR_DAZ 0x0040u
#define MXCSR_RC 0x6000u
#define MXCSR_FTZ 0x8000u
#define MXCSR_FLAGS 0x003fu /* sticky exception flags */
#define MXCSR_MASKS 0x1f80u /* exception masks */

/* variant: VARIANT_FP16 (block16), VARIANT_VNNI (block16f) or VARIANT_AVX2 (block8). */
X86_TARGET static void gemm_rows(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                 float *c, a_prep *prep, int variant)
{
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    const int64_t t_count = ceil_div(n, TILE_N);
    const int64_t n_full = (n / TILE_N) * TILE_N;
    const int64_t grouped_rows = (m / ROW_GROUP) * ROW_GROUP;
    for (int64_t row0 = 0; row0 < m;) {
        const int rows = row0 < grouped_rows ? ROW_GROUP : 1;
        for (int r = 0; r < rows; r++)
            for (int64_t s = 0; s < s_count; s++)
                prep_row(a_packed, m, row0 + r, s, s_count, prep + r * s_count + s);
        const int j_real = (int)((k - (s_count - 1) * SUPERBLOCK_K) / QK); /* sub-blocks of the last superblock within K */
        int pad_ok = j_real < SUBBLOCKS;
        for (int r = 0; r < rows && pad_ok; r++) {
            const a_prep *last = prep + r * s_count + s_count - 1;
            pad_ok = last->sa - last->sa == 0.0f; /* finite */
            for (int j = j_real; j < SUBBLOCKS && pad_ok; j++)
                pad_ok = (last->rel_h[j] & 0x7fffu) == 0 && (last->asum8_h[j] & 0x7fffu) == 0;
        }
        if (pad_ok && variant != VARIANT_FP16)
            for (int r = 0; r < rows; r++)
                prep[r * s_count + s_count - 1].pad_from = j_real;
        for (int64_t t = 0; t < t_count; t++) {
            const int64_t col0 = t * TILE_N;
            const int full = col0 + TILE_N <= n_full;
            const int ncols = full ? TILE_N : (int)(n - col0);
            const int wide = variant != VARIANT_AVX2;
            const int step = wide ? 16 : 8;
            if (variant == VARIANT_AVX2 && rows == 1 && full) {
                block8_m1_tile(b_packed, prep, s_count, t, c + row0 * n + col0);
                continue;
            }
            if (variant == VARIANT_VNNI && rows == 1 && full) {
                block16f_m1_tile(b_packed, prep, s_count, t, c + row0 * n + col0);
                continue;
            }
            for (int cb = 0; cb < ncols; cb += step) {
                const int w = ncols - cb < step ? ncols - cb : step;
                float *cp = c + row0 * n + col0 + cb;
                if (variant == VARIANT_FP16 && rows == ROW_GROUP)
                    block16_m4(b_packed, prep, s_count, t, cb, full, cp, n, w);
                else if (variant == VARIANT_FP16)
                    block16_m1(b_packed, prep, s_count, t, cb, full, cp, n, w);
                else if (wide && rows == ROW_GROUP)
                    block16f_m4(b_packed, prep, s_count, t, cb, full, cp, n, w);
                else if (wide)
                    block16f_m1(b_packed, prep, s_count, t, cb, full, cp, n, w);
                else if (rows == ROW_GROUP)
                    block8_m4(b_packed, prep, s_count, t, cb, full, cp, n, w);
                else
                    block8_m1(b_packed, prep, s_count, t, cb, full, cp, n, w);
            }
        }
        row0 += rows;
    }
}

npu_ime2_status npu_ime2_gemm_x86(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                  float *c)
{
    if (!npu_ime2_x86_usable())
        return NPU_IME2_ERR_BAD_PATH;
    size_t bytes;
    if (!mul3_size(ROW_GROUP, ceil_div(k, SUPERBLOCK_K), (int64_t)sizeof(a_prep), &bytes))
        return NPU_IME2_ERR_NO_MEMORY;
    a_prep *prep = malloc(bytes);
    if (!prep)
        return NPU_IME2_ERR_NO_MEMORY;
    const unsigned int csr = _mm_getcsr();
    /* no flushing, round to nearest even, all exceptions masked (inf * 0 and overflow are results
     * here, never traps) */
    _mm_setcsr((csr & ~(MXCSR_DAZ | MXCSR_FTZ | MXCSR_RC)) | MXCSR_MASKS);
    gemm_rows(a_packed, b_packed, m, k, n, c, prep, x86_variant());
    _mm_setcsr(csr | (_mm_getcsr() & MXCSR_FLAGS));
    free(prep);
    return NPU_IME2_OK;
}
