/*
 * npu_ime2.h - C ABI of the Q4_0 x 32 IME2 HP GEMM kernel (npu-harness issue 3, section 2).
 *
 *   C[M, N] = A[M, K] @ dequant(qweight, scales)^T
 *
 * Inputs (the op's format, see docs/ime2.md):
 *   A        float32 [M, K], row-major, finite, M >= 0
 *   qweight  uint8   [N, K/32, 16]: byte b of a block holds K element 2b (bits 3:0) and 2b+1
 *                    (bits 7:4); unsigned codes 0..15, zero point 8
 *   scales   float32 [N, K/32], finite
 *   K        a positive multiple of 32 (need not be a multiple of 256)
 *
 * Every function returns a status code. Output buffers are provided by the caller with their
 * size in bytes; a function never writes outside [out, out + out_bytes) and writes nothing at
 * all when it returns an error. Packed layouts and arithmetic are those of the numpy
 * executable specification npusim.q4x32 (level="hardware"), bit for bit.
 */
#ifndef NPU_IME2_H
#define NPU_IME2_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI 5 (issue 15) added npu_ime2_auto_path_with, npu_ime2_set_allow_fallback,
 * npu_ime2_allow_fallback, npu_ime2_vlenb and npu_ime2_hp_gemm_on (the vlenb rule, below), and the
 * worker pool of npu_ime2_gemm_mt with npu_ime2_pool_start, npu_ime2_pool_configure,
 * npu_ime2_pool_shutdown, npu_ime2_pool_get_info and npu_ime2_pool_get_worker (their structs
 * npu_ime2_pool_info and npu_ime2_pool_worker_info; "thread pinning", below). */
#define NPU_IME2_ABI_VERSION 5

/* Bytes of one packed B block (K32 x N32: 32 fp16 scales + 512 nibble bytes). */
#define NPU_IME2_B_BLOCK_BYTES 576
/* Bytes of one quantized A row per 256-K superblock. */
#define NPU_IME2_A_BLOCK_BYTES 290

typedef enum npu_ime2_status {
    NPU_IME2_OK = 0,
    NPU_IME2_ERR_BAD_K = 1,            /* K is not a positive multiple of 32 */
    NPU_IME2_ERR_BAD_SHAPE = 2,        /* M < 0, N < 1 (packing) or N < 0, or a size overflows */
    NPU_IME2_ERR_NULL_POINTER = 3,     /* a required pointer is NULL */
    NPU_IME2_ERR_NON_FINITE = 4,       /* NaN or +/-Inf in A or scales */
    NPU_IME2_ERR_BUFFER_TOO_SMALL = 5, /* an output buffer is smaller than the required size */
    NPU_IME2_ERR_WRONG_VLEN = 6,       /* IME2 path, or AUTO / the whole op on the K3 build without
                                          the fallback opt-in: vlenb != 128 (VLEN 1024 required) */
    NPU_IME2_ERR_BAD_PATH = 7,         /* unknown path, or a path not built into this library */
    NPU_IME2_ERR_NO_MEMORY = 8         /* workspace allocation failed (npu_ime2_hp_gemm) */
} npu_ime2_status;

typedef enum npu_ime2_path {
    NPU_IME2_PATH_AUTO = 0,     /* the K3 build: IME2 (no fallback unless opted in, see below);
                                   other builds: the first usable of RVV, X86 (host SIMD), portable */
    NPU_IME2_PATH_PORTABLE = 1, /* portable C, any architecture */
    NPU_IME2_PATH_RVV = 2,      /* RVV 1.0 intrinsics, VLEN-agnostic (riscv64 builds only) */
    NPU_IME2_PATH_IME2 = 3,     /* vmadot*.hp emitted with .insn, VLEN 1024 only (riscv64 builds) */
    NPU_IME2_PATH_X86 = 4       /* x86-64 AVX2 + F16C, same results as portable bit for bit */
} npu_ime2_path;

/* Number of path values (AUTO included); valid paths are 0 .. NPU_IME2_PATH_COUNT - 1. */
#define NPU_IME2_PATH_COUNT 5

