/*
 * dispatch.c - argument checks shared by every path, path selection, the whole op, and the
 * status strings.
 *
 * Paths. The portable C path is always built. The others are compiled in when their source file
 * is part of the build, which then defines (see internal.h):
 *   NPU_IME2_HAVE_RVV   npu_ime2_gemm_rvv                         (src/gemm_rvv.c, riscv64)
 *   NPU_IME2_HAVE_IME2  npu_ime2_gemm_ime2, npu_ime2_ime2_usable  (src/gemm_ime2.c, riscv64)
 *   NPU_IME2_HAVE_X86   npu_ime2_gemm_x86, npu_ime2_x86_usable    (src/gemm_x86.c, x86-64)
 * A path that is not built answers NPU_IME2_ERR_BAD_PATH.
 *
 * AUTO (npu_ime2.h, "AUTO and the vlenb rule"). The K3 build (NPU_IME2_HAVE_IME2) runs IME2 and
 * nothing else: at vlenb != 128 AUTO stays IME2, whose status is NPU_IME2_ERR_WRONG_VLEN, unless
 * the process opted in with npu_ime2_set_allow_fallback(1); then, and in every build without the
 * IME2 path, AUTO runs the first usable path of IME2, RVV, X86 (the CPU has AVX2 and F16C),
 * portable.
 *
 * The whole op (npu_ime2_hp_gemm_on): the argument checks, the path check where the GEMM will
 * run, quantizing A and packing B in the calling thread, then the GEMM: in the calling thread, or,
 * when the worker pool is configured (threads.c; on the K3 the core fence pins one worker per
 * A100 core), as npu_ime2_gemm_mt over the configured workers, one slice each. The result is
 * bit-identical either way.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

const char *npu_ime2_status_string(int status)
{
    switch (status) {
    case NPU_IME2_OK:
        return "ok";
    case NPU_IME2_ERR_BAD_K:
        return "K must be a positive multiple of 32 (the Q4_0 block length)";
    case NPU_IME2_ERR_BAD_SHAPE:
        return "bad shape (M must be >= 0, N >= 1 for packing, and the sizes must fit in memory)";
    case NPU_IME2_ERR_NULL_POINTER:
        return "a required pointer is NULL";
    case NPU_IME2_ERR_NON_FINITE:
        return "an input holds NaN or Inf (A and scales must be finite)";
    case NPU_IME2_ERR_BUFFER_TOO_SMALL:
        return "an output buffer is smaller than the required size";
    case NPU_IME2_ERR_WRONG_VLEN:
        return "the IME2 path needs VLEN 1024 (vlenb == 128)";
    case NPU_IME2_ERR_BAD_PATH:
        return "unknown GEMM path, or a path not built into this library";
    case NPU_IME2_ERR_NO_MEMORY:
        return "workspace allocation failed";
    default:
        return "unknown status code";
    }
}

int npu_ime2_abi_version(void) { return NPU_IME2_ABI_VERSION; }

npu_ime2_status npu_ime2_path_status(int path)
{
    switch (path) {
    case NPU_IME2_PATH_AUTO:
        return npu_ime2_path_status(npu_ime2_auto_path()); /* never AUTO: no recursion */
    case NPU_IME2_PATH_PORTABLE:
        return NPU_IME2_OK;
    case NPU_IME2_PATH_RVV:
#ifdef NPU_IME2_HAVE_RVV
        return NPU_IME2_OK;
#else
        return NPU_IME2_ERR_BAD_PATH;
#endif
    case NPU_IME2_PATH_IME2:
#ifdef NPU_IME2_HAVE_IME2
        return npu_ime2_ime2_usable();
#else
        return NPU_IME2_ERR_BAD_PATH;
#endif
    case NPU_IME2_PATH_X86:
#ifdef NPU_IME2_HAVE_X86
        return npu_ime2_x86_usable() ? NPU_IME2_OK : NPU_IME2_ERR_BAD_PATH;
#else
        return NPU_IME2_ERR_BAD_PATH;
#endif
    default:
        return NPU_IME2_ERR_BAD_PATH;
    }
}

const char *npu_ime2_x86_variant(void)
{
#ifdef NPU_IME2_HAVE_X86
    return npu_ime2_x86_variant_name();
#else
    return "none";
#endif
}

/* The fallback opt-in (0 = refuse, the default); atomic so that any thread may set it. */
static atomic_int allow_fallback_setting = 0;

