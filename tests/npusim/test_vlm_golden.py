"""The golden numpy Qwen2-VL / Qwen3-VL (patchify, M-RoPE, vision towers, decoder) against transformers 5.19.

Compared with transformers 5.19 in this process: ``Qwen2VLImageProcessorPil`` (the processor
class the tiny checkpoints' ``preprocessor_config.json`` names resolves to the PIL backend
here: torchvision is not installed), ``Qwen2VLModel.get_rope_index`` /
``Qwen3VLModel.get_rope_index``, the text rotary embeddings, the vision towers and
``Qwen2VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration`` built from the tiny
checkpoints (float32, eager attention). ``AutoProcessor`` needs the video processors, which
need torchvision: it is loaded in a subprocess with the repository's torchvision import
placeholder (``tools/vllm-rbln-env/import-placeholders``), its image processor swapped for the
PIL one. transformers' video processors do not run here (torchvision), so the video patch order
is checked against our own reading of upstream's ``Qwen2VLVideoProcessor._preprocess``
(``view(t, tp, C, h/m, m, p, w/m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)``, per video).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from npusim.llm.mrope import mrope_cos_sin, rope_index
from npusim.llm.vision import GridError
from npusim.llm.vision_inputs import patchify
from npusim.llm.vlm_reference import VisionTokenMismatchError, VlmReference

pytest.importorskip("tokenizers", reason="building the tiny VLM checkpoints needs tokenizers")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from npusim.tinymodel import vlm as tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDERS = REPO / "tools" / "vllm-rbln-env" / "import-placeholders"
FAMILIES = ("qwen2_vl", "qwen3_vl")
IMAGE, VIDEO, START, END = 1026, 1027, 1024, 1025


def _nmse(ref, got) -> float:
    ref = np.asarray(ref, np.float64)
    return float(((np.asarray(got, np.float64) - ref) ** 2).sum() / (ref ** 2).sum())


def _pp(family: str) -> dict:
    pp = tiny.PREPROCESSORS[family]
    return {k: pp[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}


@pytest.fixture(scope="module")
def tok():
    return tiny.vlm_tokenizer()


@pytest.fixture(scope="module")
def refs(vlm_model_dir) -> dict[str, VlmReference]:
    return {f: VlmReference.from_pretrained(vlm_model_dir(f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def hf(vlm_model_dir) -> dict:
    from transformers import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    out = {}
    for f, cls in (("qwen2_vl", Qwen2VLForConditionalGeneration), ("qwen3_vl", Qwen3VLForConditionalGeneration)):
        m = cls.from_pretrained(vlm_model_dir(f), dtype=torch.float32, attn_implementation="eager")
        out[f] = m.eval()
    return out


def _text(tok, s: str) -> list[int]:
    return tok.encode(s).ids


def _image_block(n: int) -> list[int]:
    return [START] + [IMAGE] * n + [END]


def _prompt(tok, family: str, items: list, question: str = "What is in the picture?", after: str = "") -> tuple:
    """ChatML prompt ids with the items (("image", name) or ("video", name)) expanded, and the mm arguments."""
    ids = _text(tok, "<|im_start|>user\n")
    imgs, igrids, vids, vgrids = [], [], [], []
    for kind, name in items:
        if kind == "image":
            pv, g = patchify(tiny.test_image(name), **_pp(family))
            imgs.append(pv)
            igrids.append(g)
            ids += _image_block(g[0] * g[1] * g[2] // 4)
        else:
            pv, g = patchify(tiny.test_video(name), **_pp(family))
            vids.append(pv)
            vgrids.append(g)
            per = g[1] * g[2] // 4
            if family == "qwen3_vl":  # one block per frame after its timestamp, as Qwen3-VL's processor writes
                for i in range(g[0]):
                    ids += _text(tok, f"<{i * 1.0:.1f} seconds>") + [START] + [VIDEO] * per + [END]
            else:
                ids += [START] + [VIDEO] * (g[0] * per) + [END]
    ids += _text(tok, question + "<|im_end|>\n<|im_start|>assistant\n" + after)
    mm = {}
    if imgs:
        mm.update(pixel_values=np.concatenate(imgs), image_grid_thw=igrids)
    if vids:
        mm.update(pixel_values_videos=np.concatenate(vids), video_grid_thw=vgrids)
    return np.array(ids, np.int64), mm


def _hf_inputs(ids: np.ndarray, mm: dict) -> dict:
    kw = {"input_ids": torch.from_numpy(ids)[None],
          "mm_token_type_ids": torch.from_numpy(np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0)))[None]}
    if "pixel_values" in mm:
        kw["pixel_values"] = torch.from_numpy(mm["pixel_values"])
        kw["image_grid_thw"] = torch.tensor(mm["image_grid_thw"])
    if "pixel_values_videos" in mm:
        kw["pixel_values_videos"] = torch.from_numpy(mm["pixel_values_videos"])
        kw["video_grid_thw"] = torch.tensor(mm["video_grid_thw"])
    return kw


# ---------------------------------------------------------------- patchify

PATCHIFY_CASES = [(f, n) for f in FAMILIES for n in tiny.IMAGES if tiny.fits(n, f)]


@pytest.mark.parametrize("family,name", PATCHIFY_CASES)
def test_patchify_equals_the_hf_image_processor(vlm_model_dir, family, name, record_diff):
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(vlm_model_dir(family))
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    img = tiny.test_image(name)
    want = proc(images=[img], return_tensors="np")
    got, grid = patchify(img, **_pp(family))
    assert [list(grid)] == want["image_grid_thw"].tolist()
    assert got.dtype == np.float32 and got.shape == want["pixel_values"].shape
    diff = float(np.abs(got - want["pixel_values"]).max())
    record_diff(f"vlm patchify vs HF {family}", diff)
    assert diff <= 1e-6 and _nmse(want["pixel_values"], got) <= 1e-14


@pytest.mark.parametrize("family", FAMILIES)
def test_patchify_video_order_and_image_as_repeated_frames(family):
    pp = _pp(family)
    p, tp, m = pp["patch_size"], pp["temporal_patch_size"], pp["merge_size"]
    video = tiny.test_video("square")
    got, (t, h, w) = patchify(video, **pp)
    f, H, W, _ = video.shape
    assert (t, h, w) == (f // tp, H // p, W // p)
    # upstream's video patch order, read from Qwen2VLVideoProcessor (same in Qwen3-VL): frames [F, C, H, W]
    x = ((video.astype(np.float64) / 255).astype(np.float32) - np.float32(pp["image_mean"])) / np.float32(pp["image_std"])
    x = x.transpose(0, 3, 1, 2).reshape(t, tp, 3, h // m, m, p, w // m, m, p)
    want = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, 3 * tp * p * p)
    np.testing.assert_array_equal(got, want)
    one, g1 = patchify(video[0], **pp)
    pair, g2 = patchify(np.stack([video[0]] * tp), **pp)
    assert g1 == g2 == (1, h, w)
    np.testing.assert_array_equal(one, pair)


def test_patchify_rejects_bad_inputs():
    pp = _pp("qwen2_vl")
    with pytest.raises(ValueError, match="H=230 and width W=224"):
        patchify(np.zeros((230, 224, 3), np.uint8), **pp)
    with pytest.raises(ValueError, match="multiple of temporal_patch_size=2"):
        patchify(np.zeros((3, 224, 224, 3), np.uint8), **pp)
    with pytest.raises(ValueError, match="uint8"):
        patchify(np.zeros((224, 224, 3), np.float32), **pp)


# ---------------------------------------------------------------- M-RoPE


def _rope_cases(tok, family):
    cases = {
        "text": (np.array(_text(tok, "<|im_start|>user\nhello there<|im_end|>\n"), np.int64), {}),
        "one_image": _prompt(tok, family, [("image", "sunset")], after=""),
        "two_images": _prompt(tok, family, [("image", "rings"), ("image", "dots")]),
        "image_text_after": _prompt(tok, family, [("image", "dots")], after="It shows"),
        "video": _prompt(tok, family, [("video", "square")]),
        "image_video": _prompt(tok, family, [("image", "sunset"), ("video", "square")]),
    }
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_index_equals_hf_get_rope_index(tok, hf, family):
    model = hf[family].model
    for name, (ids, mm) in _rope_cases(tok, family).items():
        got, delta = rope_index(ids, image_grid_thw=mm.get("image_grid_thw", ()),
                                video_grid_thw=mm.get("video_grid_thw", ()), image_token_id=IMAGE,
                                video_token_id=VIDEO, vision_start_token_id=START, spatial_merge_size=2,
                                family=family)
        kw = _hf_inputs(ids, mm)
        want, want_delta = model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"],
                                                image_grid_thw=kw.get("image_grid_thw"),
                                                video_grid_thw=kw.get("video_grid_thw"))
        np.testing.assert_array_equal(got, want[:, 0].numpy(), err_msg=name)
        assert delta == int(want_delta[0, 0]), name
        if name == "text":
            np.testing.assert_array_equal(got, np.broadcast_to(np.arange(len(ids)), (3, len(ids))))


def test_rope_index_rejects_mismatched_grids():
    kw = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, spatial_merge_size=2,
              family="qwen2_vl")
    with pytest.raises(ValueError, match="has 3 tokens but its grid"):
        rope_index([START, IMAGE, IMAGE, IMAGE, END], image_grid_thw=[(1, 4, 4)], **kw)
    with pytest.raises(ValueError, match="1 image grid"):
        rope_index([1, 2, 3], image_grid_thw=[(1, 4, 4)], **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_cos_sin_equals_hf_rotary_embedding(tok, hf, refs, family, record_diff):
    ids, mm = _rope_cases(tok, family)["image_video"]
    ref = refs[family]
    pos, _ = ref.positions(ids, mm["image_grid_thw"], mm["video_grid_thw"])
    pos = np.concatenate([pos, pos[:, -1:] + np.arange(1, 5000, 997)], axis=1)  # far positions too
    rot = hf[family].model.language_model.rotary_emb
    x = torch.zeros(1, pos.shape[1], 128)
    cos_t, sin_t = rot(x, torch.from_numpy(pos)[:, None])
    cos, sin = ref.rope_tables(pos)
    diff = max(float(np.abs(cos - cos_t[0].numpy()).max()), float(np.abs(sin - sin_t[0].numpy()).max()))
    record_diff(f"vlm mrope cos/sin vs HF {family}", diff)
    assert diff <= 2e-6
    flat = np.broadcast_to(np.arange(40), (3, 40))  # equal rows: plain RoPE (chunked or interleaved)
    c, s = ref.rope_tables(flat)
    c0, s0 = ref.decoder.config.rope.cos_sin(np.arange(40), seq_len=40)
    np.testing.assert_allclose(c, c0, atol=1e-6)
    np.testing.assert_allclose(s, s0, atol=1e-6)
    c2, _ = mrope_cos_sin(flat, head_dim=32, rope_theta=ref.rope_theta, mrope_section=ref.mrope_section,
                          interleaved=not ref.mrope_interleaved)
    np.testing.assert_array_equal(c, c2)


# ---------------------------------------------------------------- vision towers

TOWER_CASES = [("qwen2_vl", ["sunset"]), ("qwen2_vl", ["rings", "dots"]), ("qwen3_vl", ["checker"]),
               ("qwen3_vl", ["stripes"]), ("qwen3_vl", ["checker", "stripes"])]


@pytest.mark.parametrize("family,names", TOWER_CASES, ids=[f"{f}-{'+'.join(n)}" for f, n in TOWER_CASES])
def test_vision_tower_equals_hf(hf, refs, family, names, record_diff):
    parts = [patchify(tiny.test_image(n), **_pp(family)) for n in names]
    pv = np.concatenate([p for p, _ in parts])
    grids = [g for _, g in parts]
    tower = refs[family].vision
    with torch.no_grad():
        out = hf[family].model.visual(torch.from_numpy(pv), grid_thw=torch.tensor(grids))
    got = tower.forward(pv, grids)
    emb = got[0] if family == "qwen3_vl" else got
    nmse = _nmse(out.pooler_output.numpy(), emb)
    record_diff(f"vlm tower NMSE {family}", nmse)
    assert emb.shape == tuple(out.pooler_output.shape) and nmse <= 1e-10
    if family == "qwen3_vl":
        assert got[1].shape == (3, *emb.shape)
        for k, feat in enumerate(out.deepstack_features):
            d = _nmse(feat.numpy(), got[1][k])
            record_diff(f"vlm deepstack NMSE {family}", d)
            assert d <= 1e-10
    # forward == concatenation of per-item forward_patches with the host's tables, exactly
    pieces, s = [], 0
    for p, g in parts:
        cos, sin = tower.rope(g)
        if family == "qwen3_vl":
            pieces.append(tower.forward_patches(p, tower.pos_embeds(g), cos, sin))
        else:
            pieces.append(tower.forward_patches(p, cos, sin))
    if family == "qwen3_vl":
        np.testing.assert_array_equal(got[0], np.concatenate([e for e, _ in pieces]))
        np.testing.assert_array_equal(got[1], np.concatenate([d for _, d in pieces], axis=1))
    else:
        np.testing.assert_array_equal(got, np.concatenate(pieces))


def test_vision_video_is_per_frame(refs):
    """A video's frames attend only to themselves: its embeddings are the frames' own, in order."""
    tower = refs["qwen3_vl"].vision
    pv, g = patchify(tiny.test_video("square"), **_pp("qwen3_vl"))
    emb, deep = tower.forward(pv, [g])
    per = g[1] * g[2]
    frames = [tower.forward(pv[i * per:(i + 1) * per], [(1, g[1], g[2])]) for i in range(g[0])]
    np.testing.assert_array_equal(emb, np.concatenate([e for e, _ in frames]))
    np.testing.assert_array_equal(deep, np.concatenate([d for _, d in frames], axis=1))
    with pytest.raises(GridError):
        tower.forward(pv[:-4], [g])


# ---------------------------------------------------------------- whole model

LOGIT_CASES = [("qwen2_vl", [("image", "sunset")]), ("qwen2_vl", [("video", "square")]),
               ("qwen3_vl", [("image", "checker")]), ("qwen3_vl", [("image", "checker"), ("image", "stripes")]),
               ("qwen3_vl", [("video", "square")]), ("qwen3_vl", [("image", "sunset"), ("video", "square")])]


@pytest.mark.parametrize("family,items", LOGIT_CASES,
                         ids=[f"{f}-{'+'.join(n for _, n in it)}" for f, it in LOGIT_CASES])
def test_prompt_logits_equal_hf(tok, hf, refs, family, items, record_diff):
    ids, mm = _prompt(tok, family, items)
    with torch.no_grad():
        want = hf[family](**_hf_inputs(ids, mm)).logits[0].numpy()
    got = refs[family].prompt_logits(ids, **mm)
    nmse = _nmse(want, got)
    record_diff(f"vlm prompt logits NMSE {family}", nmse)
    assert nmse <= 1e-10


@pytest.mark.parametrize("family,items", [("qwen2_vl", [("image", "sunset")]), ("qwen3_vl", [("image", "checker")]),
                                          ("qwen3_vl", [("video", "square")])])
def test_greedy_equals_hf_generate(tok, hf, refs, family, items):
    ids, mm = _prompt(tok, family, items)
    with torch.no_grad():
        out = hf[family].generate(**_hf_inputs(ids, mm), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    want = out[0, len(ids):].tolist()
    got = refs[family].generate_greedy(ids, max_new_tokens=8, **mm)
    assert got == want and len(got) == 8


def test_linear_positions_are_plain_rope_and_differ_from_mrope(tok, refs):
    ref = refs["qwen2_vl"]
    ids, mm = _prompt(tok, "qwen2_vl", [("image", "sunset")])
    lin = ref.generate_greedy(ids, max_new_tokens=6, positions="linear", **mm)
    emb, _, delta, deep = ref.prompt_inputs(ids, **mm)
    assert deep is None and delta < 0
    dec = ref.decoder
    cache = dec.new_cache(len(ids) + 6)
    plain = dec.continue_greedy(dec.forward_embeddings(emb, cache), cache, 6, set())
    assert lin == plain
    linear_logits = ref.prompt_logits(ids, positions="linear", **mm)
    # the decoder's own RoPE tables (RopeConfig, float32 pow) may differ from mrope_cos_sin's (torch-exact) by an ulp
    np.testing.assert_allclose(linear_logits, dec.forward_embeddings(emb, dec.new_cache(len(ids))), atol=1e-5, rtol=0)
    assert not np.allclose(linear_logits, ref.prompt_logits(ids, **mm), atol=1e-3)
    # text only: both position schemes are the same
    text = np.array(_text(tok, "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"), np.int64)
    assert ref.generate_greedy(text, max_new_tokens=4) == ref.generate_greedy(text, max_new_tokens=4, positions="linear")


def test_deepstack_adds_at_visual_rows_only(tok, refs):
    ref = refs["qwen3_vl"]
    ids, mm = _prompt(tok, "qwen3_vl", [("image", "checker")])
    _, _, _, deep = ref.prompt_inputs(ids, **mm)
    assert deep.shape == (3, len(ids), 128)
    visual = ids == IMAGE
    assert not deep[:, ~visual].any() and np.abs(deep[:, visual]).min(axis=-1).all() >= 0
    with pytest.raises(VisionTokenMismatchError, match="image tokens"):
        ref.prompt_inputs(ids[:-70].tolist() + ids[-5:].tolist(), **mm)


# ---------------------------------------------------------------- the checkpoints load upstream


def test_autoprocessor_loads_and_matches(tmp_path, vlm_model_dir, tok):
    """AutoConfig / AutoProcessor (subprocess, torchvision placeholder) load both directories offline; the
    processor's chat template, expansion and mm_token_type_ids equal our prompt and patchify."""
    script = textwrap.dedent("""
        import json, sys
        import numpy as np
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor
        sys.path.insert(0, sys.argv[1])
        from npusim.tinymodel.vlm import test_image
        out = {}
        for fam, d, img in json.loads(sys.argv[2]):
            cfg = AutoConfig.from_pretrained(d)
            # the image processor of the PIL backend (torchvision is a placeholder here)
            p = AutoProcessor.from_pretrained(d)
            p.image_processor = AutoImageProcessor.from_pretrained(d, backend="pil")
            assert type(p.image_processor).__name__ == "Qwen2VLImageProcessorPil", type(p.image_processor)
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
            text = p.apply_chat_template(msgs, add_generation_prompt=True)
            r = p(text=[text], images=[test_image(img)], return_tensors="np")
            out[fam] = {"cls": type(p).__name__, "cfg": type(cfg).__name__, "text": text,
                        "ids": r["input_ids"][0].tolist(), "mm": r["mm_token_type_ids"][0].tolist(),
                        "grid": r["image_grid_thw"].tolist()}
            np.save(sys.argv[3] + "/" + fam + ".npy", r["pixel_values"])
        print(json.dumps(out))
    """)
    cases = [["qwen2_vl", str(vlm_model_dir("qwen2_vl")), "sunset"], ["qwen3_vl", str(vlm_model_dir("qwen3_vl")), "checker"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLACEHOLDERS), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", script, str(REPO / "simulators"), json.dumps(cases), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for fam, _, img in cases:
        g = got[fam]
        assert g["cls"] == {"qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[fam]
        assert g["text"] == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture?"
                             "<|im_end|>\n<|im_start|>assistant\n")
        ids, mm = _prompt(tok, fam, [("image", img)])
        assert g["ids"] == ids.tolist()
        assert g["mm"] == np.where(ids == IMAGE, 1, 0).tolist()
        assert g["grid"] == [list(mm["image_grid_thw"][0])]
        np.testing.assert_allclose(np.load(tmp_path / f"{fam}.npy"), mm["pixel_values"], atol=1e-6, rtol=0)


def test_build_is_deterministic(tmp_path, vlm_model_dir):
    again = tiny.build_qwen2_vl(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json", "chat_template.jinja", "generation_config.json"):
        assert (again / name).read_bytes() == (vlm_model_dir("qwen2_vl") / name).read_bytes(), name
    cfg = json.loads((vlm_model_dir("qwen3_vl") / "config.json").read_text())
    assert (cfg["image_token_id"], cfg["video_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (
        1026, 1027, 1024, 1025)
    assert cfg["text_config"]["vocab_size"] == 1028
    assert (vlm_model_dir("qwen3_vl") / "video_preprocessor_config.json").is_file()


def test_make_model_cli_builds_both(tmp_path, vlm_model_dir, capsys):
    from npu_conformance.cli import main

    for family in FAMILIES:
        assert main(["make-model", "--arch", family, "--out", str(tmp_path / family)]) == 0
        for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
            assert (tmp_path / family / name).read_bytes() == (vlm_model_dir(family) / name).read_bytes()
    assert main(["make-model", "--arch", "qwen2_vl", "--eagle3", "--out", str(tmp_path / "x")]) == 2
    assert "not qwen2_vl" in capsys.readouterr().err
