"""Shared fixtures for the npusim tests: tiny models built once per session, cached HF models.

Tiny model directories (``tiny_model_dir``) and HF models (``hf_model``) come from the
``npu_conformance`` plugin's fixtures; they need the optional ``tokenizers`` package, and
``torch`` and ``transformers``. Tests that need them skip (with the import's reason) when they are absent;
everything else runs with numpy alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ARG001
    """In a run that selects the torch-free child (``test_npusim_numpy_only.py``), the modules
    whose every test passes there (:data:`numpy_only_modules.NUMPY_ONLY_MODULES`) run once, in
    that child: they are deselected here (after ``-k`` / ``-m``, so a run that deselects the
    child keeps them)."""
    from numpy_only_modules import NUMPY_ONLY_MODULES, RUNNER

    here = Path(__file__).resolve().parent
    if not any(item.nodeid.endswith(RUNNER) for item in items):
        return
    keep, drop = [], []
    for item in items:
        path = Path(str(item.fspath)).resolve()
        (drop if path.parent == here and path.stem in NUMPY_ONLY_MODULES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# Max |numpy - reference| measured by the tests, printed in the terminal summary.
_DIFFS: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _DIFFS:
        return
    terminalreporter.section("npusim: measured differences (max abs unless named NMSE)")
    for name in sorted(_DIFFS):
        terminalreporter.write_line(f"{name:<58} {_DIFFS[name]:.3e}")


@pytest.fixture(scope="session")
def record_diff() -> Callable[[str, float], None]:
    """``record_diff(name, value)``: report a measured difference in the terminal summary."""

    def record(name: str, value: float) -> None:
        _DIFFS[name] = max(float(value), _DIFFS.get(name, 0.0))

    return record


@pytest.fixture(scope="session")
def tiny_decoder() -> Callable[..., Any]:
    """``tiny_decoder(arch, seed=0, dtype=np.float32, **overrides) -> Decoder`` built in memory (numpy only).

    Same config and weights as ``tiny_model_dir`` (vocab 1024), without the tokenizer or disk.
    """
    from npusim.llm import Decoder, ModelConfig
    from npusim.tinymodel import make_config, make_weights

    cache: dict[str, Any] = {}

    def get(arch: str, seed: int = 0, dtype: Any = np.float32, **overrides: Any):
        key = json.dumps([arch, seed, np.dtype(dtype).name, overrides], sort_keys=True)
        if key not in cache:
            cfg = ModelConfig.from_dict(make_config(arch, vocab_size=1024, **overrides))
            cache[key] = Decoder(cfg, make_weights(cfg, seed), dtype=dtype)
        return cache[key]

    return get


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------- npusim.mxq fixtures

MXQ_VOCAB = 256
MXQ_MAX_POSITIONS = 256


@pytest.fixture(scope="session")
def mxq_hf_dir(tmp_path_factory) -> Path:
    """A tiny llama HF directory (2 layers, vocab 256, 256 positions) written with numpy alone,
    plus placeholder tokenizer files (only copied by the compiler, never parsed)."""
    from npusim.llm import ModelConfig, save_safetensors
    from npusim.tinymodel import make_config, make_weights

    d = tmp_path_factory.mktemp("mxq_hf")
    cfg = make_config("llama", vocab_size=MXQ_VOCAB, max_position_embeddings=MXQ_MAX_POSITIONS)
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_safetensors(d / "model.safetensors", make_weights(ModelConfig.from_dict(cfg), 0))
    (d / "tokenizer.json").write_text('{"placeholder": true}\n', encoding="utf-8")
    (d / "tokenizer_config.json").write_text('{"model_max_length": 256}\n', encoding="utf-8")
    (d / "generation_config.json").write_text('{"do_sample": false}\n', encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def mxq_artifact(tmp_path_factory, mxq_hf_dir) -> Callable[..., Path]:
    """``mxq_artifact(**compile_kwargs) -> Path`` of ``model.mxq``, compiled once per kwargs.

    Defaults for tests: ``max_cache_size=64, max_width=16, prefill_chunk_size=16``.
    """
    from npusim.mxq.compile import compile_artifact

    cache: dict[str, Path] = {}

    def get(**kwargs: Any) -> Path:
        kw = {"max_cache_size": 64, "max_width": 16, "prefill_chunk_size": 16, **kwargs}
        key = json.dumps(kw, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("mxq_art")
            cache[key] = compile_artifact(mxq_hf_dir, out, **kw) / "model.mxq"
        return cache[key]

    return get


@pytest.fixture(scope="session")
def mxq_golden(mxq_hf_dir):
    """The golden float32 decoder of ``mxq_hf_dir``."""
    from npusim.llm import Decoder

    return Decoder.from_pretrained(mxq_hf_dir)


@pytest.fixture
def mxq_machine(monkeypatch):
    """A fresh simulated machine (no env config, default settings), reset again afterwards."""
    from npusim.mxq import machine, tracing

    monkeypatch.delenv(machine.ENV_VAR, raising=False)
    machine.reset()
    yield machine
    tracing.stop_tracing_events() if tracing.active() else None
    machine.reset()


@pytest.fixture
def glog(capsys) -> Callable[[], list[str]]:
    """``glog()``: the glog details (text after ``"] "``) printed to stdout (where the real core's
    glog writes) since the last call."""
    import re

    line = re.compile(r"^[EW]\d{4} \d\d:\d\d:\d\d\.\d{3} \d+ [\w.]+:\d+\] (.*)$")

    def details() -> list[str]:
        captured = capsys.readouterr()
        details.stderr = captured.err.splitlines()  # plain stderr lines (e.g. "Unable to load; ...")
        printed = captured.out
        out = []
        for text in printed.splitlines():
            m = line.match(text)
            assert m, f"not a glog line: {text!r}"
            out.append(m.group(1))
        return out

    return details


#: The environment variables ``npusim.neff`` reads.
NEFF_ENV = ("NPUSIM_NEFF", "NEURON_PLATFORM_TARGET_OVERRIDE", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES")


@pytest.fixture
def neff_env(monkeypatch):
    """``npusim.neff`` with none of its environment variables set and nothing loaded (reset
    before and after the test)."""
    import npusim.neff as nrt

    for k in NEFF_ENV:
        monkeypatch.delenv(k, raising=False)
    nrt.reset()
    yield
    nrt.reset()


# ---------------------------------------------------------------- tiny VLMs (issue 14 §1)


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """``vlm_model_dir(family) -> Path``: the tiny ``qwen2_vl`` / ``qwen3_vl`` checkpoint of
    :mod:`npusim.tinymodel.vlm` (seed 0), built once per session (needs ``tokenizers``)."""
    pytest.importorskip("tokenizers", reason="building the tiny VLM checkpoints needs tokenizers")
    from npusim.tinymodel.vlm import build_qwen2_vl, build_qwen3_vl

    builders = {"qwen2_vl": build_qwen2_vl, "qwen3_vl": build_qwen3_vl}
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = builders[family](tmp_path_factory.mktemp(family))
        return cache[family]

    return get
