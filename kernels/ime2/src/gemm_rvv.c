/*
 * gemm_rvv.c - the RVV 1.0 GEMM path on packed operands (riscv64, VLEN-agnostic intrinsics).
 *
 * Same arithmetic as gemm_portable.c (read its top comment), bit for bit, with the fp16 and fp32
 * roundings done by the vector unit instead of software:
 *
 *   full 32-column tiles, per superblock, sub-block j (e16 = fp16 lanes, one column per lane):
 *     sc    = vfmul.vf(d, rel_j)                          fp16(d * rel_j)
 *     sc16  = vfmul.vf(d, fp16(rel_j * 16))   4-row group (the m4 kernel)
 *           | vfmul.vf(sc, 16.0)              single row  (the m1 kernel)
 *     zp    = vfmul.vf(sc, asum8_j)
 *     acc   = vfwmacc.vf(acc, sa, zp)                     fp32(acc + sa * zp), exact product
 *     d16   = vfadd(d16, vfmul(vfcvt.f.x(dot_hi), sc16))  each step rounded RNE (unfused)
 *     d16   = vfadd(d16, vfmul(vfcvt.f.x(dot_lo), sc))
 *   after the 8 sub-blocks: acc = vfwmacc.vf(acc, sa, d16)
 *   The fp16 vector ops overflow to +/-inf and keep subnormals (IEEE 754), as fp16.h does.
 *
 *   columns past 32 * (N / 32) (the scalar tail, now per lane in fp32):
 *     acc = acc + ((sa * rel_j) * d) * (float(16 * dot_hi + dot_lo) + asum8_j)
 *
 * The int dots: codes c (unsigned 0..15) of a column are 16 bytes apart in a B block, so byte b
 * of every column is one strided load (vlse8, stride 16); its low nibble is K element 2b, its high
 * nibble element 2b + 1. With a = 16 * hi + lo (hi = a >> 4 signed, lo = a & 15):
 *   dot_hi += hi * c, dot_lo += lo * c      vwmaccsu.vx (signed scalar x unsigned u8 -> int16)
 * |dot_lo| <= 32 * 15 * 15 = 7200 and |dot_hi| <= 32 * 8 * 15 = 3840 fit int16 exactly;
 * vfcvt.f.x.v (int16 -> fp16, RNE) is the fp16(dot) rounding of the model. The tail's full dot
 * 16 * dot_hi + dot_lo (|.| <= 61440) is formed in int32 and converted exactly to fp32.
 *
 * Vector shapes: e16 at LMUL 2 (fp16 values, int16 dots), e32 at LMUL 4 (fp32 accumulators),
 * e8 at LMUL 1 (codes). vl = vsetvl_e16m2(columns left in the tile): 16 columns per strip at
 * VLEN 128, the whole 32-column tile at VLEN >= 256. A 4-row group keeps 4 accumulators
 * (4 x m4), 4 fp16 sums (4 x m2) and 8 dots (8 x m2) live: 40 registers > 32, so the compiler
 * spills whole register groups (vs2r/vs4r/vl2r/vl4r). Built WITHOUT a zvl flag and without
 * -mrvv-vector-bits those spill slots are sized from vlenb at run time and the code is correct at
 * every VLEN; built with zvl256b + -mrvv-vector-bits=zvl the slots are fixed 256-bit sizes and a
 * VLEN 1024 machine overruns them (tests/vllm_npu/test_ime2_vlen_hazard.py keeps that caught).
 *
 * Loads are byte loads only (vle8/vlse8, scalar byte reads), so the packed buffers need no
 * alignment. frm is set to round-to-nearest-even for the call and restored afterwards.
 *
 * QEMU 7.2 (Debian 12) notes: every instruction kind used here (vsetvli, vle8/vlse8, vand/vsrl,
 * vwmaccsu.vx, vfcvt.f.x.v e16, vfmul/vfadd e16, vfwmacc.vf, vfwcvt.f.f.v, vsext.vf2, vsll,
 * vwadd.wv, vfcvt.f.x.v e32, vse32, whole-register spills) runs correctly with -cpu ...,Zfh=true;
 * narrowing float->int conversions (vfncvt.rtz.x.f.w aborts QEMU 7.2) are not used.
 */
#include <float.h>
#include <riscv_vector.h>
#include <string.h>

#include "fp16.h"
#include "internal.h"

