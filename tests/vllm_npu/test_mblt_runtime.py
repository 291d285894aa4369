"""vllm_npu.mblt.runtime: the target -> runtime-module seam."""

from __future__ import annotations

import types

import pytest

from vllm_npu.mblt.runtime import MbltRuntimeUnavailable, load_runtime


@pytest.mark.parametrize(("target_name", "module"), [("mblt-sim", "npusim.mxq"), ("mblt-hw", "qbruntime")])
def test_target_imports_its_module_by_name(target_name, module):
    sentinel = types.ModuleType(module)
    seen = []

    def importer(name):
        seen.append(name)
        return sentinel

    assert load_runtime(target_name, import_module=importer) is sentinel
    assert seen == [module]


def test_sim_target_is_the_npusim_mxq_module():
    import npusim.mxq

    assert load_runtime("mblt-sim") is npusim.mxq


def test_missing_hw_runtime_names_module_and_install_command():
    def importer(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    with pytest.raises(MbltRuntimeUnavailable, match=r"'qbruntime'.*pip install mobilint-qb-runtime") as info:
        load_runtime("mblt-hw", import_module=importer)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_sim_runtime_names_module():
    def importer(name):
        raise ImportError("broken")

    with pytest.raises(MbltRuntimeUnavailable, match=r"'npusim\.mxq'"):
        load_runtime("mblt-sim", import_module=importer)


@pytest.mark.parametrize("target_name", ["rbln-sim", "mblt", "", None])
def test_other_targets_are_value_errors(target_name):
    with pytest.raises(ValueError, match="has no mblt runtime; expected one of: mblt-sim, mblt-hw"):
        load_runtime(target_name)


def test_adapter_modules_import_no_runtime_torch_or_vllm():
    """The adapter reaches qbruntime/npusim only through load_runtime, and never needs torch or
    vLLM (a fresh interpreter, since this test session may have imported them)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import vllm_npu.mblt.backend, vllm_npu.mblt.dispatch, vllm_npu.mblt.placement\n"
        "import vllm_npu.mblt.runtime, vllm_npu.mblt.tracing, vllm_npu.mblt.errors\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'vllm', 'qbruntime', 'npusim'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
