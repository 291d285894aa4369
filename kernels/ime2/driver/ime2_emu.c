/*
 * ime2_emu.c - SIGILL-handler emulator of the SpacemiT IME2 vmadot*.hp int4 instructions, so the
 * real IME2 kernel binary (.insn and all) runs under upstream QEMU user mode, which decodes
 * custom-1 (opcode 0x2B) words with bit 31 set as illegal (shared reference ime2.md 6.3).
 *
 * Emulated: the four int4 .hp forms (Zvvm_spacemit v0.6 section 5.4.3), any vd, vs1, vs2:
 *   bits  31   30:29   28:26                           25       24:20 19:15 14:12 11:7  6:0
 *         1    10 i4   011 u / 110 us / 101 su / 100 ss vscale   vs2   vs1   imm3  vd    0101011
 * at VLEN 1024 only (vlenb == 128: 8 x 32 x 8 tile), with the semantics and options of
 * npusim.q4x32.instr.execute_hp (defaults: rounding unfused, dot fp16, overflow inf):
 *   for p in 0..63 (row p / 8, column p % 8):
 *     tmp   = sum_{q < 32} A[p/8][q] * B[p%8][q]       int32; A = vs1 (row-major), B = vs2
 *             (column-major); element e of a register is byte e/2, bits 3:0 (e even) or 7:4
 *             (e odd), sign-extended when that operand is signed
 *     scale = vscale[imm3 * 8 + p % 8]                  fp16, vscale = v0 (bit 25 = 0) or v1
 *     t     = fp16(tmp)  (dot fp16)  |  tmp  (dot exact)
 *     vd[p] = fp16(vd[p] + fp16(t * scale))   (unfused)  |  fp16(vd[p] + t * scale)  (fused)
 *   every fp16 rounding RNE with subnormals; overflow -> +/-inf (inf) or every infinite result
 *   clamped to +/-65504 (saturate, as numpy's clip in npusim.q4x32.fp16.to_f16). All sources
 *   are read before vd is written (vd may alias vs1, vs2 or vscale).
 * The fp16 arithmetic is the emulator's own (ime2_emu_fp16.h: integers only, exact values in
 * units of 2**-24, one RNE per rounding); nothing is shared with the kernel under test
 * (kernels/ime2/src is not included), so the two meet only in the specification.
 * Not emulated (the handler restores SIG_DFL and returns, so re-executing the word kills the
 * process with the real SIGILL): i8 .hp (data type 11), every other IME instruction (vmadot,
 * .sp, vpack, vfwmadot, ...), any other illegal instruction, and any .hp at vlenb != 128.
 *
 * Mechanics: QEMU user mode neither saves nor restores vector registers around a signal
 * handler, so the handler reads and writes the live register file: v0..v31 are stored with four
 * vs8r.v (stride 8 * vlenb), vd is replaced in memory, all 32 are reloaded with vl8re8.v, vl and
 * vtype are restored with vsetvl, and the pc in the signal context is advanced by 4. (A real
 * Linux kernel restores vector state from the signal frame, so this works under QEMU only; on
 * the A100 the instructions execute natively and the handler never runs.)
 *
 * Built without auto-vectorization; the handler calls no library function except sigaction
 * (on the give-up path), so no vector register is touched before it is saved.
 *
 * Threads: the handler runs on the thread that trapped (the kernel's pool workers leave SIGILL
 * unblocked), possibly on several threads at once. Its per-trap state (the saved register file
 * emu_regs; everything else is on the stack) is _Thread_local, the counter is atomic, and the
 * options are written once by npu_ime2_emu_install before any .hp runs, then only read.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include "ime2_emu.h"
#include "ime2_emu_fp16.h"

#define EMU_VLENB 128
#define NREGS 32
#define OUTPUTS 64 /* 8 x 8 fp16 */
#define TK 32      /* K of an int4 .hp tile */

