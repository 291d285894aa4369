"""The target registry: what each target is, which runtime backs its seam, and whether this
machine can run it (the reasons ``npu-harness doctor`` prints).

A probe never raises: whatever goes wrong becomes an :class:`Availability` with a one-line
reason naming the import or device probe that failed.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_npu.targets import ENV_VAR, RUNTIME_SEAMS, TARGET_NAMES, UnknownTargetError

#: Column of the golden numpy decoder: the reference every device target is compared with.
REFERENCE = "ref"
#: Alias that expands to the reference and every simulator target.
SIM_ALIAS = "sim"


@dataclass(frozen=True)
class Availability:
    """Whether a target can run here; ``reason`` is one line either way."""

    available: bool
    reason: str


@dataclass(frozen=True)
class Target:
    """One column of the conformance table.

    Attributes:
        name: the user-facing target name (``mblt-sim``...).
        device: device family (``ref``, ``mblt``, ``rbln``, ``neuron``, ``ime2``).
        kind: ``reference``, ``sim``, ``hw`` or ``vendor`` (a vendor's own vLLM plugin in its
            own environment, on one of our simulators: :mod:`npu_conformance.vendor_envs`).
        runtime: the module that backs the device seam on this target.
        probe: returns this machine's :class:`Availability` for the target; never raises.
        base: for a ``vendor`` column, the simulator target it runs on (``rbln-sim``).
    """

    name: str
    device: str
    kind: str
    runtime: str
    probe: Callable[[], Availability]
    base: str = ""

    @property
    def is_hardware(self) -> bool:
        return self.kind == "hw"


def _import_reason(module: str, hint: str = "") -> Availability | None:
    """None when ``module`` imports as itself; else an unavailable Availability naming the
    failure, or naming the simulator when ``module`` is a vendor name aliased to one
    (:mod:`npusim.alias`: ``import rebel`` giving ``npusim.rbln`` is not the vendor runtime)."""
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure is a reason, never a crash
        extra = f" ({hint})" if hint else ""
        return Availability(False, f"import {module} failed: {type(exc).__name__}: {exc}{extra}")
    actual = getattr(loaded, "__name__", module)
    if actual != module:
        return Availability(False, f"import {module} gives the simulator {actual} (npusim.alias), "
                                   f"not the vendor runtime")
    return None


def _seam_reason(module: str, symbol: str) -> Availability | None:
    """None when ``module.symbol`` resolves; the NotImplementedError text (naming the issue)
    when the simulator is not built yet."""
    failed = _import_reason(module)
    if failed:
        return failed
    try:
        getattr(importlib.import_module(module), symbol)
    except NotImplementedError as exc:
        return Availability(False, str(exc))
    except AttributeError as exc:
        return Availability(False, f"{module}.{symbol} missing: {exc}")
    return None


def _probe_reference() -> Availability:
    failed = _seam_reason("npusim.llm", "Decoder")
    if failed:
        return failed
    import numpy

    return Availability(True, f"npusim.llm golden decoder on numpy {numpy.__version__}")


def _probe_sim(module: str, symbol: str, what: str) -> Callable[[], Availability]:
    def probe() -> Availability:
        failed = _seam_reason(module, symbol)
        return failed or Availability(True, f"{module} ({what})")

    return probe


def _probe_ime2_qemu() -> Availability:
    failed = _seam_reason("npusim.q4x32", "ime2_hp_gemm")
    if failed:
        return failed
    try:
        from npu_conformance import qemu_ime2

        missing = qemu_ime2.missing_reason()
    except Exception as exc:  # noqa: BLE001 - any failure is a reason, never a crash
        return Availability(False, f"npu_conformance.qemu_ime2 failed: {type(exc).__name__}: {exc}")
    if missing:
        return Availability(False, missing)
    return Availability(True, "kernels/ime2 riscv64 driver under qemu-riscv64-static "
                              "(portable, RVV and IME2 paths; IME2 .hp emulated on SIGILL)")


def _probe_mblt_hw() -> Availability:
    seam = RUNTIME_SEAMS["mblt"]
    failed = _import_reason(seam.vendor_module, seam.hw_install)
    if failed:
        return failed
    qbruntime = importlib.import_module(seam.vendor_module)

    try:
        devices = qbruntime.get_available_devices()
    except Exception as exc:  # noqa: BLE001
        return Availability(False, f"qbruntime.get_available_devices() failed: {exc}")
    if not devices:
        return Availability(False, "qbruntime.get_available_devices() found no Mobilint device")
    return Availability(True, f"qbruntime devices: {', '.join(map(str, devices))}")


def _probe_rbln_sim() -> Availability:
    """``npusim.rbln`` (the ``rebel`` simulator, needs torch) and the vendor's optimum-rbln,
    which the RBLN plugin's ``transformers`` model path drives."""
    failed = _seam_reason(_backing("rbln-sim"), "Runtime")
    if failed:
        return failed
    try:
        found = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.rbln") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return Availability(False, "optimum-rbln is not installed (pip install --no-deps optimum-rbln==0.12.0)")
    return Availability(True, "npusim.rbln (rebel surface) with optimum-rbln")


def _probe_rbln_hw() -> Availability:
    seam = RUNTIME_SEAMS["rbln"]
    failed = _import_reason(seam.vendor_module, seam.hw_install)
    if failed:
        return failed
    rebel = importlib.import_module(seam.vendor_module)

    try:
        count = rebel.device_count()
    except Exception as exc:  # noqa: BLE001
        return Availability(False, f"rebel.device_count() failed: {exc}")
    if count < 1:
        return Availability(False, "rebel.device_count() is 0: no RBLN NPU")
    return Availability(True, f"{count} RBLN NPU(s): {rebel.get_npu_name(0)}")


