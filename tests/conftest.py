"""Test-suite wiring: pytester (for testing the conformance plugin in throwaway projects), the
Hypothesis profiles, and ``serve_vllm`` (a real ``vllm serve`` process for a test module)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from npu_conformance import vllm_server

pytest_plugins = ["pytester"]

# Property tests: no per-example deadline (the machine is noisy). With CI set, Hypothesis's
# "ci" profile (derandomized: the same examples every run) is used with these bounds; local
# runs explore new examples each time.
_BOUNDS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("ci"), **_BOUNDS)
settings.register_profile("dev", **_BOUNDS)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="module")
def serve_vllm(tmp_path_factory) -> Iterator[Callable[..., dict]]:
    """``serve_vllm(model, *args)`` starts ``vllm serve MODEL ARGS`` (vLLM's CPU backend: no
    ``NPU_HARNESS_TARGET``) on a free local port through :mod:`npu_conformance.vllm_server`,
    waits until ``/health`` answers and returns ``{"base", "model", "log"}``; every server
    started is stopped when the module ends. A server that exits or is not healthy in time
    fails the test with the tail of its log."""
    servers: list[vllm_server.Server] = []

    def start(model: Path, *args: str) -> dict:
        log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
        try:
            server = vllm_server.start(model, args, env=vllm_server.vllm_env(), log=log)
        except vllm_server.ServerError as exc:
            pytest.fail(str(exc))
        servers.append(server)
        return {"base": server.base, "model": model, "log": log}

    yield start
    for server in servers:
        server.stop()
