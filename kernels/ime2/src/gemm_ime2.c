/*
 * gemm_ime2.c - the IME2 path: SpacemiT vmadotsu.hp / vmadotu.hp (Zvvm_spacemit v0.6, int4,
 * fp16 accumulate), emitted with `.insn`, on the A100 cores (VLEN 1024, vlenb == 128 only).
 *
 * Built with -march=rv64gcv_zvfh_zvl1024b and no auto-vectorization (Makefile). Every entry
 * point reads vlenb first and returns NPU_IME2_ERR_WRONG_VLEN unless it is 128, before any
 * vector instruction runs and before C is written: at another VLEN the .hp tile geometry does
 * not exist and the zvl1024b code would be wrong.
 *
 * Arithmetic: exactly that of gemm_portable.c (see its top comment), bit for bit. Only the
 * fp16 tile accumulation d16 runs on the matrix unit; everything else (scales, zero-point
 * terms, the fp32 accumulation, the scalar tail) is scalar C with the fp16.h helpers.
 *
 * Instruction tile (.hp, int4, VLEN 1024): 8 rows x 32 K x 8 columns.
 *   vs1 = A: 8 rows x 32 int4, row r in bytes 16r..16r+15, element 2b in bits 3:0 of byte b,
 *            2b+1 in bits 7:4. Rows past the real 1 (m1) or 4 (m4 group) rows are zero.
 *   vs2 = B: 8 columns x 32 int4, column c in bytes 16c..16c+15: exactly 128 consecutive bytes of
 *            a packed block_q4_0x32's nibbles (columns 8g..8g+7 at offset 64 + 128g).
 *   v0     : 64 fp16 = 8 groups of 8 scales; group g (0..3) = sc of columns 8g..8g+7, group 4+g =
 *            sc16 of the same columns. Output p (row p/8, column p%8) uses v0[imm3*8 + p%8].
 *   vd     : 64 fp16, row-major 8 x 8: vd[p] = fp16(vd[p] + fp16(fp16(dot) * scale)).
 *
 * Per row group (1 or 4 rows), full 32-column tile and 256-K superblock, for each K32
 * sub-block j: one asm block loads v0 (scales), v16..v19 (the four 8-column d16 accumulators),
 * v8 (A high planes, a >> 4), v9 (A low planes, a & 15), v12..v15 (the tile's 512 nibble
 * bytes), then for g = 0..3:
 *     vmadotsu.hp v16+g, v8, v12+g, v0, 4+g    .insn r 0x2b, 4+g, 0x6a, v16+g, v8, v12+g
 *     vmadotu.hp  v16+g, v9, v12+g, v0, g      .insn r 0x2b, g,   0x66, v16+g, v9, v12+g
 * (funct7 0x6a = 1 10 101 0: i4, signed A x unsigned B, scales in v0; 0x66 = 1 10 011 0:
 * i4, unsigned x unsigned, v0), and stores v16..v19 back: 8 .hp instructions per sub-block,
 * 64 per tile and superblock, the minimum for two int4 planes and 32 columns.
 */
#include <float.h>
#include <string.h>

#include "fp16.h"
#include "internal.h"

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "the IME2 kernel needs FLT_EVAL_METHOD == 0 (float arithmetic rounded to float)"
#endif

#define IME2_VLENB 128   /* bytes per vector register at VLEN 1024 */
#define GROUPS 4         /* 8-column groups per 32-column tile */
#define TILE_ROWS 8      /* rows of an .hp A tile */

static inline unsigned long read_vlenb(void)
{
    unsigned long v;
    __asm__ volatile("csrr %0, vlenb" : "=r"(v));
    return v;
}

npu_ime2_status npu_ime2_ime2_usable(void)
{
    return read_vlenb() == IME2_VLENB ? NPU_IME2_OK : NPU_IME2_ERR_WRONG_VLEN;
}

static inline f16_t get_f16(const uint8_t *p) { return (f16_t)(p[0] | (p[1] << 8)); }

static inline uint16_t f16_bits_of(double v) { return f16_from_double(v); } /* v is an fp16 value */

/* One row group's view of one superblock of quantized A (rows share rel and sa; see pack.c). */
typedef struct {
    double rel_d[SUBBLOCKS];                /* fp16 rel_j, exact */
    double rel16_d[SUBBLOCKS];              /* fp16(rel_j * 16), m4 only */
    double asum8_d[ROW_GROUP][SUBBLOCKS];   /* fp16 asum8 per row */
    float sa;                               /* fp16 scale_avg */
    uint8_t hi[SUBBLOCKS][IME2_VLENB];      /* vs1 images: a >> 4 (signed nibbles) */
    uint8_t lo[SUBBLOCKS][IME2_VLENB];      /* vs1 images: a & 15 */
} a_group;

