/*
 * x86_throughput.c - throughput of the instructions the IME2 host kernel's X86 path is made of
 * (kernels/ime2/src/gemm_x86.c), on this CPU, in core clock cycles per instruction (issue 12).
 *
 *     cc -O2 -o /tmp/x86_throughput benchmarks/x86_throughput.c && /tmp/x86_throughput
 *
 * Each line runs one operation on 8 independent register chains for 50 M rounds (so latency is
 * hidden and the figure is the issue rate), and divides the time by the number of operations.
 * Cycles come from the core clock measured the same way: a chain of dependent scalar adds retires
 * one per cycle. Lines whose instructions this CPU lacks are reported as such. The compiler flags
 * of the kernel apply (no -march: per-function target attributes).
 *
 * What the figures say (docs/benchmarks.md, "Why the floor is not reached"): an fp16 rounding as
 * the kernel did it before (VCVTPS2PH + VCVTPH2PS) costs several times an int dot instruction, and
 * three plain fp32 operations (v16, Veltkamp's split) cost less than the conversion pair.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ROUNDS 50000000L

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Seconds per cycle: ROUNDS x 4 dependent adds, one cycle each. */
static double cycle_seconds(void)
{
    long x = 0;
    const double t0 = now();
    for (long i = 0; i < ROUNDS; i++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return (now() - t0) / (4.0 * ROUNDS);
}

/* One benchmark body: 8 chains a0..a7 of `op`, kept in registers by an empty asm each round. */
#define CHAINS(type, init, op)                                                                          \
    type m = init, a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init; \
    const double t0 = now();                                                                            \
    for (long i = 0; i < ROUNDS; i++) {                                                                 \
        a0 = op(a0, m); a1 = op(a1, m); a2 = op(a2, m); a3 = op(a3, m);                                 \
        a4 = op(a4, m); a5 = op(a5, m); a6 = op(a6, m); a7 = op(a7, m);                                 \
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),    \
                         "+x"(a7), "+x"(m));                                                            \
    }                                                                                                   \
    return (now() - t0) / (8.0 * ROUNDS);

#define A2 __attribute__((target("avx2,f16c"), noinline))
#define A5 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni"), noinline))

#define OP_MADDUBS(a, m) _mm256_maddubs_epi16(m, a)
#define OP_PADDW(a, m) _mm256_add_epi16(a, m)
#define OP_ADDPS(a, m) _mm256_add_ps(a, m)
#define OP_MULPS(a, m) _mm256_mul_ps(a, m)
#define OP_CVT(a, m) _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT))
#define OP_V16(a, m) _mm256_sub_ps(_mm256_mul_ps(a, m), _mm256_sub_ps(_mm256_mul_ps(a, m), a))
#define OP_DPB_Y(a, m) _mm256_dpbusd_epi32(a, m, m)
#define OP_DPB_Z(a, m) _mm512_dpbusd_epi32(a, m, m)
#define OP_ADDPS_Z(a, m) _mm512_add_ps(a, m)
#define OP_CVT_Z(a, m) _mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define OP_V16_Z(a, m) _mm512_sub_ps(_mm512_mul_ps(a, m), _mm512_sub_ps(_mm512_mul_ps(a, m), a))

A2 static double t_maddubs(void) { CHAINS(__m256i, _mm256_set1_epi8(1), OP_MADDUBS) }
A2 static double t_paddw(void) { CHAINS(__m256i, _mm256_set1_epi8(1), OP_PADDW) }
A2 static double t_addps(void) { CHAINS(__m256, _mm256_set1_ps(1.0f), OP_ADDPS) }
A2 static double t_mulps(void) { CHAINS(__m256, _mm256_set1_ps(1.0f), OP_MULPS) }
A2 static double t_cvt(void) { CHAINS(__m256, _mm256_set1_ps(1.0f), OP_CVT) }
A2 static double t_v16(void) { CHAINS(__m256, _mm256_set1_ps(8193.0f), OP_V16) }
A5 static double t_dpb_y(void) { CHAINS(__m256i, _mm256_set1_epi8(1), OP_DPB_Y) }
A5 static double t_dpb_z(void) { CHAINS(__m512i, _mm512_set1_epi8(1), OP_DPB_Z) }
A5 static double t_addps_z(void) { CHAINS(__m512, _mm512_set1_ps(1.0f), OP_ADDPS_Z) }
A5 static double t_cvt_z(void) { CHAINS(__m512, _mm512_set1_ps(1.0f), OP_CVT_Z) }
A5 static double t_v16_z(void) { CHAINS(__m512, _mm512_set1_ps(8193.0f), OP_V16_Z) }

int main(void)
{
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    const int vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    const double cyc = cycle_seconds();
    printf("core clock: %.2f GHz (dependent scalar adds)\n", 1e-9 / cyc);
    printf("%-58s %s\n", "operation (8 independent chains)", "cycles per operation");
    const struct {
        const char *name;
        int needs_vnni;
        double (*fn)(void);
    } rows[] = {
        {"VPMADDUBSW ymm (32 u8 x s8 products)", 0, t_maddubs},
        {"VPADDW ymm", 0, t_paddw},
        {"VADDPS ymm", 0, t_addps},
        {"VMULPS ymm", 0, t_mulps},
        {"fp16 rounding, VCVTPS2PH + VCVTPH2PS ymm (r16)", 0, t_cvt},
        {"fp16 rounding, VMULPS + 2 VSUBPS ymm (v16, Veltkamp)", 0, t_v16},
        {"VPDPBUSD ymm (32 u8 x s8 products)", 1, t_dpb_y},
        {"VPDPBUSD zmm (64 u8 x s8 products)", 1, t_dpb_z},
        {"VADDPS zmm", 1, t_addps_z},
        {"fp16 rounding, VCVTPS2PH + VCVTPH2PS zmm (r16z)", 1, t_cvt_z},
        {"fp16 rounding, VMULPS + 2 VSUBPS zmm (v16z, Veltkamp)", 1, t_v16_z},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        if (!avx2 || (rows[i].needs_vnni && !vnni))
            printf("%-58s (not on this CPU)\n", rows[i].name);
        else
            printf("%-58s %.2f\n", rows[i].name, rows[i].fn() / cyc);
    }
    return 0;
}
