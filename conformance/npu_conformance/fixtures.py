"""Session fixtures shared by scenarios and tests: tiny models built once per session.

Nothing here imports numpy, torch or tokenizers until a fixture is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``tiny_model_dir(arch, seed=0, **config_overrides) -> Path``.

    Builds the model with ``npusim.tinymodel.build`` the first time a combination is asked
    for in this session (per xdist worker) and returns the cached directory afterwards.
    Skips when the ``tokenizers`` package (extra ``models``) is missing.
    """
    built: dict[str, Path] = {}

    def make(arch: str, seed: int = 0, **overrides: Any) -> Path:
        pytest.importorskip("tokenizers", reason="building tiny models needs the 'models' extra")
        from npusim import tinymodel

        key = json.dumps([arch, seed, overrides], sort_keys=True, default=str)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-s{seed}")
            built[key] = tinymodel.build(arch, out, seed=seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def golden_decoder(tiny_model_dir: Callable[..., Path]) -> Callable[..., Any]:
    """Factory ``golden_decoder(arch, seed=0, **config_overrides) -> npusim.llm.Decoder``,
    cached per session like :func:`tiny_model_dir`."""
    loaded: dict[Path, Any] = {}

    def make(arch: str, seed: int = 0, **overrides: Any) -> Any:
        from npusim.llm import Decoder

        path = tiny_model_dir(arch, seed, **overrides)
        if path not in loaded:
            loaded[path] = Decoder.from_pretrained(path)
        return loaded[path]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[..., Any]:
    """Factory ``hf_model(model_dir, fresh=False)``: transformers' ``AutoModelForCausalLM`` in
    float32 with eager attention, cached per directory unless ``fresh``.

    transformers' dynamic RoPE keeps state between calls (the longest sequence seen), so
    tests of it ask for a fresh model. Skips when torch or transformers is missing.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cache: dict[str, Any] = {}

    def get(model_dir: Path, fresh: bool = False) -> Any:
        key = str(model_dir)
        if fresh or key not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            if fresh:
                return model
            cache[key] = model
        return cache[key]

    return get


@pytest.fixture(scope="session")
def device_labs(tmp_path_factory: pytest.TempPathFactory):
    """Factory ``device_labs(target_name) -> npu_conformance.devices.base.DeviceLab``: one per
    target per session (artifacts built once, servers started once, shared by the serving
    suite and the device's own scenarios); every server is stopped at the end.

    Raises:
        npu_conformance.devices.NoDeviceLab: the target's device has no lab (yet).
    """
    from npu_conformance import devices
    from npu_conformance.targets import TARGETS

    labs: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in labs:
            cls = devices.lab_class(TARGETS[name].device)
            labs[name] = cls(name, tmp_path_factory.mktemp(f"{TARGETS[name].device}-{name}"))
        return labs[name]

    yield get
    for lab in labs.values():
        lab.close()
