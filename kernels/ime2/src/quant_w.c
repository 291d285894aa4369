/*
 * quant_w.c - Q4_0 weight quantization into the op's input format (qweight [N, K/32, 16],
 * scales [N, K/32]), the same bits as npusim.q4x32.quantize_q4_0 (ggml's quantize_row_q4_0_ref):
 *
 *   per row n and K block b of 32 values x (fp32):
 *     vmax = the x with the largest |x| (the first one on ties)
 *     d    = vmax / -8                       (fp32; stored as the float32 scale, not rounded)
 *     id   = d != 0 ? 1 / d : 0              (fp32)
 *     q    = min(15, trunc(x * id + 8.5))    (fp32 product, fp32 sum; codes 0..15)
 *   byte b' of a block holds K elements 2b' (bits 3:0) and 2b' + 1 (bits 7:4).
 *
 * Needs FLT_EVAL_METHOD == 0 and no contraction (-ffp-contract=off), as the rest of the kernel.
 */
#include <float.h>
#include <math.h>

#include "internal.h"

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "quant_w.c needs FLT_EVAL_METHOD == 0 (float arithmetic rounded to float)"
#endif

static void quantize_block(const float x[QK], uint8_t out[QK / 2], float *scale)
{
    float vmax = 0.0f, amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        const float a = fabsf(x[i]);
        if (amax < a) { /* strict: the first largest |x| wins, as ggml */
            amax = a;
            vmax = x[i];
        }
    }
    const float d = vmax / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t codes[QK];
    for (int i = 0; i < QK; i++) {
        const float p = x[i] * id;
        const float t = p + 8.5f;
        const int q = (int)t; /* t is in [0.5, 16.5]: truncation toward zero */
        codes[i] = (uint8_t)(q < 15 ? q : 15);
    }
    for (int b = 0; b < QK / 2; b++)
        out[b] = (uint8_t)((codes[2 * b] & 0x0f) | ((codes[2 * b + 1] & 0x0f) << 4));
    *scale = d;
}

npu_ime2_status npu_ime2_quantize_q4_0(const float *w, int64_t n, int64_t k, uint8_t *qweight, size_t q_bytes,
                                       float *scales, size_t s_bytes)
{
    if (!w || !qweight || !scales)
        return NPU_IME2_ERR_NULL_POINTER;
    if (!k_ok(k))
        return NPU_IME2_ERR_BAD_K;
    if (n < 1 || n > NPU_IME2_MAX_DIM)
        return NPU_IME2_ERR_BAD_SHAPE;
    size_t q_need, s_need;
    if (!mul3_size(n, k / QK, QK / 2, &q_need) || !mul3_size(n, k / QK, (int64_t)sizeof(float), &s_need))
        return NPU_IME2_ERR_BAD_SHAPE;
    if (q_bytes < q_need || s_bytes < s_need)
        return NPU_IME2_ERR_BUFFER_TOO_SMALL;
    const size_t count = (size_t)n * (size_t)k;
    for (size_t i = 0; i < count; i++)
        if (!isfinite(w[i]))
            return NPU_IME2_ERR_NON_FINITE;
    const int64_t kb = k / QK;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < kb; b++)
            quantize_block(w + r * k + b * QK, qweight + (r * kb + b) * (QK / 2), scales + r * kb + b);
    return NPU_IME2_OK;
}
