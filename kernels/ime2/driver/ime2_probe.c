/*
 * ime2_probe.c - runs single IME2 instruction words on given vector register files. riscv64
 * only; VLEN 1024 (vlenb 128) expected. Two builds of this one file (kernels/ime2/Makefile):
 *   npu_ime2_emu_probe  cross build, linked with the SIGILL emulator (ime2_emu.c,
 *                       -DNPU_IME2_HAVE_EMU): under QEMU, to test the emulator against
 *                       npusim.q4x32.execute_hp;
 *   npu_ime2_hp_probe   native build on a riscv64 host (the K3), WITHOUT the emulator: the words
 *                       run on the real matrix unit, so the board answers the open questions
 *                       (conformance scenarios test_ime2_board.py). A word the core does not
 *                       execute kills it with the real SIGILL; nothing is ever emulated.
 *
 *   npu_ime2_emu_probe [--ai-cores] < request > response    (npu_ime2_hp_probe alike)
 *
 * Request (little-endian):  "NPUIME2E", uint32 count, then count times:
 *                           uint32 instruction word, 32 x vlenb bytes v0..v31
 * Response:                 "NPUIME2F", uint32 count, then count times 32 x vlenb bytes: the
 *                           register file after the instruction
 * Each word is written, followed by `ret`, into an executable page and called between a
 * whole-register load of v0..v31 and a whole-register store of them. A word the emulator does
 * not handle kills the process with SIGILL (nothing is written for it, and no response).
 * --ai-cores: before any vector instruction, move to the K3's A100 cores the way the seed does
 *   it (write the process id to $NPU_IME2_PROBE_PROC/set_ai_thread, default /proc, then set the
 *   affinity to cores 8..15), check that vlenb is 128, and print one line
 *   "<probe name>: emulator=<yes|no> vlenb=<n> cpu=<c>" on stderr.
 * Exit status: 0 done; 2 bad request or I/O error; 4 --ai-cores failed (set_ai_thread or the
 * affinity refused, or vlenb != 128 after the move); message on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef NPU_IME2_HAVE_EMU
#include "ime2_emu.h"
#define PROBE_EMULATOR "yes"
#define PROBE_NAME "npu_ime2_emu_probe"
#else
#define PROBE_EMULATOR "no"
#define PROBE_NAME "npu_ime2_hp_probe"
#endif

#define NREGS 32
#define RET 0x00008067u /* jalr x0, 0(ra) */
#define AI_FIRST 8      /* the K3's A100 cores: 8..15 (opensolvers.github.io boards/SM10.md) */
#define AI_LAST 15
#define IME2_VLENB 128

static int fail(const char *msg)
{
    fprintf(stderr, PROBE_NAME ": %s\n", msg);
    return 2;
}

static unsigned long read_vlenb(void)
{
    unsigned long v;
    __asm__ volatile("csrr %0, vlenb" : "=r"(v));
    return v;
}

/* The seed's fence: register the process id with set_ai_thread, then run on cores 8..15 only.
 * Returns 0, or 4 with a message naming the file, the cores or vlenb. */
static int enter_ai_cores(void)
{
    const char *root = getenv("NPU_IME2_PROBE_PROC");
    char path[512];
    snprintf(path, sizeof path, "%s/set_ai_thread", root && *root ? root : "/proc");
    char pid[32];
    const int len = snprintf(pid, sizeof pid, "%ld", (long)getpid());
    const int fd = open(path, O_WRONLY); /* no O_CREAT: the kernel's file must exist */
    const int ok = fd >= 0 && write(fd, pid, (size_t)len) == len;
    const int err = errno;
    if (fd >= 0)
        close(fd);
    if (!ok) {
        fprintf(stderr, PROBE_NAME ": --ai-cores: cannot write the process id to %s: %s\n", path, strerror(err));
        return 4;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c = AI_FIRST; c <= AI_LAST; c++)
        CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        fprintf(stderr, PROBE_NAME ": --ai-cores: sched_setaffinity(cores %d-%d) failed: %s\n", AI_FIRST,
                AI_LAST, strerror(errno));
        return 4;
    }
    const unsigned long vlenb = read_vlenb();
    fprintf(stderr, PROBE_NAME ": emulator=%s vlenb=%lu cpu=%d\n", PROBE_EMULATOR, vlenb, sched_getcpu());
    if (vlenb != IME2_VLENB) {
        fprintf(stderr, PROBE_NAME ": --ai-cores: vlenb is %lu on cpu %d, not %d: the .hp tile needs VLEN 1024 "
                        "(the A100 cores)\n", vlenb, sched_getcpu(), IME2_VLENB);
        return 4;
    }
    return 0;
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

int main(int argc, char **argv)
{
    int ai_cores = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--ai-cores") == 0) {
            ai_cores = 1;
        } else {
            fprintf(stderr, PROBE_NAME ": unknown argument %s (expected --ai-cores)\n", argv[i]);
            return 2;
        }
    }
#ifdef NPU_IME2_HAVE_EMU
    if (npu_ime2_emu_install() != 0)
        return fail("cannot install the IME2 emulator");
#endif
    if (ai_cores) {
        const int rc = enter_ai_cores();
        if (rc != 0)
            return rc;
    }
    const unsigned long vlenb = read_vlenb();
    unsigned char hdr[12];
    if (fread(hdr, 1, sizeof hdr, stdin) != sizeof hdr || memcmp(hdr, "NPUIME2E", 8) != 0)
        return fail("bad request header (expected NPUIME2E + count)");
    const uint32_t count = get_u32(hdr + 8);
    const size_t file_bytes = NREGS * vlenb;
    uint8_t *regs = malloc(file_bytes);
    uint32_t *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!regs || page == MAP_FAILED)
        return fail("out of memory");
    if (fwrite("NPUIME2F", 1, 8, stdout) != 8 || fwrite(hdr + 8, 1, 4, stdout) != 4)
        return fail("cannot write the response");
    for (uint32_t i = 0; i < count; i++) {
        unsigned char wb[4];
        if (fread(wb, 1, 4, stdin) != 4 || fread(regs, 1, file_bytes, stdin) != file_bytes)
            return fail("short request body");
        /* write the stub, then make the page executable (never writable and executable at once) */
        if (mprotect(page, 4096, PROT_READ | PROT_WRITE) != 0)
            return fail("mprotect(PROT_WRITE) failed");
        page[0] = get_u32(wb);
        page[1] = RET;
        if (mprotect(page, 4096, PROT_READ | PROT_EXEC) != 0)
            return fail("mprotect(PROT_EXEC) failed");
        __builtin___clear_cache((char *)page, (char *)(page + 2));
        run_stub((void (*)(void))(void *)page, regs, vlenb);
        if (fwrite(regs, 1, file_bytes, stdout) != file_bytes)
            return fail("cannot write the response");
    }
    if (fflush(stdout) != 0)
        return fail("cannot write the response");
#ifdef NPU_IME2_HAVE_EMU
    npu_ime2_emu_report();
#endif
    return 0;
}