/* Human-readable name of a status code (static string; never NULL). */
const char *npu_ime2_status_string(int status);

/* ABI version of the loaded library (NPU_IME2_ABI_VERSION). */
int npu_ime2_abi_version(void);

/* Whether `path` can run here: NPU_IME2_OK; NPU_IME2_ERR_BAD_PATH when the path is unknown, not
 * built into this library, or needs CPU features this CPU lacks; NPU_IME2_ERR_WRONG_VLEN for the
 * IME2 path when vlenb != 128. For NPU_IME2_PATH_AUTO: the status of npu_ime2_auto_path()
 * (since ABI 5; before, always OK). Never touches vector state beyond reading vlenb. */
npu_ime2_status npu_ime2_path_status(int path);

/*
 * AUTO and the vlenb rule (ABI 5). The rule applies to the K3 build only: a library with the
 * IME2 path compiled in (NPU_IME2_HAVE_IME2: src/gemm_ime2.c in a riscv64 build, the board's
 * native build and the riscv64 cross build alike). There AUTO is the IME2 path, so AUTO, the
 * whole op and npu_ime2_gemm(_mt) with AUTO return NPU_IME2_ERR_WRONG_VLEN unless vlenb == 128,
 * before any other work (packing, quantizing, vector instructions). Only an explicit opt-in,
 * npu_ime2_set_allow_fallback(1), makes AUTO fall back there to the first usable of RVV and
 * portable when vlenb != 128. Every other build (x86-64 hosts; riscv64 builds without the IME2
 * path) ignores the setting: AUTO is the first usable of RVV, X86, portable, as before ABI 5.
 * Explicit paths (PORTABLE, RVV, IME2, X86) never fall back and ignore the setting.
 */

/* The concrete path NPU_IME2_PATH_AUTO runs on this CPU under the current fallback setting
 * (never NPU_IME2_PATH_AUTO itself). On the K3 build without the opt-in this is always
 * NPU_IME2_PATH_IME2, whose status then says whether it can run. */
int npu_ime2_auto_path(void);

/* The same for an explicit choice: allow_fallback != 0 as if the opt-in were set (ABI 5). */
int npu_ime2_auto_path_with(int allow_fallback);

/* Process-wide fallback opt-in (ABI 5): 0 (the default) = AUTO on the K3 build refuses with
 * NPU_IME2_ERR_WRONG_VLEN when vlenb != 128; non-zero = AUTO falls back to RVV / portable.
 * Atomic; the library never reads it from the environment (the Python binding maps
 * NPU_IME2_ALLOW_FALLBACK onto it). */
void npu_ime2_set_allow_fallback(int allow);
int npu_ime2_allow_fallback(void);

/* vlenb (bytes per vector register: VLEN / 8) read with `csrr vlenb` on the hart running the
 * calling thread now; 0 in a build without the V extension (x86-64, any non-RVV build). Reads
 * no other vector state (ABI 5). */
int npu_ime2_vlenb(void);

/* The variant the X86 path runs on this CPU now (static string; never NULL): "avx512-vnni-fp16"
 * (AVX-512 F/BW/VL, VNNI and FP16 usable, and NPU_IME2_X86_ISA is neither "avx2" nor
 * "avx512-vnni"), "avx512-vnni-f16c" (AVX-512 F/BW/VL and VNNI usable without FP16, or capped there
 * by NPU_IME2_X86_ISA=avx512-vnni), "avx2-f16c", or "none" (the path is not built into this library, or the CPU lacks AVX2/F16C). Read at each
 * call, like the GEMM's own choice. Added in ABI version 4. */
const char *npu_ime2_x86_variant(void);

/* Bytes of packed B: ceil(N/32) * ceil(K/256) * 8 * 576. Requires N >= 1. */
npu_ime2_status npu_ime2_b_packed_size(int64_t n, int64_t k, size_t *bytes);

/* Bytes of quantized A: M * ceil(K/256) * 290. M may be 0. */
npu_ime2_status npu_ime2_a_packed_size(int64_t m, int64_t k, size_t *bytes);

