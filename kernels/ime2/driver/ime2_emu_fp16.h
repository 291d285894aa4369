/*
 * ime2_emu_fp16.h - the IME2 emulator's own binary16 arithmetic: fp16 <-> fp32 conversion and
 * the per-output arithmetic of a vmadot*.hp instruction. Portable C11, header only (static
 * functions), so the host tests compile it alone and check it against numpy's float16.
 *
 * Written apart from the kernel on purpose: it includes nothing from kernels/ime2/src (in
 * particular not src/fp16.h, which computes in double); what the emulator and the kernel share
 * is only the specification (Zvvm_spacemit v0.6 section 5.4.3, shared reference ime2.md 4).
 *
 * Method: integers only, no floating-point arithmetic at all.
 *   - Conversions decode the IEEE fields and round with explicit guard/sticky bits.
 *   - Every value a .hp output handles is an integer multiple of 2**-24 (the fp16 subnormal
 *     step): fp16 values, products tmp * scale (|tmp| <= 7200 for int4), and their sums. In
 *     "units" of 2**-24 each fits an int64 exactly (|vd|, |scale| <= 65504 * 2**24 < 2**40,
 *     |tmp * scale| < 7200 * 2**40 < 2**53), so sums and products are exact and the only
 *     inexact step is the final RNE rounding to fp16, done once per rounding the mode asks for.
 *
 * Limits: fp32 -> fp16 handles every fp32 (NaN -> a quiet NaN with the sign kept, payload
 * dropped); fp16 -> fp32 is exact for every fp16 (NaN payloads kept, shifted into the top of
 * the fp32 significand). emu_hp_output expects |tmp| < 2**20 (int8 .hp tops out at 16 * 255 *
 * 255 = 1040400 < 2**20); larger tmp values are outside the .hp range and not supported.
 */
#ifndef NPU_IME2_EMU_FP16_H
#define NPU_IME2_EMU_FP16_H

#include <stdint.h>

#define EMU_F16_SIGN 0x8000u
#define EMU_F16_INF 0x7c00u
#define EMU_F16_QNAN 0x7e00u
#define EMU_F16_MAX 0x7bffu /* 65504 */

/* The open .hp details (npusim.q4x32.options): 0 = the first (default) value of each. */
typedef struct {
    int fused;    /* rounding: 0 unfused fp16(vd + fp16(t * scale)), 1 fused fp16(vd + t * scale) */
    int dot_exact; /* dot: 0 t = fp16(tmp), 1 t = tmp */
    int saturate; /* overflow: 0 +/-inf, 1 every infinite rounding result becomes +/-65504 */
} emu_hp_mode;

/* Number of significant bits of x (0 for 0). */
static inline int emu_bit_length(uint64_t x)
{
    int n = 0;
    while (x) {
        x >>= 1;
        n++;
    }
    return n;
}

/*
 * RNE of the non-negative value mag * 2**e2 to fp16, sign bit `sign` (0 or 0x8000). Results of
 * magnitude >= 65520 (the midpoint above 65504) are infinite. mag < 2**63.
 */
static inline uint16_t emu_round_f16(uint16_t sign, uint64_t mag, int e2)
{
    if (mag == 0)
        return sign;
    const int len = emu_bit_length(mag);
    const int top = len - 1 + e2; /* the value lies in [2**top, 2**(top+1)) */
    if (top > 15)
        return (uint16_t)(sign | EMU_F16_INF);
    /* keep the bits of weight >= 2**q_exp: 11 significant bits for normals, 2**-24 below */
    const int q_exp = top >= -14 ? top - 10 : -24;
    const int drop = q_exp - e2; /* low bits of mag to round away (<= 0: exact) */
    uint64_t q;
    if (drop <= 0) {
        q = mag << -drop; /* exact; q < 2**11 */
    } else if (drop > len) {
        q = 0; /* below half of the smallest step */
    } else { /* 1 <= drop <= len <= 63 */
        q = mag >> drop;
        const uint64_t rest = mag & ((UINT64_C(1) << drop) - 1);
        const uint64_t half = UINT64_C(1) << (drop - 1);
        if (rest > half || (rest == half && (q & 1u)))
            q++;
    }
    /* q * 2**q_exp. Normal: q in [2**10, 2**11], 2**11 after a carry. Subnormal: q <= 2**10. */
    if (top < -14)
        return (uint16_t)(sign | q); /* q == 1024 is the smallest normal, 0x0400: correct */
    int biased = top + 15; /* 1..30 */
    if (q == (UINT64_C(1) << 11)) {
        q >>= 1;
        biased++;
    }
    if (biased >= 31)
        return (uint16_t)(sign | EMU_F16_INF);
    return (uint16_t)(sign | ((unsigned)biased << 10) | (unsigned)(q & 0x3ffu));
}

