"""vllm_npu.mblt.vlm_model: vLLM 0.32's front end for Mobilint Qwen2-VL / Qwen3-VL releases.

Each test builds vLLM's processor for a release-like directory (the tiny VLM's tokenizer and
preprocessor configs, ``config.json`` as a compiled release's: ``mobilint-*`` model type, nested
``mxq_path``..., the static/dynamic flag) through ``ModelConfig`` and
``MULTIMODAL_REGISTRY.create_processor``, and applies it to prompts with generated images. No
engine runs. The pixels are compared with transformers' ``Qwen2VLImageProcessorPil`` (and a
video's with npusim's ``patchify``), the rules' messages with the values they must name."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "simulators") not in sys.path:
    sys.path.insert(0, str(REPO / "simulators"))

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from npusim.llm.vision_inputs import patchify  # noqa: E402
from npusim.tinymodel.vlm import PREPROCESSORS, build_qwen2_vl, build_qwen3_vl, test_image, test_video  # noqa: E402
from vllm_npu.mblt import models  # noqa: E402
from vllm_npu.mblt import vlm_model as vm  # noqa: E402
from vllm_npu.mblt.vlm_positions import rope_index  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PAD, VIDEO_PAD, V_START, V_END = 1026, 1027, 1024, 1025
RELEASES = {"q2_static": ("qwen2_vl", False), "q2_dynamic": ("qwen2_vl", True),
            "q3_static": ("qwen3_vl", False), "q3_dynamic": ("qwen3_vl", True)}


def write_release(family: str, out: Path, dynamic: bool) -> Path:
    """A release-like directory: the tiny VLM's files, ``config.json`` as ``mxq compile`` writes it."""
    (build_qwen2_vl if family == "qwen2_vl" else build_qwen3_vl)(out)
    cfg = json.loads((out / "config.json").read_text())
    backend = {"dev_no": 0, "core_mode": "single", "max_batch_size": 1}
    cfg.update(model_type=f"mobilint-{family}",
               architectures=[vm.MobilintQwen2VLForConditionalGeneration.__name__ if family == "qwen2_vl"
                              else vm.MobilintQwen3VLForConditionalGeneration.__name__])
    cfg["vision_config"].update(model_type=f"mobilint-{family}", mxq_path="vision.mxq", **backend)
    cfg["text_config"].update(model_type=f"mobilint-{family}_text", mxq_path="text.mxq", **backend)
    if family == "qwen2_vl":
        cfg["dynamic_vision"] = dynamic
    else:
        cfg.update(is_dynamic=dynamic, dynamic_vision=dynamic)
        cfg["vision_config"]["vision_output_order"] = [0, 2, 3, 1]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """name -> vLLM processor of each release kind (:data:`RELEASES`)."""
    from vllm import ModelRegistry
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    models.register()
    # The class objects themselves: vLLM inspects them in this process instead of a subprocess
    # per architecture (what the lazy "module:Class" registration costs, ~10 s each).
    for cls in (vm.MobilintQwen2VLForConditionalGeneration, vm.MobilintQwen3VLForConditionalGeneration):
        ModelRegistry.register_model(cls.__name__, cls)
    root = tmp_path_factory.mktemp("vlm_releases")
    out = {}
    for name, (family, dynamic) in RELEASES.items():
        d = write_release(family, root / name, dynamic)
        mc = ModelConfig(model=str(d), tokenizer=str(d), dtype="float32", max_model_len=4096)
        out[name] = MULTIMODAL_REGISTRY.create_processor(mc)
    return out


def with_meta(frames: np.ndarray, fps: float = 2.0) -> tuple[np.ndarray, dict]:
    """A video item as vLLM's loaders give it: the frames and their metadata (the processor keeps
    it with the frames: ``video_needs_metadata``)."""
    n = len(frames)
    return frames, {"fps": fps, "frames_indices": list(range(n)), "total_num_frames": n, "duration": n / fps}


