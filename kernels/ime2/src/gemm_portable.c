/*
 * gemm_portable.c - the portable-C GEMM path on packed operands.
 *
 * The arithmetic of npusim.q4x32.ime2_hp_gemm(level="hardware") with the default options
 * (rounding="unfused", dot="fp16", overflow="inf", order="hi_lo"), per row m, column n and
 * superblock s (sa = fp16 scale_avg, d = the tile's fp16 column scale):
 *
 *   full 32-column tiles (the vmadot*.hp instruction path):
 *     d16 = 0 (fp16)
 *     for j in 0..7:
 *       sc   = fp16(d * rel_j)
 *       sc16 = fp16(sc * 16)                 (row quantized alone: the m1 kernel)
 *            | fp16(d * fp16(rel_j * 16))    (row of a 4-row group: the m4 kernel)
 *       zp_j = fp16(sc * asum8_j)
 *       d16  = fp16(d16 + fp16(fp16(dot_hi) * sc16))   vmadotsu.hp, a_hi = a >> 4 (signed)
 *       d16  = fp16(d16 + fp16(fp16(dot_lo) * sc))     vmadotu.hp,  a_lo = a & 15
 *     for j: acc = fp32(acc + sa * zp_j)               vfwmacc (exact product)
 *     acc = fp32(acc + sa * d16)
 *
 *   columns past 32 * (N / 32) (the scalar tail), for each sub-block j in order:
 *     acc = fp32(acc + fp32(fp32(fp32(sa * rel_j) * d) * fp32(dot + asum8_j)))
 *
 * All fp16 roundings are explicit (fp16.h); fp32 operations are plain C float operations, which
 * requires FLT_EVAL_METHOD == 0 and no contraction (-ffp-contract=off).
 */
#include <float.h>

#include "fp16.h"
#include "internal.h"

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "the portable kernel needs FLT_EVAL_METHOD == 0 (float arithmetic rounded to float)"
#endif

static inline f16_t get_f16(const uint8_t *p) { return (f16_t)(p[0] | (p[1] << 8)); }

/* One row's view of one superblock of quantized A. */
typedef struct {
    int8_t q[SUPERBLOCK_K];
    int8_t hi[SUPERBLOCK_K]; /* q >> 4, signed -8..7 */
    int8_t lo[SUPERBLOCK_K]; /* q & 15 */
    f16_t rel[SUBBLOCKS];
    f16_t rel16[SUBBLOCKS]; /* fp16(rel * 16) */
    f16_t asum8[SUBBLOCKS];
    double rel_d[SUBBLOCKS];   /* the same values as doubles (exact) */
    double rel16_d[SUBBLOCKS];
    double asum8_d[SUBBLOCKS];
    float rel_f[SUBBLOCKS];
    float asum8_f[SUBBLOCKS];
    float sa;
} a_super;

static void load_a(const uint8_t *a_packed, int64_t m, int64_t row, int64_t s, int64_t s_count, a_super *out)
{
    a_row_ptrs ptrs;
    a_row_locate(a_packed, m, row, s, s_count, &ptrs);
    const uint8_t *const *rel_p = ptrs.rel, *const *q_p = ptrs.q, *asum_p = ptrs.asum, *sa_p = ptrs.sa;
    for (int j = 0; j < SUBBLOCKS; j++) {
        out->rel[j] = get_f16(rel_p[j]);
        out->rel16[j] = f16_mul(out->rel[j], 0x4c00u /* 16.0 */);
        out->rel_f[j] = f16_to_float(out->rel[j]);
        out->asum8[j] = get_f16(asum_p + 2 * j);
        out->asum8_f[j] = f16_to_float(out->asum8[j]);
        out->rel_d[j] = out->rel_f[j];
        out->rel16_d[j] = f16_to_double(out->rel16[j]);
        out->asum8_d[j] = out->asum8_f[j];
        for (int i = 0; i < QK; i++) {
            const int8_t v = (int8_t)q_p[j][i];
            out->q[j * QK + i] = v;
            out->hi[j * QK + i] = (int8_t)(v >> 4); /* arithmetic shift (checked by the tests) */
            out->lo[j * QK + i] = (int8_t)(v & 15);
        }
    }
    out->sa = f16_to_float(get_f16(sa_p));
}

static inline void unpack_codes(const uint8_t *bytes, uint8_t codes[QK])
{
    for (int i = 0; i < QK / 2; i++) {
        codes[2 * i] = bytes[i] & 0x0fu;
        codes[2 * i + 1] = bytes[i] >> 4;
    }
}