/* Set once by npu_ime2_emu_install, before any thread traps; only read by the handler. */
static emu_hp_mode emu_mode = {0, 0, 0}; /* rounding unfused, dot fp16, overflow inf */
static int emu_report_count = 0;
/* Emulated instructions, all threads (lock-free atomic add: async-signal-safe). */
static atomic_ulong emu_count = 0;
/* The per-trap state, one copy per thread: several threads (the kernel's GEMM workers) may be
 * in the handler at once, each saving and editing its own register file (4 KiB of static TLS
 * per thread, so the handler's stack use stays small). */
static _Thread_local uint8_t emu_regs[NREGS * EMU_VLENB] __attribute__((aligned(16)));

unsigned long npu_ime2_emu_count(void) { return atomic_load_explicit(&emu_count, memory_order_relaxed); }

static inline uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Element e (0..255) of an int4 register image. */
static inline int nibble(const uint8_t *reg, int e, int is_signed)
{
    const int v = (reg[e >> 1] >> (4 * (e & 1))) & 0xf;
    return is_signed && v >= 8 ? v - 16 : v;
}

/* vd (in emu_regs) <- the .hp result; the register numbers come from the decoded word. */
static void execute(int vd, int vs1, int vs2, int vscale, int imm3, int a_signed, int b_signed)
{
    const uint8_t *a = emu_regs + vs1 * EMU_VLENB, *b = emu_regs + vs2 * EMU_VLENB;
    const uint8_t *sc = emu_regs + vscale * EMU_VLENB + 2 * 8 * imm3;
    uint8_t *d = emu_regs + vd * EMU_VLENB;
    uint16_t out[OUTPUTS];
    for (int p = 0; p < OUTPUTS; p++) {
        const int row = p / 8, col = p % 8;
        int32_t tmp = 0;
        for (int q = 0; q < TK; q++)
            tmp += nibble(a, row * TK + q, a_signed) * nibble(b, col * TK + q, b_signed);
        out[p] = emu_hp_output(get_u16(d + 2 * p), tmp, get_u16(sc + 2 * col), &emu_mode);
    }
    for (int p = 0; p < OUTPUTS; p++) { /* every source was read above */
        d[2 * p] = (uint8_t)(out[p] & 0xffu);
        d[2 * p + 1] = (uint8_t)(out[p] >> 8);
    }
}

/* ---- register file ---- */

static inline unsigned long csr_vlenb(void)
{
    unsigned long v;
    __asm__ volatile("csrr %0, vlenb" : "=r"(v));
    return v;
}

/* Stores v0..v31 to emu_regs (whole-register stores: independent of vl and vtype). */
static inline void save_vregs(unsigned long vlenb)
{
    uint8_t *p = emu_regs;
    __asm__ volatile("vs8r.v v0, (%0)\n\t"
                     "vs8r.v v8, (%1)\n\t"
                     "vs8r.v v16, (%2)\n\t"
                     "vs8r.v v24, (%3)\n\t"
                     :
                     : "r"(p), "r"(p + 8 * vlenb), "r"(p + 16 * vlenb), "r"(p + 24 * vlenb)
                     : "memory");
}

/* Reloads v0..v31 from emu_regs, then vl and vtype. */
static inline void restore_vregs(unsigned long vlenb, unsigned long vl, unsigned long vtype)
{
    const uint8_t *p = emu_regs;
    __asm__ volatile("vl8re8.v v0, (%0)\n\t"
                     "vl8re8.v v8, (%1)\n\t"
                     "vl8re8.v v16, (%2)\n\t"
                     "vl8re8.v v24, (%3)\n\t"
                     "vsetvl x0, %4, %5\n\t"
                     :
                     : "r"(p), "r"(p + 8 * vlenb), "r"(p + 16 * vlenb), "r"(p + 24 * vlenb), "r"(vl), "r"(vtype)
                     : "memory", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12",
                       "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25",
                       "v26", "v27", "v28", "v29", "v30", "v31", "vl", "vtype");
}

