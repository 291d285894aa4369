/*
 * ime2_probe.c - runs single IME2 instruction words on given vector register files under QEMU,
 * through the SIGILL emulator (ime2_emu.c), to test the emulator against
 * npusim.q4x32.execute_hp. riscv64 only; VLEN 1024 (vlenb 128) expected.
 *
 *   npu_ime2_emu_probe < request > response
 *
 * Request (little-endian):  "NPUIME2E", uint32 count, then count times:
 *                           uint32 instruction word, 32 x vlenb bytes v0..v31
 * Response:                 "NPUIME2F", uint32 count, then count times 32 x vlenb bytes: the
 *                           register file after the instruction
 * Each word is written, followed by `ret`, into an executable page and called between a
 * whole-register load of v0..v31 and a whole-register store of them. A word the emulator does
 * not handle kills the process with SIGILL (nothing is written for it, and no response).
 * Exit status: 0 done; 2 bad request or I/O error (message on stderr).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ime2_emu.h"

#define NREGS 32
#define RET 0x00008067u /* jalr x0, 0(ra) */

static int fail(const char *msg)
{
    fprintf(stderr, "npu_ime2_emu_probe: %s\n", msg);
    return 2;
}

static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Loads v0..v31 from regs, calls the stub (the instruction, then ret), stores v0..v31 back. */
static void run_stub(void (*stub)(void), uint8_t *regs, unsigned long vlenb)
{
    unsigned long vl;
    __asm__ volatile("li %[vl], 64\n\t"
                     "vsetvli %[vl], %[vl], e16, m1, ta, ma\n\t"
                     "vl8re8.v v0, (%[r0])\n\t"
                     "vl8re8.v v8, (%[r1])\n\t"
                     "vl8re8.v v16, (%[r2])\n\t"
                     "vl8re8.v v24, (%[r3])\n\t"
                     "jalr ra, 0(%[fn])\n\t"
                     "vs8r.v v0, (%[r0])\n\t"
                     "vs8r.v v8, (%[r1])\n\t"
                     "vs8r.v v16, (%[r2])\n\t"
                     "vs8r.v v24, (%[r3])\n\t"
                     : [vl] "=&r"(vl)
                     : [r0] "r"(regs), [r1] "r"(regs + 8 * vlenb), [r2] "r"(regs + 16 * vlenb),
                       [r3] "r"(regs + 24 * vlenb), [fn] "r"(stub)
                     : "ra", "memory", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11",
                       "v12", "v13", "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24",
                       "v25", "v26", "v27", "v28", "v29", "v30", "v31", "vl", "vtype");
    (void)vl;
}

int main(void)
{
    if (npu_ime2_emu_install() != 0)
        return fail("cannot install the IME2 emulator");
    unsigned long vlenb;
    __asm__ volatile("csrr %0, vlenb" : "=r"(vlenb));
    unsigned char hdr[12];
    if (fread(hdr, 1, sizeof hdr, stdin) != sizeof hdr || memcmp(hdr, "NPUIME2E", 8) != 0)
        return fail("bad request header (expected NPUIME2E + count)");
    const uint32_t count = get_u32(hdr + 8);
    const size_t file_bytes = NREGS * vlenb;
    uint8_t *regs = malloc(file_bytes);
    uint32_t *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!regs || page == MAP_FAILED)
        return fail("out of memory");
    if (fwrite("NPUIME2F", 1, 8, stdout) != 8 || fwrite(hdr + 8, 1, 4, stdout) != 4)
        return fail("cannot write the response");
    for (uint32_t i = 0; i < count; i++) {
        unsigned char wb[4];
        if (fread(wb, 1, 4, stdin) != 4 || fread(regs, 1, file_bytes, stdin) != file_bytes)
            return fail("short request body");
        page[0] = get_u32(wb);
        page[1] = RET;
        __builtin___clear_cache((char *)page, (char *)(page + 2));
        run_stub((void (*)(void))(void *)page, regs, vlenb);
        if (fwrite(regs, 1, file_bytes, stdout) != file_bytes)
            return fail("cannot write the response");
    }
    if (fflush(stdout) != 0)
        return fail("cannot write the response");
    npu_ime2_emu_report();
    return 0;
}
