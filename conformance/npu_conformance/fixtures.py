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


class DeviceLabs:
    """The session's device labs, by target name: ``labs(name) -> DeviceLab``.

    A lab is made once per target per session (its artifacts are built once). Its servers run
    only while that target's scenarios run: :meth:`stop` stops them once the last one of a
    contiguous run of that target's scenarios is done (:func:`pytest_runtest_teardown` in the
    plugin; the plugin also orders the lab-using scenarios target by target), so at most one
    target's ``vllm serve`` processes hold memory at a time. A lab whose servers were stopped
    starts them again when asked (correct, only slower).
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._labs: dict[str, Any] = {}

    def __call__(self, name: str) -> Any:
        """The lab of target ``name``.

        Raises:
            npu_conformance.devices.NoDeviceLab: the target's device has no lab (yet).
        """
        if name not in self._labs:
            from npu_conformance import devices
            from npu_conformance.targets import TARGETS

            cls = devices.lab_class_for(name)
            self._labs[name] = cls(name, self._tmp.mktemp(f"{TARGETS[name].device}-{name}"))
        return self._labs[name]

    def stop(self, name: str) -> None:
        """Stop target ``name``'s servers (no-op for a target without a lab yet)."""
        lab = self._labs.get(name)
        if lab is not None:
            lab.close()

    def close(self) -> None:
        """Stop every lab's servers."""
        for lab in self._labs.values():
            lab.close()


#: Where :func:`device_labs` leaves its :class:`DeviceLabs` for the plugin's teardown hook.
LABS_KEY = pytest.StashKey[DeviceLabs]()


@pytest.fixture(scope="session")
def device_labs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Factory ``device_labs(target_name) -> npu_conformance.devices.base.DeviceLab``: one
    :class:`DeviceLabs` per session (artifacts built once per target, shared by the serving
    suite and the device's own scenarios). A target's servers are stopped after its last
    scenario in a row, every server at the end of the session.

    Raises:
        npu_conformance.devices.NoDeviceLab: the target's device has no lab (yet).
    """
    labs = DeviceLabs(tmp_path_factory)
    request.config.stash[LABS_KEY] = labs
    yield labs
    labs.close()
    del request.config.stash[LABS_KEY]
