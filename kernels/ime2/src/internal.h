/* internal.h - shared constants and checks of the ime2 kernel sources (not installed). */
#ifndef NPU_IME2_INTERNAL_H
#define NPU_IME2_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "npu_ime2.h"

#define QK 32                 /* Q4_0 block length */
#define SUPERBLOCK_K 256      /* K per superblock */
#define SUBBLOCKS 8           /* sub-blocks of 32 per superblock */
#define TILE_N 32             /* columns per B tile */
#define ROW_GROUP 4           /* rows quantized together */
#define B_BLOCK 576           /* 64 B of fp16 scales + 512 B of nibbles */
#define B_SCALES 64           /* offset of the nibbles in a B block */
#define A_ROW 290             /* one row, one superblock */
#define A_ROW_STRIDE 34       /* fp16 rel + 32 int8 */
#define A_ROW_ASUM 272
#define A_ROW_SA 288
#define A_GROUP 1160          /* four rows, one superblock */
#define A_GROUP_STRIDE 136
#define A_GROUP_ASUM 1088
#define A_GROUP_SA 1152

/* Largest dimension accepted (keeps every size computation far from SIZE_MAX). */
#define NPU_IME2_MAX_DIM (INT64_C(1) << 31)

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static inline int k_ok(int64_t k) { return k > 0 && k % QK == 0 && k <= NPU_IME2_MAX_DIM; }

/* a * b * c with overflow detection (all non-negative), without 128-bit integers so that it
 * builds on any architecture. Returns 0 when the product exceeds SIZE_MAX / 2. */
static inline int mul3_size(int64_t a, int64_t b, int64_t c, size_t *out)
{
    const uint64_t limit = (uint64_t)(SIZE_MAX / 2);
    uint64_t r = (uint64_t)a;
    if (b != 0 && r > limit / (uint64_t)b)
        return 0;
    r *= (uint64_t)b;
    if (c != 0 && r > limit / (uint64_t)c)
        return 0;
    r *= (uint64_t)c;
    *out = (size_t)r;
    return 1;
}

/* Where row `row` of quantized A (M rows) keeps superblock s (pack.c layout): a row of a 4-row
 * group (row < 4 * (M / 4)) reads the group's shared rel_j / scale_avg slots and its own int8
 * values and asum8; a remainder row has a 290-byte block of its own. */
typedef struct {
    const uint8_t *rel[SUBBLOCKS]; /* fp16 rel_j */
    const uint8_t *q[SUBBLOCKS];   /* int8[32] of sub-block j */
    const uint8_t *asum;           /* fp16 asum8[8] */
    const uint8_t *sa;             /* fp16 scale_avg */
} a_row_ptrs;

/* The same for a row whose kind is known: `grouped` = it belongs to a 4-row group. */
static inline void a_row_locate_kind(const uint8_t *a_packed, int64_t row, int grouped, int64_t s, int64_t s_count,
                                     a_row_ptrs *p)
{
    if (grouped) {
        const int r = (int)(row % ROW_GROUP);
        const uint8_t *blk = a_packed + (size_t)((row - r) * s_count * A_ROW) + (size_t)s * A_GROUP;
        for (int j = 0; j < SUBBLOCKS; j++) {
            p->rel[j] = blk + A_GROUP_STRIDE * j;
            p->q[j] = blk + A_GROUP_STRIDE * j + 8 + QK * r;
        }
        p->asum = blk + A_GROUP_ASUM + 16 * r;
        p->sa = blk + A_GROUP_SA;
    } else {
        const uint8_t *blk = a_packed + (size_t)(row * s_count * A_ROW) + (size_t)s * A_ROW;
        for (int j = 0; j < SUBBLOCKS; j++) {
            p->rel[j] = blk + A_ROW_STRIDE * j;
            p->q[j] = blk + A_ROW_STRIDE * j + 2;
        }
        p->asum = blk + A_ROW_ASUM;
        p->sa = blk + A_ROW_SA;
    }
}

static inline void a_row_locate(const uint8_t *a_packed, int64_t m, int64_t row, int64_t s, int64_t s_count,
                                a_row_ptrs *p)
{
    a_row_locate_kind(a_packed, row, row < (m / ROW_GROUP) * ROW_GROUP, s, s_count, p);
}

/* Portable GEMM on packed operands (shapes and sizes already validated). */
void npu_ime2_gemm_portable(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                            float *c);
/* The portable path restricted to the columns past 32 * (N / 32) (the scalar tail), all rows. */
void npu_ime2_gemm_portable_tail(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                 float *c);

/* Every argument check of npu_ime2_gemm, in its order (dispatch.c); *b_need: bytes of packed B. */
npu_ime2_status npu_ime2_gemm_check(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                    int64_t m, int64_t k, int64_t n, const float *c, size_t c_bytes, int path,
                                    size_t *b_need);
/* Runs `path` (AUTO resolved here) on checked operands with M, N >= 1; a path this CPU cannot run
 * returns its npu_ime2_path_status before any work (dispatch.c). */
npu_ime2_status npu_ime2_run_path(int path, const uint8_t *a, const uint8_t *b, int64_t m, int64_t k, int64_t n,
                                  float *c);

/* The worker pool of npu_ime2_gemm_mt (threads.c), for the whole op (dispatch.c). */
/* The pinned workers every npu_ime2_gemm_mt call of this process runs on: 0 when the pool is
 * unconfigured (every host but a K3 after the core fence), else 1 .. NPU_IME2_MAX_THREADS. */
int npu_ime2_pool_configured(void);
/* npu_ime2_path_status(path), AUTO resolved, where npu_ime2_gemm_mt's slices run: by worker 0 on
 * its own core when the pool is configured, else in the calling thread. Touches no data. */
npu_ime2_status npu_ime2_pool_path_status(int path);

/* Optional paths (dispatch.c): each is defined by its own source file, which the build adds
 * together with -DNPU_IME2_HAVE_<PATH>. They receive validated shapes with M, N >= 1 and are
 * only called after their usable check passed. */
#ifdef NPU_IME2_HAVE_RVV
npu_ime2_status npu_ime2_gemm_rvv(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                  float *c);
#endif
#ifdef NPU_IME2_HAVE_IME2
/* NPU_IME2_OK when vlenb == 128, else NPU_IME2_ERR_WRONG_VLEN (reads vlenb only). */
npu_ime2_status npu_ime2_ime2_usable(void);
/* Re-checks vlenb itself and returns NPU_IME2_ERR_WRONG_VLEN before touching vector state. */
npu_ime2_status npu_ime2_gemm_ime2(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                   float *c);
#endif
#ifdef NPU_IME2_HAVE_X86
/* 1 when the CPU has AVX2 and F16C (and the OS saves YMM state), else 0. */
int npu_ime2_x86_usable(void);
const char *npu_ime2_x86_variant_name(void);
npu_ime2_status npu_ime2_gemm_x86(const uint8_t *a_packed, const uint8_t *b_packed, int64_t m, int64_t k, int64_t n,
                                  float *c);
#endif

#endif /* NPU_IME2_INTERNAL_H */
