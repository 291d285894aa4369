"""The device workers driven directly, step by step, by the shared :class:`step_driver.Driver`:
``mblt_worker_cases.py``, ``rbln_worker_cases.py`` and ``neuron_worker_cases.py``, each file run
in a fresh interpreter by its test module (``test_mblt_worker.py``, ``test_rbln_worker.py``,
``test_neuron_worker.py``: ``case_params`` and ``check_case`` from here).

vLLM resolves its platform once per process, the first time anything asks for it; in a
full test session some earlier test has already resolved vLLM's CPU platform, so the cases,
which build a real ``VllmConfig`` through a device's platform, run in a child pytest started
with that device's ``NPU_HARNESS_TARGET`` from the start (forked from the prefork zygote, which
has imported torch and transformers already: :func:`npu_conformance.prefork.run_python`). Each
case there is one test here that reports the child's outcome for it (with its failure text).
"""

from __future__ import annotations

import ast
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: device -> (its cases file, the target its child session runs on)
DEVICES = {"mblt": ("mblt_worker_cases.py", "mblt-sim"), "rbln": ("rbln_worker_cases.py", "rbln-sim"),
           "neuron": ("neuron_worker_cases.py", "neuron-sim")}


def _case_names(device: str) -> list[str]:
    tree = ast.parse((HERE / DEVICES[device][0]).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


_RESULTS: dict[str, dict[str, list[tuple[str, str]]]] = {}
#: ``python -c`` program of the child session: pytest on the cases file named in its arguments.
_PYTEST = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"


def case_params(device: str) -> list:
    """The device's case names, as ``pytest.mark.parametrize`` values."""
    return _case_names(device)


def check_case(device: str, case: str, tmp_path_factory) -> None:
    """Run the device's cases once (in a child session), then assert ``case`` passed there."""
    if device not in _RESULTS:
        _RESULTS[device] = _run(device, tmp_path_factory.mktemp(f"{device}-worker"))
    runs = _RESULTS[device].get(case)
    assert runs, f"{case} did not run in the child session"
    failed = [text for outcome, text in runs if outcome == "failed"]
    assert not failed, f"{case}:\n" + "\n".join(failed)[-6000:]
    if all(outcome == "skipped" for outcome, _ in runs):
        pytest.skip(runs[0][1])


def _run(device: str, work: Path) -> dict[str, list[tuple[str, str]]]:
    cases, target = DEVICES[device]
    xml = work / "cases.xml"
    from npu_conformance import prefork

    env = dict(os.environ, NPU_HARNESS_TARGET=target)
    args = [str(HERE / cases), "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "addopts=",
            f"--rootdir={HERE.parents[1]}"]
    proc = prefork.run_python(_PYTEST, args, env=env, timeout=1200)
    if not xml.exists():
        pytest.fail(f"the {device} worker cases did not run ({proc.returncode}):\n{proc.stdout[-4000:]}"
                    f"{proc.stderr[-2000:]}")
    results: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, text = "failed", (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped":
                outcome, text = "skipped", child.get("message") or ""
        results.setdefault(name, []).append((outcome, text))
    return results
