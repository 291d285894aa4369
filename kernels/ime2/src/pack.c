/*
 * pack.c - weight packing to B tiles and activation quantization to the HP int8 rows.
 *
 * The layouts and arithmetic are those of npusim/q4x32/layout.py and quant.py (the numpy
 * executable specification); the results are byte-identical to npusim.q4x32.pack_b and
 * npusim.q4x32.pack_a(npusim.q4x32.quantize_a(A)).
 */
#include <math.h>
#include <string.h>

#include "fp16.h"
#include "internal.h"

npu_ime2_status npu_ime2_b_packed_size(int64_t n, int64_t k, size_t *bytes)
{
    if (!bytes)
        return NPU_IME2_ERR_NULL_POINTER;
    if (!k_ok(k))
        return NPU_IME2_ERR_BAD_K;
    if (n < 1 || n > NPU_IME2_MAX_DIM)
        return NPU_IME2_ERR_BAD_SHAPE;
    if (!mul3_size(ceil_div(n, TILE_N), ceil_div(k, SUPERBLOCK_K), SUBBLOCKS * B_BLOCK, bytes))
        return NPU_IME2_ERR_BAD_SHAPE;
    return NPU_IME2_OK;
}

npu_ime2_status npu_ime2_a_packed_size(int64_t m, int64_t k, size_t *bytes)
{
    if (!bytes)
        return NPU_IME2_ERR_NULL_POINTER;
    if (!k_ok(k))
        return NPU_IME2_ERR_BAD_K;
    if (m < 0 || m > NPU_IME2_MAX_DIM)
        return NPU_IME2_ERR_BAD_SHAPE;
    if (!mul3_size(m, ceil_div(k, SUPERBLOCK_K), A_ROW, bytes))
        return NPU_IME2_ERR_BAD_SHAPE;
    return NPU_IME2_OK;
}

static int all_finite(const float *x, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

static void put_f16(uint8_t *p, f16_t h)
{
    p[0] = (uint8_t)(h & 0xffu);
    p[1] = (uint8_t)(h >> 8);
}

npu_ime2_status npu_ime2_pack_b(const uint8_t *qweight, const float *scales, int64_t n, int64_t k, void *out,
                                size_t out_bytes)
{
    if (!qweight || !scales || !out)
        return NPU_IME2_ERR_NULL_POINTER;
    size_t need;
    npu_ime2_status st = npu_ime2_b_packed_size(n, k, &need);
    if (st != NPU_IME2_OK)
        return st;
    if (out_bytes < need)
        return NPU_IME2_ERR_BUFFER_TOO_SMALL;
    const int64_t kb = k / QK;
    if (!all_finite(scales, (size_t)(n * kb)))
        return NPU_IME2_ERR_NON_FINITE;
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    const int64_t t_count = ceil_div(n, TILE_N);
    uint8_t *o = (uint8_t *)out;
    for (int64_t t = 0; t < t_count; t++)
        for (int64_t s = 0; s < s_count; s++)
            for (int j = 0; j < SUBBLOCKS; j++) {
                uint8_t *blk = o + ((t * s_count + s) * SUBBLOCKS + j) * B_BLOCK;
                const int64_t b = s * SUBBLOCKS + j; /* K block index */
                for (int c = 0; c < TILE_N; c++) {
                    const int64_t col = t * TILE_N + c;
                    uint8_t *codes = blk + B_SCALES + c * (QK / 2);
                    if (col < n && b < kb) {
                        put_f16(blk + 2 * c, f16_from_float(scales[col * kb + b]));
                        memcpy(codes, qweight + (col * kb + b) * (QK / 2), QK / 2);
                    } else {
                        put_f16(blk + 2 * c, 0);
                        memset(codes, 0x88, QK / 2);
                    }
                }
            }
    return NPU_IME2_OK;
}

/* vfncvt.x.f.w (fp32 -> int16, RNE, saturating, NaN -> 32767) then vncvt (low 8 bits). */
static int8_t narrow_to_i8(float v)
{
    int32_t r;
    if (isnan(v)) {
        r = 32767;
    } else {
        double d = rint((double)v); /* default rounding mode: to nearest even */
        if (d > 32767.0)
            d = 32767.0;
        if (d < -32768.0)
            d = -32768.0;
        r = (int32_t)d;
    }
    return (int8_t)(uint8_t)((uint32_t)r & 0xffu);
}

/*
 * Quantize `rows` (1 or 4) consecutive rows of A for superblock s into the caller's slots.
 * vals[r][i] are the 256 (zero-padded) values of row r. The scales are shared by the rows.
 * Results: q[r][256], rel[8], asum8[r][8], sa.
 */
static void quantize_superblock(const float vals[ROW_GROUP][SUPERBLOCK_K], int rows, int8_t q[ROW_GROUP][SUPERBLOCK_K],
                                f16_t rel[SUBBLOCKS], f16_t asum8[ROW_GROUP][SUBBLOCKS], f16_t *sa)
{
    float scale[SUBBLOCKS];
    for (int j = 0; j < SUBBLOCKS; j++) {
        float amax = 0.0f;
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < QK; i++) {
                const float v = fabsf(vals[r][j * QK + i]);
                if (v > amax)
                    amax = v;
            }
        scale[j] = amax / 127.0f;
    }
    float ssum = 0.0f;
    for (int j = 0; j < SUBBLOCKS; j++)
        ssum = ssum + scale[j];
    const float scale_avg = ssum / (float)SUBBLOCKS;
    const float fac = scale_avg != 0.0f ? 1.0f / scale_avg : 0.0f;
    for (int j = 0; j < SUBBLOCKS; j++) {
        const float prod = scale[j] * fac;
        rel[j] = f16_from_float(prod);
        const float rep = scale[j] != 0.0f ? 1.0f / scale[j] : 0.0f;
        for (int r = 0; r < rows; r++) {
            int64_t sum = 0;
            for (int i = 0; i < QK; i++) {
                const float v = vals[r][j * QK + i] * rep;
                const int8_t qi = narrow_to_i8(v);
                q[r][j * QK + i] = qi;
                sum += qi;
            }
            asum8[r][j] = f16_mul(f16_from_int(-sum), 0x4800u /* 8.0 */);
        }
    }
    *sa = f16_from_float(scale_avg);
}

