"""vllm_npu.mblt.vlm_positions: the plugin's M-RoPE positions against transformers 5.19's
``Qwen2VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` and npusim's golden
``rope_index``, and the decode rule."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_npu.mblt.vlm_positions import MropeInputError, decode_positions, rope_index, split_video_grids

REPO = Path(__file__).resolve().parents[2]
IMG, VID, VS, VE = 1026, 1027, 1024, 1025
M = 2


def _tokens(parts) -> list[int]:
    """``parts``: ints are text tokens, ``("image"|"video", t, h, w)`` an item expanded (for a
    Qwen3-VL video use one part per frame group, ``t`` = 1, text between)."""
    ids: list[int] = []
    for p in parts:
        if isinstance(p, tuple):
            kind, t, h, w = p
            ids += [VS] + [IMG if kind == "image" else VID] * (t * h * w // (M * M)) + [VE]
        else:
            ids.append(p)
    return ids


T = list(range(10, 17))  # some text
CASES = {
    "text only": ("qwen2_vl", T, [], []),
    "one static image": ("qwen2_vl", [*T, ("image", 1, 16, 16), *T], [(1, 16, 16)], []),
    "image first": ("qwen3_vl", [("image", 1, 16, 16), *T], [(1, 16, 16)], []),
    "image last": ("qwen3_vl", [*T, ("image", 1, 14, 22)], [(1, 14, 22)], []),
    "two images, not square": ("qwen3_vl", [*T, ("image", 1, 14, 22), 5, 6, ("image", 1, 28, 14), *T],
                               [(1, 14, 22), (1, 28, 14)], []),
    "qwen2 video, t past h and w": ("qwen2_vl", [*T, ("video", 6, 4, 4), *T], [], [(6, 4, 4)]),
    "qwen2 image and video": ("qwen2_vl", [*T, ("image", 1, 8, 12), 7, ("video", 2, 6, 4), *T],
                              [(1, 8, 12)], [(2, 6, 4)]),
    "qwen3 video per frame group": ("qwen3_vl", [*T, 40, 41, ("video", 1, 14, 14), 42, 43, ("video", 1, 14, 14), *T],
                                    [], [(2, 14, 14)]),
    "qwen3 image then video": ("qwen3_vl", [*T, ("image", 1, 16, 16), 9, 40, ("video", 1, 6, 8), 41,
                                            ("video", 1, 6, 8), 42, ("video", 1, 6, 8), *T],
                               [(1, 16, 16)], [(3, 6, 8)]),
}


def _transformers(family, ids, images, videos):
    torch = pytest.importorskip("torch")
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=M)))
    fake.get_vision_position_ids = lambda *a, **k: Model.get_vision_position_ids(fake, *a, **k)
    x = torch.tensor([ids])
    types = torch.where(x == IMG, 1, torch.where(x == VID, 2, 0))
    pos, delta = Model.get_rope_index(fake, x, types, image_grid_thw=torch.tensor(images) if images else None,
                                      video_grid_thw=torch.tensor(videos) if videos else None)
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


def _ours(family, ids, images, videos):
    return rope_index(ids, image_grid_thw=images, video_grid_thw=videos, image_token_id=IMG, video_token_id=VID,
                      vision_start_token_id=VS, spatial_merge_size=M, family=family)


@pytest.mark.parametrize("case", list(CASES))
def test_rope_index_matches_transformers(case):
    family, parts, images, videos = CASES[case]
    ids = _tokens(parts)
    pos, delta = _ours(family, ids, images, videos)
    want, want_delta = _transformers(family, ids, images, videos)
    assert pos.dtype == np.int64 and pos.shape == (3, len(ids))
    assert np.array_equal(pos, want), case
    assert delta == want_delta, case
    assert delta == int(pos.max()) + 1 - len(ids)


@pytest.mark.parametrize("case", list(CASES))
def test_rope_index_matches_the_golden(case):
    """Same numbers as npusim.llm.mrope.rope_index (the simulator's side of the contract)."""
    if not (REPO / "simulators" / "npusim" / "llm" / "mrope.py").is_file():
        pytest.skip("npusim.llm.mrope not there yet")
    sys.path.insert(0, str(REPO / "simulators"))
    from npusim.llm.mrope import rope_index as golden

    family, parts, images, videos = CASES[case]
    ids = _tokens(parts)
    pos, delta = _ours(family, ids, images, videos)
    want, want_delta = golden(ids, image_grid_thw=images, video_grid_thw=videos, image_token_id=IMG,
                              video_token_id=VID, vision_start_token_id=VS, spatial_merge_size=M, family=family)
    assert np.array_equal(pos, want) and delta == want_delta


def test_values_of_one_image():
    """Text 0..6, the 8x8 merged image at 7 + (0, row, col), text resuming at 7 + 8."""
    ids = _tokens([*T, ("image", 1, 16, 16), 1, 2])
    pos, delta = _ours("qwen2_vl", ids, [(1, 16, 16)], [])
    assert pos[:, :8].tolist() == [list(range(8))] * 3  # text and <|vision_start|>
    img = pos[:, 8:8 + 64]
    assert (img[0] == 8).all() and img[1].tolist() == [8 + i // 8 for i in range(64)]
    assert img[2].tolist() == [8 + i % 8 for i in range(64)]
    assert pos[:, 72:].tolist() == [[16, 17, 18]] * 3  # <|vision_end|> and the text after
    assert delta == 19 - len(ids) == -56


def test_decode_positions_continue_at_index_plus_delta():
    ids = _tokens([*T, ("image", 1, 16, 16), 1])
    pos, delta = _ours("qwen3_vl", ids, [(1, 16, 16)], [])
    nxt = decode_positions(len(ids), 3, delta)
    assert nxt.shape == (3, 3) and nxt.dtype == np.int64
    assert nxt[:, 0].tolist() == [int(pos.max()) + 1] * 3 and nxt[0].tolist() == [pos.max() + 1, pos.max() + 2,
                                                                                   pos.max() + 3]


def test_split_video_grids():
    assert split_video_grids([(2, 4, 6), (1, 2, 2)]) == [(1, 4, 6), (1, 4, 6), (1, 2, 2)]


def test_adjacent_items_in_one_run():
    """Two images with no token between them (not what a chat template writes) are split by
    their grids; too short a run or a grid left over is an error naming the counts."""
    ids = [1, *([IMG] * 4), *([IMG] * 6), 2]
    pos, _ = _ours("qwen3_vl", ids, [(1, 4, 4), (1, 4, 6)], [])
    assert pos[:, 5].tolist() == [3, 3, 3]  # second image starts after max(2, 2)
    with pytest.raises(MropeInputError, match="needs 6 tokens, 2 left"):
        _ours("qwen3_vl", [1, *([IMG] * 6), 2], [(1, 4, 4), (1, 4, 6)], [])
    with pytest.raises(MropeInputError, match="2 image grid\\(s\\) given, the prompt's pad runs hold 1"):
        _ours("qwen3_vl", [1, *([IMG] * 4), 2], [(1, 4, 4), (1, 4, 6)], [])
    with pytest.raises(MropeInputError, match="only 0 video grid"):
        _ours("qwen2_vl", [1, VID, 2], [], [])
    with pytest.raises(MropeInputError, match="family 'llava'"):
        rope_index([1], image_token_id=IMG, video_token_id=VID, spatial_merge_size=M,
                   family="llava")  # type: ignore[arg-type]