#if !defined(__riscv_v_intrinsic) || __riscv_v_intrinsic < 12000
#error "gemm_rvv.c needs the RVV 1.0 intrinsics (__riscv_ names, v0.12 or later)"
#endif
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "the RVV kernel needs FLT_EVAL_METHOD == 0 (the tail's scalar sa * rel_j is a float product)"
#endif

static inline f16_t get_f16(const uint8_t *p) { return (f16_t)(p[0] | (p[1] << 8)); }

static inline _Float16 as_half(f16_t h)
{
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return v;
}

/* Where one superblock of up to 4 rows of quantized A lives (pack.c layout, internal.h). */
typedef struct {
    const uint8_t *rel[SUBBLOCKS]; /* fp16 rel_j (shared by a 4-row group: slot 0) */
    const uint8_t *q[ROW_GROUP][SUBBLOCKS]; /* int8[32] of row r, sub-block j */
    const uint8_t *asum[ROW_GROUP]; /* fp16 asum8[8] of row r */
    const uint8_t *sa; /* fp16 scale_avg (shared) */
} a_view;

static void view_a(const uint8_t *a_packed, int64_t row0, int rows, int grouped, int64_t s, int64_t s_count,
                   a_view *v)
{
    for (int r = 0; r < rows; r++) {
        a_row_ptrs p;
        a_row_locate_kind(a_packed, row0 + r, grouped, s, s_count, &p);
        for (int j = 0; j < SUBBLOCKS; j++)
            v->q[r][j] = p.q[j];
        v->asum[r] = p.asum;
        if (r == 0) { /* the rows of a group share these slots */
            for (int j = 0; j < SUBBLOCKS; j++)
                v->rel[j] = p.rel[j];
            v->sa = p.sa;
        }
    }
}

/* The vl fp16 column scales starting at byte p (2 bytes each, possibly unaligned): a byte load
 * of 2*vl bytes reinterpreted as vl fp16 lanes (little-endian, as RISC-V is). */
static inline vfloat16m2_t load_d(const uint8_t *p, size_t vl)
{
    const vuint8m2_t bytes = __riscv_vle8_v_u8m2(p, 2 * vl);
    return __riscv_vreinterpret_v_u16m2_f16m2(__riscv_vreinterpret_v_u8m2_u16m2(bytes));
}

/* One step of the int dots: K elements e = 2b (low nibbles) and 2b + 1 (high nibbles). */
#define DOT_STEP(R, DH, DL)                                                                        \
    do {                                                                                           \
        const int8_t a0 = (int8_t)q[R][2 * b], a1 = (int8_t)q[R][2 * b + 1];                      \
        DH = __riscv_vwmaccsu_vx_i16m2(DH, (int8_t)(a0 >> 4), c_lo, vl);                          \
        DL = __riscv_vwmaccsu_vx_i16m2(DL, (int8_t)(a0 & 15), c_lo, vl);                          \
        DH = __riscv_vwmaccsu_vx_i16m2(DH, (int8_t)(a1 >> 4), c_hi, vl);                          \
        DL = __riscv_vwmaccsu_vx_i16m2(DL, (int8_t)(a1 & 15), c_hi, vl);                          \
    } while (0)

/* d16 = fp16(d16 + fp16(fp16(dot_hi) * sc16)), then the same with dot_lo and sc. */
static inline vfloat16m2_t hp_madd(vfloat16m2_t d16, vint16m2_t dh, vint16m2_t dl, vfloat16m2_t sc16,
                                   vfloat16m2_t sc, size_t vl)
{
    d16 = __riscv_vfadd_vv_f16m2(d16, __riscv_vfmul_vv_f16m2(__riscv_vfcvt_f_x_v_f16m2(dh, vl), sc16, vl), vl);
    return __riscv_vfadd_vv_f16m2(d16, __riscv_vfmul_vv_f16m2(__riscv_vfcvt_f_x_v_f16m2(dl, vl), sc, vl), vl);
}