/* Loads rows row0 .. row0 + rows - 1 (a 4-row group when grouped, else one row). */
static void load_group(const uint8_t *a_packed, int64_t row0, int rows, int grouped, int64_t s, int64_t s_count,
                       a_group *g)
{
    a_row_ptrs p[ROW_GROUP]; /* the rows of a group share rel_j and scale_avg: read row 0's */
    for (int r = 0; r < rows; r++)
        a_row_locate_kind(a_packed, row0 + r, grouped, s, s_count, &p[r]);
    const uint8_t *const *rel_p = p[0].rel, *sa_p = p[0].sa;
    memset(g->hi, 0, sizeof g->hi);
    memset(g->lo, 0, sizeof g->lo);
    for (int j = 0; j < SUBBLOCKS; j++) {
        const f16_t rel = get_f16(rel_p[j]);
        g->rel_d[j] = f16_to_double(rel);
        g->rel16_d[j] = f16_to_double(f16_mul(rel, 0x4c00u /* 16.0 */));
        for (int r = 0; r < rows; r++) {
            g->asum8_d[r][j] = f16_to_double(get_f16(p[r].asum + 2 * j));
            for (int b = 0; b < QK / 2; b++) {
                const uint8_t q0 = p[r].q[j][2 * b], q1 = p[r].q[j][2 * b + 1];
                /* q >> 4 as a 4-bit two's-complement nibble is bits 7:4 of the byte */
                g->hi[j][16 * r + b] = (uint8_t)((q0 >> 4) | (q1 & 0xf0u));
                g->lo[j][16 * r + b] = (uint8_t)((q0 & 0x0fu) | ((q1 & 0x0fu) << 4));
            }
        }
    }
    g->sa = f16_to_float(get_f16(sa_p));
}

/*
 * One K32 sub-block on the matrix unit: d16[g] (8 x 8 fp16, g = 8-column group) +=
 * the hi plane (scale group 4+g of v0img) then the lo plane (group g). All operands in memory.
 */
static void hp_subblock(uint16_t d16[GROUPS][64], const uint16_t v0img[64], const uint8_t *a_hi,
                        const uint8_t *a_lo, const uint8_t *b_nibbles)
{
    unsigned long vl;
    __asm__ volatile(
        "li %[vl], 128\n\t"
        "vsetvli %[vl], %[vl], e8, m1, ta, ma\n\t"
        "vle8.v v8, (%[ahi])\n\t"
        "vle8.v v9, (%[alo])\n\t"
        "vle8.v v12, (%[b0])\n\t"
        "vle8.v v13, (%[b1])\n\t"
        "vle8.v v14, (%[b2])\n\t"
        "vle8.v v15, (%[b3])\n\t"
        "li %[vl], 64\n\t"
        "vsetvli %[vl], %[vl], e16, m1, ta, ma\n\t"
        "vle16.v v0, (%[sc])\n\t"
        "vle16.v v16, (%[d0])\n\t"
        "vle16.v v17, (%[d1])\n\t"
        "vle16.v v18, (%[d2])\n\t"
        "vle16.v v19, (%[d3])\n\t"
        /* columns 0..7: vmadotsu.hp v16, v8, v12, v0, 4 ; vmadotu.hp v16, v9, v12, v0, 0 */
        ".insn r 0x2b, 4, 0x6a, v16, v8, v12\n\t"
        ".insn r 0x2b, 0, 0x66, v16, v9, v12\n\t"
        /* columns 8..15 */
        ".insn r 0x2b, 5, 0x6a, v17, v8, v13\n\t"
        ".insn r 0x2b, 1, 0x66, v17, v9, v13\n\t"
        /* columns 16..23 */
        ".insn r 0x2b, 6, 0x6a, v18, v8, v14\n\t"
        ".insn r 0x2b, 2, 0x66, v18, v9, v14\n\t"
        /* columns 24..31 */
        ".insn r 0x2b, 7, 0x6a, v19, v8, v15\n\t"
        ".insn r 0x2b, 3, 0x66, v19, v9, v15\n\t"
        "vse16.v v16, (%[d0])\n\t"
        "vse16.v v17, (%[d1])\n\t"
        "vse16.v v18, (%[d2])\n\t"
        "vse16.v v19, (%[d3])\n\t"
        : [vl] "=&r"(vl)
        : [ahi] "r"(a_hi), [alo] "r"(a_lo), [b0] "r"(b_nibbles), [b1] "r"(b_nibbles + 128),
          [b2] "r"(b_nibbles + 256), [b3] "r"(b_nibbles + 384), [sc] "r"(v0img), [d0] "r"(d16[0]),
          [d1] "r"(d16[1]), [d2] "r"(d16[2]), [d3] "r"(d16[3])
        : "v0", "v8", "v9", "v12", "v13", "v14", "v15", "v16", "v17", "v18", "v19", "vl", "vtype", "memory");
    (void)vl;
}