/* fp32 bits -> fp16 bits, RNE, subnormals, overflow to inf (IEEE 754 convertFormat). */
static inline uint16_t emu_f32_to_f16(uint32_t f)
{
    const uint16_t sign = (uint16_t)((f >> 16) & EMU_F16_SIGN);
    const uint32_t exp = (f >> 23) & 0xffu;
    const uint32_t man = f & 0x7fffffu;
    if (exp == 0xffu)
        return (uint16_t)(sign | (man ? EMU_F16_QNAN : EMU_F16_INF));
    if (exp == 0)
        return emu_round_f16(sign, man, -149); /* fp32 subnormal (or zero) */
    return emu_round_f16(sign, man | 0x800000u, (int)exp - 150);
}

/* fp16 bits -> fp32 bits (exact). */
static inline uint32_t emu_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & EMU_F16_SIGN) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu)
        return sign | 0x7f800000u | (man << 13);
    if (exp == 0) {
        if (man == 0)
            return sign;
        int e = -14; /* value = man * 2**-24 = (man / 2**10) * 2**-14: normalise */
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        return sign | ((uint32_t)(e + 127) << 23) | ((man & 0x3ffu) << 13);
    }
    return sign | ((exp - 15u + 127u) << 23) | (man << 13);
}

/* ---- exact values in units of 2**-24 ---- */

enum { EMU_FINITE, EMU_INF, EMU_NAN };

typedef struct {
    int cls;      /* EMU_FINITE, EMU_INF, EMU_NAN */
    int neg;      /* sign (also of zeros and infinities) */
    uint64_t mag; /* |value| / 2**-24 when finite */
} emu_num;

/* The exact value of an fp16 bit pattern, read through emu_f16_to_f32. */
static inline emu_num emu_from_f16(uint16_t h)
{
    const uint32_t f = emu_f16_to_f32(h);
    emu_num v = {EMU_FINITE, (int)(f >> 31), 0};
    const uint32_t exp = (f >> 23) & 0xffu;
    const uint32_t man = f & 0x7fffffu;
    if (exp == 0xffu) {
        v.cls = man ? EMU_NAN : EMU_INF;
        return v;
    }
    if (exp == 0)
        return v; /* zero (an fp16 value is never an fp32 subnormal) */
    /* (man | 2**23) * 2**(exp - 150) in units of 2**-24: shift by exp - 126 (>= -13 here; the
     * bits shifted out are zero because the value is an fp16 value) */
    const int shift = (int)exp - 126;
    const uint64_t sig = man | 0x800000u;
    v.mag = shift >= 0 ? sig << shift : sig >> -shift;
    return v;
}

/* RNE to fp16 (saturate: an infinite result becomes +/-65504; NaN stays NaN). */
static inline uint16_t emu_to_f16(emu_num v, int saturate)
{
    const uint16_t sign = v.neg ? (uint16_t)EMU_F16_SIGN : 0;
    uint16_t h;
    if (v.cls == EMU_NAN)
        return (uint16_t)(sign | EMU_F16_QNAN);
    h = v.cls == EMU_INF ? (uint16_t)(sign | EMU_F16_INF) : emu_round_f16(sign, v.mag, -24);
    if (saturate && (h & 0x7fffu) == EMU_F16_INF)
        h = (uint16_t)(sign | EMU_F16_MAX);
    return h;
}

