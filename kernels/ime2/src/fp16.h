/*
 * fp16.h - IEEE 754 binary16 helpers for the portable kernel (internal header).
 *
 * Values are carried as uint16_t bit patterns. Arithmetic follows npusim/q4x32/fp16.py: the
 * exact result is formed in double (products of two fp16 values, sums of two fp16 values and
 * integers below 2**53 are exact in double) and rounded ONCE to fp16 with round-to-nearest-even,
 * subnormals included, overflow to +/-inf. No _Float16 and no excess-precision semantics are
 * relied on. Build with -ffp-contract=off so the compiler never fuses a multiply and an add.
 */
#ifndef NPU_IME2_FP16_H
#define NPU_IME2_FP16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t f16_t;

/* double -> fp16, round to nearest even (one rounding). NaN -> quiet NaN with the sign kept. */
static inline f16_t f16_from_double(double x)
{
    uint64_t b;
    memcpy(&b, &x, sizeof b);
    const uint16_t sign = (uint16_t)((b >> 48) & 0x8000u);
    const uint32_t exp = (uint32_t)((b >> 52) & 0x7ffu);
    const uint64_t man = b & ((UINT64_C(1) << 52) - 1);
    if (exp == 0x7ffu)
        return (uint16_t)(sign | (man ? 0x7e00u : 0x7c00u));
    if (exp == 0)
        return sign; /* double zero or subnormal: far below half the smallest fp16 subnormal */
    const int e = (int)exp - 1023;
    if (e > 15)
        return (uint16_t)(sign | 0x7c00u);
    const uint64_t sig = man | (UINT64_C(1) << 52); /* 53 significant bits */
    const int normal = e >= -14;
    const int shift = normal ? 42 : 42 + (-14 - e);
    if (shift > 60)
        return sign; /* < 2**-26: rounds to zero */
    uint64_t keep = sig >> shift;
    const uint64_t rem = sig & ((UINT64_C(1) << shift) - 1);
    const uint64_t half = UINT64_C(1) << (shift - 1);
    if (rem > half || (rem == half && (keep & 1u)))
        keep++;
    if (normal) {
        uint32_t he = (uint32_t)(e + 15);
        if (keep == (UINT64_C(1) << 11)) {
            keep >>= 1;
            he++;
        }
        if (he >= 31)
            return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | (he << 10) | (uint32_t)(keep & 0x3ffu));
    }
    /* subnormal result; keep == 1024 carries into the smallest normal (0x0400), as it should */
    return (uint16_t)(sign | (uint32_t)keep);
}

/* float -> fp16 (float -> double is exact, so this is one rounding). */
static inline f16_t f16_from_float(float x) { return f16_from_double((double)x); }

/* fp16 -> float (exact). */
static inline float f16_to_float(f16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-08f; /* man * 2**-24, exact */
        return sign ? -v : v;
    }
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline double f16_to_double(f16_t h) { return (double)f16_to_float(h); }

/* fp16(a * b): the product of two fp16 values is exact in double. */
static inline f16_t f16_mul(f16_t a, f16_t b) { return f16_from_double(f16_to_double(a) * f16_to_double(b)); }

/* fp16(a + b): the sum of two fp16 values is exact in double. */
static inline f16_t f16_add(f16_t a, f16_t b) { return f16_from_double(f16_to_double(a) + f16_to_double(b)); }

/* fp16(i) for an integer |i| < 2**53. */
static inline f16_t f16_from_int(int64_t i) { return f16_from_double((double)i); }

/*
 * fp16 rounding without leaving double: the double value of f16_from_double(x), i.e. x rounded
 * to the nearest fp16 value (RNE), +/-inf beyond 65504, NaN kept. Equivalent to
 * f16_to_double(f16_from_double(x)) (the tests compare the GEMM built on it with numpy bit for
 * bit); used by the GEMM inner loop, where most values never need their fp16 bit pattern.
 */
static inline double f16_round(double x)
{
    uint64_t b;
    memcpy(&b, &x, sizeof b);
    const uint64_t sign = b & UINT64_C(0x8000000000000000);
    const uint64_t mag = b ^ sign;
    if (mag >= UINT64_C(0x3f10000000000000)) { /* |x| >= 2**-14: fp16 normal range or beyond */
        if (mag >= UINT64_C(0x7ff0000000000000))
            return x; /* inf, NaN */
        /* round the 52-bit fraction to 10 bits, ties to even; a carry moves into the exponent */
        uint64_t r = mag + ((UINT64_C(1) << 41) - 1) + ((mag >> 42) & 1u);
        r &= ~((UINT64_C(1) << 42) - 1);
        if (r > UINT64_C(0x40effc0000000000)) /* > 65504.0 */
            r = UINT64_C(0x7ff0000000000000);
        b = sign | r;
        double y;
        memcpy(&y, &b, sizeof y);
        return y;
    }
    /* subnormal fp16 range: round to a multiple of 2**-24 (|x| < 2**-14, so the sum is exact
     * up to that rounding, which is RNE in the current (default) rounding mode) */
    const double big = 402653184.0; /* 1.5 * 2**28: its ulp is 2**-24 */
    double a;
    memcpy(&a, &mag, sizeof a);
    volatile double t = a + big; /* volatile: keep the two operations (no -ffast-math anyway) */
    double y = t - big;
    uint64_t yb;
    memcpy(&yb, &y, sizeof yb);
    yb |= sign;
    memcpy(&y, &yb, sizeof y);
    return y;
}

#endif /* NPU_IME2_FP16_H */
