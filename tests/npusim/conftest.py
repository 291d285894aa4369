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