/* The exact product t * x for an integer t (|t| < 2**20) and an fp16 value x (0 * inf = NaN). */
static inline emu_num emu_mul_int(int64_t t, emu_num x)
{
    emu_num p = {x.cls, x.neg ^ (t < 0), 0};
    const uint64_t at = (uint64_t)(t < 0 ? -t : t);
    if (x.cls == EMU_INF && at == 0)
        p.cls = EMU_NAN;
    else if (x.cls == EMU_FINITE)
        p.mag = at * x.mag;
    return p;
}

/* The product of an infinity (sign neg) and an fp16 value x: NaN for x zero or NaN. */
static inline emu_num emu_mul_inf(int neg, emu_num x)
{
    emu_num p = {EMU_INF, neg ^ x.neg, 0};
    if (x.cls == EMU_NAN || (x.cls == EMU_FINITE && x.mag == 0))
        p.cls = EMU_NAN;
    return p;
}

/* The exact sum a + b (IEEE signs: x + (-x) = +0, -0 + -0 = -0, inf - inf = NaN). */
static inline emu_num emu_add(emu_num a, emu_num b)
{
    emu_num s = {EMU_FINITE, 0, 0};
    if (a.cls == EMU_NAN || b.cls == EMU_NAN) {
        s.cls = EMU_NAN;
        return s;
    }
    if (a.cls == EMU_INF || b.cls == EMU_INF) {
        if (a.cls == EMU_INF && b.cls == EMU_INF && a.neg != b.neg) {
            s.cls = EMU_NAN;
            return s;
        }
        s.cls = EMU_INF;
        s.neg = a.cls == EMU_INF ? a.neg : b.neg;
        return s;
    }
    if (a.mag == 0 && b.mag == 0) {
        s.neg = a.neg && b.neg;
        return s;
    }
    const int64_t x = a.neg ? -(int64_t)a.mag : (int64_t)a.mag;
    const int64_t y = b.neg ? -(int64_t)b.mag : (int64_t)b.mag;
    const int64_t sum = x + y;
    s.neg = sum < 0;
    s.mag = (uint64_t)(sum < 0 ? -sum : sum);
    return s;
}

/*
 * One output of a .hp instruction: vd + (fp16)tmp * scale, with the roundings of `mode`:
 *   t      = fp16(tmp) (dot fp16, an integer for |tmp| < 65520) | tmp (dot exact)
 *   result = fp16(vd + fp16(t * scale))   (unfused) | fp16(vd + t * scale)   (fused)
 * each fp16 rounding RNE with subnormals; overflow per mode->saturate.
 */
static inline uint16_t emu_hp_output(uint16_t vd, int32_t tmp, uint16_t scale, const emu_hp_mode *mode)
{
    const emu_num sc = emu_from_f16(scale);
    emu_num p;
    if (mode->dot_exact) {
        p = emu_mul_int(tmp, sc);
    } else {
        const uint64_t at = (uint64_t)(tmp < 0 ? -(int64_t)tmp : (int64_t)tmp);
        const emu_num t = emu_from_f16(emu_to_f16((emu_num){EMU_FINITE, tmp < 0, at << 24}, mode->saturate));
        /* fp16(tmp) is an integer (fp16 values >= 1024 have a step >= 1), or infinite */
        p = t.cls == EMU_INF ? emu_mul_inf(t.neg, sc)
                             : emu_mul_int(t.neg ? -(int64_t)(t.mag >> 24) : (int64_t)(t.mag >> 24), sc);
    }
    if (!mode->fused)
        p = emu_from_f16(emu_to_f16(p, mode->saturate));
    return emu_to_f16(emu_add(emu_from_f16(vd), p), mode->saturate);
}

#endif /* NPU_IME2_EMU_FP16_H */