def run(proc, text: str, images=(), videos=(), **kwargs):
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    ids = proc.info.get_tokenizer().encode(f"<|im_start|>user\n{text}<|im_end|>\n", add_special_tokens=False)
    data = {}
    if images:
        data["image"] = list(images)
    if videos:
        data["video"] = list(videos)
    return proc.apply(ProcessorInputs(ids, proc.info.parse_mm_data(data), hf_processor_mm_kwargs=kwargs),
                      TimingContext(enabled=False))


def hf_pixels(family: str, images, **call):
    pp = PREPROCESSORS[family]
    ip = Qwen2VLImageProcessorPil(patch_size=pp["patch_size"], temporal_patch_size=pp["temporal_patch_size"],
                                  merge_size=pp["merge_size"], image_mean=pp["image_mean"], image_std=pp["image_std"],
                                  size={"shortest_edge": pp["min_pixels"], "longest_edge": pp["max_pixels"]})
    return ip(images=list(images), return_tensors="pt", **call)


def data(out, modality: str):
    return [{k: v.data for k, v in item.items()} for item in out["mm_kwargs"][modality]]


# ------------------------------------------------------------------------------------------------

def test_family_and_static_flag_from_the_config():
    assert vm.vlm_family({"model_type": "mobilint-qwen2_vl"}) == "qwen2_vl"
    assert vm.vlm_family(SimpleNamespace(model_type="mobilint-qwen3_vl")) == "qwen3_vl"
    with pytest.raises(vm.UnsupportedVlmModelType, match="model_type 'mobilint-llava'"):
        vm.vlm_family({"model_type": "mobilint-llava"})
    assert vm.is_dynamic_vision({"model_type": "mobilint-qwen2_vl", "dynamic_vision": True})
    assert not vm.is_dynamic_vision({"model_type": "mobilint-qwen2_vl", "is_dynamic": True})  # a Qwen3-VL key
    assert vm.is_dynamic_vision({"model_type": "mobilint-qwen3_vl", "is_dynamic": True})
    assert vm.is_dynamic_vision({"model_type": "mobilint-qwen3_vl", "dynamic_vision": True})  # legacy alias
    assert not vm.is_dynamic_vision({"model_type": "mobilint-qwen3_vl"})


def test_release_config_loads(procs):
    cfg = procs["q3_dynamic"].info.get_hf_config()
    assert type(cfg).__name__ == "MobilintQwen3VLConfig" and cfg.is_dynamic
    assert (cfg.vision_config.mxq_path, cfg.text_config.mxq_path) == ("vision.mxq", "text.mxq")
    assert cfg.vision_config.vision_output_order == [0, 2, 3, 1]
    text = cfg.get_text_config()
    assert (text.hidden_size, text.num_attention_heads, text.vocab_size) == (128, 4, 1028)
    assert procs["q2_static"].info.ctx.model_config.uses_mrope
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id) == (IMAGE_PAD, VIDEO_PAD, V_START)


@pytest.mark.parametrize("name", ["q2_static", "q3_static"])
@pytest.mark.parametrize("image", ["sunset", "stripes", "rings"])
def test_static_image_resized_to_the_fixed_frame(procs, name, image):
    """Any image -> 224x224 first; Qwen2-VL keeps it (grid 16x16 at patch 14), Qwen3-VL's stock
    shortest_edge 65536 scales it to 256x256 (grid 16x16 at patch 16): 64 pads either way."""
    family = RELEASES[name][0]
    out = run(procs[name], f"{IMAGE}what?", [test_image(image)])
    assert out["prompt_token_ids"].count(IMAGE_PAD) == 64
    (item,) = data(out, "image")
    assert item["image_grid_thw"].tolist() == [1, 16, 16]
    frame = Image.fromarray(test_image(image)).resize((224, 224), Image.BICUBIC)
    want = hf_pixels(family, [frame])
    assert torch.equal(item["pixel_values"], want["pixel_values"].to(torch.float32))
    assert want["image_grid_thw"].tolist() == [[1, 16, 16]]