void npu_ime2_set_allow_fallback(int allow) { atomic_store(&allow_fallback_setting, allow != 0); }

int npu_ime2_allow_fallback(void) { return atomic_load(&allow_fallback_setting); }

int npu_ime2_vlenb(void)
{
#if defined(__riscv) && defined(__riscv_vector)
    unsigned long v;
    __asm__ volatile("csrr %0, vlenb" : "=r"(v));
    return (int)v;
#else
    return 0;
#endif
}

/* The first usable of IME2, RVV, X86, else portable (no vlenb rule). */
static int first_usable_path(void)
{
    static const int order[] = {NPU_IME2_PATH_IME2, NPU_IME2_PATH_RVV, NPU_IME2_PATH_X86};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (npu_ime2_path_status(order[i]) == NPU_IME2_OK)
            return order[i];
    return NPU_IME2_PATH_PORTABLE;
}

int npu_ime2_auto_path_with(int allow_fallback)
{
#ifdef NPU_IME2_HAVE_IME2
    if (!allow_fallback)
        return NPU_IME2_PATH_IME2; /* the K3 build: IME2 or an error, never a silent fallback */
#else
    (void)allow_fallback; /* no IME2 path built: the rule does not apply */
#endif
    return first_usable_path();
}

int npu_ime2_auto_path(void) { return npu_ime2_auto_path_with(npu_ime2_allow_fallback()); }

/* npu_ime2_path_status of the concrete path `path` runs (AUTO resolved); *resolved gets it. */
static npu_ime2_status resolve_path(int path, int *resolved)
{
    *resolved = path == NPU_IME2_PATH_AUTO ? npu_ime2_auto_path() : path;
    return npu_ime2_path_status(*resolved);
}

/* Validates the GEMM shapes and buffer sizes; fills the required sizes. */
static npu_ime2_status check_gemm(int64_t m, int64_t k, int64_t n, size_t c_bytes, size_t *a_need, size_t *b_need)
{
    npu_ime2_status st;
    if (!k_ok(k))
        return NPU_IME2_ERR_BAD_K;
    if (m < 0 || m > NPU_IME2_MAX_DIM || n < 0 || n > NPU_IME2_MAX_DIM)
        return NPU_IME2_ERR_BAD_SHAPE;
    if ((st = npu_ime2_a_packed_size(m, k, a_need)) != NPU_IME2_OK)
        return st;
    *b_need = 0;
    if (n > 0 && (st = npu_ime2_b_packed_size(n, k, b_need)) != NPU_IME2_OK)
        return st;
    size_t c_need;
    if (!mul3_size(m, n, (int64_t)sizeof(float), &c_need))
        return NPU_IME2_ERR_BAD_SHAPE;
    if (c_bytes < c_need)
        return NPU_IME2_ERR_BUFFER_TOO_SMALL;
    return NPU_IME2_OK;
}

npu_ime2_status npu_ime2_run_path(int path, const uint8_t *a, const uint8_t *b, int64_t m, int64_t k, int64_t n,
                                  float *c)
{
    const npu_ime2_status usable = resolve_path(path, &path);
    if (usable != NPU_IME2_OK)
        return usable; /* before any work: the op never runs a path this CPU cannot run */
    switch (path) {
    case NPU_IME2_PATH_PORTABLE:
        npu_ime2_gemm_portable(a, b, m, k, n, c);
        return NPU_IME2_OK;
#ifdef NPU_IME2_HAVE_RVV
    case NPU_IME2_PATH_RVV:
        return npu_ime2_gemm_rvv(a, b, m, k, n, c);
#endif
#ifdef NPU_IME2_HAVE_IME2
    case NPU_IME2_PATH_IME2:
        return npu_ime2_gemm_ime2(a, b, m, k, n, c);
#endif
#ifdef NPU_IME2_HAVE_X86
    case NPU_IME2_PATH_X86:
        return npu_ime2_gemm_x86(a, b, m, k, n, c);
#endif
    default:
        return NPU_IME2_ERR_BAD_PATH;
    }
}

static int path_known(int path) { return path >= NPU_IME2_PATH_AUTO && path < NPU_IME2_PATH_COUNT; }