/* The scalar-tail term of one row: acc + ((sa * rel_j) * d) * (float(16 dh + dl) + asum8_j). */
static inline vfloat32m4_t tail_madd(vfloat32m4_t acc, vint16m2_t dh, vint16m2_t dl, vfloat32m4_t d32, float sa,
                                     float rel, float asum8, size_t vl)
{
    const float sa_as = sa * rel;
    const vint32m4_t dot = __riscv_vwadd_wv_i32m4(__riscv_vsll_vx_i32m4(__riscv_vsext_vf2_i32m4(dh, vl), 4, vl), dl, vl);
    const vfloat32m4_t coef = __riscv_vfmul_vf_f32m4(d32, sa_as, vl);
    const vfloat32m4_t tt = __riscv_vfadd_vf_f32m4(__riscv_vfcvt_f_x_v_f32m4(dot, vl), asum8, vl);
    return __riscv_vfadd_vv_f32m4(acc, __riscv_vfmul_vv_f32m4(coef, tt, vl), vl);
}

/*
 * Rows row0 .. row0 + rows - 1 (rows = 4: a quantized group, or 1: a single row) x columns
 * col .. col + vl - 1 of tile t, all superblocks; writes those C elements. `full`: the tile has
 * 32 columns (the .hp arithmetic), else the scalar-tail arithmetic. Inlined with constant `rows`
 * so that the unused row registers vanish for rows = 1.
 */
static inline __attribute__((always_inline)) void strip(const uint8_t *a_packed, const uint8_t *b_packed,
                                                        int64_t k, int64_t n, int64_t row0, const int rows,
                                                        int grouped, int64_t t, int full, int64_t col, size_t vl,
                                                        float *c)
{
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    const int cc = (int)(col - t * TILE_N); /* first column inside the tile */
    vfloat32m4_t acc0 = __riscv_vfmv_v_f_f32m4(0.0f, vl), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t s = 0; s < s_count; s++) {
        a_view av;
        view_a(a_packed, row0, rows, grouped, s, s_count, &av);
        const f16_t sa_h = get_f16(av.sa);
        const _Float16 sa = as_half(sa_h);
        const float sa_f = f16_to_float(sa_h);
        vfloat16m2_t z16 = __riscv_vfmv_v_f_f16m2((_Float16)0.0f, vl);
        vfloat16m2_t h0 = z16, h1 = z16, h2 = z16, h3 = z16; /* d16 of each row */
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        for (int j = 0; j < SUBBLOCKS; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            const uint8_t *codes = blk + B_SCALES + (QK / 2) * cc;
            const uint8_t *q[ROW_GROUP];
            for (int r = 0; r < rows; r++)
                q[r] = av.q[r][j];
            vint16m2_t zi = __riscv_vmv_v_x_i16m2(0, vl);
            vint16m2_t dh0 = zi, dl0 = zi, dh1 = zi, dl1 = zi, dh2 = zi, dl2 = zi, dh3 = zi, dl3 = zi;
            for (int b = 0; b < QK / 2; b++) {
                const vuint8m1_t byte = __riscv_vlse8_v_u8m1(codes + b, QK / 2, vl);
                const vuint8m1_t c_lo = __riscv_vand_vx_u8m1(byte, 15, vl);
                const vuint8m1_t c_hi = __riscv_vsrl_vx_u8m1(byte, 4, vl);
                DOT_STEP(0, dh0, dl0);
                if (rows > 1) {
                    DOT_STEP(1, dh1, dl1);
                    DOT_STEP(2, dh2, dl2);
                    DOT_STEP(3, dh3, dl3);
                }
            }
            const f16_t rel_h = get_f16(av.rel[j]);
            if (full) {
                const vfloat16m2_t d = load_d(blk + 2 * cc, vl);
                const vfloat16m2_t sc = __riscv_vfmul_vf_f16m2(d, as_half(rel_h), vl);
                const vfloat16m2_t sc16 = grouped ? __riscv_vfmul_vf_f16m2(d, as_half(f16_mul(rel_h, 0x4c00u)), vl)
                                                  : __riscv_vfmul_vf_f16m2(sc, as_half(0x4c00u /* 16 */), vl);
#define HP_ROW(R, ACC, H, DH, DL)                                                                  \
    do {                                                                                           \
        const vfloat16m2_t zp = __riscv_vfmul_vf_f16m2(sc, as_half(get_f16(av.asum[R] + 2 * j)), vl); \
        ACC = __riscv_vfwmacc_vf_f32m4(ACC, sa, zp, vl);                                           \
        H = hp_madd(H, DH, DL, sc16, sc, vl);                                                      \
    } while (0)
                HP_ROW(0, acc0, h0, dh0, dl0);
                if (rows > 1) {
                    HP_ROW(1, acc1, h1, dh1, dl1);
                    HP_ROW(2, acc2, h2, dh2, dl2);
                    HP_ROW(3, acc3, h3, dh3, dl3);
                }
#undef HP_ROW
            } else {
                const vfloat32m4_t d32 = __riscv_vfwcvt_f_f_v_f32m4(load_d(blk + 2 * cc, vl), vl);
                const float rel = f16_to_float(rel_h);
#define TAIL_ROW(R, ACC, DH, DL)                                                                   \
    ACC = tail_madd(ACC, DH, DL, d32, sa_f, rel, f16_to_float(get_f16(av.asum[R] + 2 * j)), vl)
                TAIL_ROW(0, acc0, dh0, dl0);
                if (rows > 1) {
                    TAIL_ROW(1, acc1, dh1, dl1);
                    TAIL_ROW(2, acc2, dh2, dl2);
                    TAIL_ROW(3, acc3, dh3, dl3);
                }
#undef TAIL_ROW
            }
        }
        if (full) {
            acc0 = __riscv_vfwmacc_vf_f32m4(acc0, sa, h0, vl);
            if (rows > 1) {
                acc1 = __riscv_vfwmacc_vf_f32m4(acc1, sa, h1, vl);
                acc2 = __riscv_vfwmacc_vf_f32m4(acc2, sa, h2, vl);
                acc3 = __riscv_vfwmacc_vf_f32m4(acc3, sa, h3, vl);
            }
        }
    }
    __riscv_vse32_v_f32m4(c + row0 * n + col, acc0, vl);
    if (rows > 1) {
        __riscv_vse32_v_f32m4(c + (row0 + 1) * n + col, acc1, vl);
        __riscv_vse32_v_f32m4(c + (row0 + 2) * n + col, acc2, vl);
        __riscv_vse32_v_f32m4(c + (row0 + 3) * n + col, acc3, vl);
    }
}
#undef DOT_STEP