def test_static_rules(procs):
    for name, family in (("q2_static", "Qwen2-VL"), ("q3_static", "Qwen3-VL")):
        p = procs[name]
        two = [test_image("sunset"), test_image("dots")]
        with pytest.raises(vm.VlmRequestError, match="2 images"):
            run(p, IMAGE * 2, two)
        with pytest.raises(vm.VlmRequestError, match=f"dynamic-vision {family} release.*1 video"):
            run(p, VIDEO, videos=[with_meta(test_video("square"))])
        with pytest.raises(vm.VlmRequestError, match="2 images"):  # the chat path's count check
            p.info.validate_num_items("image", 2)
        for field, value in (("size", {"longest_edge": 50176}), ("min_pixels", 3136), ("max_pixels", 50176),
                             ("do_resize", False)):
            with pytest.raises(vm.VlmRequestError, match=rf"image {field}={value!r} cannot override the "
                                                         rf"static-vision {family} processor's fixed resize"):
                run(p, IMAGE, [test_image("sunset")], **{field: value})
            with pytest.raises(vm.VlmRequestError, match=rf"image {field}="):
                run(p, IMAGE, [test_image("sunset")], images_kwargs={field: value})
        assert run(p, IMAGE, [test_image("sunset")], do_resize=True)["prompt_token_ids"].count(IMAGE_PAD) == 64


