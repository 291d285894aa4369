/*
 * driver.c - test driver of the IME2 kernel for riscv64 under QEMU (issue 3, section 3).
 *
 *   npu_ime2_driver [--allow-fallback] [REQUEST_FILE]   (no file or "-": the request is read from stdin)
 *
 * --allow-fallback calls npu_ime2_set_allow_fallback(1) before the request runs: AUTO and the
 * whole op then fall back to RVV / portable when vlenb != 128 instead of returning
 * NPU_IME2_ERR_WRONG_VLEN (npu_ime2.h, "AUTO and the vlenb rule").
 *
 * Reads one request, runs the kernel through its C ABI, writes one response to stdout. All
 * integers are little-endian; float32 is IEEE binary32 little-endian.
 *
 * Request (72-byte header, then the three arrays back to back):
 *   off  size  field
 *     0     8  magic "NPUIME2Q"
 *     8     4  uint32 version = 1
 *    12     4  int32  path: -1 = npu_ime2_hp_gemm (the whole op);
 *                           0..3 = npu_ime2_quantize_a + npu_ime2_pack_b, then npu_ime2_gemm with
 *                           that path (0 auto, 1 portable, 2 rvv, 3 ime2; others are passed as is)
 *    16     8  int64  M
 *    24     8  int64  K
 *    32     8  int64  N
 *    40     8  uint64 a_bytes  (normally M*K*4)       A       float32 [M, K]
 *    48     8  uint64 q_bytes  (normally N*K/32*16)   qweight uint8   [N, K/32, 16]
 *    56     8  uint64 s_bytes  (normally N*K/32*4)    scales  float32 [N, K/32]
 *    64     8  reserved, 0
 *    72        A, qweight, scales (a_bytes + q_bytes + s_bytes bytes)
 *
 * Response (48-byte header, then the status text, then C):
 *     0     8  magic "NPUIME2R"
 *     8     4  int32  status (npu_ime2_status; 0 = ok)
 *    12     4  int32  vlenb read with `csrr vlenb` (-1 when built without the V extension)
 *    16     4  int32  guards_ok: 1 when every guard region came back untouched
 *    20     4  uint32 text_len: bytes of the status text that follows the header
 *    24     8  int64  M
 *    32     8  int64  N
 *    40     8  uint64 c_bytes: bytes of C after the text (M*N*4 when status is 0, else 0)
 *    48        status text (npu_ime2_status_string, no NUL), then C float32 [M, N]
 *
 * Guards: C and (for path >= 0) the packed A and B workspaces are allocated with 4 KiB of
 * 0xA5 before and after them (C itself is prefilled with 0xA5 too). If any guard byte changed,
 * the driver still writes the response (guards_ok = 0), prints a message naming the buffer on
 * stderr and exits with status 3.
 *
 * Exit status: 0 response written, guards intact (whatever the kernel status); 2 bad request or
 * I/O error (message on stderr, no response); 3 guard region touched.
 *
 * IME2 under QEMU: when built with driver/ime2_emu.c (NPU_IME2_HAVE_EMU) the driver first
 * installs the SIGILL emulator of vmadot*.hp (ime2_emu.h: options NPU_IME2_EMU_*; with
 * NPU_IME2_EMU_COUNT=1 it prints "npu_ime2_emu: emulated=<n>" on stderr at the end).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npu_ime2.h"
#ifdef NPU_IME2_HAVE_EMU
#include "ime2_emu.h" /* SIGILL emulation of vmadot*.hp under QEMU (inert when none runs) */
#endif

#define GUARD 4096
#define GUARD_BYTE 0xA5
#define REQ_HEADER 72
#define RESP_HEADER 48
#define MAX_INPUT_BYTES ((uint64_t)1 << 30)

static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static int32_t read_vlenb(void)
{
#if defined(__riscv) && defined(__riscv_vector)
    unsigned long v;
    __asm__ volatile("csrr %0, vlenb" : "=r"(v));
    return (int32_t)v;
#else
    return -1;
#endif
}

/* A buffer of `bytes` bytes with GUARD bytes of GUARD_BYTE on each side (all prefilled). */
typedef struct {
    unsigned char *base;
    size_t bytes;
    const char *name;
} guarded;

static int guarded_alloc(guarded *g, size_t bytes, const char *name)
{
    g->bytes = bytes;
    g->name = name;
    g->base = malloc(bytes + 2 * GUARD);
    if (!g->base)
        return 0;
    memset(g->base, GUARD_BYTE, bytes + 2 * GUARD);
    return 1;
}

static void *guarded_ptr(const guarded *g) { return g->base + GUARD; }

/* 1 when both guard regions are intact; else prints where they were touched. */
static int guarded_check(const guarded *g)
{
    size_t before = 0, after = 0;
    for (size_t i = 0; i < GUARD; i++) {
        before += g->base[i] != GUARD_BYTE;
        after += g->base[GUARD + g->bytes + i] != GUARD_BYTE;
    }
    if (before || after) {
        fprintf(stderr, "npu_ime2_driver: guard region of %s touched: %zu bytes before, %zu bytes after\n", g->name,
                before, after);
        return 0;
    }
    return 1;
}

static int fail(const char *msg)
{
    fprintf(stderr, "npu_ime2_driver: %s\n", msg);
    return 2;
}

