/*
 * ime2_emu.h - SIGILL-handler emulator of the SpacemiT IME2 vmadot*.hp int4 instructions for
 * QEMU user mode (riscv64 test binaries only; see ime2_emu.c).
 */
#ifndef NPU_IME2_EMU_H
#define NPU_IME2_EMU_H

/* Environment variables read once by npu_ime2_emu_install() (default first):
 *   NPU_IME2_EMU_ROUNDING  unfused | fused       (npusim.q4x32 option "rounding")
 *   NPU_IME2_EMU_DOT       fp16 | exact          (option "dot")
 *   NPU_IME2_EMU_OVERFLOW  inf | saturate        (option "overflow")
 *   NPU_IME2_EMU_COUNT     when set and non-empty, npu_ime2_emu_report() prints the number of
 *                          emulated instructions on stderr */
#define NPU_IME2_EMU_ENV_ROUNDING "NPU_IME2_EMU_ROUNDING"
#define NPU_IME2_EMU_ENV_DOT "NPU_IME2_EMU_DOT"
#define NPU_IME2_EMU_ENV_OVERFLOW "NPU_IME2_EMU_OVERFLOW"
#define NPU_IME2_EMU_ENV_COUNT "NPU_IME2_EMU_COUNT"

/* Installs the SIGILL handler (a no-op for programs that never execute an IME instruction).
 * Returns 0, or -1 with a message on stderr when an environment variable holds an unknown value
 * or sigaction fails. */
int npu_ime2_emu_install(void);

/* Number of .hp instructions emulated so far. */
unsigned long npu_ime2_emu_count(void);

/* Prints "npu_ime2_emu: emulated=<count>" on stderr when NPU_IME2_EMU_COUNT was set. */
void npu_ime2_emu_report(void);

#endif /* NPU_IME2_EMU_H */