npu_ime2_status npu_ime2_gemm_check(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                    int64_t m, int64_t k, int64_t n, const float *c, size_t c_bytes, int path,
                                    size_t *b_need)
{
    if (!a_packed || !b_packed || !c)
        return NPU_IME2_ERR_NULL_POINTER;
    if (!path_known(path))
        return NPU_IME2_ERR_BAD_PATH;
    size_t a_need;
    npu_ime2_status st = check_gemm(m, k, n, c_bytes, &a_need, b_need);
    if (st != NPU_IME2_OK)
        return st;
    if (a_bytes < a_need || b_bytes < *b_need)
        return NPU_IME2_ERR_BAD_SHAPE; /* the inputs are too small for the stated shapes */
    return NPU_IME2_OK;
}

npu_ime2_status npu_ime2_gemm(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes, int64_t m,
                              int64_t k, int64_t n, float *c, size_t c_bytes, int path)
{
    size_t b_need;
    npu_ime2_status st = npu_ime2_gemm_check(a_packed, a_bytes, b_packed, b_bytes, m, k, n, c, c_bytes, path, &b_need);
    if (st != NPU_IME2_OK)
        return st;
    int concrete;
    if ((st = resolve_path(path, &concrete)) != NPU_IME2_OK)
        return st; /* also for an empty C: the path must be able to run here */
    if (m == 0 || n == 0)
        return NPU_IME2_OK;
    return npu_ime2_run_path(concrete, (const uint8_t *)a_packed, (const uint8_t *)b_packed, m, k, n, c);
}

npu_ime2_status npu_ime2_hp_gemm(const float *a, const uint8_t *qweight, const float *scales, int64_t m, int64_t k,
                                 int64_t n, float *c, size_t c_bytes)
{
    return npu_ime2_hp_gemm_on(a, qweight, scales, m, k, n, c, c_bytes, NPU_IME2_PATH_AUTO);
}

npu_ime2_status npu_ime2_hp_gemm_on(const float *a, const uint8_t *qweight, const float *scales, int64_t m, int64_t k,
                                    int64_t n, float *c, size_t c_bytes, int path)
{
    if (!a || !qweight || !scales || !c)
        return NPU_IME2_ERR_NULL_POINTER;
    if (!path_known(path))
        return NPU_IME2_ERR_BAD_PATH;
    size_t a_need, b_need;
    npu_ime2_status st = check_gemm(m, k, n, c_bytes, &a_need, &b_need);
    if (st != NPU_IME2_OK)
        return st;
    /* Finite checks before any work (A first, as the numpy specification does). */
    for (size_t i = 0; i < (size_t)(m * k); i++)
        if (!isfinite(a[i]))
            return NPU_IME2_ERR_NON_FINITE;
    for (size_t i = 0; i < (size_t)(n * (k / QK)); i++)
        if (!isfinite(scales[i]))
            return NPU_IME2_ERR_NON_FINITE;
    /* Where the GEMM runs: on the configured pool's pinned workers (the core fence on the K3:
     * the A100 cores), one slice each, else in this thread. The vlenb rule (and any unusable
     * explicit path) is checked there, after the argument checks and before any work: no
     * allocation, no packing, no vector instruction; also for an empty C. A pooled `path` stays
     * unresolved: each worker resolves AUTO on its own core. */
    const int workers = npu_ime2_pool_configured();
    if ((st = workers > 0 ? npu_ime2_pool_path_status(path) : resolve_path(path, &path)) != NPU_IME2_OK)
        return st;
    if (m == 0 || n == 0)
        return NPU_IME2_OK;
    uint8_t *ap = malloc(a_need);
    uint8_t *bp = malloc(b_need);
    if (!ap || !bp) {
        free(ap);
        free(bp);
        return NPU_IME2_ERR_NO_MEMORY;
    }
    /* Quantizing A and packing B run here, in the calling thread: C with no IME2 instruction,
     * built without a zvl flag (the compiler's memcpy/memset expansions are the only vector code,
     * VLEN-agnostic), so on the K3 they run on an X100 core. The GEMM runs where it was checked. */
    st = npu_ime2_quantize_a(a, m, k, ap, a_need);
    if (st == NPU_IME2_OK)
        st = npu_ime2_pack_b(qweight, scales, n, k, bp, b_need);
    if (st == NPU_IME2_OK)
        st = workers > 0 ? npu_ime2_gemm_mt(ap, a_need, bp, b_need, m, k, n, c, c_bytes, path, workers)
                         : npu_ime2_run_path(path, ap, bp, m, k, n, c);
    free(ap);
    free(bp);
    return st;
}