def test_static_qwen3_grid_check_names_the_grid(procs, tmp_path):
    """A release whose preprocessor lowers shortest_edge would give 14x14 patches from 224x224:
    refused naming the grid (the static MXQ takes 256 patches)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    d = write_release("qwen3_vl", tmp_path / "low", False)
    pp = json.loads((d / "preprocessor_config.json").read_text())
    pp["size"]["shortest_edge"] = 3136
    (d / "preprocessor_config.json").write_text(json.dumps(pp))
    proc = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(d), tokenizer=str(d), dtype="float32",
                                                            max_model_len=4096))
    with pytest.raises(vm.VlmRequestError, match=r"\(1, 16, 16\) patch grid; the processor produced \(1, 14, 14\)"):
        run(proc, IMAGE, [test_image("sunset")])


@pytest.mark.parametrize("name", ["q2_static", "q2_dynamic", "q3_static", "q3_dynamic"])
def test_structural_overrides_refused(procs, name):
    family = RELEASES[name][0]
    patch = PREPROCESSORS[family]["patch_size"]
    with pytest.raises(vm.VlmRequestError, match=rf"image patch_size=99 cannot override the vision MXQ's "
                                                 rf"compile-time value \({patch}\)"):
        run(procs[name], IMAGE, [test_image("sunset")], patch_size=99)
    with pytest.raises(vm.VlmRequestError, match=r"image merge_size=4 .*\(2\)"):
        run(procs[name], IMAGE, [test_image("sunset")], images_kwargs={"merge_size": 4})
    out = run(procs[name], IMAGE, [test_image("sunset")], temporal_patch_size=2)  # the release's own value
    assert out["prompt_token_ids"].count(IMAGE_PAD) > 0


def test_dynamic_qwen2_one_image_its_own_aspect(procs):
    p = procs["q2_dynamic"]
    out = run(p, IMAGE, [test_image("stripes")])  # 192x320: upstream rounding to 196x308
    (item,) = data(out, "image")
    want = hf_pixels("qwen2_vl", [Image.fromarray(test_image("stripes"))])
    assert item["image_grid_thw"].tolist() == want["image_grid_thw"][0].tolist() == [1, 14, 22]
    assert torch.equal(item["pixel_values"], want["pixel_values"].to(torch.float32))
    assert out["prompt_token_ids"].count(IMAGE_PAD) == 14 * 22 // 4
    with pytest.raises(vm.VlmRequestError, match="exactly one image in the initial request, but got 2 images"):
        run(p, IMAGE * 2, [test_image("sunset"), test_image("dots")])
    with pytest.raises(vm.VlmRequestError, match=r"does not support video inputs \(got 1 video"):
        run(p, VIDEO, videos=[with_meta(test_video("square"))])


def test_dynamic_qwen3_several_images(procs):
    p = procs["q3_dynamic"]
    names = ["checker", "stripes", "rings"]  # 256x256, 192x320 (below shortest_edge: scaled up), 448x224
    out = run(p, f"a {IMAGE} b {IMAGE} c {IMAGE}", [test_image(n) for n in names])
    items = data(out, "image")
    want = hf_pixels("qwen3_vl", [Image.fromarray(test_image(n)) for n in names])
    grids = [it["image_grid_thw"].tolist() for it in items]
    assert grids == want["image_grid_thw"].tolist() == [[1, 16, 16], [1, 14, 22], [1, 28, 14]]
    assert torch.equal(torch.cat([it["pixel_values"] for it in items]), want["pixel_values"].to(torch.float32))
    ranges = out["mm_placeholders"]["image"]
    assert [r.length for r in ranges] == [64, 77, 98]
    ids = out["prompt_token_ids"]
    assert all(ids[r.offset - 1] == V_START and ids[r.offset + r.length] == V_END for r in ranges)
    assert ids.count(IMAGE_PAD) == 64 + 77 + 98


def test_dynamic_qwen3_clamp_and_do_resize(procs):
    """At most 4096 pre-merge patches: the stored longest_edge (16777216) and any larger override
    come down to 4096*16^2; a smaller override still applies; do_resize=False is refused."""
    p = procs["q3_dynamic"]
    big = np.asarray(Image.fromarray(test_image("checker")).resize((2048, 2048), Image.BICUBIC))
    limit = vm.MAX_VISION_TOKENS * 16 * 16
    assert p.info.vision.image_size["longest_edge"] == limit
    for kwargs in ({}, {"max_pixels": 10**8}, {"size": {"longest_edge": 10**8}},
                   {"images_kwargs": {"size": {"shortest_edge": 10**7, "longest_edge": 10**8}}}):
        (item,) = data(run(p, IMAGE, [big], **kwargs), "image")
        assert item["image_grid_thw"].tolist() == [1, 64, 64], kwargs
    (item,) = data(run(p, IMAGE, [big], max_pixels=512 * 512), "image")
    assert item["image_grid_thw"].tolist() == [1, 32, 32]
    for kwargs in ({"do_resize": False}, {"images_kwargs": {"do_resize": False}}):
        with pytest.raises(vm.VlmRequestError, match="do_resize=False bypasses the 4096-token NPU vision-token "
                                                     "ceiling for image inputs"):
            run(p, IMAGE, [big], **kwargs)
    with pytest.raises(vm.VlmRequestError, match="ceiling for video inputs"):
        run(p, VIDEO, videos=[with_meta(test_video("square"))], videos_kwargs={"do_resize": False})


def test_dynamic_qwen3_video(procs):
    """4 frames of 224x224 at 2 fps -> 2 frame groups of 14x14 patches: per group the timestamp
    text, <|vision_start|>, 49 pads, <|vision_end|> (only the pads are embeddings); the pixels
    are npusim's patchify of the frames; positions split per frame group."""
    p = procs["q3_dynamic"]
    frames = test_video("square")
    meta = {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4, "duration": 2.0}
    out = run(p, f"see {VIDEO} ok", videos=[(frames, meta)])
    (item,) = data(out, "video")
    assert item["video_grid_thw"].tolist() == [2, 14, 14]
    assert item["timestamps"].tolist() == [0.25, 1.25]
    pp = PREPROCESSORS["qwen3_vl"]
    want, grid = patchify(frames, patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=pp["image_mean"],
                          image_std=pp["image_std"])
    assert grid == (2, 14, 14)
    np.testing.assert_allclose(item["pixel_values_videos"].numpy(), want, atol=1e-6)
    tok = p.info.get_tokenizer()
    ids = out["prompt_token_ids"]
    (rng,) = out["mm_placeholders"]["video"]

    def group(stamp: str) -> list[int]:
        return tok.encode(f"<{stamp} seconds>", add_special_tokens=False) + [V_START, *[VIDEO_PAD] * 49, V_END]

    assert ids[rng.offset:rng.offset + rng.length] == group("0.2") + group("1.2")
    assert int(rng.is_embed.sum()) == 98 == ids.count(VIDEO_PAD)
    assert V_START not in ids[:rng.offset][-1:]  # the prompt's own wrap was replaced
    feats = [SimpleNamespace(modality="video", mm_position=rng, data=out["mm_kwargs"]["video"][0])]
    pos, delta = vm.mrope_input_positions(p.info.get_hf_config(), ids, feats)
    want_pos, want_delta = rope_index(ids, video_grid_thw=[(2, 14, 14)], image_token_id=IMAGE_PAD,
                                      video_token_id=VIDEO_PAD, spatial_merge_size=2, family="qwen3_vl")
    assert np.array_equal(pos.numpy(), want_pos) and delta == want_delta


