"""What vLLM itself resolves as its platform under each NPU_HARNESS_TARGET (real vLLM, in a
subprocess because vLLM resolves the platform once per process)."""

from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("vllm")
from npu_conformance import prefork  # noqa: E402

PROBE = ("from vllm.platforms import current_platform; "
         "print('DEVICE', current_platform.device_type, type(current_platform).__qualname__)")


def _resolve(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NPU_HARNESS_TARGET"}
    if value is not None:
        env["NPU_HARNESS_TARGET"] = value
    # as ``python -c PROBE`` would run, forked from the prefork zygote (npu_conformance.prefork)
    return prefork.run_python(PROBE, env=env, timeout=300)


def test_no_target_keeps_vllms_cpu_platform():
    proc = _resolve(None)
    assert proc.returncode == 0, proc.stderr
    assert "DEVICE cpu" in proc.stdout


def test_mblt_targets_resolve_the_mblt_platform():
    for target in ("mblt-sim", "mblt-hw"):
        proc = _resolve(target)
        assert proc.returncode == 0, proc.stderr
        assert "DEVICE cpu MbltPlatform" in proc.stdout


def test_rbln_targets_resolve_the_rbln_platform():
    for target in ("rbln-sim", "rbln-hw"):
        proc = _resolve(target)
        assert proc.returncode == 0, proc.stderr
        assert "DEVICE cpu RblnPlatform" in proc.stdout


def test_neuron_targets_resolve_the_neuron_platform():
    for target in ("neuron-sim", "neuron-hw"):
        proc = _resolve(target)
        assert proc.returncode == 0, proc.stderr
        assert "DEVICE cpu NeuronPlatform" in proc.stdout


def test_an_invalid_target_fails_loudly_instead_of_serving_on_cpu():
    proc = _resolve("mblt_sim")
    assert proc.returncode != 0
    assert "NPU_HARNESS_TARGET='mblt_sim' is not a target" in proc.stderr