/* ---- the handler ---- */

static void give_up(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGILL, &sa, NULL);
}

static void on_sigill(int sig, siginfo_t *info, void *ctx)
{
    (void)sig;
    (void)info;
    ucontext_t *uc = (ucontext_t *)ctx;
    const uintptr_t pc = (uintptr_t)uc->uc_mcontext.__gregs[REG_PC];
    const uint16_t *half = (const uint16_t *)pc; /* instructions are 2-byte aligned */
    if ((half[0] & 3u) != 3u) { /* a 16-bit (compressed) instruction: not ours */
        give_up();
        return;
    }
    const uint32_t w = (uint32_t)half[0] | ((uint32_t)half[1] << 16);
    const unsigned funct = (w >> 26) & 7u;
    /* opcode 0x2B, bit 31 set, data type 10 (i4), bits 28:26 one of 011 u, 110 us, 101 su, 100 ss */
    const int is_hp_i4 = (w & 0x7fu) == 0x2bu && (w >> 31) == 1u && ((w >> 29) & 3u) == 2u && funct >= 3u &&
                         funct <= 6u;
    if (!is_hp_i4) {
        give_up();
        return;
    }
    const unsigned long vlenb = csr_vlenb();
    if (vlenb != EMU_VLENB) {
        give_up();
        return;
    }
    unsigned long vl, vtype;
    __asm__ volatile("csrr %0, vl\n\tcsrr %1, vtype" : "=r"(vl), "=r"(vtype));
    save_vregs(vlenb);
    const int a_signed = funct == 5u || funct == 4u; /* su, ss */
    const int b_signed = funct == 6u || funct == 4u; /* us, ss */
    execute((int)((w >> 7) & 31u), (int)((w >> 15) & 31u), (int)((w >> 20) & 31u), (int)((w >> 25) & 1u),
            (int)((w >> 12) & 7u), a_signed, b_signed);
    restore_vregs(vlenb, vl, vtype);
    atomic_fetch_add_explicit(&emu_count, 1, memory_order_relaxed);
    uc->uc_mcontext.__gregs[REG_PC] = pc + 4;
}

/* ---- installation ---- */

/* Index of `value` in `names` (default: index 0 when unset or empty), or -1 (message printed). */
static int env_choice(const char *var, const char *const names[], int count)
{
    const char *v = getenv(var);
    if (!v || !*v)
        return 0;
    for (int i = 0; i < count; i++)
        if (strcmp(v, names[i]) == 0)
            return i;
    fprintf(stderr, "npu_ime2_emu: %s=%s is not one of", var, v);
    for (int i = 0; i < count; i++)
        fprintf(stderr, " %s", names[i]);
    fprintf(stderr, "\n");
    return -1;
}

int npu_ime2_emu_install(void)
{
    static const char *const rounding[] = {"unfused", "fused"};
    static const char *const dot[] = {"fp16", "exact"};
    static const char *const overflow[] = {"inf", "saturate"};
    const int r = env_choice(NPU_IME2_EMU_ENV_ROUNDING, rounding, 2);
    const int d = env_choice(NPU_IME2_EMU_ENV_DOT, dot, 2);
    const int o = env_choice(NPU_IME2_EMU_ENV_OVERFLOW, overflow, 2);
    if (r < 0 || d < 0 || o < 0)
        return -1;
    emu_mode.fused = r == 1;
    emu_mode.dot_exact = d == 1;
    emu_mode.saturate = o == 1;
    const char *count = getenv(NPU_IME2_EMU_ENV_COUNT);
    emu_report_count = count && *count;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigill;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGILL, &sa, NULL) != 0) {
        perror("npu_ime2_emu: sigaction");
        return -1;
    }
    return 0;
}

void npu_ime2_emu_report(void)
{
    if (emu_report_count)
        fprintf(stderr, "npu_ime2_emu: emulated=%lu\n", npu_ime2_emu_count());
}
