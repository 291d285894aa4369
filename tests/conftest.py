"""Test-suite wiring: pytester (for testing the conformance plugin in throwaway projects), the
Hypothesis profiles, and ``serve_vllm`` (a real ``vllm serve`` process for a test module)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

# Property tests: no per-example deadline (the machine is noisy). With CI set, Hypothesis's
# "ci" profile (derandomized: the same examples every run) is used with these bounds; local
# runs explore new examples each time.
_BOUNDS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("ci"), **_BOUNDS)
settings.register_profile("dev", **_BOUNDS)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


#: How long a ``vllm serve`` may take to become healthy (engine start-up is ~35-65 s here).
VLLM_START_TIMEOUT_S = 600


def vllm_command() -> str:
    """The ``vllm`` console script of this environment."""
    return shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment for a vLLM child: no device target, 1 GiB CPU KV cache, offline."""
    env = {k: v for k, v in os.environ.items() if k != "NPU_HARNESS_TARGET"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_vllm(tmp_path_factory) -> Iterator[Callable[..., dict]]:
    """``serve_vllm(model, *args)`` starts ``vllm serve MODEL ARGS`` on a free local port, waits
    until ``/health`` answers and returns ``{"base", "model", "log"}``; every server started is
    stopped when the module ends. A server that exits or is not healthy in time fails the test
    with the tail of its log."""
    procs: list[subprocess.Popen] = []

    def start(model: Path, *args: str) -> dict:
        port = _free_port()
        log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
        cmd = [vllm_command(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm_env())
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return {"base": base, "model": model, "log": log}
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {VLLM_START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
