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

#define NPU_IME2_ABI_VERSION 4

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
    NPU_IME2_ERR_WRONG_VLEN = 6,       /* IME2 path: vlenb != 128 (VLEN 1024 required) */
    NPU_IME2_ERR_BAD_PATH = 7,         /* unknown path, or a path not built into this library */
    NPU_IME2_ERR_NO_MEMORY = 8         /* workspace allocation failed (npu_ime2_hp_gemm) */
} npu_ime2_status;

typedef enum npu_ime2_path {
    NPU_IME2_PATH_AUTO = 0,     /* the first usable of: IME2, RVV, X86 (host SIMD), portable */
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
 * IME2 path when vlenb != 128. Never touches vector state beyond reading vlenb. */
npu_ime2_status npu_ime2_path_status(int path);

/* The concrete path NPU_IME2_PATH_AUTO runs on this CPU (never NPU_IME2_PATH_AUTO itself). */
int npu_ime2_auto_path(void);

/* The variant the X86 path runs on this CPU now (static string; never NULL): "avx512-vnni-fp16"
 * (AVX-512 F/BW/VL, VNNI and FP16 usable, and NPU_IME2_X86_ISA is not "avx2"), "avx2-f16c", or
 * "none" (the path is not built into this library, or the CPU lacks AVX2/F16C). Read at each
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
 * a_bytes / b_bytes are the sizes of the input buffers (checked against the shapes). */
npu_ime2_status npu_ime2_gemm(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                              int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path);

/* The same GEMM with its N tiles split over `threads` POSIX threads (1 .. NPU_IME2_MAX_THREADS;
 * the calling thread is one of them; at most one thread per 32-column tile). Bit-identical to
 * npu_ime2_gemm; same checks and statuses, plus NPU_IME2_ERR_BAD_SHAPE for a bad `threads` and
 * NPU_IME2_ERR_NO_MEMORY when its [M, N] scratch cannot be allocated. */
#define NPU_IME2_MAX_THREADS 256
npu_ime2_status npu_ime2_gemm_mt(const void *a_packed, size_t a_bytes, const void *b_packed, size_t b_bytes,
                                 int64_t m, int64_t k, int64_t n, float *c, size_t c_bytes, int path, int threads);

/* Q4_0-quantize a weight W [N, K] (float32, row-major, finite; K a positive multiple of 32) into
 * the op's inputs: qweight [N, K/32, 16] (q_bytes >= N*K/2) and scales [N, K/32] (s_bytes >=
 * N*K/32*4). The bits of npusim.q4x32.quantize_q4_0 (ggml's quantize_row_q4_0_ref). */
npu_ime2_status npu_ime2_quantize_q4_0(const float *w, int64_t n, int64_t k, uint8_t *qweight, size_t q_bytes,
                                       float *scales, size_t s_bytes);

/* The whole op: quantize A, pack B (allocating the workspaces), GEMM on the AUTO path. */
npu_ime2_status npu_ime2_hp_gemm(const float *a, const uint8_t *qweight, const float *scales, int64_t m,
                                 int64_t k, int64_t n, float *c, size_t c_bytes);

#ifdef __cplusplus
}
#endif

#endif /* NPU_IME2_H */
