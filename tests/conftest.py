"""Test-suite wiring: pytester (for testing the conformance plugin in throwaway projects), the
Hypothesis profiles, ``serve_vllm`` (a real ``vllm serve`` process for a test module),
``moe_release`` (the tiny Qwen3-MoE compiled to the Mobilint Mixture-of-Experts release),
``moe_golden`` (its golden decoder), ``eagle3_model_dir`` (the tiny EAGLE-3 checkpoint),
``eagle3_release`` (it compiled to the Mobilint EAGLE-3 release) and ``eagle3_golden`` (its base
decoder and draft)."""

from __future__ import annotations

import os
import json
from types import SimpleNamespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="session")
def moe_release(tiny_model_dir, tmp_path_factory) -> Callable[..., Path]:
    """``moe_release(**moe_options) -> Path``: the tiny Qwen3-MoE (2 layers, 8 experts, top-2)
    compiled by ``mxq compile`` to the Mixture-of-Experts release layout, width and prefill chunk
    16, placed on 3 cards as the release is unless ``devices`` says otherwise; once per options
    (:func:`npusim.mxq.compile_moe.compile_moe_release`'s keywords)."""
    from npusim.mxq.compile import compile_artifact

    cache: dict[str, Path] = {}

    def get(**moe: Any) -> Path:
        key = json.dumps(moe, sort_keys=True)
        if key not in cache:
            cache[key] = compile_artifact(tiny_model_dir("qwen3_moe"), tmp_path_factory.mktemp("moe-release"),
                                          max_width=16, prefill_chunk_size=16, moe={"devices": 3, **moe})
        return cache[key]

    return get


@pytest.fixture(scope="session")
def moe_golden(tiny_model_dir) -> Any:
    """The golden decoder (``npusim.llm.Decoder``) of the tiny Qwen3-MoE that ``moe_release`` compiles."""
    from npusim.llm import Decoder

    return Decoder.from_pretrained(tiny_model_dir("qwen3_moe"))


#: ``eagle3_release``'s defaults: small capacities, so tests see chunking and fit in a moment.
EAGLE3_TEST_OPTIONS: dict[str, Any] = {"max_cache_size": 256, "prefill_chunk_size": 16}


@pytest.fixture(scope="session")
def eagle3_model_dir(tmp_path_factory) -> Path:
    """The tiny EAGLE-3 checkpoint of ``npusim.tinymodel.eagle3.build_eagle3`` (llama base, seed 0):
    the 4-layer base in the directory, the draft in ``eagle3_draft/``; built once per session."""
    pytest.importorskip("tokenizers", reason="building tiny models needs the 'models' extra")
    from npusim.tinymodel.eagle3 import build_eagle3

    return build_eagle3(tmp_path_factory.mktemp("tiny-eagle3"), base_arch="llama", seed=0)


@pytest.fixture(scope="session")
def eagle3_release(eagle3_model_dir, tmp_path_factory) -> Callable[..., Path]:
    """``eagle3_release(**opts) -> Path``: the tiny EAGLE-3 checkpoint compiled by ``mxq compile``
    to the Mobilint EAGLE-3 release layout (:func:`npusim.mxq.compile_eagle3.compile_eagle3_release`'s
    keywords; defaults :data:`EAGLE3_TEST_OPTIONS`: base/draft KV 256 tokens, prefill chunk 16,
    the vendor's tree 5/8/64), once per options."""
    from npusim.mxq.compile import compile_artifact

    cache: dict[str, Path] = {}

    def get(**opts: Any) -> Path:
        kw = {**EAGLE3_TEST_OPTIONS, **opts}
        key = json.dumps(kw, sort_keys=True)
        if key not in cache:
            top = {k: kw.pop(k) for k in ("max_cache_size", "prefill_chunk_size", "max_width", "hub_proxy") if k in kw}
            cache[key] = compile_artifact(eagle3_model_dir, tmp_path_factory.mktemp("eagle3-release"), eagle3=kw, **top)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def eagle3_golden(eagle3_model_dir) -> SimpleNamespace:
    """The golden pieces of the tiny EAGLE-3 checkpoint: ``.base`` (``npusim.llm.Decoder``),
    ``.draft`` (``npusim.llm.eagle3.Eagle3Draft``) and ``.model_dir``."""
    from npusim.llm import Decoder
    from npusim.llm.eagle3 import Eagle3Draft

    return SimpleNamespace(base=Decoder.from_pretrained(eagle3_model_dir),
                           draft=Eagle3Draft.from_pretrained(eagle3_model_dir / "eagle3_draft"),
                           model_dir=eagle3_model_dir)