/* Pack qweight [N, K/32, 16] and scales [N, K/32] into B tiles (npusim.q4x32.pack_b bytes).
 * out_bytes must be >= npu_ime2_b_packed_size(N, K); exactly that many bytes are written. */
npu_ime2_status npu_ime2_pack_b(const uint8_t *qweight, const float *scales, int64_t n, int64_t k,
                                void *out, size_t out_bytes);

/* Quantize A [M, K] to the kernel's rows (npusim.q4x32.pack_a(quantize_a(A)) bytes): 4-row
 * groups first, then the M % 4 remaining rows one at a time. out_bytes must be >=
 * npu_ime2_a_packed_size(M, K); exactly that many bytes are written. */
npu_ime2_status npu_ime2_quantize_a(const float *a, int64_t m, int64_t k, void *out, size_t out_bytes);

/* C[M, N] (float32, row-major) from quantized A and packed B. c_bytes >= M * N * 4.
 * a_bytes / b_bytes are the sizes of the input buffers (checked against the shapes). After the
 * argument checks the path (AUTO resolved) must be usable, also for M == 0 or N == 0 (ABI 5). */
npu_ime2_status npu_ime2_gemm(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                              int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path);

/* The same GEMM with its N tiles split into slices (`threads`: 1 .. NPU_IME2_MAX_THREADS; at most
 * one slice per 32-column tile, and on a configured pool at most one per configured worker), slice
 * i on worker i of the library's persistent worker pool ("thread pinning", below). The calling
 * thread computes no slice: it checks the arguments, hands the slices out, waits and copies them
 * into C; only an unconfigured pool with a single slice runs it in the calling thread, as
 * npu_ime2_gemm. AUTO is resolved, and the path checked, where each slice runs (a worker's core).
 * Bit-identical to npu_ime2_gemm; same checks and statuses, plus NPU_IME2_ERR_BAD_SHAPE for a bad
 * `threads` and NPU_IME2_ERR_NO_MEMORY when its [M, N] scratch cannot be allocated. */
#define NPU_IME2_MAX_THREADS 256
npu_ime2_status npu_ime2_gemm_mt(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                 int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path, int threads);

/* Q4_0-quantize a weight W [N, K] (float32, row-major, finite; K a positive multiple of 32) into
 * the op's inputs: qweight [N, K/32, 16] (q_bytes >= N*K/2) and scales [N, K/32] (s_bytes >=
 * N*K/32*4). The bits of npusim.q4x32.quantize_q4_0 (ggml's quantize_row_q4_0_ref). */
npu_ime2_status npu_ime2_quantize_q4_0(const float *w, int64_t n, int64_t k, uint8_t *qweight, size_t q_bytes,
                                       float *scales, size_t s_bytes);

/* The whole op: quantize A, pack B (allocating the workspaces), GEMM on the AUTO path. The path
 * is resolved and its status checked after the argument checks and before anything else (also
 * for M == 0 or N == 0): on the K3 build, vlenb != 128 without the fallback opt-in returns
 * NPU_IME2_ERR_WRONG_VLEN (see "AUTO and the vlenb rule" above). Quantizing A and packing B run
 * in the calling thread (no IME2 instruction). The GEMM runs in the calling thread too, unless
 * the worker pool is configured (npu_ime2_pool_configure: the core fence on the K3): then it runs
 * as npu_ime2_gemm_mt with one slice per configured worker, and the path check is made by worker
 * 0 on its core, not in the calling thread. Bit-identical either way. */
npu_ime2_status npu_ime2_hp_gemm(const float *a, const uint8_t *qweight, const float *scales, int64_t m,
                                 int64_t k, int64_t n, float *c, size_t c_bytes);

/* The whole op on an explicit `path` (NPU_IME2_PATH_AUTO: as npu_ime2_hp_gemm). ABI 5. */
npu_ime2_status npu_ime2_hp_gemm_on(const float *a, const uint8_t *qweight, const float *scales, int64_t m,
                                    int64_t k, int64_t n, float *c, size_t c_bytes, int path);