def _probe_neuron_hw() -> Availability:
    nodes = sorted(glob.glob("/dev/neuron*"))
    if not nodes:
        return Availability(False, "no /dev/neuron* device node: no Neuron device")
    seam = RUNTIME_SEAMS["neuron"]
    failed = _import_reason(seam.vendor_module, seam.hw_install)
    if failed:
        return failed
    return Availability(True, f"Neuron devices: {', '.join(nodes)}")


def _probe_ime2_hw(proc_root: str = "/proc") -> Availability:
    """A SpacemiT K3 by the core fence's own rule (``vllm_npu.ime2.fence.detect_k3``), with the kernel."""
    machine = platform.machine()
    if machine != "riscv64":
        return Availability(False, f"host is {machine}, not riscv64 (needs a SpacemiT K3 board)")
    from vllm_npu.ime2 import fence

    found = fence.detect_k3(fence.CoreLayout(proc_root=proc_root))
    if not found.is_k3:
        return Availability(False, f"not a SpacemiT K3: {found.reason}")
    failed = _seam_reason("vllm_npu.ime2", "ime2_hp_gemm_cpu")
    return failed or Availability(True, f"SpacemiT K3 ({found.reason}) with the IME2 kernel")


def _probe_vendor(name: str) -> Callable[[], Availability]:
    """A vendor column: its simulator target's availability, then its built environment."""

    def probe() -> Availability:
        from npu_conformance import vendor_envs

        env = vendor_envs.VENDOR_ENVS[name]
        base = availability(env.sim_target)
        if not base.available:
            return Availability(False, f"{env.sim_target} unavailable: {base.reason}")
        try:
            where = env.locate()
        except vendor_envs.VendorEnvError as exc:
            return Availability(False, str(exc))
        return Availability(True, f"{env.plugin}, unpatched, in {where}, on {TARGETS[env.sim_target].runtime}")

    return probe


def _backing(target: str) -> str:
    """The module that answers on ``target``, from the runtime seam table
    (:data:`vllm_npu.targets.RUNTIME_SEAMS`)."""
    return RUNTIME_SEAMS[target.rsplit("-", 1)[0]].backing_module(target)


#: Every target, in report-column order: the reference first, then each device's sim, the vendor
#: plugin's column on that simulator, and hw.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(REFERENCE, "ref", "reference", "npusim.llm", _probe_reference),
        Target("mblt-sim", "mblt", "sim", _backing("mblt-sim"),
               _probe_sim(_backing("mblt-sim"), "Accelerator", "qbruntime surface")),
        Target("vllm-mblt@mblt-sim", "mblt", "vendor", "vllm-mblt 0.8.0 on npusim.mxq", _probe_vendor("mblt"),
               base="mblt-sim"),
        Target("mblt-hw", "mblt", "hw", _backing("mblt-hw"), _probe_mblt_hw),
        Target("rbln-sim", "rbln", "sim", _backing("rbln-sim"),
               _probe_rbln_sim),
        Target("vllm-rbln@rbln-sim", "rbln", "vendor", "vllm-rbln 0.12.0 on npusim.rbln", _probe_vendor("rbln"),
               base="rbln-sim"),
        Target("rbln-hw", "rbln", "hw", _backing("rbln-hw"), _probe_rbln_hw),
        Target("neuron-sim", "neuron", "sim", _backing("neuron-sim"),
               _probe_sim(_backing("neuron-sim"), "NrtpyModel", "nrtpy surface")),
        Target("neuron-hw", "neuron", "hw", _backing("neuron-hw"), _probe_neuron_hw),
        Target("ime2-qemu", "ime2", "sim", "kernels/ime2 under qemu-riscv64", _probe_ime2_qemu),
        Target("ime2-hw", "ime2", "hw", "kernels/ime2 on the K3", _probe_ime2_hw),
    )
}
assert tuple(n for n, t in TARGETS.items() if t.kind in ("sim", "hw")) == TARGET_NAMES


def vendor_columns(names: Iterable[str]) -> list[str]:
    """The vendor columns of the simulator targets among ``names`` (expanded), registry order."""
    bases = set(expand(names))
    return [n for n, t in TARGETS.items() if t.kind == "vendor" and t.base in bases]


def expand(names: Iterable[str]) -> list[str]:
    """Expand aliases and deduplicate, keeping registry order.

    ``sim`` is the reference column plus every simulator target. The reference column is
    always part of a run that names any simulator target.

    Raises:
        UnknownTargetError: a name that is neither a target nor ``sim``.
    """
    wanted: set[str] = set()
    for name in names:
        if name == SIM_ALIAS:
            wanted.update(n for n, t in TARGETS.items() if t.kind in ("reference", "sim"))
        elif name in TARGETS:
            wanted.add(name)
        else:
            raise UnknownTargetError(
                f"unknown target {name!r}; expected {SIM_ALIAS!r} or one of: {', '.join(TARGETS)}"
            )
    return [n for n in TARGETS if n in wanted]


_cache: dict[str, Availability] = {}


def availability(name: str) -> Availability:
    """The (memoized per process) availability of target ``name``."""
    if name not in _cache:
        try:
            _cache[name] = TARGETS[name].probe()
        except Exception as exc:  # noqa: BLE001 - a probe bug must not crash the suite
            _cache[name] = Availability(False, f"probe crashed: {type(exc).__name__}: {exc}")
    return _cache[name]


def env_targets() -> list[str] | None:
    """Targets named by ``NPU_HARNESS_TARGET`` when it is set (used as the pytest default)."""
    value = os.environ.get(ENV_VAR, "").strip()
    return [value] if value else None
