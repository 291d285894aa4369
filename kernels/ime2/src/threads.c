/*
 * threads.c - npu_ime2_gemm_mt: the GEMM with its N tiles split over POSIX threads.
 *
 * Thread i of T gets the contiguous tile range [i * tiles / T, (i + 1) * tiles / T) (whole
 * 32-column tiles; only the last range can end in the partial tail tile). A tile range is a
 * contiguous slice of packed B, and a path's result for a column depends only on that column's
 * tile, so each thread runs the ordinary single-threaded path on its slice, into its own
 * [M, cols] slice of one scratch buffer; C is filled from the scratch only when every slice
 * succeeded. The result is bit-identical to npu_ime2_gemm. The calling thread computes the first
 * range itself.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    const uint8_t *a, *b; /* b: the slice's first tile */
    int64_t m, k, n_cols;
    float *out; /* [M, n_cols] slice of the scratch */
    int path;
    npu_ime2_status status;
} slice_job;

static void *run_slice(void *arg)
{
    slice_job *j = (slice_job *)arg;
    j->status = npu_ime2_run_path(j->path, j->a, j->b, j->m, j->k, j->n_cols, j->out);
    return NULL;
}

npu_ime2_status npu_ime2_gemm_mt(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                 int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path, int threads)
{
    if (threads < 1 || threads > NPU_IME2_MAX_THREADS)
        return NPU_IME2_ERR_BAD_SHAPE;
    if (threads == 1 || m < 1 || n <= TILE_N)
        return npu_ime2_gemm(a_packed, a_bytes, b_packed, b_bytes, m, k, n, c, c_bytes, path);
    size_t b_need; /* the checks of npu_ime2_gemm, once, before any thread starts */
    npu_ime2_status st = npu_ime2_gemm_check(a_packed, a_bytes, b_packed, b_bytes, m, k, n, c, c_bytes, path, &b_need);
    if (st != NPU_IME2_OK)
        return st;
    if (path == NPU_IME2_PATH_AUTO)
        path = npu_ime2_auto_path();
    if ((st = npu_ime2_path_status(path)) != NPU_IME2_OK)
        return st;

    const int64_t tiles = ceil_div(n, TILE_N);
    const int t_count = (int)(tiles < threads ? tiles : threads);
    const size_t tile_bytes = b_need / (size_t)tiles;
    slice_job jobs[NPU_IME2_MAX_THREADS];
    pthread_t tids[NPU_IME2_MAX_THREADS];
    int started[NPU_IME2_MAX_THREADS] = {0};
    int64_t col0s[NPU_IME2_MAX_THREADS];
    float *scratch = malloc((size_t)m * (size_t)n * sizeof(float)); /* fits: checked above */
    if (!scratch)
        return NPU_IME2_ERR_NO_MEMORY;
    for (int i = 0; i < t_count; i++) {
        const int64_t t0 = tiles * i / t_count, t1 = tiles * (i + 1) / t_count;
        const int64_t col0 = t0 * TILE_N, col1 = t1 * TILE_N < n ? t1 * TILE_N : n;
        col0s[i] = col0;
        jobs[i] = (slice_job){.a = a_packed, .b = (const uint8_t *)b_packed + (size_t)t0 * tile_bytes, .m = m,
                              .k = k, .n_cols = col1 - col0, .out = scratch + (size_t)m * (size_t)col0,
                              .path = path, .status = NPU_IME2_OK};
    }
    for (int i = 1; i < t_count; i++)
        started[i] = pthread_create(&tids[i], NULL, run_slice, &jobs[i]) == 0;
    run_slice(&jobs[0]); /* the calling thread takes the first range */
    for (int i = 1; i < t_count; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            run_slice(&jobs[i]); /* no thread could be started: run the slice here */
    }
    st = NPU_IME2_OK;
    for (int i = 0; i < t_count && st == NPU_IME2_OK; i++)
        st = jobs[i].status;
    if (st == NPU_IME2_OK) /* C is written only when every slice succeeded */
        for (int i = 0; i < t_count; i++)
            for (int64_t r = 0; r < m; r++)
                memcpy(c + r * n + col0s[i], jobs[i].out + r * jobs[i].n_cols, (size_t)jobs[i].n_cols * sizeof(float));
    free(scratch);
    return st;
}