/* ---- thread pinning (issue 15, ABI 5) ---------------------------------------------------------
 * npu_ime2_gemm_mt runs its slices on a persistent per-process pool of worker threads (threads.c):
 * created when first needed, then reused, never per call; slice i runs on worker i and the calling
 * thread only waits (it computes nothing itself, except that an unconfigured pool with one slice
 * runs inline, as npu_ime2_gemm). Unconfigured, the pool grows to the largest slice count asked for
 * and its workers are not pinned. npu_ime2_pool_configure pins worker i to cpus[i]; from then on
 * every npu_ime2_gemm_mt call runs on those workers only, with min(threads, n, tiles) slices, and
 * so does the GEMM of the whole op (npu_ime2_hp_gemm, npu_ime2_hp_gemm_on) with threads = n.
 * After fork() the child's pool is empty and unconfigured (counters at 0); a destructor joins the
 * idle workers at exit / dlclose. One GEMM at a time uses the pool (concurrent callers wait).
 * These functions return 0 or a positive errno value (they are not npu_ime2_status codes). */

/* Highest CPU number npu_ime2_pool_configure accepts (CPU_SETSIZE - 1 on Linux). */
#define NPU_IME2_POOL_MAX_CPU 1023

typedef struct npu_ime2_pool_info {
    int32_t size;       /* workers alive */
    int32_t configured; /* 0, or the number of pinned workers every GEMM runs on */
    int64_t created;    /* worker threads created in this process (since start, or since fork) */
} npu_ime2_pool_info;

typedef struct npu_ime2_pool_worker_info {
    int64_t tid;      /* kernel thread id (gettid): what /proc/set_ai_thread and sched_getaffinity take */
    int32_t cpu;      /* the CPU npu_ime2_pool_configure pinned it to, -1 when not pinned */
    int32_t last_cpu; /* the CPU its last slice ended on (sched_getcpu), -1 before its first slice */
    int32_t last_vlenb; /* npu_ime2_vlenb() read right after its last slice, -1 before the first */
    int32_t reserved;   /* 0 */
    int64_t slices;     /* slices it has run (an empty GEMM's path check counts as one) */
} npu_ime2_pool_worker_info;

/* Makes sure at least n workers (1 .. NPU_IME2_MAX_THREADS) exist; new ones are idle, unpinned,
 * and have run no code of this library but their wait loop. 0, EINVAL (n out of range), or the
 * error of pthread_create (EAGAIN; the workers started before it stay). */
int npu_ime2_pool_start(int n);

/* Pins worker i to cpus[i] for i < n (creating workers as needed); every later npu_ime2_gemm_mt
 * runs on workers 0 .. n-1 only. n == 0 unconfigures: the workers are stopped and joined (a pinned
 * thread cannot always be unpinned) and later GEMMs start fresh unpinned ones. Returns 0; EINVAL
 * when n is outside 0 .. NPU_IME2_MAX_THREADS, cpus is NULL with n > 0, or cpus[i] is outside
 * 0 .. NPU_IME2_POOL_MAX_CPU or repeats an earlier entry; the error of pthread_create; or the error
 * of pthread_setaffinity_np (EINVAL: the CPU is offline or not allowed to this thread). On an
 * error *failed_index (if not NULL) is the offending index of cpus (-1 when it is no single entry)
 * and the pool is left unconfigured (pins made before the failure stay). */
int npu_ime2_pool_configure(const int *cpus, int n, int *failed_index);

/* Stops and joins every worker (the pool becomes empty and unconfigured; `created` is kept). */
void npu_ime2_pool_shutdown(void);

/* The pool's counters. 0, or EINVAL when out is NULL. */
int npu_ime2_pool_get_info(npu_ime2_pool_info *out);

/* Worker i (0 .. size - 1). 0, or EINVAL when out is NULL or there is no worker i. */
int npu_ime2_pool_get_worker(int i, npu_ime2_pool_worker_info *out);

#ifdef __cplusplus
}
#endif

#endif /* NPU_IME2_H */
