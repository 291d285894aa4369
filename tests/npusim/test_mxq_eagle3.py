"""npusim.mxq's EAGLE-3 release (``mxq compile`` with ``eagle3`` options) and its three MXQ kinds.

Reference: the golden pieces (``npusim.llm.Decoder.forward_tree``, ``npusim.llm.eagle3.Eagle3Draft``).
Each MXQ computes with that same code, so its outputs and KV must equal them bit for bit in
float32. The RoPE rows are packed here by :func:`pack_rope_rows` (ours, vendor-independent; the
vendor's own table is compared with it in ``test_transformers_mblt.py -k eagle3``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.llm.decoder import _attention_mask
from npusim.llm.safetensors import load_safetensors
from npusim.mxq.compile import compile_artifact
from npusim.mxq.eagle3_kinds import Eagle3InputError, pack_rope_rows, rope_row_width, unpack_rope_rows
from npusim.mxq.mxqfile import read_mxq

PROMPT = [1, 5, 9, 33, 70, 2, 11]


def _x4(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32)[None, None]


def _model(root: Path, role: str) -> qb.Model:
    m = qb.Model(str(root / "mxq" / f"{role}.mxq"))
    m.launch(qb.Accelerator())
    return m


def _tree_mask(start: int) -> np.ndarray:
    """5 rows at ``start``: a root, its two children, a child of each (rows 3, 4): true = hidden."""
    parents = [-1, 0, 0, 1, 2]
    m = np.zeros((5, start + 5), bool)
    for r in range(5):
        m[r, start:] = True
        node = r
        while node >= 0:
            m[r, start + node] = False
            node = parents[node]
    return m


TREE_POS = np.array([0, 1, 1, 2, 2])


# ---------------------------------------------------------------------------------------- RoPE rows
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_rope_rows_round_trip(head_dim):
    from npusim.llm.rope import RopeConfig

    rope = RopeConfig("default", 10000.0, head_dim, 1024)
    cos, sin = rope.cos_sin(np.array([0, 3, 3, 700]), dtype=np.float32)
    rows = pack_rope_rows(cos, sin)
    assert rows.shape == (4, rope_row_width(head_dim)) and rope_row_width(head_dim) == 2 * (-(-head_dim // 64) * 64)
    cp, h = rows.shape[1] // 2, head_dim // 2
    # the layout, slot by slot
    assert np.array_equal(rows[:, 0:head_dim:2], cos[:, :h]) and np.array_equal(rows[:, 1:head_dim:2], -sin[:, :h])
    assert np.array_equal(rows[:, cp:cp + head_dim:2], sin[:, h:]) and np.array_equal(rows[:, cp + 1:cp + head_dim:2], cos[:, h:])
    assert not rows[:, head_dim:cp].any() and not rows[:, cp + head_dim:].any()
    c2, s2 = unpack_rope_rows(rows, head_dim)
    assert np.array_equal(c2, cos) and np.array_equal(s2, sin)
    with pytest.raises(ValueError, match=rf"\[T, {rope_row_width(head_dim)}\]"):
        unpack_rope_rows(rows[:, :-1], head_dim)


# ---------------------------------------------------------------------------------------- kinds
def test_base_kind_equals_forward_tree_and_writes_the_kv(mxq_machine, eagle3_release, eagle3_golden):
    root, base = eagle3_release(), eagle3_golden.base
    c = base.config
    m = _model(root, "base")
    assert m.get_model_input_shape() == [(1, -1, c.hidden_size), (1, -1, -1), (1, -1, rope_row_width(c.head_dim))]
    assert m.get_model_output_shape() == [(1, -1, c.hidden_size)] * 3 + [(1, -1, c.vocab_size)]
    assert len(m.get_cache_infos()) == c.num_hidden_layers
    info = m.get_input_buffer_info()
    assert len(info) == 3 and info[0].max_cache_size == 256
    gcache = base.new_cache(64)
    n = len(PROMPT)
    # prefill (causal), then a tree of 5 nodes at explicit positions, then the tree again (rewound)
    for ids, pos, hide, cs in ((PROMPT, np.arange(n), _attention_mask(0, n, None), 0),
                               ([40, 41, 42, 43, 44], n + TREE_POS, _tree_mask(n), n)):
        cos, sin = c.rope.cos_sin(pos, dtype=np.float32)
        emb = base.embed(ids)
        got = m.infer([_x4(emb), _x4(hide.astype(np.float32)), _x4(pack_rope_rows(cos, sin))], None, cs)
        gcache.length = cs
        logits, taps = base.forward_tree(emb, gcache, cos, sin, hide, taps=(1, 2, 3))
        assert [g.shape for g in got] == [(1, 1, len(ids), c.hidden_size)] * 3 + [(1, 1, len(ids), c.vocab_size)]
        for g, want in zip(got, [*taps, logits]):
            assert g.dtype == np.float32 and np.array_equal(g[0, 0], want)
    again = m.infer([_x4(emb), _x4(hide.astype(np.float32)), _x4(pack_rope_rows(cos, sin))], None, n)
    assert all(np.array_equal(a, b) for a, b in zip(again, got))
    total = n + 5
    for layer, blob in enumerate(m.dump_cache_memory(0)):
        kv = np.frombuffer(blob, np.float32).reshape(2, c.num_key_value_heads, 256, c.head_dim)
        assert np.array_equal(kv[0][:, :total], gcache.keys[layer][:, :total])
        assert np.array_equal(kv[1][:, :total], gcache.values[layer][:, :total])
        assert np.isnan(kv[0][:, total:]).all()  # never written
    m.dispose()


def test_fc_and_draft_kinds_equal_the_golden_draft(mxq_machine, eagle3_release, eagle3_golden):
    root, base, draft = eagle3_release(), eagle3_golden.base, eagle3_golden.draft
    dc = draft.config
    fc, dm = _model(root, "fc"), _model(root, "draft")
    assert fc.get_model_input_shape() == [(1, -1, 3 * dc.target_hidden_size)] and not fc.get_cache_infos()
    assert fc.get_model_output_shape() == [(1, -1, dc.hidden_size)]
    assert fc.get_input_buffer_info()[0].max_width == 256  # a whole prompt in one infer
    assert dm.get_model_input_shape() == [(1, -1, dc.hidden_size), (1, -1, dc.hidden_size), (1, -1, -1),
                                          (1, -1, rope_row_width(dc.head_dim))]
    assert dm.get_model_output_shape() == [(1, -1, dc.hidden_size), (1, -1, dc.draft_vocab_size)]
    assert len(dm.get_cache_infos()) == 1
    n = len(PROMPT)
    cos, sin = base.config.rope.cos_sin(np.arange(n), dtype=np.float32)
    _, taps = base.forward_tree(base.embed(PROMPT), base.new_cache(n), cos, sin, _attention_mask(0, n, None), taps=(1, 2, 3))
    feats = np.concatenate(taps, axis=-1)
    (g,) = fc.infer([_x4(feats)])
    assert g.shape == (1, 1, n, dc.hidden_size) and np.array_equal(g[0, 0], draft.fc(feats))
    buf = np.empty((1, 1, n, dc.hidden_size), np.float32)
    assert fc.infer([_x4(feats)], [buf]) is None and np.array_equal(buf, g)  # into the caller's buffer
    (g3,) = fc.infer([feats[None]])  # rank 3 in, rank 3 out
    assert g3.shape == (1, n, dc.hidden_size) and np.array_equal(g3[0], g[0, 0])
    gcache = draft.new_cache(64)
    ids = PROMPT[1:] + [17]
    for emb, hid, pos, hide, cs in (
        (draft.embed(ids), g[0, 0], np.arange(n), _attention_mask(0, n, None), 0),
        (draft.embed([3, 4, 5, 6, 7]), np.repeat(g[0, 0, -1:], 5, 0), n + TREE_POS, _tree_mask(n), n),
    ):
        dcos, dsin = dc.rope.cos_sin(pos, dtype=np.float32)
        out, logits = dm.infer([_x4(emb), _x4(hid), _x4(hide.astype(np.float32)), _x4(pack_rope_rows(dcos, dsin))],
                               None, cs)
        gcache.length = cs
        want_out, want_logits = draft.forward(emb, hid, gcache, dcos, dsin, hide)
        assert np.array_equal(out[0, 0], want_out) and np.array_equal(logits[0, 0], want_logits)
    fc.dispose()
    dm.dispose()


def test_eagle3_infer_errors(mxq_machine, eagle3_release, eagle3_golden, capsys):
    root, base = eagle3_release(), eagle3_golden.base
    c = base.config
    m = _model(root, "base")
    cos, sin = c.rope.cos_sin(np.arange(4), dtype=np.float32)
    emb, rope = _x4(base.embed([1, 2, 3, 4])), _x4(pack_rope_rows(cos, sin))
    mask = _x4(_attention_mask(0, 4, None).astype(np.float32))
    with pytest.raises(ValueError, match=r"The number of inputs is invalid \(expected 3, got 1\)"):
        m.infer([emb], None, 0)
    with pytest.raises(Eagle3InputError, match=r"inputs\[1\] \(attention_mask\) expected \[1, 1, 4, 6\], got \[1, 1, 4, 4\]"):
        m.infer([emb, mask, rope], None, 2)
    with pytest.raises(Eagle3InputError, match=r"inputs\[2\] \(position_embs\) expected \[1, 1, 4, 128\]"):
        m.infer([emb, mask, rope[..., :64]], None, 0)
    with pytest.raises(Eagle3InputError, match=r"inputs\[0\] \(inputs_embeds\) expected \[1, 1, 4, 128\]"):
        m.infer([emb[..., :64], mask, rope], None, 0)
    with pytest.raises(Eagle3InputError, match=r"inputs\[1\] \(attention_mask\) must be \[1, 1, T, C\]"):
        m.infer([emb, mask[0], rope], None, 0)
    blind = mask.copy()
    blind[0, 0, 2, :] = 1.0
    with pytest.raises(Eagle3InputError, match="attention_mask row 2 masks every key"):
        m.infer([emb, blind, rope], None, 0)
    with pytest.raises(qb.QbRuntimeError) as exc:
        m.infer([emb, np.zeros((1, 1, 4, 257), np.float32), rope], None, 253)
    assert exc.value.status == "Model_CacheOverflow" and "(257 > 256)" in capsys.readouterr().out
    with pytest.raises(qb.QbRuntimeError) as exc:
        m.infer([emb, mask, rope], None, 0, [qb.BatchParam(0, 4, 0)])
    assert exc.value.status == "Model_InvalidBatchParam"
    wide = m.W + 1
    with pytest.raises(qb.QbRuntimeError) as exc:
        m.infer([np.zeros((1, 1, wide, c.hidden_size), np.float32), np.zeros((1, 1, wide, wide), np.float32),
                 np.zeros((1, 1, wide, 128), np.float32)], None, 0)
    assert exc.value.status == "Model_ShapeMismatched" and f"({wide} > {m.W})" in capsys.readouterr().out
    with pytest.raises(qb.QbRuntimeError) as exc:
        m.infer_npu_data([], None, 0)
    assert exc.value.status == "NotImplemented"
    # nothing was written by the failed calls
    assert all(np.isnan(np.frombuffer(b, np.float32)).all() for b in m.dump_cache_memory(0))
    m.dispose()
    fc = _model(root, "fc")
    with pytest.raises(ValueError, match=r"expected 1, got 2"):
        fc.infer([np.zeros((1, 1, 2, 384), np.float32)] * 2)
    with pytest.raises(Eagle3InputError, match=r"inputs\[0\] \(hidden_states\) expected \[1, 1, 2, 384\], got \[1, 1, 2, 128\]"):
        fc.infer([np.zeros((1, 1, 2, 128), np.float32)])
    fc.dispose()


def test_header_rules(tmp_path, eagle3_release):
    from npusim.mxq.model import _check_header
    from npusim.mxq.mxqfile import MxqFormatError

    header, _ = read_mxq(eagle3_release() / "mxq" / "base.mxq")
    with pytest.raises(MxqFormatError, match="eagle3_taps"):
        _check_header({k: v for k, v in header.items() if k != "eagle3_taps"})
    with pytest.raises(MxqFormatError, match="input_scales"):
        _check_header({**header, "input_scales": [1.0]})
    draft_header, _ = read_mxq(eagle3_release() / "mxq" / "draft.mxq")
    with pytest.raises(MxqFormatError, match="eagle3_taps"):
        _check_header({**draft_header, "eagle3_taps": [1, 2, 3]})
    with pytest.raises(MxqFormatError, match="max_batch_size"):
        _check_header({**draft_header, "max_batch_size": 2})
    with pytest.raises(MxqFormatError, match="outputs"):
        _check_header({**header, "outputs": ["logits"]})
    assert _check_header({**header, "outputs": ["logits", "hidden3", "hidden2", "hidden1"]})


# ---------------------------------------------------------------------------------------- compile
def test_release_layout(eagle3_release, eagle3_golden):
    root = eagle3_release(hub_proxy=True)
    cfg = json.loads((root / "config.json").read_text())
    base_raw = json.loads((eagle3_golden.model_dir / "config.json").read_text())
    assert cfg["model_type"] == "mobilint-llama-eagle3" and cfg["architectures"] == ["MobilintLlamaEagle3ForCausalLM"]
    assert cfg["auto_map"] == {"AutoConfig": "proxy_llama_eagle3.MobilintLlamaEagle3Config",
                               "AutoModelForCausalLM": "proxy_llama_eagle3.MobilintLlamaEagle3ForCausalLM"}
    assert (root / "proxy_llama_eagle3.py").is_file()
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_size"] == base_raw["hidden_size"]
    for role in ("base", "draft", "fc"):
        assert cfg[f"{role}_mxq_path"] == f"mxq/{role}.mxq" and (root / cfg[f"{role}_mxq_path"]).is_file()
        assert (cfg[f"{role}_max_batch_size"], cfg[f"{role}_core_mode"]) == (1, "single")
    assert (cfg["npu_prefill_chunk_size"], cfg["eagle3_tree_depth"], cfg["eagle3_tree_top_k"]) == (16, 5, 8)
    dc, d = eagle3_golden.draft.config, cfg["draft_config"]
    assert d["model_type"] == "llama" and d["num_hidden_layers"] == 1 and d["tie_word_embeddings"] is False
    assert (d["hidden_size"], d["head_dim"], d["num_attention_heads"], d["num_key_value_heads"], d["vocab_size"],
            d["draft_vocab_size"], d["intermediate_size"]) == (dc.hidden_size, dc.head_dim, dc.num_attention_heads,
                                                               dc.num_key_value_heads, dc.vocab_size,
                                                               dc.draft_vocab_size, dc.intermediate_size)
    gen = json.loads((root / "generation_config.json").read_text())
    assert (gen["num_assistant_tokens"], gen["eagle3_tree_depth"], gen["eagle3_tree_top_k"]) == (64, 5, 8)
    assert gen["eos_token_id"] == base_raw["eos_token_id"] and "repetition_penalty" not in gen
    w = load_safetensors(root)
    assert sorted(w) == ["eagle3_base_model.embed_tokens.weight", "eagle3_draft_model.d2t",
                         "eagle3_draft_model.embed_tokens.weight", "eagle3_draft_model.t2d"]
    assert w["eagle3_draft_model.d2t"].dtype == np.int64 and w["eagle3_draft_model.t2d"].dtype == np.bool_
    assert np.array_equal(w["eagle3_draft_model.d2t"], eagle3_golden.draft.d2t)
    assert np.array_equal(w["eagle3_base_model.embed_tokens.weight"], eagle3_golden.base.embed(np.arange(dc.vocab_size)))
    assert (root / "tokenizer.json").is_file()
    headers = {role: read_mxq(root / "mxq" / f"{role}.mxq") for role in ("base", "draft", "fc")}
    (hb, tb), (hd, td), (hf, tf) = headers["base"], headers["draft"], headers["fc"]
    assert (hb["kind"], hb["eagle3_taps"], hb["max_cache_size"], hb["max_width"]) == ("eagle3_base", [1, 2, 3], 256, 70)
    assert (hd["kind"], hd["max_cache_size"], hd["max_width"]) == ("eagle3_draft", 256, 70)
    assert (hf["kind"], hf["max_width"]) == ("eagle3_fc", 256)
    assert sorted(tf) == ["fc.weight"] and "fc.weight" not in td and "embed_tokens.weight" not in td
    assert "lm_head.weight" in td and "model.embed_tokens.weight" in tb


def test_release_options(eagle3_release):
    root = eagle3_release(tree_depth=3, tree_top_k=4, num_assistant_tokens=10, max_cache_size=128,
                          prefill_chunk_size=32)
    cfg = json.loads((root / "config.json").read_text())
    gen = json.loads((root / "generation_config.json").read_text())
    assert (cfg["eagle3_tree_depth"], cfg["eagle3_tree_top_k"], cfg["npu_prefill_chunk_size"]) == (3, 4, 32)
    assert (gen["num_assistant_tokens"], gen["eagle3_tree_depth"], gen["eagle3_tree_top_k"]) == (10, 3, 4)
    hb, _ = read_mxq(root / "mxq" / "base.mxq")
    assert (hb["max_cache_size"], hb["max_width"]) == (128, 32)  # the chunk is wider than a round (10 + 3 + 1)


def _copy(src: Path, dst: Path, edit: dict[str, Any] | None = None, draft_edit: dict[str, Any] | None = None) -> Path:
    shutil.copytree(src, dst)
    for path, changes in ((dst / "config.json", edit), (dst / "eagle3_draft" / "config.json", draft_edit)):
        if changes:
            d = json.loads(path.read_text())
            d.update(changes)
            path.write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("kwargs, eagle3, match", [
    ({}, {"tree_depth": 0}, r"tree_depth 0 must be an integer >= 1"),
    ({}, {"tree_top_k": -1}, r"tree_top_k -1 must be an integer >= 1"),
    ({}, {"num_assistant_tokens": 1}, r"num_assistant_tokens 1 must be an integer >= 2"),
    ({"max_batch_size": 2}, {}, r"max_batch_size 2 must be 1"),
    ({"core_mode": "multi"}, {}, r"core_mode='multi'"),
    ({"max_cache_size": 4096}, {}, r"max_cache_size 4096 must be <= max_position_embeddings 1024"),
    ({"max_width": 8, "prefill_chunk_size": 16}, {}, r"max_width 8 must be >= every prefill chunk size"),
    ({}, {"draft_dir": "/nonexistent"}, r"'/nonexistent' has no config.json"),
])
def test_compile_refusals(tmp_path, eagle3_model_dir, kwargs, eagle3, match):
    with pytest.raises(ValueError, match=match):
        compile_artifact(eagle3_model_dir, tmp_path / "out", eagle3=eagle3, **kwargs)


@pytest.mark.parametrize("edit, draft_edit, match", [
    (None, {"target_hidden_size": 64}, r"draft target_hidden_size 64 differs from the base's hidden_size 128"),
    (None, {"vocab_size": 2048}, r"draft vocab_size 2048 differs from the base's vocab_size 1024"),
    ({"use_sliding_window": True, "sliding_window": 8}, None, r"use_sliding_window=True"),
    ({"model_type": "exaone4"}, None, r"EAGLE-3 base model_type 'exaone4' must be one of llama, qwen2, qwen3"),
    (None, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, r"name layers past the base's 4"),
])
def test_compile_refuses_a_mismatched_checkpoint(tmp_path, eagle3_model_dir, edit, draft_edit, match):
    src = _copy(eagle3_model_dir, tmp_path / "ckpt", edit, draft_edit)
    with pytest.raises(ValueError, match=match):
        compile_artifact(src, tmp_path / "out", eagle3={})


def test_cli_compiles_an_eagle3_release(tmp_path, eagle3_model_dir):
    from npu_conformance.cli import main

    out = tmp_path / "rel"
    assert main(["mxq", "compile", str(eagle3_model_dir), "--out", str(out), "--eagle3-tree", "3", "4", "12",
                 "--max-cache-size", "128", "--prefill-chunk-size", "16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert cfg["model_type"] == "mobilint-llama-eagle3" and (cfg["eagle3_tree_depth"], cfg["eagle3_tree_top_k"]) == (3, 4)
    assert gen["num_assistant_tokens"] == 12
    assert main(["mxq", "compile", str(eagle3_model_dir), "--out", str(tmp_path / "bad"), "--eagle3-tree", "0", "4",
                 "12"]) != 0