/* Rows row0 .. row0 + rows - 1 x the full 32-column tile t. */
static void tile_rows(const uint8_t *a_packed, const uint8_t *b_packed, int64_t k, int64_t n, int64_t row0,
                      int rows, int grouped, int64_t t, float *c)
{
    const int64_t s_count = ceil_div(k, SUPERBLOCK_K);
    a_group g;
    float acc[ROW_GROUP][TILE_N];
    for (int r = 0; r < rows; r++)
        for (int cc = 0; cc < TILE_N; cc++)
            acc[r][cc] = 0.0f;

    for (int64_t s = 0; s < s_count; s++) {
        load_group(a_packed, row0, rows, grouped, s, s_count, &g);
        const uint8_t *sup = b_packed + (size_t)((t * s_count + s) * SUBBLOCKS) * B_BLOCK;
        uint16_t d16[GROUPS][64];
        memset(d16, 0, sizeof d16); /* +0.0 */
        float zp_f[ROW_GROUP][TILE_N][SUBBLOCKS];
        for (int j = 0; j < SUBBLOCKS; j++) {
            const uint8_t *blk = sup + (size_t)j * B_BLOCK;
            uint16_t v0img[64];
            for (int cc = 0; cc < TILE_N; cc++) {
                const double d = f16_to_double(get_f16(blk + 2 * cc));
                const double sc = f16_round(d * g.rel_d[j]);                          /* m1 and m4 */
                const double sc16 = grouped ? f16_round(d * g.rel16_d[j])             /* m4 */
                                            : f16_round(sc * 16.0);                   /* m1 */
                v0img[cc] = f16_bits_of(sc);
                v0img[TILE_N + cc] = f16_bits_of(sc16);
                for (int r = 0; r < rows; r++)
                    zp_f[r][cc][j] = (float)f16_round(sc * g.asum8_d[r][j]);
            }
            hp_subblock(d16, v0img, g.hi[j], g.lo[j], blk + B_SCALES);
        }
        /* acc += sa * zp_j (j = 0..7), then acc += sa * d16: fp32, one rounding per operation */
        for (int r = 0; r < rows; r++) {
            for (int cc = 0; cc < TILE_N; cc++) {
                float a = acc[r][cc];
                for (int j = 0; j < SUBBLOCKS; j++) {
                    const float p = g.sa * zp_f[r][cc][j];
                    a = a + p;
                }
                const float d16f = f16_to_float(d16[cc / 8][r * 8 + cc % 8]);
                const float p = g.sa * d16f;
                acc[r][cc] = a + p;
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int cc = 0; cc < TILE_N; cc++)
            c[(row0 + r) * n + t * TILE_N + cc] = acc[r][cc];
}

/* The work, once vlenb == 128 is known (kept out of line so no vector code can be scheduled
 * before the check in npu_ime2_gemm_ime2). */
static __attribute__((noinline)) void gemm_ime2_vlen1024(const uint8_t *a_packed, const uint8_t *b_packed,
                                                         int64_t m, int64_t k, int64_t n, float *c)
{
    const int64_t full_tiles = n / TILE_N;
    const int64_t grouped_rows = (m / ROW_GROUP) * ROW_GROUP;
    for (int64_t row0 = 0; row0 < m;) {
        const int grouped = row0 < grouped_rows;
        const int rows = grouped ? ROW_GROUP : 1;
        for (int64_t t = 0; t < full_tiles; t++)
            tile_rows(a_packed, b_packed, k, n, row0, rows, grouped, t, c);
        row0 += rows;
    }
    npu_ime2_gemm_portable_tail(a_packed, b_packed, m, k, n, c); /* columns past 32 * (N / 32) */
}

npu_ime2_status npu_ime2_gemm_ime2(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                   float *c)
{
    if (read_vlenb() != IME2_VLENB)
        return NPU_IME2_ERR_WRONG_VLEN;
    gemm_ime2_vlen1024(a_packed, b_packed, m, k, n, c);
    return NPU_IME2_OK;
}
