"""The MBLT worker cases (``mblt_worker_cases.py``), each run in a fresh interpreter.

vLLM resolves its platform once per process, the first time anything asks for it; in a
full test session some earlier test has already resolved vLLM's CPU platform, so the cases,
which build a real ``VllmConfig`` through the MBLT platform, run in a child pytest started
with ``NPU_HARNESS_TARGET=mblt-sim`` from the start. Each case there is one test here that
reports the child's outcome for it (with its failure text).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("vllm")

CASES = Path(__file__).with_name("mblt_worker_cases.py")


def _case_names() -> list[str]:
    tree = ast.parse(CASES.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict[str, list[tuple[str, str]]]:
    """Run the cases once; map each case function to its ``(outcome, text)`` per parameter."""
    xml = tmp_path_factory.mktemp("mblt-worker") / "cases.xml"
    env = dict(os.environ, NPU_HARNESS_TARGET="mblt-sim")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider",
         f"--junitxml={xml}", "-o", "addopts="],
        env=env, capture_output=True, text=True, timeout=1200, cwd=CASES.parents[2],
    )
    if not xml.exists():
        pytest.fail(f"the worker cases did not run ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
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


@pytest.mark.slow
@pytest.mark.parametrize("case", _case_names())
def test_worker_case(child_results, case):
    runs = child_results.get(case)
    assert runs, f"{case} did not run in the child session"
    failed = [text for outcome, text in runs if outcome == "failed"]
    assert not failed, f"{case}:\n" + "\n".join(failed)[-6000:]
    if all(outcome == "skipped" for outcome, _ in runs):
        pytest.skip(runs[0][1])
