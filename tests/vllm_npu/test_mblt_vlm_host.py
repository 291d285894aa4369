"""The MBLT plugin's Qwen2-VL / Qwen3-VL host side (``vllm_npu.mblt.vlm``, issue 14 §1): the host's
part of each MXQ call against the golden npusim pieces (vision RoPE, packed rotate rows, Qwen3-VL's
bilinear position embedding, the static relayout, the text M-RoPE rows), the layouts read off the
MXQ input counts, the vision encoder on every npusim vision layout (its outputs equal the golden
tower's), the per-request items and rules, and the session rule. No vLLM engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from npusim.llm.mrope import mrope_cos_sin, rope_index
from npusim.llm.vision import Qwen2VisionTower, Qwen3VisionTower
from npusim.mxq.eagle3_kinds import pack_rope_rows, unpack_rope_rows
from npusim.mxq.vlm_kinds import VlmVisionPart, relayout_pixels
from npusim.tinymodel import vlm as tiny
from vllm_npu.mblt import vlm
from vllm_npu.mblt.settings import MbltConfigError
from vllm_npu.mblt.vlm import (
    MAX_VISION_PATCHES,
    SessionImagePositions,
    VisionEncoder,
    VlmInputError,
    VlmLayoutError,
    VlmRelease,
    VlmRuleError,
    deepstack_window,
    feature_items,
    pack_rotate,
    pos_embed_interpolate,
    static_relayout,
    text_layout,
    text_rope_rows,
    vision_layout,
    vision_rope_cos_sin,
)

TOWERS = {"qwen2_vl": Qwen2VisionTower, "qwen3_vl": Qwen3VisionTower}


@pytest.fixture(scope="module")
def towers():
    """family -> (vision_config, tensors, golden tower), random weights of the tiny shapes."""
    out = {}
    for family, cls in TOWERS.items():
        cfg = dict(tiny._VISION[family])
        tensors = tiny._vision_weights(family, cfg, 0)
        out[family] = (cfg, tensors, cls(cfg, tensors))
    return out


def _head_dim(cfg, family):
    return (cfg["embed_dim"] if family == "qwen2_vl" else cfg["hidden_size"]) // cfg["num_heads"]


# ------------------------------------------------------------------------------------------ host parts


def test_pack_rotate_is_the_npusim_rotate_layout():
    rng = np.random.default_rng(0)
    for d in (16, 32, 64, 80):
        half = rng.normal(size=(5, d // 2)).astype(np.float32)
        cos, sin = np.concatenate([np.cos(half)] * 2, 1), np.concatenate([np.sin(half)] * 2, 1)
        rows = pack_rotate(cos, sin)
        assert rows.shape == (5, 2 * (-(-d // 64) * 64))
        np.testing.assert_array_equal(rows, pack_rope_rows(cos, sin))
        back = unpack_rope_rows(rows, d)
        np.testing.assert_array_equal(back[0], cos)
        np.testing.assert_array_equal(back[1], sin)


@pytest.mark.parametrize("family", TOWERS)
@pytest.mark.parametrize("grids", [[(1, 16, 16)], [(1, 4, 8)], [(2, 6, 4)], [(1, 8, 4), (3, 4, 4)]])
def test_vision_rope_equals_the_golden_tower(towers, family, grids):
    cfg, _t, tower = towers[family]
    cos, sin = vision_rope_cos_sin(grids, head_dim=_head_dim(cfg, family), merge_size=cfg["spatial_merge_size"])
    gcos, gsin = tower.rope(grids)
    np.testing.assert_allclose(cos, gcos, atol=2e-6)
    np.testing.assert_allclose(sin, gsin, atol=2e-6)


@pytest.mark.parametrize("grids", [[(1, 16, 16)], [(1, 8, 12)], [(1, 64, 64)], [(2, 10, 6)], [(1, 4, 4), (1, 20, 8)]])
def test_pos_embed_interpolation_equals_the_golden_tower(towers, grids):
    cfg, tensors, tower = towers["qwen3_vl"]
    got = pos_embed_interpolate(tensors["model.visual.pos_embed.weight"], grids, merge_size=cfg["spatial_merge_size"])
    np.testing.assert_allclose(got, tower.pos_embeds(grids), atol=1e-5)


@pytest.mark.parametrize(("grid", "patch", "shape"), [((1, 16, 16), 14, (896, 56, 6)), ((1, 16, 16), 16, (1024, 64, 6)),
                                                       ((1, 4, 6), 14, (84, 56, 6))])
def test_static_relayout_is_the_npusim_layout(grid, patch, shape):
    x = np.random.default_rng(1).normal(size=(grid[1] * grid[2], 3 * 2 * patch * patch)).astype(np.float32)
    got = static_relayout(x, grid)
    assert got.shape == shape
    np.testing.assert_array_equal(got, relayout_pixels(x, grid, merge=2, temporal=2))
    with pytest.raises(VlmInputError, match="one image"):
        static_relayout(np.concatenate([x, x]), (2, grid[1], grid[2]))


@pytest.mark.parametrize(("family", "head_dim", "section", "theta", "interleaved"),
                         [("qwen2_vl", 32, [4, 6, 6], 1e6, False), ("qwen3_vl", 32, [6, 5, 5], 5e6, True),
                          ("qwen3_vl", 128, [24, 20, 20], 5e6, True)])
def test_text_rope_rows_pack_the_golden_mrope(family, head_dim, section, theta, interleaved):
    ids = [5, 6, 1024, *([1026] * 16), 1025, 7, 8, 9]
    pos, delta = rope_index(ids, image_grid_thw=[(1, 8, 8)], image_token_id=1026, video_token_id=1027,
                            vision_start_token_id=1024, spatial_merge_size=2, family=family)
    assert delta < 0
    cos, sin = mrope_cos_sin(pos, head_dim=head_dim, rope_theta=theta, mrope_section=section, interleaved=interleaved)
    rows = text_rope_rows(pos, head_dim=head_dim, rope_theta=theta, mrope_section=section, interleaved=interleaved)
    np.testing.assert_allclose(rows, pack_rope_rows(cos, sin), atol=1e-6)
    # 1-D and 4-row positions: broadcast / drop row 0
    lin = np.arange(7)
    np.testing.assert_array_equal(
        text_rope_rows(lin, head_dim=head_dim, rope_theta=theta, mrope_section=section, interleaved=interleaved),
        text_rope_rows(np.stack([lin] * 4), head_dim=head_dim, rope_theta=theta, mrope_section=section,
                       interleaved=interleaved))
    with pytest.raises(ValueError, match="mrope_section"):
        text_rope_rows(pos, head_dim=head_dim, rope_theta=theta, mrope_section=[1, 1, 1], interleaved=interleaved)


def test_deepstack_window_scatters_visual_rows_only():
    deep = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) + 1
    pos = np.array([3, 4, 7])
    w = deepstack_window(pos, deep, 2, 4, layers=2, hidden=4)  # tokens 2..5
    assert w.shape == (2, 4, 4)
    np.testing.assert_array_equal(w[:, 1], deep[:, 0])
    np.testing.assert_array_equal(w[:, 2], deep[:, 1])
    assert not w[:, [0, 3]].any()
    assert not deepstack_window(pos, deep, 8, 3, layers=2, hidden=4).any()  # generated tokens: zeros
    assert not deepstack_window(None, None, 0, 2, layers=3, hidden=4).any()


# ------------------------------------------------------------------------------------------ layouts

Q2 = tiny._VISION["qwen2_vl"]
Q3 = tiny._VISION["qwen3_vl"]


def test_vision_layouts_by_input_count_and_width():
    assert vision_layout("qwen2_vl", [(896, 56, 6)], Q2).kind == "static"
    lay = vision_layout("qwen2_vl", [(1, -1, 128), (1, -1, 1176)], Q2)
    assert (lay.kind, dict(lay.slots)) == ("dynamic", {"folded": 1, "rope": 0})
    lay = vision_layout("qwen2_vl", [(1, -1, 1176), (1, -1, 16), (1, -1, 16)], Q2)
    assert dict(lay.slots) == {"folded": 0, "cos": 1, "sin": 2}
    with pytest.raises(VlmLayoutError, match="must expose 1, 2, or 3 inputs; got 4"):
        vision_layout("qwen2_vl", [(1, -1, 1)] * 4, Q2)
    lay = vision_layout("qwen3_vl", [(1, 256, 1536)], Q3)
    assert (lay.kind, lay.static_patches) == ("folded", 256)
    assert vision_layout("qwen3_vl", [(1024, 64, 6)], Q3).kind == "legacy"
    lay = vision_layout("qwen3_vl", [(1, -1, 1536), (1, -1, 32), (1, -1, 128)], Q3)
    assert dict(lay.slots) == {"folded": 0, "pos": 1, "rope": 2}
    with pytest.raises(VlmLayoutError, match="matches neither the folded layout"):
        vision_layout("qwen3_vl", [(1, 256, 7)], Q3)
    with pytest.raises(VlmLayoutError, match="do not match the expected pos width 32"):
        vision_layout("qwen3_vl", [(1, -1, 1536), (1, -1, 33), (1, -1, 128)], Q3)


def test_text_layouts_and_batch_refusals():
    assert text_layout("qwen2_vl", [(1, -1, 128)]).inputs == ("embeds",)
    assert text_layout("qwen2_vl", [(1, -1, 128), (1, -1, 128)]).has_rope
    assert text_layout("qwen3_vl", [()] * 2).inputs == ("embeds", "deepstack")
    assert text_layout("qwen3_vl", [()] * 3).inputs == ("embeds", "deepstack", "rope")
    assert text_layout("qwen3_vl", [()] * 3, max_batch_size=4).inputs == ("embeds", "rope", "deepstack")
    assert text_layout("qwen3_vl", [()] * 4).inputs == ("embeds", "ds0", "ds1", "ds2")
    assert text_layout("qwen3_vl", [()] * 5, max_batch_size=16).inputs == ("embeds", "ds0", "ds1", "ds2", "rope")
    with pytest.raises(MbltConfigError, match="Batched Qwen3-VL text MXQs without a RoPE input are unsupported"):
        text_layout("qwen3_vl", [()] * 2, max_batch_size=16)
    with pytest.raises(MbltConfigError, match="split-static .* batched split-static artifacts are unsupported"):
        text_layout("qwen3_vl", [()] * 4, max_batch_size=2)
    with pytest.raises(MbltConfigError, match="Batched Qwen2-VL text MXQs with an external RoPE input"):
        text_layout("qwen2_vl", [()] * 2, max_batch_size=2)
    with pytest.raises(VlmLayoutError, match="input count is not recognized: got 6"):
        text_layout("qwen3_vl", [()] * 6)


def _artifact(family, **top):
    vc = {**(Q2 if family == "qwen2_vl" else Q3), "mxq_path": "vision.mxq"}
    if family == "qwen3_vl":
        vc["deepstack_visual_indexes"] = [0, 1, 2]
    tc = {"mxq_path": "text.mxq", "hidden_size": 128, "num_attention_heads": 4, "head_dim": 32,
          "rope_scaling": {"mrope_section": [4, 6, 6] if family == "qwen2_vl" else [6, 5, 5]}, "rope_theta": 1e6}
    return {"model_type": f"mobilint-{family}", "vision_config": vc, "text_config": tc, "image_token_id": 1026,
            "video_token_id": 1027, **top}


def test_release_paths_overrides_and_reconciliation(caplog):
    art = _artifact("qwen2_vl", dynamic_vision=True)
    rel = VlmRelease.resolve("/r", art, {}, [(896, 56, 6)], [(1, -1, 128)])
    assert (rel.vision_mxq, rel.text_mxq, rel.dynamic) == ("/r/vision.mxq", "/r/text.mxq", False)
    assert "override config.json's dynamic flag True" in caplog.text
    rel = VlmRelease.resolve("/r", {**art, "text_mxq_path": "t2.mxq"}, {"vision_mxq_path": "v3.mxq"},
                             [(1, -1, 1176), (1, -1, 128)], [(1, -1, 128), (1, -1, 128)])
    assert (rel.vision_mxq, rel.text_mxq, rel.dynamic, rel.text.has_rope) == ("/r/v3.mxq", "/r/t2.mxq", True, True)
    with pytest.raises(VlmLayoutError, match="pairs a dynamic vision MXQ with a RoPE-input text MXQ"):
        VlmRelease.resolve("/r", art, {}, [(896, 56, 6)], [(1, -1, 128), (1, -1, 128)])
    with pytest.raises(vlm.MbltBackendError, match="names no text MXQ"):
        VlmRelease.resolve("/r", {**art, "text_config": {}}, {}, [(896, 56, 6)], [(1, -1, 128)])
    rel3 = VlmRelease.resolve("/r", _artifact("qwen3_vl"), {}, [(1, 256, 1536)], [()] * 2)
    assert (rel3.output_order, rel3.deepstack_layers, rel3.text.deepstack) == ((0, 2, 3, 1), 3, "bundled")
    art3 = _artifact("qwen3_vl")
    art3["vision_config"]["vision_output_order"] = "3,0,1,2"
    assert VlmRelease.resolve("/r", art3, {}, [(1, 256, 1536)], [()] * 2).output_order == (3, 0, 1, 2)
    art3["vision_config"]["vision_output_order"] = [0, 0, 1, 2]
    with pytest.raises(VlmLayoutError, match="expected a permutation of 0..3"):
        VlmRelease.resolve("/r", art3, {}, [(1, 256, 1536)], [()] * 2)


# ------------------------------------------------------------------------------------------ the encoder


class _PartModel:
    """An npusim vision part as a qbruntime model (shapes from the variant handle; infer)."""

    def __init__(self, part):
        self.part, self.calls = part, []

    def get_model_variant_handle(self, idx):
        assert idx == 0
        return SimpleNamespace(get_model_input_shape=self.part.input_shapes)

    def infer(self, inputs):
        self.calls.append([np.asarray(x).shape for x in inputs])
        arrays, batch = self.part.check(inputs)
        return self.part.run(arrays, batch)

    def dispose(self):
        pass


LAYOUT_CASES = [  # family, vision_layout, header extras, grids (items), kind
    ("qwen2_vl", "static", {"vision_grid": [1, 16, 16]}, [(1, 16, 16)], "image"),
    ("qwen2_vl", "rope", {}, [(1, 8, 12)], "image"),
    ("qwen2_vl", "cos_sin", {}, [(2, 4, 8)], "video"),
    ("qwen3_vl", "folded", {"vision_grid": [1, 16, 16]}, [(1, 16, 16)], "image"),
    ("qwen3_vl", "legacy", {"vision_grid": [1, 16, 16]}, [(1, 16, 16)], "image"),
    ("qwen3_vl", "dynamic", {}, [(1, 12, 8)], "image"),
    ("qwen3_vl", "dynamic", {"vision_input_order": ["folded", "pos", "rope"], "vision_output_order": [3, 0, 1, 2]},
     [(3, 8, 4)], "video"),
]


def _encoder(towers, family, layout, extra):
    cfg, tensors, _tower = towers[family]
    header = {"llm_config": cfg, "vision_layout": layout, "max_width": 4096, **extra}
    part = VlmVisionPart(f"{family}_vision", header, tensors)
    model = _PartModel(part)
    art = _artifact(family)
    if "vision_output_order" in extra:
        art["vision_config"]["vision_output_order"] = extra["vision_output_order"]
    dynamic = "vision_grid" not in extra
    text = ([()] * 2 if family == "qwen2_vl" else [()] * 3) if dynamic else ([()] if family == "qwen2_vl" else [()] * 2)
    rel = VlmRelease.resolve("/r", art, {}, part.input_shapes(), text)
    pos = tensors.get("model.visual.pos_embed.weight") if family == "qwen3_vl" and dynamic else None
    return VisionEncoder(rel, model, pos_embed=pos), model


@pytest.mark.parametrize(("family", "layout", "extra", "grids", "kind"), LAYOUT_CASES)
def test_encoder_equals_the_golden_tower_on_every_layout(towers, family, layout, extra, grids, kind):
    cfg, _tensors, tower = towers[family]
    enc, model = _encoder(towers, family, layout, extra)
    fold = 3 * 2 * cfg["patch_size"] ** 2
    n = sum(t * h * w for t, h, w in grids)
    x = np.random.default_rng(2).normal(size=(n, fold)).astype(np.float32)
    embeds, deep = enc.encode(x, grids, kind=kind)
    want = tower.forward(x, grids)
    if family == "qwen2_vl":
        assert deep is None
        np.testing.assert_allclose(embeds, want, atol=1e-5)
        assert len(model.calls) == len(grids)  # one call per item
    else:
        np.testing.assert_allclose(embeds, want[0], atol=1e-5)
        np.testing.assert_allclose(deep, want[1], atol=1e-5)
        assert deep.shape == (3, n // 4, embeds.shape[1])
        assert len(model.calls) == sum(t for t, _h, _w in grids)  # one call per image / video frame


def test_encoder_refusals(towers):
    enc, _m = _encoder(towers, "qwen2_vl", "static", {"vision_grid": [1, 16, 16]})
    x = np.zeros((64, 1176), np.float32)
    with pytest.raises(VlmInputError, match="resized to the compiled frame"):
        enc.encode(x, [(1, 8, 8)])
    with pytest.raises(VlmInputError, match="does not support video inputs"):
        enc.encode(np.zeros((512, 1176), np.float32), [(2, 16, 16)], kind="video")
    enc3, _m = _encoder(towers, "qwen3_vl", "folded", {"vision_grid": [1, 16, 16]})
    with pytest.raises(VlmInputError, match="compiled for 256 patches; the processor produced 64"):
        enc3.encode(np.zeros((64, 1536), np.float32), [(1, 8, 8)])
    dyn, _m = _encoder(towers, "qwen3_vl", "dynamic", {})
    with pytest.raises(VlmRuleError, match=r"\[\[1, 80, 64\]\] pre-merge vision tokens \(5120 total for one encoder "
                                           r"call\), exceeding the NPU encoder limit of 4096"):
        dyn.encode(np.zeros((80 * 64, 1536), np.float32), [(1, 80, 64)])
    vlm.check_vision_patches("video", [(8, 64, 64)])  # per frame: 4096 each, one call per frame
    with pytest.raises(VlmLayoutError, match="needs 'model.visual.pos_embed.weight'"):
        VisionEncoder(dyn.release, _m, pos_embed=None)


# ------------------------------------------------------------------------------------------ items and rules


def _spec(identifier, modality, offset, length, pixels=None, grid=None, is_embed=None):
    data = None
    if pixels is not None:
        key = "pixel_values_videos" if modality == "video" else "pixel_values"
        gkey = "video_grid_thw" if modality == "video" else "image_grid_thw"
        data = {key: SimpleNamespace(data=pixels), gkey: SimpleNamespace(data=np.asarray(grid))}
    return SimpleNamespace(identifier=identifier, modality=modality, data=data,
                           mm_position=SimpleNamespace(offset=offset, length=length, is_embed=is_embed))


def test_feature_items_place_rows_at_is_embed_positions(towers):
    enc, _m = _encoder(towers, "qwen3_vl", "dynamic", {})
    img = np.random.default_rng(3).normal(size=(32, 1536)).astype(np.float32)
    vid = np.random.default_rng(4).normal(size=(2 * 16, 1536)).astype(np.float32)
    is_embed = np.array([False] + [True] * 4 + [False, False] + [True] * 4)  # a timestamp between frames
    items = feature_items([_spec("v", "video", 20, 11, vid, [2, 4, 4], is_embed),
                           _spec("i", "image", 3, 8, img, [1, 4, 8])], enc)
    assert [it.identifier for it in items] == ["i", "v"]
    assert items[0].positions.tolist() == list(range(3, 11))
    assert items[1].positions.tolist() == [21, 22, 23, 24, 27, 28, 29, 30]
    assert items[1].rows.shape == (8, 128) and items[1].deepstack.shape == (3, 8, 128)
    with pytest.raises(VlmInputError, match="embed-count mismatch"):
        feature_items([_spec("i", "image", 3, 9, img, [1, 4, 8])], enc)
    with pytest.raises(VlmInputError, match="arrived without its pixels"):
        feature_items([_spec("i", "image", 3, 8)], enc, computed_tokens=10)
    covered = feature_items([_spec("i", "image", 3, 8)], enc, computed_tokens=11)
    assert covered[0].rows is None and covered[0].end == 11


def test_request_rules():
    vlm.check_request_rules(["image"], dynamic=False)
    vlm.check_request_rules([], dynamic=False)
    with pytest.raises(VlmRuleError, match="supports exactly one image in the initial request, but got 2 image"):
        vlm.check_request_rules(["image", "image"], dynamic=False)
    with pytest.raises(VlmRuleError, match="does not support video inputs. Only one initial image"):
        vlm.check_request_rules(["image", "video"], dynamic=False)
    with pytest.raises(VlmRuleError, match="Unsupported multimodal modality for Mobilint Qwen2/3-VL on NPU: audio"):
        vlm.check_request_rules(["audio"], dynamic=False)
    vlm.check_request_rules(["image", "video", "image"], dynamic=True)
    with pytest.raises(VlmRuleError, match=r"Qwen3-VL dynamic vision on NPU: \['audio'\]"):
        vlm.check_request_rules(["image", "audio"], dynamic=True)
    assert MAX_VISION_PATCHES == 4096


def test_session_image_positions():
    s = SessionImagePositions(capacity=2)
    sig = (5, 64, None)
    s.check(None, sig)
    s.check(None, (9, 64, None))  # no session id: every request is its own session
    s.check("a", sig)
    s.check("a", None)  # a text-only turn
    s.check("a", sig)  # the same image position
    with pytest.raises(VlmRuleError, match=r"requires a fixed image-token position. session_id=a, "
                                           r"expected=\(5, 64, None\), got=\(7, 64, None\)"):
        s.check("a", (7, 64, None))
    s.check("b", (7, 64, None))
    s.check("c", (7, 64, None))  # capacity 2: "a" is dropped
    s.check("a", (7, 64, None))
    assert vlm.session_id_of(SimpleNamespace(extra_args={"session_id": 12})) == "12"
    assert vlm.session_id_of(SimpleNamespace(extra_args=None)) is None
    ph = SimpleNamespace(offset=2, length=3, is_embed=np.array([True, False, True]))
    assert vlm.image_signature(ph) == (2, 3, (True, False, True))
