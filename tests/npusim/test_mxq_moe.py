"""npusim.mxq's Mixture-of-Experts release (``mxq compile`` of a qwen3_moe checkpoint) and the
NPU-data API its host side drives (``acquire_*_npu_data``, ``infer_npu_data``, ``NPUData``,
``get_input_scale`` / ``get_output_scale``).

Reference: the golden decoder (``npusim.llm``). The pieces composed by a host that routes as the
golden decoder does and sums the experts in ascending expert id must give its logits bit for bit;
a host that sums in the order the experts finish must not be deterministic (the seed: "greedy
output can differ run to run because ... adds the expert outputs in the order they finish").
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.llm import Decoder
from npusim.mxq.compile import compile_artifact
from npusim.mxq.compile_moe import EXPERT_IN, expert_output_scale, release_placement
from npusim.mxq.mxqfile import read_mxq

PROMPT = [1, 5, 9, 33, 70, 2, 11]


def _members(root: Path) -> dict[tuple[int, int], bytes]:
    """``{(layer, member): bytes}`` of every pack, split as the index says (member 0 shared, 1+e expert e)."""
    index = json.loads((root / "mxq" / "index.json").read_text())
    out = {}
    for layer, sizes in enumerate(index["sizes"]):
        data = (root / "mxq" / index["pack"].format(layer=layer)).read_bytes()
        pos = 0
        for i, size in enumerate(sizes):
            out[(layer, i)] = data[pos : pos + size]
            pos = -(-(pos + size) // index["alignment"]) * index["alignment"]
    return out


# ---------------------------------------------------------------------------------------- layout
def test_packed_release_layout(moe_release, moe_golden):
    root = moe_release()
    cfg = moe_golden.config
    index = json.loads((root / "mxq" / "index.json").read_text())
    assert (index["format"], index["version"], index["pack"]) == ("mobilint-moe-mxqpack", 1, "block_{layer}.mxqpack")
    assert len(index["sizes"]) == cfg.num_hidden_layers and all(len(r) == 1 + cfg.num_experts for r in index["sizes"])
    a = index["alignment"]
    for layer, sizes in enumerate(index["sizes"]):  # the vendor's exact size rule: aligned members, last unpadded
        pack = root / "mxq" / f"block_{layer}.mxqpack"
        assert pack.stat().st_size == sum(-(-s // a) * a for s in sizes[:-1]) + sizes[-1]
    for (layer, i), data in _members(root).items():
        tmp = root.parent / f"member-{layer}-{i}.mxq"
        tmp.write_bytes(data)
        header, tensors = read_mxq(tmp)
        assert header["kind"] == ("moe_shared" if i == 0 else "moe_expert") and header["layer"] == layer
        if i:
            assert header["expert"] == i - 1 and sorted(tensors) == sorted(
                f"model.layers.{layer}.mlp.experts.{i - 1}.{p}_proj.weight" for p in ("gate", "up", "down"))
        else:
            assert not any(".experts." in n for n in tensors) and f"model.layers.{layer}.mlp.gate.weight" in tensors
    assert sorted(p.name for p in (root / "mxq").iterdir()) == ["block_0.mxqpack", "block_1.mxqpack", "index.json", "lm_head.mxq"]
    conf = json.loads((root / "config.json").read_text())
    assert conf["model_type"] == "mobilint-qwen3_moe" and conf["architectures"] == ["MobilintQwen3MoEForCausalLM"]
    assert conf["max_batch_size"] == 1 and conf["moe_mxq_pack_index"] == "mxq/index.json"
    assert conf["lm_head_mxq_path"] == "mxq/lm_head.mxq" and "shared_mxq_path" not in conf
    assert {k: conf[k] for k in release_placement(3)} == release_placement(3)
    # the declared max_model_len (40960) is above the shared MXQs' KV capacity (4096), as the release's
    declared = json.loads((root / "config.json").read_text())["max_position_embeddings"]
    header, _ = read_mxq(_write(root, _members(root)[(0, 0)]))
    assert (header["max_cache_size"], declared) == (4096, 40960)


def _write(root: Path, data: bytes) -> Path:
    p = root.parent / "one.mxq"
    p.write_bytes(data)
    return p


def test_unpacked_release_and_release_placement(moe_release):
    root = moe_release(packed=False)
    conf = json.loads((root / "config.json").read_text())
    assert conf["shared_mxq_path"] == "mxq/block_{layer}_shared.mxq"
    assert conf["expert_mxq_path"] == "mxq/block_{layer}_expert_{expert}.mxq" and "moe_mxq_pack_index" not in conf
    assert (root / "mxq" / "block_1_expert_7.mxq").is_file()
    place = release_placement(3)  # the seed's: shared over devices 0-2, experts on all 24 cores, lm_head alone
    assert place["shared_target_cores"] == ["0:0:0", "1:0:0", "2:0:0"] and place["lm_head_target_cores"] == ["2:0:0"]
    assert len(place["expert_target_cores"]) == 24


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_batch_size": 2}, r"max_batch_size=2: a Mixture-of-Experts release supports only max_batch_size=1"),
    ({"core_mode": "multi"}, r"core_mode='multi': .* supports only core_mode='single'"),
    ({"output_logits": "all"}, r"output_logits='all': .* only output_logits='last'"),
    ({"moe": {"shared_output_order": ["gate", "gate", "residual"]}}, r"must be a permutation of \['residual'"),
    ({"moe": {"alignment": 3000}}, r"alignment 3000 must be a power of two"),
    ({"moe": {"devices": 0}}, r"devices 0 must be an integer >= 1"),
    ({"max_cache_size": 50000}, r"max_cache_size 50000 must be <= max_position_embeddings 40960"),
])
def test_bad_release_options_are_refused_before_writing(tiny_model_dir, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compile_artifact(tiny_model_dir("qwen3_moe"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_dense_layers_and_moe_options_for_a_dense_model_are_refused(tiny_model_dir, tmp_path):
    src = tmp_path / "mixed"
    src.mkdir()
    for f in tiny_model_dir("qwen3_moe").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match=r"layers \[0\] are dense .*transformers-mblt treats every layer as sparse"):
        compile_artifact(src, tmp_path / "out")
    with pytest.raises(ValueError, match=r"Mixture-of-Experts options \['devices'\] given for model_type 'llama'"):
        compile_artifact(tiny_model_dir("llama"), tmp_path / "out2", moe={"devices": 1})


def test_cli_compiles_a_moe_release(tiny_model_dir, tmp_path):
    from npu_conformance.cli import main

    assert main(["mxq", "compile", str(tiny_model_dir("qwen3_moe")), "--out", str(tmp_path / "rel"), "--moe-devices", "2"]) == 0
    conf = json.loads((tmp_path / "rel" / "config.json").read_text())
    assert conf["lm_head_target_cores"] == ["1:0:0"] and (tmp_path / "rel" / "mxq" / "index.json").is_file()
    assert main(["mxq", "compile", str(tiny_model_dir("qwen3_moe")), "--out", str(tmp_path / "bad"), "--max-batch-size", "4"]) == 2


# ---------------------------------------------------------------------------------------- the MXQs
def _models(root: Path, acc: Any) -> tuple[list[Any], list[list[Any]], Any]:
    """Every MXQ of an unpacked release, launched on ``acc``: ``(shared, experts, lm_head)``."""
    conf = json.loads((root / "config.json").read_text())
    n_layers, n_experts = conf["num_hidden_layers"], conf["num_experts"]

    mc = qb.ModelConfig()
    mc.set_single_core_mode(None, [qb.CoreId(qb.Cluster.Cluster0, qb.Core.Core0)])  # all share one core, as
                                                                                   # a release's MXQs do
    def up(rel: str) -> Any:
        m = qb.Model(str(root / rel), mc)
        m.launch(acc)
        return m

    shared = [up(f"mxq/block_{layer}_shared.mxq") for layer in range(n_layers)]
    experts = [[up(f"mxq/block_{layer}_expert_{e}.mxq") for e in range(n_experts)] for layer in range(n_layers)]
    return shared, experts, up("mxq/lm_head.mxq")


def test_moe_mxq_shapes_scales_and_kv(mxq_machine, moe_release, moe_golden):
    c = moe_golden.config
    shared, experts, head = _models(moe_release(packed=False), qb.Accelerator())
    s = shared[0]
    assert s.get_model_input_shape() == [(1, -1, c.hidden_size)]
    assert s.get_model_output_shape() == [(1, -1, c.hidden_size), (1, -1, c.hidden_size), (1, -1, c.num_experts)]
    assert [sc.scale for sc in s.get_output_scale()][1] * experts[0][0].get_input_scale()[0].scale == 1.0
    assert s.get_output_scale()[0].scale * experts[0][0].get_input_scale()[0].scale != 1.0  # only expert_in pairs
    assert len({e.get_output_scale()[0].scale for e in experts[0][:3]}) == 3  # per-expert output scales
    assert len(s.get_cache_infos()) == 1 and experts[0][0].get_cache_infos() == [] and head.get_cache_infos() == []
    assert head.get_model_input_shape() == [(1, 1, c.hidden_size)] and head.get_model_output_shape() == [(1, 1, c.vocab_size)]
    blob = s.dump_cache_memory(0)  # a shared MXQ's KV is one layer's, dumped and restored exactly
    s.infer([np.ones((1, 3, c.hidden_size), np.float32)], None, 0)
    s.load_cache_memory(blob, 0)
    assert [b == a for b, a in zip(s.dump_cache_memory(0), blob)] == [True]
    last = _models(moe_release(packed=False, last_only=True), qb.Accelerator())[0]
    assert last[0].get_model_output_shape()[0][-2] == -1 and last[-1].get_model_output_shape()[0][-2] == 1
    with pytest.raises(qb.QbRuntimeError):
        head.infer([np.ones((1, 2, c.hidden_size), np.float32)])  # the lm_head MXQ takes one token


def _forward(moe_golden: Decoder, shared: list[Any], experts: list[list[Any]], head: Any, ids: list[int], *,
             finish_order: bool, pool: ThreadPoolExecutor) -> np.ndarray:
    """A host driving the pieces over NPUData on the card: one-shot prefill, last logits. Experts run
    on ``pool``; their weighted outputs are added to the residual one by one in the order they
    finish (``finish_order``, as transformers-mblt's token path), or summed in ascending expert id
    and then added (the golden reference's order)."""
    c = moe_golden.config
    h = moe_golden.embed(ids)
    for layer, s in enumerate(shared):
        host_in = s.acquire_input_npu_data([1, len(ids), c.hidden_size], 0, False)
        npu_in = s.acquire_input_npu_data([1, len(ids), c.hidden_size], 0, True)
        outs = [s.acquire_output_npu_data([1, len(ids), ch], i, True)
                for i, ch in enumerate((c.hidden_size, c.hidden_size, c.num_experts))]
        host_in[:] = h[None]
        npu_in.copy_from(host_in)
        s.infer_npu_data([npu_in], outs, 0)
        reads = [s.acquire_output_npu_data(list(o.shape), i, False) for i, o in enumerate(outs)]
        for r, o in zip(reads, outs):
            r.copy_from(o)
        residual, expert_in = reads[0][0], reads[1][0]
        top, weights = moe_golden.route(layer, expert_in)

        def run(e: int, rows: np.ndarray) -> np.ndarray:
            ex = experts[layer][e]
            x_host = ex.acquire_input_npu_data([1, len(rows), c.hidden_size], 0, False)
            x_npu = ex.acquire_input_npu_data([1, len(rows), c.hidden_size], 0, True)
            y_npu = ex.acquire_output_npu_data([1, len(rows), c.hidden_size], 0, True)
            y_host = ex.acquire_output_npu_data([1, len(rows), c.hidden_size], 0, False)
            x_host[:] = expert_in[rows][None]
            x_npu.copy_from(x_host)
            ex.infer_npu_data([x_npu], [y_npu])
            y_host.copy_from(y_npu)
            return y_host[0]

        jobs = {}
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            jobs[pool.submit(run, int(e), rows)] = (int(e), rows, slot)
        if finish_order:  # as transformers-mblt's token path: into the residual, as each expert finishes
            h = np.array(residual)
            for f in as_completed(jobs):
                _, rows, slot = jobs[f]
                h[rows] += f.result() * weights[rows, slot, None]
            continue
        out = np.zeros_like(residual)  # as the golden reference: the experts in ascending id, then the residual
        for f in sorted(jobs, key=lambda f: jobs[f][0]):
            _, rows, slot = jobs[f]
            y = f.result().astype(np.float64) * weights[rows, slot, None].astype(np.float64)
            out[rows] = (out[rows].astype(np.float64) + y.astype(np.float32)).astype(np.float32)
        h = (residual.astype(np.float64) + out).astype(np.float32)
    x = head.acquire_input_npu_data([1, 1, c.hidden_size], 0, False)
    y = head.acquire_output_npu_data([1, 1, c.vocab_size], 0, False)
    x[:] = h[-1:][None]
    head.infer_npu_data([x], [y])  # host-resident, as transformers-mblt calls its lm_head
    return np.array(y[0, 0])


def test_pieces_summed_in_expert_order_equal_golden_bit_for_bit_and_finish_order_varies(mxq_machine, moe_release, moe_golden):
    """The golden reference's sum order (ascending expert id) over the simulated pieces gives its
    logits exactly, every run. Summed in finish order (the board's; ``expert_finish_jitter_us``
    on by default), runs differ in the last bits and stay within 1e-5 of the reference."""
    shared, experts, head = _models(moe_release(packed=False), qb.Accelerator())
    ids = PROMPT * 2  # 14 tokens: within the width of 16
    ref = moe_golden.prefill(ids, moe_golden.new_cache(64))[-1]
    with ThreadPoolExecutor(max_workers=8) as pool:
        fixed = {_forward(moe_golden, shared, experts, head, ids, finish_order=False, pool=pool).tobytes() for _ in range(3)}
        assert fixed == {ref.tobytes()}
        runs = [_forward(moe_golden, shared, experts, head, ids, finish_order=True, pool=pool) for _ in range(12)]
    assert len({r.tobytes() for r in runs}) > 1, "finish order never changed the sum: the jitter is not working"
    assert max(float(np.abs(r - ref).max()) for r in runs) < 1e-5
    with pytest.raises(ValueError, match=r"expert_finish_jitter_us=-1 must be a number >= 0"):
        mxq_machine.configure(expert_finish_jitter_us=-1)


# ---------------------------------------------------------------------------------------- NPUData
def test_npu_data_residency_and_scales(mxq_machine, moe_release, moe_golden):
    c = moe_golden.config
    shared, experts, _ = _models(moe_release(packed=False), qb.Accelerator())
    e0, e1 = experts[0][0], experts[0][1]
    host = e0.acquire_input_npu_data([1, 2, c.hidden_size], 0, False)
    assert (host.shape, host.dtype, host.dev_no, host.hardware_name, len(host)) == (
        (1, 2, c.hidden_size), np.dtype(np.float32), -1, "", 1)
    host[:] = 1.5
    npu = e0.acquire_input_npu_data([1, 2, c.hidden_size], 0, True)
    assert (npu.dev_no, npu.hardware_name) == (0, "aries-rb")
    with pytest.raises(ValueError, match=r"^NPUData is not on the CPU; call cpu\(\) first\.$"):
        npu[0]
    with pytest.raises(ValueError, match=r"NPUData is not on the CPU"):
        npu[:] = 0
    npu.copy_from(host)
    npu.cpu()  # back with its own scale: the exact values
    assert float(npu[0, 0, 0]) == 1.5
    npu.launch(qb.Accelerator())
    with pytest.raises(ValueError, match=r"shape mismatch \(destination \(1, 2, 128\), source \(1, 3, 128\)\)"):
        npu.copy_from(e0.acquire_input_npu_data([1, 3, c.hidden_size], 0, False))
    with pytest.raises(ValueError, match=r"shape \[1, 2, 7\] must be \[1, T, 128\]"):
        e0.acquire_input_npu_data([1, 2, 7], 0, True)
    with pytest.raises(ValueError, match=r"output index 3 is out of range: the model has 1 output"):
        e0.acquire_output_npu_data([1, 1, c.hidden_size], 3, True)
    # a card writes raw values with the writing model's scale; a buffer acquired from another expert
    # reads back with that expert's scale, off by the ratio the host must correct
    out0 = e0.acquire_output_npu_data([1, 2, c.hidden_size], 0, True)
    e1.infer_npu_data([npu], [out0])
    back = e0.acquire_output_npu_data([1, 2, c.hidden_size], 0, False)
    back.copy_from(out0)
    own = e1.infer_npu_data([host])[0]  # host-resident: real values, returned as new NPUData
    ratio = expert_output_scale(0) / expert_output_scale(1)
    np.testing.assert_array_equal(back[:], own[:] * np.float32(ratio))
    with pytest.raises(qb.QbRuntimeError):  # never a mixed set of residencies
        e0.infer_npu_data([host], [out0])
    with pytest.raises(ValueError, match=r"outputs\[0\] has shape \(1, 3, 128\), the result \(1, 2, 128\)"):
        e0.infer_npu_data([npu], [e0.acquire_output_npu_data([1, 3, c.hidden_size], 0, True)])
    assert EXPERT_IN * e0.get_input_scale()[0].scale == 1.0


def test_npu_data_on_another_card_is_refused(mxq_machine, moe_release, moe_golden):
    mxq_machine.configure(devices=2)
    c = moe_golden.config
    root = moe_release(packed=False)
    a = qb.Model(str(root / "mxq" / "block_0_expert_0.mxq"))
    a.launch(qb.Accelerator(0))
    b = qb.Model(str(root / "mxq" / "block_0_expert_0.mxq"))
    b.launch(qb.Accelerator(1))
    x = a.acquire_input_npu_data([1, 1, c.hidden_size], 0, True)
    with pytest.raises(qb.QbRuntimeError):
        b.infer_npu_data([x], [b.acquire_output_npu_data([1, 1, c.hidden_size], 0, True)])