npu_ime2_status npu_ime2_quantize_a(const float *a, int64_t m, int64_t k, void *out, size_t out_bytes)
{
    if (!a || !out)
        return NPU_IME2_ERR_NULL_POINTER;
    size_t need;
    npu_ime2_status st = npu_ime2_a_packed_size(m, k, &need);
    if (st != NPU_IME2_OK)
        return st;
    if (out_bytes < need)
        return NPU_IME2_ERR_BUFFER_TOO_SMALL;
    if (!all_finite(a, (size_t)(m * k)))
        return NPU_IME2_ERR_NON_FINITE;
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    const int64_t groups = m / ROW_GROUP;
    uint8_t *o = (uint8_t *)out;
    float vals[ROW_GROUP][SUPERBLOCK_K];
    int8_t q[ROW_GROUP][SUPERBLOCK_K];
    f16_t rel[SUBBLOCKS], asum8[ROW_GROUP][SUBBLOCKS], sa;

    for (int64_t row0 = 0; row0 < m;) {
        const int rows = row0 < groups * ROW_GROUP ? ROW_GROUP : 1;
        for (int64_t s = 0; s < s_count; s++) {
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < SUPERBLOCK_K; i++) {
                    const int64_t kk = s * SUPERBLOCK_K + i;
                    vals[r][i] = kk < k ? a[(row0 + r) * k + kk] : 0.0f;
                }
            quantize_superblock((const float(*)[SUPERBLOCK_K])vals, rows, q, rel, asum8, &sa);
            if (rows == ROW_GROUP) {
                uint8_t *blk = o + (size_t)(row0 * s_count * A_ROW) + (size_t)s * A_GROUP;
                memset(blk, 0, A_GROUP);
                for (int j = 0; j < SUBBLOCKS; j++) {
                    put_f16(blk + A_GROUP_STRIDE * j, rel[j]);
                    for (int r = 0; r < ROW_GROUP; r++) {
                        memcpy(blk + A_GROUP_STRIDE * j + 8 + QK * r, &q[r][j * QK], QK);
                        put_f16(blk + A_GROUP_ASUM + 16 * r + 2 * j, asum8[r][j]);
                    }
                }
                put_f16(blk + A_GROUP_SA, sa);
            } else {
                uint8_t *blk = o + (size_t)(row0 * s_count * A_ROW) + (size_t)s * A_ROW;
                for (int j = 0; j < SUBBLOCKS; j++) {
                    put_f16(blk + A_ROW_STRIDE * j, rel[j]);
                    memcpy(blk + A_ROW_STRIDE * j + 2, &q[0][j * QK], QK);
                    put_f16(blk + A_ROW_ASUM + 2 * j, asum8[0][j]);
                }
                put_f16(blk + A_ROW_SA, sa);
            }
        }
        row0 += rows;
    }
    return NPU_IME2_OK;
}
