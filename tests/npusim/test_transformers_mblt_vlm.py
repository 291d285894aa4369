"""The vendor's own transformers-mblt 0.6.1 Qwen2-VL / Qwen3-VL classes run our simulated VLM releases
(``mxq compile`` of the tiny checkpoints) on ``npusim.mxq`` as their ``qbruntime``, unpatched.

``MobilintQwen2VLForConditionalGeneration`` / ``MobilintQwen3VLForConditionalGeneration``
``.from_pretrained(<release>)`` detect each MXQ's layout from ``get_model_input_shape()`` (input
counts, slot widths), reconcile static/dynamic between the vision and text MXQs, and ``generate``
through upstream transformers 5.19's Qwen2-VL / Qwen3-VL ``generate`` (the image rows merged over
``<|image_pad|>``, M-RoPE positions from ``get_rope_index``). The greedy tokens must equal the golden
pipeline's (``VlmReference.generate_greedy``) with positions ``"linear"`` for a static text MXQ (it
rotates by the cache position: the contract's "Static text MXQ") and ``"mrope"`` for a RoPE-input one.

The processors are not used: upstream's image processors import torchvision, which this environment
lacks (docs/mblt-vlm-release.md §6); the pixels come from ``npusim.llm.vision_inputs.patchify``
(what the processor computes for these unresized pictures), with ``mm_token_type_ids`` as the
processor returns it (transformers 5.19 builds M-RoPE positions only when it is given).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _tmblt_alias import transformers_mblt_on_simulator

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers_mblt") is None or importlib.util.find_spec("mblt_npu") is None:
    pytest.skip("transformers-mblt / mblt-npu-python (pinned test dependencies) are not installed",
                allow_module_level=True)
vlm_tiny = pytest.importorskip("npusim.tinymodel.vlm")

NEW = 8


@pytest.fixture(scope="module")
def qbruntime() -> Iterator[Any]:
    """``import qbruntime`` on the simulator for this module only, transformers-mblt registered."""
    with transformers_mblt_on_simulator() as (mod, registered):
        assert {"qwen2_vl", "qwen3_vl"} <= set(registered)
        yield mod


@pytest.fixture
def sim(qbruntime) -> Iterator[Any]:
    from npusim.mxq import machine

    machine.reset()
    yield machine
    machine.reset()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tmblt_vlm_hf")
    return {"qwen2_vl": vlm_tiny.build_qwen2_vl(d / "q2"), "qwen3_vl": vlm_tiny.build_qwen3_vl(d / "q3")}


@pytest.fixture(scope="module")
def ref(ckpt) -> dict[str, Any]:
    from npusim.llm.vlm_reference import VlmReference

    return {f: VlmReference.from_pretrained(p) for f, p in ckpt.items()}


@pytest.fixture(scope="module")
def release(ckpt, tmp_path_factory):
    """``release(family, max_batch_size=1, **vlm options) -> Path``, compiled once per combination."""
    from npusim.mxq.compile import compile_artifact

    cache: dict[str, Path] = {}

    def get(family: str, max_batch_size: int = 1, **vlm: Any) -> Path:
        key = json.dumps([family, max_batch_size, vlm], sort_keys=True)
        if key not in cache:
            cache[key] = compile_artifact(ckpt[family], tmp_path_factory.mktemp("tmblt_vlm_rel") / "rel", vlm=vlm,
                                          max_batch_size=max_batch_size, max_width=16, prefill_chunk_size=16,
                                          max_cache_size=512)
        return cache[key]

    return get


def _load(family: str, path: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path))
    want = "MobilintQwen2VLForConditionalGeneration" if family == "qwen2_vl" else "MobilintQwen3VLForConditionalGeneration"
    assert type(model).__name__ == want and type(model).__module__.startswith("transformers_mblt."), type(model)
    return model


def _dispose(model: Any) -> None:
    """Free both MXQs (the composite model has no dispose of its own)."""
    model.model.visual.dispose()
    model.model.language_model.dispose()


def _pixels(family: str, image: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    from npusim.llm.vision_inputs import patchify

    pp = vlm_tiny.PREPROCESSORS[family]
    return patchify(vlm_tiny.test_image(image), patch_size=pp["patch_size"], temporal_patch_size=2, merge_size=2,
                    image_mean=pp["image_mean"], image_std=pp["image_std"])


def _prompt(r: Any, family: str, images: tuple[str, ...]) -> tuple[list[int], dict[str, Any]]:
    """A prompt with ``images`` (``<|vision_start|><|image_pad|>*n<|vision_end|>`` each) and their pixels."""
    ids, pvs, grids = [5, 17, 300], [], []
    for k, image in enumerate(images):
        pv, grid = _pixels(family, image)
        ids += [r.vision_start_token_id] + [r.image_token_id] * (grid[1] * grid[2] // 4) + [r.vision_end_token_id]
        ids += [44 + k, 9]
        pvs.append(pv)
        grids.append(grid)
    ids += [71, 2]
    return ids, {"pixel_values": np.concatenate(pvs), "image_grid_thw": grids}


def _vendor_generate(model: Any, r: Any, ids: list[int], mm: dict[str, Any]) -> list[int]:
    pid = torch.tensor([ids])
    token_types = torch.zeros_like(pid)
    token_types[pid == r.image_token_id] = 1
    with torch.no_grad():
        out = model.generate(input_ids=pid, attention_mask=torch.ones_like(pid),
                             pixel_values=torch.tensor(mm["pixel_values"]),
                             image_grid_thw=torch.tensor(mm["image_grid_thw"]), mm_token_type_ids=token_types,
                             max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def _vendor_qwen2_tables(r: Any, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cos/sin tables transformers-mblt 0.6.1's ``MobilintQwen2VLRotaryEmbedding`` packs for a
    2-input Qwen2-VL text MXQ: angles over the whole head (``cat(freqs, freqs)``) split by
    ``[2 * s for s in mrope_section]`` ([8, 12, 12] here), part ``i`` from position row ``i % 3``.
    Upstream splits the half head by ``mrope_section`` and repeats it, so for rows whose three
    positions differ (image tokens) the vendor's tables are not upstream M-RoPE."""
    d = r.decoder.config.head_dim
    inv = (np.float32(1) / (np.float32(r.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    freqs = positions[:, :, None].astype(np.float32) * inv.astype(np.float32)  # [3, T, d/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    bounds = np.cumsum([0] + [2 * s for s in r.mrope_section])
    pick = np.concatenate([np.full(b - a, i % 3) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    sel = emb[pick, :, np.arange(d)].T  # [T, d]: column j from row pick[j]
    return np.cos(sel).astype(np.float32), np.sin(sel).astype(np.float32)


def _golden_vendor_qwen2_rope(r: Any, ids: list[int], mm: dict[str, Any]) -> list[int]:
    """Greedy tokens of the golden decoder fed the vendor's Qwen2-VL RoPE tables (prompt positions
    from ``rope_index``; decode rows are equal, where both layouts agree)."""
    emb, pos, delta, _ = r.prompt_inputs(ids, **mm)
    dec = r.decoder
    cache = dec.new_cache(len(emb) + NEW)
    logits = dec.forward_rope(emb, cache, *_vendor_qwen2_tables(r, pos))
    out: list[int] = []
    while len(out) < NEW:
        out.append(int(np.argmax(logits[-1])))
        p = np.full((3, 1), cache.length + delta)
        logits = dec.forward_rope(dec.embed([out[-1]]), cache, *_vendor_qwen2_tables(r, p))
    return out


@pytest.mark.parametrize("layout, image", [("rope", "rings"), ("cos_sin", "sunset")])
def test_vendor_qwen2_dynamic_generate_follows_its_rope_rows(sim, release, ref, layout, image):
    """Dynamic Qwen2-VL: the text MXQ rotates by whatever rows the host packs. transformers-mblt
    0.6.1's rows are not upstream's M-RoPE (:func:`_vendor_qwen2_tables`), so its tokens equal the
    golden decoder driven by those rows, not ``generate_greedy(positions="mrope")`` (they differ
    for ``rings``)."""
    r = ref["qwen2_vl"]
    model = _load("qwen2_vl", release("qwen2_vl", vision="dynamic", vision_layout=layout))
    assert model.model.visual._uses_dynamic_vision and model.model.language_model._uses_rope_input
    ids, mm = _prompt(r, "qwen2_vl", (image,))
    got = _vendor_generate(model, r, ids, mm)
    assert got == _golden_vendor_qwen2_rope(r, ids, mm)
    if image == "rings":
        assert got != r.generate_greedy(ids, max_new_tokens=NEW, positions="mrope", **mm)
    _dispose(model)


CASES = [
    ("qwen2_vl", {"vision": "static"}, ("sunset",)),
    ("qwen2_vl", {"vision": "static"}, ("dots",)),
    ("qwen3_vl", {"vision": "static"}, ("checker",)),
    ("qwen3_vl", {"vision": "static", "vision_layout": "legacy", "text_layout": "split"}, ("checker",)),
    ("qwen3_vl", {"vision": "dynamic"}, ("stripes", "checker")),
    ("qwen3_vl", {"vision": "dynamic", "text_layout": "split", "vision_layout": "folded,pos,rope",
                  "vision_output_order": "3,0,1,2"}, ("sunset",)),
]


@pytest.mark.parametrize("family, opts, images", CASES,
                         ids=["-".join([f, *(str(v) for v in o.values())]) for f, o, _ in CASES])
def test_vendor_generate_equals_golden(sim, release, ref, family, opts, images):
    r = ref[family]
    model = _load(family, release(family, **opts))
    dynamic = opts["vision"] == "dynamic"
    assert bool(model.config.dynamic_vision) is dynamic
    assert model.model.visual._uses_dynamic_vision is dynamic
    assert model.model.language_model._uses_rope_input is dynamic
    ids, mm = _prompt(r, family, images)
    want = r.generate_greedy(ids, max_new_tokens=NEW, positions="mrope" if dynamic else "linear", **mm)
    assert _vendor_generate(model, r, ids, mm) == want
    _dispose(model)


@pytest.mark.parametrize("family, opts, image", [("qwen2_vl", {"vision": "static"}, "dots"),
                                                 ("qwen3_vl", {"vision": "static"}, "checker"),
                                                 ("qwen2_vl", {"vision": "dynamic"}, "rings"),
                                                 ("qwen3_vl", {"vision": "dynamic", "vision_output_order": "1,3,0,2"},
                                                  "stripes")])
def test_vendor_vision_tower_equals_golden(sim, release, ref, family, opts, image, record_diff):
    """The vendor's vision module on the vision MXQ: static layouts bit for bit (the MXQ computes
    the grid's RoPE itself); dynamic ones within float32 rounding (the host's RoPE is torch's)."""
    r = ref[family]
    model = _load(family, release(family, **opts))
    pv, grid = _pixels(family, image)
    with torch.no_grad():
        got = model.model.visual(torch.tensor(pv), torch.tensor([grid]))
    want_e, want_d = r.encode(pv, [grid])
    got_e = got.pooler_output.numpy()
    if opts["vision"] == "static":
        assert np.array_equal(got_e, want_e)
    else:
        diff = float(np.abs(got_e - want_e).max())
        record_diff(f"transformers-mblt {family} dynamic vision", diff)
        assert diff < 1e-4
    if family == "qwen3_vl":
        got_d = np.stack([d.numpy() for d in got.deepstack_features])
        assert np.allclose(got_d, want_d, rtol=0, atol=1e-4)
        if opts["vision"] == "static":
            assert np.array_equal(got_d, want_d)
    _dispose(model)


def test_vendor_batch_qwen3_rope_release(sim, release, ref):
    """A batch Qwen3-VL build (max_batch_size 2, text MXQ in the batch order embeds, rope, deepstack):
    transformers-mblt's batched DeepStack path with BatchParams gives the golden tokens."""
    r = ref["qwen3_vl"]
    path = release("qwen3_vl", max_batch_size=2, vision="dynamic")
    assert json.loads((path / "config.json").read_text())["text_config"]["max_batch_size"] == 2
    model = _load("qwen3_vl", path)
    ids, mm = _prompt(r, "qwen3_vl", ("stripes",))
    want = r.generate_greedy(ids, max_new_tokens=NEW, positions="mrope", **mm)
    assert _vendor_generate(model, r, ids, mm) == want
    _dispose(model)


def test_vendor_refuses_split_static_batch_and_mismatched_pairs(sim, release):
    with pytest.raises(ValueError, match="split-static text MXQ .* only supported for max_batch_size == 1"):
        _load("qwen3_vl", release("qwen3_vl", max_batch_size=2, vision="static", text_layout="split"))
    # a static vision MXQ with a RoPE-input text MXQ (the pair our compiler refuses to write)
    from transformers import AutoModelForImageTextToText

    static, dynamic = release("qwen3_vl", vision="static"), release("qwen3_vl", vision="dynamic")
    with pytest.raises(ValueError, match="bundled release and cannot be swapped"):
        AutoModelForImageTextToText.from_pretrained(str(static), text_mxq_path=str(dynamic / "text.mxq"))


def test_vendor_rejects_oversized_dynamic_call(sim, release):
    """More than 4096 patches in one dynamic vision call: the simulator's qbruntime-style shape error."""
    model = _load("qwen3_vl", release("qwen3_vl", vision="dynamic"))
    grid = (1, 64, 66)  # 4224 patches
    pv = np.zeros((grid[1] * grid[2], 1536), np.float32)
    with pytest.raises(ValueError, match=r"Input shape is invalid\..*N <= 4096.*N = 4224"):
        with torch.no_grad():
            model.model.visual(torch.tensor(pv), torch.tensor([grid]))
    _dispose(model)
