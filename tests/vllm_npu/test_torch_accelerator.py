"""vLLM's ``cleanup_dist_env_and_memory()`` under our platforms (issue 20 §3.3).

vLLM's test conftest calls it after every test; on a non-CPU platform it runs
``torch.accelerator.empty_cache()``, which raised on our CPU-only torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_npu import torch_accelerator  # noqa: E402


def test_cleanup_dist_env_and_memory_under_an_npu_platform():
    """In a fresh process with ``NPU_HARNESS_TARGET=mblt-sim``: the platform is not the CPU
    platform, and vLLM's cleanup returns (before the fix it raised "Cannot access accelerator
    device when none is available")."""
    from npu_conformance import vllm_server

    code = (
        "from vllm.platforms import current_platform\n"
        "assert type(current_platform).__name__ == 'MbltPlatform', type(current_platform)\n"
        "assert not current_platform.is_cpu()\n"
        "from vllm.distributed.parallel_state import cleanup_dist_env_and_memory\n"
        "cleanup_dist_env_and_memory()\n"
        "print('CLEANUP-OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=vllm_server.vllm_env("mblt-sim"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "CLEANUP-OK" in out.stdout, out.stderr[-3000:]


def test_wrapped_calls_do_nothing_without_an_accelerator():
    torch_accelerator.install()
    assert torch.accelerator.current_accelerator() is None
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()
    assert torch_accelerator.install() == [], "install() is idempotent"


def test_with_an_accelerator_torch_is_called(monkeypatch):
    calls = []
    wrapped = torch_accelerator._safe(lambda: calls.append("torch"))
    monkeypatch.setattr(torch_accelerator, "_no_accelerator", lambda: False)
    wrapped()
    assert calls == ["torch"]
    monkeypatch.setattr(torch_accelerator, "_no_accelerator", lambda: True)
    wrapped()
    assert calls == ["torch"]