/* Every tile of rows row0 .. row0 + rows - 1, strip-mined over the columns of each tile. */
static inline __attribute__((always_inline)) void row_block(const uint8_t *a_packed, const uint8_t *b_packed,
                                                            int64_t k, int64_t n, int64_t row0, const int rows,
                                                            int grouped, float *c)
{
    const int64_t n_full = (n / TILE_N) * TILE_N;
    for (int64_t t = 0; t < ceil_div(n, TILE_N); t++) {
        const int64_t col0 = t * TILE_N;
        const int full = col0 + TILE_N <= n_full;
        const int64_t col_end = full ? col0 + TILE_N : n;
        for (int64_t col = col0; col < col_end;) {
            const size_t vl = __riscv_vsetvl_e16m2((size_t)(col_end - col));
            strip(a_packed, b_packed, k, n, row0, rows, grouped, t, full, col, vl, c);
            col += (int64_t)vl;
        }
    }
}

static __attribute__((noinline)) void group_rows(const uint8_t *a, const uint8_t *b, int64_t k, int64_t n,
                                                 int64_t row0, float *c)
{
    row_block(a, b, k, n, row0, ROW_GROUP, 1, c);
}

static __attribute__((noinline)) void single_row(const uint8_t *a, const uint8_t *b, int64_t k, int64_t n,
                                                 int64_t row0, float *c)
{
    row_block(a, b, k, n, row0, 1, 0, c);
}

/* All rows: the 4-row groups first (the m4 kernel), then the remaining single rows (m1). */
static __attribute__((noinline)) void gemm_all(const uint8_t *a, const uint8_t *b, int64_t m, int64_t k, int64_t n,
                                               float *c)
{
    const int64_t grouped_rows = (m / ROW_GROUP) * ROW_GROUP;
    for (int64_t row0 = 0; row0 < grouped_rows; row0 += ROW_GROUP)
        group_rows(a, b, k, n, row0, c);
    for (int64_t row0 = grouped_rows; row0 < m; row0++)
        single_row(a, b, k, n, row0, c);
}

npu_ime2_status npu_ime2_gemm_rvv(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                  float *c)
{
    /* frm = RNE (0) for the whole call; the work is in a noinline callee so that no rounding
     * operation can be scheduled across the two CSR writes. */
    unsigned long old_frm;
    __asm__ volatile("fsrmi %0, 0" : "=r"(old_frm)::"memory");
    gemm_all(a_packed, b_packed, m, k, n, c);
    __asm__ volatile("fsrm %0" ::"r"(old_frm) : "memory");
    return NPU_IME2_OK;
}
