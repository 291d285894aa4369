"""The runtime seam table (vllm_npu.targets.RUNTIME_SEAMS) and the readers it serves: every
plugin's load_runtime, the conformance target registry, npu-harness doctor, and npusim.alias
(which keeps its own copy and must agree)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from vllm_npu import targets as T

PLUGINS = Path(T.__file__).resolve().parent

ROWS = {  # device: (sim imports, hw imports, sim is backed by)
    "mblt": ("npusim.mxq", "qbruntime", "npusim.mxq"),
    "rbln": ("rebel", "rebel", "npusim.rbln"),
    "neuron": ("npusim.neff", "nrtpy", "npusim.neff"),
}


@pytest.mark.parametrize("device", sorted(ROWS))
def test_each_target_imports_and_is_backed_by_its_row(device):
    seam = T.RUNTIME_SEAMS[device]
    sim_name, hw_name, sim_backing = ROWS[device]
    sim, hw = seam.targets
    assert (seam.import_name(sim), seam.import_name(hw)) == (sim_name, hw_name)
    assert (seam.backing_module(sim), seam.backing_module(hw)) == (sim_backing, hw_name)
    assert set(seam.targets) <= set(T.TARGET_NAMES)


@pytest.mark.parametrize("device, other", [("mblt", "rbln-sim"), ("rbln", "mblt-hw"), ("neuron", ""), ("mblt", None)])
def test_a_target_of_another_device_is_a_value_error(device, other):
    with pytest.raises(ValueError, match=rf"target {re.escape(repr(other))} has no {device} runtime"):
        T.load_runtime(device, other, import_module=pytest.fail)


def test_a_device_without_a_seam_is_a_value_error():
    with pytest.raises(ValueError, match=r"device 'ime2' has no runtime seam; expected one of: mblt, rbln, neuron"):
        T.load_runtime("ime2", "ime2-hw", import_module=pytest.fail)


@pytest.mark.parametrize("device", sorted(ROWS))
def test_load_runtime_imports_the_row_s_name(device):
    seen: list[str] = []
    sentinel = types.ModuleType("x")

    def importer(name: str) -> types.ModuleType:
        seen.append(name)
        return sentinel

    for target in T.RUNTIME_SEAMS[device].targets:
        assert T.load_runtime(device, target, import_module=importer) is sentinel
    assert seen == list(ROWS[device][:2])


@pytest.mark.parametrize("device, on, hint", [
    ("mblt", "mblt-hw", "pip install mobilint-qb-runtime"),
    ("rbln", "rbln-hw", "rebel-compiler==0.12.0"),
    ("rbln", "rbln-sim", "npu-harness alias install"),
    ("neuron", "neuron-hw", "nrtpy"),
    ("neuron", "neuron-sim", "simulators/ directory on PYTHONPATH"),
])
def test_a_missing_module_is_the_device_s_error_naming_module_and_remedy(device, on, hint):
    class DeviceUnavailable(T.RuntimeUnavailable):
        pass

    def importer(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    with pytest.raises(DeviceUnavailable) as err:
        T.load_runtime(device, on, import_module=importer, error=DeviceUnavailable)
    assert f"needs the Python module {T.RUNTIME_SEAMS[device].import_name(on)!r}" in str(err.value)
    assert hint in str(err.value) and isinstance(err.value.__cause__, ImportError)


def test_every_plugin_error_is_a_runtime_unavailable():
    from vllm_npu.mblt.runtime import MbltRuntimeUnavailable
    from vllm_npu.neuron.runtime import NeuronRuntimeUnavailable
    from vllm_npu.rbln.runtime import RblnRuntimeUnavailable

    assert all(issubclass(c, T.RuntimeUnavailable)
               for c in (MbltRuntimeUnavailable, NeuronRuntimeUnavailable, RblnRuntimeUnavailable))


def test_rbln_loads_rebel_by_the_vendor_name_on_both_targets(monkeypatch):
    from vllm_npu.rbln import runtime

    seen: list[str] = []
    monkeypatch.setenv(T.ENV_VAR, "rbln-sim")
    runtime.load_rebel(import_module=lambda n: seen.append(n) or types.ModuleType(n))
    runtime.load_rebel("rbln-hw", import_module=lambda n: seen.append(n) or types.ModuleType(n))
    assert seen == ["rebel", "rebel"]
    monkeypatch.setenv(T.ENV_VAR, "rbln-sim")
    with pytest.raises(runtime.RblnRuntimeUnavailable, match="npu-harness alias install"):
        runtime.load_rebel(import_module=lambda n: (_ for _ in ()).throw(ImportError("none")))


def test_npusim_alias_agrees_with_the_table():
    """npusim.alias may import nothing of vllm_npu, so it keeps the alias rows itself."""
    from npusim import alias

    assert alias.ALIASES == {s.vendor_module: s.simulator_module for s in T.RUNTIME_SEAMS.values() if s.sim_alias}
    assert alias.TARGET_ALIASES == {s.targets[0]: (s.vendor_module,) for s in T.RUNTIME_SEAMS.values() if s.sim_alias}
    assert alias.TARGET_ENV_VAR == T.ENV_VAR


def test_the_target_registry_reads_the_table():
    from npu_conformance.targets import TARGETS

    for seam in T.RUNTIME_SEAMS.values():
        for target in seam.targets:
            assert TARGETS[target].runtime == seam.backing_module(target)


def test_no_plugin_names_a_runtime_module_outside_the_table():
    """Only the table names the runtime modules; each device's runtime.py reads its row (the
    compile command's alias fallback in rbln/runtime.py imports npusim.alias, not a runtime)."""
    names = {m for s in T.RUNTIME_SEAMS.values() for m in (s.vendor_module, s.simulator_module)}
    literal = re.compile(r"""["'](%s)["']""" % "|".join(re.escape(n) for n in sorted(names)))
    offenders = [f"{p.relative_to(PLUGINS)}:{n}: {line.strip()}" for p in sorted(PLUGINS.rglob("*.py"))
                 if p != Path(T.__file__).resolve()
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if literal.search(line) and not line.lstrip().startswith(("#", "*", "``"))]
    assert offenders == []