def test_video_pixels_match_the_image_processor(procs):
    """A video of two identical frames has the pixels the image processor gives that frame
    (which repeats an image to the temporal patch): the patch order is the HF one."""
    p = procs["q3_dynamic"]
    frame = test_image("rings")
    (item,) = data(run(p, VIDEO, videos=[with_meta(np.stack([frame, frame]))]), "video")
    want = hf_pixels("qwen3_vl", [Image.fromarray(frame)])
    assert item["video_grid_thw"].tolist() == [1, 28, 14]
    np.testing.assert_allclose(item["pixel_values_videos"].numpy(), want["pixel_values"].numpy(), atol=1e-6)


def test_image_positions_from_the_processor_output(procs):
    p = procs["q3_dynamic"]
    out = run(p, f"a {IMAGE} b {IMAGE}", [test_image("checker"), test_image("stripes")])
    ids = out["prompt_token_ids"]
    feats = [SimpleNamespace(modality="image", mm_position=r, data=out["mm_kwargs"]["image"][i])
             for i, r in enumerate(out["mm_placeholders"]["image"])]
    pos, delta = vm.MobilintQwen3VLForConditionalGeneration.get_mrope_input_positions(
        SimpleNamespace(config=p.info.get_hf_config()), ids, feats[::-1])
    want, want_delta = rope_index(ids, image_grid_thw=[(1, 16, 16), (1, 14, 22)], image_token_id=IMAGE_PAD,
                                  video_token_id=VIDEO_PAD, spatial_merge_size=2, family="qwen3_vl")
    assert pos.dtype == torch.int64 and np.array_equal(pos.numpy(), want) and delta == want_delta < 0


@pytest.mark.parametrize("name", list(RELEASES))
def test_dummy_inputs_and_limits(procs, name):
    p = procs[name]
    limits = p.info.get_supported_mm_limits()
    counts = {m: 1 for m in limits}
    mm = p.get_dummy_mm_inputs(counts)
    most = p.info.get_mm_max_tokens_per_item(4096, counts)
    for modality in counts:
        (rng,) = mm["mm_placeholders"][modality]
        n = rng.length if rng.is_embed is None else int(rng.is_embed.sum())
        if name != "q2_dynamic" and modality == "image":  # a dynamic Qwen2-VL's dummy is capped at 1024x1024
            assert n == most[modality], (n, most)
    if RELEASES[name] == ("qwen3_vl", True):
        assert limits == {"image": None, "video": None} and most["image"] == 1024
    else:
        assert limits == {"image": 1}
        assert most["image"] == (12845056 // 28 ** 2 if name == "q2_dynamic" else 64)


def test_placeholder_strings():
    cls = vm.MobilintQwen2VLForConditionalGeneration
    assert cls.get_placeholder_str("image", 0) == IMAGE and cls.get_placeholder_str("video", 0) == VIDEO
    with pytest.raises(ValueError, match="'audio'"):
        cls.get_placeholder_str("audio", 0)
    with pytest.raises(models.MobilintModelNotBuildable):
        cls(vllm_config=None)