/* Rows row0 .. row0 + rows - 1 (a 4-row group sharing its scales, or one row) x tile t. */
static void tile_rows(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                      int64_t row0, int rows, int grouped, int64_t t, float *c)
{
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    const int64_t n_full = (n / TILE_N) * TILE_N;
    const int64_t col0 = t * TILE_N;
    const int full = col0 + TILE_N <= n_full;
    const int ncols = full ? TILE_N : (int)(n - col0);
    a_super as[ROW_GROUP];
    uint8_t codes[QK];
    float acc[ROW_GROUP][TILE_N];
    for (int r = 0; r < rows; r++)
        for (int cc = 0; cc < TILE_N; cc++)
            acc[r][cc] = 0.0f;

    for (int64_t s = 0; s < s_count; s++) {
        for (int r = 0; r < rows; r++)
            load_a(a_packed, m, row0 + r, s, s_count, &as[r]);
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        for (int cc = 0; cc < ncols; cc++) {
            if (full) {
                /* fp16 values are carried as doubles holding fp16 values; f16_round() is the
                 * one RNE rounding to fp16 after each operation (products and sums of two fp16
                 * values, and the int32 dots, are exact in double) */
                double d16[ROW_GROUP] = {0.0, 0.0, 0.0, 0.0};
                float zp_f[ROW_GROUP][SUBBLOCKS];
                for (int j = 0; j < SUBBLOCKS; j++) {
                    const uint8_t *blk = sup + (size_t)j * B_BLOCK;
                    const double d = f16_to_double(get_f16(blk + 2 * cc));
                    unpack_codes(blk + B_SCALES + (QK / 2) * cc, codes);
                    /* a 4-row group shares rel_j, so sc and sc16 are the same for its rows */
                    const double sc = f16_round(d * as[0].rel_d[j]);                   /* m1 and m4 */
                    const double sc16 = grouped ? f16_round(d * as[0].rel16_d[j])      /* m4 */
                                                : f16_round(sc * 16.0);                /* m1 */
                    for (int r = 0; r < rows; r++) {
                        const a_super *ar = &as[r];
                        zp_f[r][j] = (float)f16_round(sc * ar->asum8_d[j]);
                        int32_t dot_hi = 0, dot_lo = 0;
                        const int8_t *hi = ar->hi + j * QK, *lo = ar->lo + j * QK;
                        for (int i = 0; i < QK; i++) {
                            dot_hi += hi[i] * codes[i];
                            dot_lo += lo[i] * codes[i];
                        }
                        /* vmadotsu.hp (high nibbles, sc16) then vmadotu.hp (low nibbles, sc) */
                        const double acc16 = f16_round(d16[r] + f16_round(f16_round((double)dot_hi) * sc16));
                        d16[r] = f16_round(acc16 + f16_round(f16_round((double)dot_lo) * sc));
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const float sa = as[r].sa;
                    float a = acc[r][cc];
                    for (int j = 0; j < SUBBLOCKS; j++) {
                        const float p = sa * zp_f[r][j];
                        a = a + p;
                    }
                    const float p = sa * (float)d16[r];
                    acc[r][cc] = a + p;
                }
            } else {
                for (int j = 0; j < SUBBLOCKS; j++) {
                    const uint8_t *blk = sup + (size_t)j * B_BLOCK;
                    const float d = f16_to_float(get_f16(blk + 2 * cc));
                    unpack_codes(blk + B_SCALES + (QK / 2) * cc, codes);
                    for (int r = 0; r < rows; r++) {
                        const a_super *ar = &as[r];
                        int32_t dot = 0;
                        const int8_t *q = ar->q + j * QK;
                        for (int i = 0; i < QK; i++)
                            dot += q[i] * codes[i];
                        const float sa_as = ar->sa * ar->rel_f[j];
                        const float coef = sa_as * d;
                        const float tt = (float)dot + ar->asum8_f[j];
                        const float prod = coef * tt;
                        acc[r][cc] = acc[r][cc] + prod;
                    }
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int cc = 0; cc < ncols; cc++)
            c[(row0 + r) * n + col0 + cc] = acc[r][cc];
}

void npu_ime2_gemm_portable(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                            float *c)
{
    const int64_t t_count = ceil_div(n, TILE_N);
    const int64_t grouped_rows = (m / ROW_GROUP) * ROW_GROUP;
    for (int64_t row0 = 0; row0 < m;) {
        const int grouped = row0 < grouped_rows;
        const int rows = grouped ? ROW_GROUP : 1;
        for (int64_t t = 0; t < t_count; t++)
            tile_rows(a_packed, b_packed, m, k, n, row0, rows, grouped, t, c);
        row0 += rows;
    }
}

/* Only the partial last tile (columns 32 * (N / 32) .. N - 1, the scalar tail), all rows; for
 * the paths that compute the full tiles themselves. Nothing when N % 32 == 0. */
void npu_ime2_gemm_portable_tail(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                 float *c)
{
    if (n % TILE_N == 0)
        return;
    const int64_t grouped_rows = (m / ROW_GROUP) * ROW_GROUP;
    for (int64_t row0 = 0; row0 < m;) {
        const int grouped = row0 < grouped_rows;
        const int rows = grouped ? ROW_GROUP : 1;
        tile_rows(a_packed, b_packed, m, k, n, row0, rows, grouped, n / TILE_N, c);
        row0 += rows;
    }
}