int main(int argc, char **argv)
{
    FILE *in = stdin;
#ifdef NPU_IME2_HAVE_EMU
    if (npu_ime2_emu_install() != 0)
        return fail("cannot install the IME2 instruction emulator");
#endif
    int arg = 1;
    if (arg < argc && strcmp(argv[arg], "--allow-fallback") == 0) {
        npu_ime2_set_allow_fallback(1);
        arg++;
    }
    if (argc - arg > 1 || (arg < argc && strncmp(argv[arg], "--", 2) == 0))
        return fail("usage: npu_ime2_driver [--allow-fallback] [REQUEST_FILE|-]");
    if (arg < argc && strcmp(argv[arg], "-") != 0) {
        in = fopen(argv[arg], "rb");
        if (!in)
            return fail("cannot open the request file");
    }
    unsigned char hdr[REQ_HEADER];
    if (fread(hdr, 1, REQ_HEADER, in) != REQ_HEADER)
        return fail("short request header");
    if (memcmp(hdr, "NPUIME2Q", 8) != 0)
        return fail("bad request magic (expected NPUIME2Q)");
    if (get_u32(hdr + 8) != 1)
        return fail("unsupported request version");
    int32_t path = (int32_t)get_u32(hdr + 12);
    int64_t m = (int64_t)get_u64(hdr + 16), k = (int64_t)get_u64(hdr + 24), n = (int64_t)get_u64(hdr + 32);
    uint64_t a_bytes = get_u64(hdr + 40), q_bytes = get_u64(hdr + 48), s_bytes = get_u64(hdr + 56);
    if (a_bytes > MAX_INPUT_BYTES || q_bytes > MAX_INPUT_BYTES || s_bytes > MAX_INPUT_BYTES)
        return fail("input arrays too large");
    if (m < 0 || n < 0 || m > (1 << 20) || n > (1 << 20) || (uint64_t)m * (uint64_t)n * 4 > MAX_INPUT_BYTES)
        return fail("M and N must be in [0, 2^20] and M*N*4 at most 1 GiB");
    /* +1 so that a zero-byte array still gets a distinct non-NULL pointer */
    unsigned char *a = malloc(a_bytes + 1), *q = malloc(q_bytes + 1), *s = malloc(s_bytes + 1);
    if (!a || !q || !s)
        return fail("out of memory reading the request");
    if (fread(a, 1, a_bytes, in) != a_bytes || fread(q, 1, q_bytes, in) != q_bytes ||
        fread(s, 1, s_bytes, in) != s_bytes)
        return fail("short request body");
    if (in != stdin)
        fclose(in);

    size_t c_bytes = (size_t)m * (size_t)n * sizeof(float);
    guarded c, ap = {0}, bp = {0};
    if (!guarded_alloc(&c, c_bytes, "C"))
        return fail("out of memory allocating C");
    int guards_ok = 1;
    npu_ime2_status st;
    if (path < 0) {
        st = npu_ime2_hp_gemm((const float *)a, q, (const float *)s, m, k, n, guarded_ptr(&c), c_bytes);
    } else {
        size_t a_need = 0, b_need = 0;
        st = npu_ime2_a_packed_size(m, k, &a_need);
        if (st == NPU_IME2_OK && n > 0)
            st = npu_ime2_b_packed_size(n, k, &b_need);
        if (st == NPU_IME2_OK && (!guarded_alloc(&ap, a_need, "packed A") || !guarded_alloc(&bp, b_need, "packed B")))
            return fail("out of memory allocating the packed operands");
        if (st == NPU_IME2_OK)
            st = npu_ime2_quantize_a((const float *)a, m, k, guarded_ptr(&ap), a_need);
        if (st == NPU_IME2_OK && n > 0)
            st = npu_ime2_pack_b(q, (const float *)s, n, k, guarded_ptr(&bp), b_need);
        if (st == NPU_IME2_OK)
            st = npu_ime2_gemm(guarded_ptr(&ap), a_need, guarded_ptr(&bp), b_need, m, k, n, guarded_ptr(&c), c_bytes,
                               path);
        if (ap.base && !guarded_check(&ap))
            guards_ok = 0;
        if (bp.base && !guarded_check(&bp))
            guards_ok = 0;
    }
    if (!guarded_check(&c))
        guards_ok = 0;

    const char *text = npu_ime2_status_string((int)st);
    size_t text_len = strlen(text);
    size_t out_c = st == NPU_IME2_OK ? c_bytes : 0;
    unsigned char resp[RESP_HEADER];
    memcpy(resp, "NPUIME2R", 8);
    put_u32(resp + 8, (uint32_t)st);
    put_u32(resp + 12, (uint32_t)read_vlenb());
    put_u32(resp + 16, (uint32_t)guards_ok);
    put_u32(resp + 20, (uint32_t)text_len);
    put_u64(resp + 24, (uint64_t)m);
    put_u64(resp + 32, (uint64_t)n);
    put_u64(resp + 40, (uint64_t)out_c);
    if (fwrite(resp, 1, RESP_HEADER, stdout) != RESP_HEADER || fwrite(text, 1, text_len, stdout) != text_len ||
        fwrite(guarded_ptr(&c), 1, out_c, stdout) != out_c || fflush(stdout) != 0)
        return fail("cannot write the response");
#ifdef NPU_IME2_HAVE_EMU
    npu_ime2_emu_report();
#endif
    free(a);
    free(q);
    free(s);
    free(c.base);
    free(ap.base);
    free(bp.base);
    return guards_ok ? 0 : 3;
}
