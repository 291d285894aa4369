"""npusim.mxq's Qwen2-VL / Qwen3-VL releases (``mxq compile`` of a qwen2_vl / qwen3_vl checkpoint)
and their MXQ kinds (``npusim.mxq.vlm_kinds``).

Reference: the golden pipeline (``npusim.llm.vlm_reference.VlmReference``). The vision MXQs compute
with the golden tower's ``forward_patches``, so every layout's outputs must equal
``VlmReference.encode`` bit for bit; the text MXQs are ``Decoder.forward_rope`` on the MXQ's
payload, so their logits must equal the golden decoder's with the same RoPE rows (the host's
packed rows, or the cache positions on all three rows for a static layout), chunked or not. The
MXQs are opened through ``npusim.mxq``'s qbruntime surface, as the vendor's host code opens them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.mxq.compile import compile_artifact
from npusim.mxq.eagle3_kinds import pack_rope_rows
from npusim.mxq.mxqfile import read_mxq, write_mxq
from npusim.mxq.vlm_kinds import VlmInputError, relayout_pixels, unrelayout_pixels

vlm_tiny = pytest.importorskip("npusim.tinymodel.vlm")
from npusim.llm.safetensors import load_safetensors  # noqa: E402
from npusim.llm.vision_inputs import patchify  # noqa: E402
from npusim.llm.vlm_reference import VlmReference  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen3_vl")
CHUNK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("vlm_hf")
    return {"qwen2_vl": vlm_tiny.build_qwen2_vl(d / "q2"), "qwen3_vl": vlm_tiny.build_qwen3_vl(d / "q3")}


@pytest.fixture(scope="module")
def ref(ckpt) -> dict[str, VlmReference]:
    return {f: VlmReference.from_pretrained(p) for f, p in ckpt.items()}


@pytest.fixture(scope="module")
def release(ckpt, tmp_path_factory):
    """``release(family, **vlm options and compile kwargs) -> Path``, compiled once per combination
    (defaults: width 16, chunk 16, KV 512 tokens)."""
    cache: dict[str, Path] = {}
    compile_keys = ("max_batch_size", "max_cache_size", "max_width", "prefill_chunk_size", "output_logits", "core_mode")

    def get(family: str, **kw: Any) -> Path:
        key = json.dumps([family, kw], sort_keys=True)
        if key not in cache:
            base = {"max_width": CHUNK, "prefill_chunk_size": CHUNK, "max_cache_size": 512}
            base.update({k: v for k, v in kw.items() if k in compile_keys})
            vlm = {k: v for k, v in kw.items() if k not in compile_keys}
            cache[key] = compile_artifact(ckpt[family], tmp_path_factory.mktemp("vlm_rel") / "rel", vlm=vlm, **base)
        return cache[key]

    return get


def _launch(path: Path) -> qb.Model:
    m = qb.Model(str(path))
    m.launch(qb.Accelerator())
    return m


def _pixels(family: str, image: str | np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    pp = vlm_tiny.PREPROCESSORS[family]
    arr = vlm_tiny.test_image(image) if isinstance(image, str) else image
    return patchify(arr, patch_size=pp["patch_size"], temporal_patch_size=pp["temporal_patch_size"],
                    merge_size=pp["merge_size"], image_mean=pp["image_mean"], image_std=pp["image_std"])


def _vendor_relayout(pv: np.ndarray, grid: tuple[int, int, int], family: str) -> np.ndarray:
    """transformers-mblt's static re-layouts, as its code writes them (view / permute indices)."""
    gt, gh, gw = grid
    p = 14 if family == "qwen2_vl" else 16
    x = pv.reshape(gt, gh // 2, gw // 2, 2, 2, 3, 2, p, p)
    if family == "qwen2_vl":  # _preprocess_image_tokens
        x = x.transpose(0, 1, 2, 7, 3, 4, 8, 6, 5).reshape(gt, gh // 2 * gw // 2 * p, 4 * p, 6)[0]
        return np.ascontiguousarray(x)
    x = x.transpose(0, 6, 5, 1, 2, 7, 3, 4, 8).reshape(gt, 6, gh // 2 * gw // 2 * p, 4 * p)  # _repreprocess
    return np.ascontiguousarray(x[0].transpose(1, 2, 0))


def _order(outs: list[np.ndarray], order=(0, 2, 3, 1)) -> tuple[np.ndarray, np.ndarray]:
    """The vendor's reading of a Qwen3-VL vision MXQ's outputs: merger, deepstack [3, N/4, H]."""
    m, *ds = order
    return outs[m][0], np.stack([outs[i][0] for i in ds])


# ---------------------------------------------------------------------------------------------- vision
def test_relayout_round_trip_and_matches_the_vendor_view(ref):
    for family, image in (("qwen2_vl", "sunset"), ("qwen3_vl", "checker")):
        pv, grid = _pixels(family, image)
        x = _vendor_relayout(pv, grid, family)
        assert x.shape == ((896, 56, 6) if family == "qwen2_vl" else (1024, 64, 6))
        p = 14 if family == "qwen2_vl" else 16
        assert np.array_equal(relayout_pixels(pv, grid, merge=2, temporal=2), x)
        assert np.array_equal(unrelayout_pixels(x, grid, merge=2, temporal=2, patch=p), pv)


def test_qwen2_static_vision_equals_golden(mxq_machine, release, ref):
    m = _launch(release("qwen2_vl", vision="static") / "vision.mxq")
    assert m.get_model_input_shape() == [(896, 56, 6)] and m.get_model_output_shape() == [(1, 64, 128)]
    assert m.get_cache_infos() == [] and m.dump_cache_memory(0) == []
    images = []
    for image in ("sunset", "dots"):
        pv, grid = _pixels("qwen2_vl", image)
        x = _vendor_relayout(pv, grid, "qwen2_vl")
        (out,) = m.infer([x])  # mxq_forward: infer([x]), result[0]
        want, _ = ref["qwen2_vl"].encode(pv, [grid])
        assert out.shape == (1, 64, 128) and out.dtype == np.float32 and np.array_equal(out[0], want)
        images.append((x, want))
    # core_mode "multi" with several images: stacked on a new axis 0, one infer
    (both,) = m.infer([np.stack([x for x, _ in images])])
    assert both.shape == (2, 64, 128) and all(np.array_equal(both[i], w) for i, (_, w) in enumerate(images))
    m.dispose()


@pytest.mark.parametrize("layout", ["rope", "cos_sin"])
def test_qwen2_dynamic_vision_equals_golden(mxq_machine, release, ref, layout):
    r = ref["qwen2_vl"]
    m = _launch(release("qwen2_vl", vision="dynamic", vision_layout=layout) / "vision.mxq")
    widths = [s[-1] for s in m.get_model_input_shape()]
    assert widths == ([1176, 128] if layout == "rope" else [1176, 16, 16])
    pp = vlm_tiny.PREPROCESSORS["qwen2_vl"]
    video, vgrid = patchify(vlm_tiny.test_video("square"), patch_size=14, temporal_patch_size=2, merge_size=2,
                            image_mean=pp["image_mean"], image_std=pp["image_std"])
    items = [_pixels("qwen2_vl", n) for n in ("sunset", "rings")] + [(video, vgrid)]
    for pv, grid in items:
        cos, sin = r.vision.rope(grid)
        side = [pack_rope_rows(cos, sin)[None]] if layout == "rope" else [cos[None], sin[None]]
        (out,) = m.infer([pv[None], *side])
        want, _ = r.encode(pv, [grid])  # a video item: attention per frame, found from the RoPE rows' period
        assert out.shape == (1, pv.shape[0] // 4, 128) and np.array_equal(out[0], want), grid
    m.dispose()


@pytest.mark.parametrize("layout", ["folded", "legacy"])
def test_qwen3_static_vision_equals_golden(mxq_machine, release, ref, layout):
    r = ref["qwen3_vl"]
    m = _launch(release("qwen3_vl", vision="static", vision_layout=layout) / "vision.mxq")
    assert m.get_model_input_shape() == ([(1, 256, 1536)] if layout == "folded" else [(1024, 64, 6)])
    assert m.get_model_output_shape() == [(1, 64, 128)] * 4
    pv, grid = _pixels("qwen3_vl", "checker")
    x = pv[None] if layout == "folded" else _vendor_relayout(pv, grid, "qwen3_vl")
    outs = m.infer(x)  # transformers-mblt: infer(npu_input)
    want_e, want_d = r.encode(pv, [grid])
    got_e, got_d = _order(outs)
    assert np.array_equal(got_e, want_e) and np.array_equal(got_d, want_d)
    m.dispose()


@pytest.mark.parametrize("order", ["rope,pos,folded", "folded,pos,rope"])
def test_qwen3_dynamic_vision_equals_golden(mxq_machine, release, ref, order):
    r = ref["qwen3_vl"]
    out_order = [3, 0, 1, 2]
    m = _launch(release("qwen3_vl", vision="dynamic", vision_layout=order, vision_output_order=out_order)
                / "vision.mxq")
    names = order.split(",")
    width = {"rope": 128, "pos": 32, "folded": 1536}
    assert m.get_model_input_shape() == [(1, -1, width[n]) for n in names]
    for image in ("checker", "stripes", "sunset"):
        pv, grid = _pixels("qwen3_vl", image)
        side = {"folded": pv[None], "pos": r.vision.pos_embeds(grid)[None],
                "rope": pack_rope_rows(*r.vision.rope(grid))[None]}
        outs = m.infer([side[n] for n in names])
        got_e, got_d = _order(outs, out_order)
        want_e, want_d = r.encode(pv, [grid])
        assert np.array_equal(got_e, want_e) and np.array_equal(got_d, want_d), image
    m.dispose()


def test_vision_shape_errors(mxq_machine, release):
    m = _launch(release("qwen2_vl", vision="static") / "vision.mxq")
    clock = m.device_clock_us()
    with pytest.raises(VlmInputError, match=r"^Input shape is invalid\. inputs\[0\] \(pixels\) must be \[896, 56, 6\].*"
                                             r"got \[1, 256, 1176\]"):
        m.infer([np.zeros((1, 256, 1176), np.float32)])
    with pytest.raises(ValueError, match=r"The number of inputs is invalid \(expected 1, got 2\)"):
        m.infer([np.zeros((896, 56, 6), np.float32)] * 2)
    with pytest.raises(qb.QbRuntimeError, match="Model_InvalidBatchParam"):
        m.infer([np.zeros((896, 56, 6), np.float32)], None, 0, [qb.BatchParam(1, 0, 0)])
    assert m.device_clock_us() == clock
    m.dispose()
    d = _launch(release("qwen3_vl", vision="dynamic") / "vision.mxq")
    with pytest.raises(VlmInputError, match=r"N <= 4096 \(its compiled limit\).*N = 4100"):
        d.infer([np.zeros((1, 4100, 128), np.float32), np.zeros((1, 4100, 32), np.float32),
                 np.zeros((1, 4100, 1536), np.float32)])
    with pytest.raises(VlmInputError, match=r"multiple of 4.*N = 6"):
        d.infer([np.zeros((1, 6, 128), np.float32), np.zeros((1, 6, 32), np.float32), np.zeros((1, 6, 1536), np.float32)])
    with pytest.raises(VlmInputError, match=r"inputs\[1\] \(pos\) must be \[1, N, 32\].*got \[1, 8, 32\]"):
        d.infer([np.zeros((1, 4, 128), np.float32), np.zeros((1, 8, 32), np.float32), np.zeros((1, 4, 1536), np.float32)])
    with pytest.raises(VlmInputError, match=r"inputs\[0\] \(rope\) must be \[1, N, 128\]"):
        d.infer([np.zeros((1, 4, 1536), np.float32), np.zeros((1, 4, 32), np.float32), np.zeros((1, 4, 128), np.float32)])
    with pytest.raises(qb.QbRuntimeError, match="NotImplemented"):
        d.infer_npu_data([])
    d.dispose()
    s = _launch(release("qwen3_vl", vision="static") / "vision.mxq")
    with pytest.raises(VlmInputError, match=r"must be \[1, 256, 1536\].*got \[1, 252, 1536\]"):
        s.infer(np.zeros((1, 252, 1536), np.float32))
    s.dispose()


def _rewrite(src: Path, dst: Path, **changes: Any) -> Path:
    header, tensors = read_mxq(src)
    for k, v in changes.items():
        if v is None:
            header.pop(k, None)
        else:
            header[k] = v
    header.pop("payload_bytes", None)
    write_mxq(dst, {k: v for k, v in header.items() if k not in ("format", "version")}, tensors)
    return dst


@pytest.mark.parametrize("which, changes, reason", [
    ("vision", {"vision_layout": "dynamic"}, r"vision_layout='dynamic' must be one of \['static', 'rope', 'cos_sin'\]"),
    ("vision", {"vision_grid": None}, r"vision_grid=None must be \[1, h, w\]"),
    ("vision", {"vision_grid": [1, 15, 16]}, r"multiples of the merge size"),
    ("vision", {"vision_output_order": [0, 1, 2, 3]}, r"vision_output_order.*for kind 'qwen3_vl_vision' only"),
    ("vision", {"outputs": ["image_embeds"]}, r"order their outputs with vision_output_order"),
    ("vision3", {"vision_output_order": [0, 1, 1, 3]}, r"must be a permutation of \[0, 1, 2, 3\]"),
    ("vision3", {"vision_input_order": ["pos", "rope", "folded"]}, r"vision_input_order"),
    ("vision3", {"vision_grid": [1, 16, 16]}, r"only static vision layouts have a compiled grid"),
    ("text", {"vlm_text_layout": "qwen3_fancy"}, r"vlm_text_layout='qwen3_fancy' must be one of"),
    ("text", {"vlm_mrope": None}, r"vlm_mrope=None must be"),
    ("text", {"vlm_text_layout": "qwen3_batch_rope"}, r"needs max_batch_size > 1"),
    ("text", {"max_batch_size": 2}, r"'qwen3_bundled_rope' with max_batch_size 2.*'qwen3_batch_rope'"),
    ("text", {"vlm_mrope": {"mrope_section": [6, 5, 4], "interleaved": True}}, r"must sum to head_dim / 2 = 16"),
    ("plain", {"vlm_deepstack_layers": 3}, r"applies only to kind 'decoder' with a vlm_text_layout"),
    ("plain", {"vision_layout": "static"}, r"applies only to kinds"),
])
def test_header_validation(mxq_machine, release, tmp_path, capsys, which, changes, reason):
    src = {"vision": release("qwen2_vl", vision="static") / "vision.mxq",
           "vision3": release("qwen3_vl", vision="dynamic") / "vision.mxq",
           "text": release("qwen3_vl", vision="dynamic") / "text.mxq",
           "plain": release("qwen3_vl", vision="dynamic") / "text.mxq"}[which]
    if which == "plain":
        changes = {"vlm_text_layout": None, "vlm_mrope": None, "vlm_deepstack_layers": None, **changes}
    bad = _rewrite(src, tmp_path / "bad.mxq", **changes)
    capsys.readouterr()
    with pytest.raises(qb.QbRuntimeError, match="Model_FailedToLoadMXQ"):
        qb.Model(str(bad))
    err = capsys.readouterr().err
    assert any(line.startswith("Unable to load; ") for line in err.splitlines()), err
    assert __import__("re").search(reason, err), err


# ---------------------------------------------------------------------------------------------- text
def _prompt(r: VlmReference, family: str, image: str) -> tuple[list[int], dict[str, Any]]:
    pv, grid = _pixels(family, image)
    n = grid[0] * grid[1] * grid[2] // 4
    ids = [5, 17, 300, r.vision_start_token_id] + [r.image_token_id] * n + [r.vision_end_token_id, 44, 9, 71, 2]
    return ids, {"pixel_values": pv, "image_grid_thw": [grid]}


def _feed(m: qb.Model, layout: str, emb: np.ndarray, rows: np.ndarray | None, deep: np.ndarray | None,
          cache: int, rank4: bool) -> list[np.ndarray]:
    """The inputs of one text infer in ``layout``'s order (as transformers-mblt builds them)."""
    t = emb.shape[0]
    e = emb[None, None] if rank4 else emb[None]
    ds = np.zeros((3, t, emb.shape[1]), np.float32) if deep is None else deep
    if layout == "qwen2_static":
        return [e]
    if layout == "qwen2_rope":
        return [e, rows[None]]
    split = [ds[i:i + 1] for i in range(3)]
    return {"qwen3_bundled_static": [e, ds], "qwen3_bundled_rope": [e, ds, None if rows is None else rows[None]],
            "qwen3_split_static": [e, *split], "qwen3_split_rope": [e, *split, None if rows is None else rows[None]],
            }[layout]


def _golden_generate(r: VlmReference, ids, mm, positions: str, new: int) -> tuple[np.ndarray, list[int]]:
    emb, pos, delta, deep = r.prompt_inputs(ids, **mm)
    if positions == "linear":
        pos = np.broadcast_to(np.arange(len(emb)), (3, len(emb)))
    cache = r.decoder.new_cache(len(emb) + new)
    adds = None if deep is None else {i: deep[i] for i in range(deep.shape[0])}
    logits = r.decoder.forward_rope(emb, cache, *r.rope_tables(pos), layer_adds=adds)
    return logits, r.generate_greedy(ids, max_new_tokens=new, positions=positions, **mm)


TEXT_CASES = [("qwen2_vl", "static", "bundled", "qwen2_static", "sunset"),
              ("qwen2_vl", "dynamic", "bundled", "qwen2_rope", "rings"),
              ("qwen3_vl", "static", "bundled", "qwen3_bundled_static", "checker"),
              ("qwen3_vl", "dynamic", "bundled", "qwen3_bundled_rope", "stripes"),
              ("qwen3_vl", "static", "split", "qwen3_split_static", "checker"),
              ("qwen3_vl", "dynamic", "split", "qwen3_split_rope", "checker")]


@pytest.mark.parametrize("family, vision, text_layout, layout, image", TEXT_CASES)
def test_text_layout_equals_golden_chunked_and_decode(mxq_machine, release, ref, family, vision, text_layout, layout,
                                                      image):
    r = ref[family]
    rel = release(family, vision=vision, text_layout=text_layout, output_logits="all")
    header, _ = read_mxq(rel / "text.mxq")
    assert header["vlm_text_layout"] == layout
    m = _launch(rel / "text.mxq")
    rope = vision == "dynamic"
    assert len(m.get_model_input_shape()) == {"qwen2_static": 1, "qwen2_rope": 2, "qwen3_bundled_static": 2,
                                              "qwen3_bundled_rope": 3, "qwen3_split_static": 4,
                                              "qwen3_split_rope": 5}[layout]
    ids, mm = _prompt(r, family, image)
    emb, pos, delta, deep = r.prompt_inputs(ids, **mm)
    positions = "mrope" if rope else "linear"
    if not rope:
        pos = np.broadcast_to(np.arange(len(emb)), (3, len(emb)))
    new = 6
    want_logits, want_tokens = _golden_generate(r, ids, mm, positions, new)
    rows = pack_rope_rows(*r.rope_tables(pos)) if rope else None
    got = []
    for s in range(0, len(emb), CHUNK):  # chunked prefill, as llm_forward windows it
        e = slice(s, s + CHUNK)
        (lg,) = m.infer(_feed(m, layout, emb[e], None if rows is None else rows[e],
                              None if deep is None else deep[:, e], s, family == "qwen2_vl"), None, s)
        got.append(lg.reshape(-1, lg.shape[-1]))
    assert np.array_equal(np.concatenate(got), want_logits)
    tokens, c = [int(np.argmax(want_logits[-1]))], len(emb)
    while len(tokens) < new:  # decode: one row at cache position c, zero DeepStack
        x = r.decoder.embed([tokens[-1]]).astype(np.float32)
        p = np.full((3, 1), c + (delta if rope else 0))
        (lg,) = m.infer(_feed(m, layout, x, pack_rope_rows(*r.rope_tables(p)) if rope else None, None, c,
                              family == "qwen2_vl"), None, c)
        tokens.append(int(np.argmax(lg.reshape(-1, lg.shape[-1])[-1])))
        c += 1
    assert tokens == want_tokens
    m.dispose()


def test_text_last_logits_and_errors(mxq_machine, release, ref):
    r = ref["qwen3_vl"]
    m = _launch(release("qwen3_vl", vision="dynamic") / "text.mxq")
    assert m.get_model_input_shape() == [(1, -1, 128), (3, -1, 128), (1, -1, 128)]
    assert m.get_model_output_shape() == [(1, 1, 1028)]
    e = r.decoder.embed([5, 6, 7]).astype(np.float32)[None]
    ds, rope = np.zeros((3, 3, 128), np.float32), pack_rope_rows(*r.rope_tables(np.tile(np.arange(3), (3, 1))))[None]
    (lg,) = m.infer([e, ds, rope], None, 0)
    assert lg.shape == (1, 1, 1028)
    with pytest.raises(ValueError, match=r"The number of inputs is invalid \(expected 3, got 2\)"):
        m.infer([e, ds], None, 0)
    with pytest.raises(VlmInputError, match=r"inputs\[1\] \(deepstack\) must be \[3, 3, 128\].*got \[1, 3, 128\]"):
        m.infer([e, ds[:1], rope], None, 0)
    with pytest.raises(VlmInputError, match=r"inputs\[2\] \(rope\) must be \[1, 3, 128\].*got \[1, 2, 128\]"):
        m.infer([e, ds, rope[:, :2]], None, 0)
    with pytest.raises(VlmInputError, match=r"inputs\[0\] \(inputs_embeds\)"):
        m.infer([e[..., :64], ds, rope], None, 0)
    with pytest.raises(qb.QbRuntimeError, match="Model_ShapeMismatched"):
        big = np.zeros((1, CHUNK + 1, 128), np.float32)
        m.infer([big, np.zeros((3, CHUNK + 1, 128), np.float32), np.zeros((1, CHUNK + 1, 128), np.float32)], None, 0)
    with pytest.raises(qb.QbRuntimeError, match="Model_CacheOverflow"):
        m.infer([e, ds, rope], None, 511)
    with pytest.raises(qb.QbRuntimeError, match="NotImplemented"):
        m.acquire_input_npu_data([1, 3, 128])
    m.dispose()


@pytest.mark.parametrize("family, vision", [("qwen3_vl", "dynamic"), ("qwen2_vl", "static"), ("qwen3_vl", "static")])
def test_batch_text_equals_golden_per_item(mxq_machine, release, ref, family, vision):
    """A batch build (max_batch_size 2): items packed on the token axis with BatchParams; Qwen3-VL
    RoPE builds take (embeds, rope, deepstack) in that order."""
    r = ref[family]
    rel = release(family, vision=vision, max_batch_size=2, output_logits="all")
    header, _ = read_mxq(rel / "text.mxq")
    want_layout = {"dynamic": "qwen3_batch_rope"}.get(vision, "qwen2_static" if family == "qwen2_vl"
                                                       else "qwen3_bundled_static")
    assert header["vlm_text_layout"] == want_layout and header["max_batch_size"] == 2
    m = _launch(rel / "text.mxq")
    seqs = [r.decoder.embed(list(range(10, 10 + n))).astype(np.float32) for n in (5, 3)]
    starts = [0, 0]
    deeps = [np.random.default_rng(i).standard_normal((3, len(s), 128)).astype(np.float32) for i, s in enumerate(seqs)]
    golden = []
    for s, d in zip(seqs, deeps):
        cache = r.decoder.new_cache(16)
        pos = np.tile(np.arange(len(s)), (3, 1))
        golden.append(r.decoder.forward_rope(s, cache, *r.rope_tables(pos),
                                             layer_adds=None if family == "qwen2_vl" else {i: d[i] for i in range(3)}))
    e = np.concatenate(seqs)
    rows = pack_rope_rows(*r.rope_tables(np.tile(np.concatenate([np.arange(len(s)) for s in seqs]), (3, 1))))
    ds = np.concatenate(deeps, axis=1)
    params = [qb.BatchParam(len(s), st, cid) for cid, (s, st) in enumerate(zip(seqs, starts))]
    ins = {"qwen3_batch_rope": [e[None], rows[None], ds], "qwen2_static": [e[None, None]],
           "qwen3_bundled_static": [e[None], ds]}[want_layout]
    (lg,) = m.infer(ins, None, 0, params)
    flat = lg.reshape(-1, lg.shape[-1])
    assert np.array_equal(flat[:5], golden[0]) and np.array_equal(flat[5:], golden[1])
    m.dispose()


# ---------------------------------------------------------------------------------------------- compile
def test_release_layout_and_config(release, ckpt):
    src = json.loads((ckpt["qwen3_vl"] / "config.json").read_text())
    rel = release("qwen3_vl", vision="dynamic", vision_output_order="3,0,1,2")
    cfg = json.loads((rel / "config.json").read_text())
    assert cfg["model_type"] == "mobilint-qwen3_vl"
    assert cfg["architectures"] == ["MobilintQwen3VLForConditionalGeneration"]
    assert cfg["is_dynamic"] is True and cfg["dynamic_vision"] is True and cfg["tie_word_embeddings"] is False
    v, t = cfg["vision_config"], cfg["text_config"]
    assert (v["model_type"], v["mxq_path"], v["max_batch_size"], v["vision_output_order"]) == (
        "mobilint-qwen3_vl", "vision.mxq", 1, [3, 0, 1, 2])
    assert (t["model_type"], t["mxq_path"], t["npu_prefill_chunk_size"], t["core_mode"]) == (
        "mobilint-qwen3_vl_text", "text.mxq", CHUNK, "single")
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert cfg[key] == src[key]
    host = load_safetensors(rel)
    w = load_safetensors(ckpt["qwen3_vl"])
    assert sorted(host) == ["model.language_model.embed_tokens.weight", "model.visual.pos_embed.weight"]
    assert all(np.array_equal(host[k], w[k]) for k in host)
    for name in ("tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"):
        assert (rel / name).read_bytes() == (ckpt["qwen3_vl"] / name).read_bytes()
    vh, _ = read_mxq(rel / "vision.mxq")
    assert (vh["kind"], vh["vision_layout"], vh["max_width"], vh["vision_output_order"]) == (
        "qwen3_vl_vision", "dynamic", 4096, [3, 0, 1, 2])
    s2 = json.loads((release("qwen2_vl", vision="static") / "config.json").read_text())
    assert s2["dynamic_vision"] is False and s2["vision_config"]["dynamic_vision"] is False
    assert "is_dynamic" not in s2 and "vision_output_order" not in s2["vision_config"]
    assert sorted(load_safetensors(release("qwen3_vl", vision="static"))) == ["model.language_model.embed_tokens.weight"]


@pytest.mark.parametrize("family, opts, match", [
    ("qwen2_vl", {"text_layout": "split"}, "no DeepStack inputs to split"),
    ("qwen3_vl", {"vision": "static", "text_layout": "bundled_rope"}, "needs a text MXQ without a RoPE input"),
    ("qwen3_vl", {"vision": "dynamic", "text_layout": "split_static"}, "needs a text MXQ with a RoPE input"),
    ("qwen2_vl", {"vision": "dynamic", "max_batch_size": 2}, "batched Qwen2-VL text MXQs with an external RoPE"),
    ("qwen2_vl", {"vision_output_order": [0, 2, 3, 1]}, "applies to Qwen3-VL only"),
    ("qwen3_vl", {"vision_output_order": "0,1,2,2"}, "must be a permutation of 0..3"),
    ("qwen3_vl", {"vision": "dynamic", "vision_layout": "pos,rope,folded"}, "vision_layout 'pos,rope,folded' must be"),
    ("qwen3_vl", {"vision": "sometimes"}, "vision 'sometimes' must be 'static' or 'dynamic'"),
])
def test_compile_refusals(ckpt, tmp_path, family, opts, match):
    kw = {k: opts.pop(k) for k in ("max_batch_size", "hub_proxy") if k in opts}
    with pytest.raises(ValueError, match=match):
        compile_artifact(ckpt[family], tmp_path / "rel", vlm=opts, **kw)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_hub_proxy(ckpt, tmp_path, family):
    # the Hub releases' remote-code entry: auto_map + proxy_<family>.py re-exporting transformers-mblt's
    # classes (AutoModelForImageTextToText: how vllm-mblt's worker loads a VLM)
    rel = compile_artifact(ckpt[family], tmp_path / "rel", hub_proxy=True, vlm={"vision": "static"})
    cfg = json.loads((rel / "config.json").read_text())
    cls = {"qwen2_vl": "MobilintQwen2VL", "qwen3_vl": "MobilintQwen3VL"}[family]
    module = f"proxy_{family}"
    assert cfg["auto_map"] == {"AutoConfig": f"{module}.{cls}Config", "AutoModel": f"{module}.{cls}ForConditionalGeneration",
                               "AutoModelForImageTextToText": f"{module}.{cls}ForConditionalGeneration",
                               "AutoProcessor": f"{module}.{cls}Processor"}
    source = (rel / f"{module}.py").read_text()
    assert f"from transformers_mblt.models.{family}.modeling_{family} import {cls}ForConditionalGeneration" in source
    assert f"from mblt_model_zoo.hf_transformers.models.{family}.configuration_{family} import {cls}Config" in source
    compile(source, module, "exec")  # valid Python; the vendor column imports it under vllm-mblt
    plain = json.loads((compile_artifact(ckpt[family], tmp_path / "plain", vlm={"vision": "static"}) / "config.json")
                       .read_text())
    assert "auto_map" not in plain and not (tmp_path / "plain" / f"{module}.py").exists()


def test_cli_compile(ckpt, tmp_path, capsys):
    from npu_conformance.cli import main

    out = tmp_path / "rel"
    rc = main(["mxq", "compile", str(ckpt["qwen3_vl"]), "--out", str(out), "--vision", "dynamic", "--text-layout",
               "split", "--vision-output-order", "1,0,2,3", "--max-width", "32", "--prefill-chunk-size", "32"])
    assert rc == 0, capsys.readouterr().err
    assert "Qwen3-VL release" in capsys.readouterr().out
    th, _ = read_mxq(out / "text.mxq")
    vh, _ = read_mxq(out / "vision.mxq")
    assert th["vlm_text_layout"] == "qwen3_split_rope" and vh["vision_output_order"] == [1, 0, 2, 3]
    rc = main(["mxq", "compile", str(ckpt["qwen3_vl"]), "--out", str(tmp_path / "bad"), "--vision", "static",
               "--text-layout", "split_rope"])
    assert rc == 2 and "without a RoPE input" in capsys.readouterr().err
    rc = main(["mxq", "compile", str(ckpt["qwen3_vl"]), "--out", str(tmp_path / "bad2"), "--moe-devices", "2"])
    assert rc == 2 and "do not apply" in capsys.readouterr().err
