"""vllm_npu.mblt.moe_backend: the MBLT plugin's host side of a Mixture-of-Experts release, on
npusim.mxq (the runtime API only; no vLLM process here, test_mblt_moe_serve.py starts one).

Reference: the golden decoder. Summed in ascending expert id (``expert_sum_order: "expert"``)
the backend's logits equal the golden decoder's bit for bit, in prefill and decode; summed in
finish order (the default, the board's) they stay within 1e-5 and vary run to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.llm import Decoder
from vllm_npu.mblt.dispatch import Row
from vllm_npu.mblt.moe_backend import MoeBackend, MoePlacement, MoeRelease, MoeReleaseError
from vllm_npu.mblt.settings import MbltConfigError

PROMPT = [(13 * i + 7) % 1000 + 1 for i in range(20)]


@pytest.fixture
def machine(monkeypatch):
    """A fresh simulated machine of 3 cards (the release's placement), reset afterwards."""
    from npusim.mxq import machine as m

    monkeypatch.delenv(m.ENV_VAR, raising=False)
    m.reset()
    m.configure(devices=3)
    yield m
    m.reset()


def _backend(root: Path, **extra: Any) -> MoeBackend:
    artifact = json.loads((root / "config.json").read_text())
    return MoeBackend.create(qb, root, artifact, MoePlacement.resolve(artifact, extra))


def _run(backend: MoeBackend, moe_golden: Decoder, ids: list[int], n_new: int) -> list[np.ndarray]:
    """Prefill ``ids`` in pieces of the backend's width, then ``n_new`` greedy decode steps; the
    logits of each step."""
    x = moe_golden.embed(ids)
    out = []
    for start in range(0, len(ids), backend.max_width):
        out.append(backend.infer_rows([Row(0, 0, x[start : start + backend.max_width], start)])[0])
    pos = len(ids)
    for _ in range(n_new):
        tok = int(np.argmax(out[-1]))
        out.append(backend.infer_rows([Row(0, 0, moe_golden.embed([tok]), pos)])[0])
        pos += 1
    return out


def _golden_steps(moe_golden: Decoder, ids: list[int], n_new: int, width: int) -> list[np.ndarray]:
    cache = moe_golden.new_cache(128)
    out = [moe_golden.prefill(ids[s : s + width], cache)[-1] for s in range(0, len(ids), width)]
    for _ in range(n_new):
        out.append(moe_golden.prefill([int(np.argmax(out[-1]))], cache)[-1])
    return out


def test_expert_order_equals_golden_bit_for_bit_every_run(machine, moe_release, moe_golden):
    """Fixing the order restores determinism: three runs, each equal to the golden decoder to the bit
    (the simulated experts still finish in a varying order: ``expert_finish_jitter_us`` is on)."""
    backend = _backend(moe_release(), expert_sum_order="expert")
    try:
        want = [w.tobytes() for w in _golden_steps(moe_golden, PROMPT, 6, backend.max_width)]
        for _ in range(3):
            assert [g.tobytes() for g in _run(backend, moe_golden, PROMPT, 6)] == want
    finally:
        backend.dispose()


def test_a_last_only_final_layer_gives_the_same_logits(machine, moe_release, moe_golden):
    """A release whose final shared MXQ emits only the last token (the seed: "the last layer only
    emits the last token's hidden state"): the experts and the lm_head then see that row alone."""
    backend = _backend(moe_release(last_only=True), expert_sum_order="expert")
    try:
        assert [layer.last_only for layer in backend.layers] == [False, True]
        want = [w.tobytes() for w in _golden_steps(moe_golden, PROMPT, 4, backend.max_width)]
        assert [g.tobytes() for g in _run(backend, moe_golden, PROMPT, 4)] == want
    finally:
        backend.dispose()


def test_finish_order_is_close_to_golden_and_varies_run_to_run(machine, moe_release, moe_golden):
    backend = _backend(moe_release())
    assert backend.placement.sum_order == "finish"  # the default
    try:
        runs = [_run(backend, moe_golden, PROMPT, 4) for _ in range(5)]
    finally:
        backend.dispose()
    want = _golden_steps(moe_golden, PROMPT, 4, 16)
    for run in runs:
        assert max(float(np.abs(g - w).max()) for g, w in zip(run, want)) < 1e-5
    assert len({b"".join(s.tobytes() for s in run) for run in runs}) > 1


def test_placement_from_the_release_and_overrides(machine, moe_release):
    backend = _backend(moe_release())
    try:
        shared = [layer.shared for layer in backend.layers]
        assert [m._dev_no for m in shared] == [0, 1]
        assert [m._dev_no for m in backend.layers[0].experts] == [e % 3 for e in range(8)]
        assert backend.lm_head._dev_no == 2 and len(backend.layers[0].experts[0].get_target_cores()) == 8
    finally:
        backend.dispose()
    backend = _backend(moe_release(), lm_head_target_cores=["1:1:2"], shared_target_cores=["0:0:3"],
                       expert_target_cores=["0:0:0", "0:0:1"], num_expert_workers=2)
    try:
        assert backend.lm_head._dev_no == 1 and str(backend.lm_head.get_target_cores()[0]).endswith("Core2)")
        assert {m._dev_no for layer in backend.layers for m in (layer.shared, *layer.experts)} == {0}
        assert backend.placement.num_expert_workers == 2
    finally:
        backend.dispose()


def test_a_snapshot_holds_every_layer_and_restores_exactly(machine, moe_release, moe_golden):
    backend = _backend(moe_release(), expert_sum_order="expert")
    try:
        assert backend.kv_nbytes_per_cache == sum(
            i.size for layer in backend.layers for i in layer.shared.get_cache_infos())
        assert len(backend.layers) == 2 and backend.kv_nbytes_per_cache == 2 * backend.layers[0].shared.get_cache_infos()[0].size
        x = moe_golden.embed(PROMPT[:10])
        backend.infer_rows([Row(0, 0, x, 0)])
        snap = backend.dump(0, 0)
        assert len(snap) == 2
        nxt = moe_golden.embed([PROMPT[10]])
        first = backend.infer_rows([Row(0, 0, nxt, 10)])[0]
        backend.infer_rows([Row(0, 0, moe_golden.embed(PROMPT[:10]) * 0.5, 0)])  # another sequence overwrites
        backend.load(0, 0, snap)
        assert backend.infer_rows([Row(0, 0, nxt, 10)])[0].tobytes() == first.tobytes()
        with pytest.raises(Exception, match=r"1 KV blobs for a release whose shared MXQs hold 2"):
            backend.load(0, 0, snap[:1])
        with pytest.raises(Exception, match=r"Mixture-of-Experts release runs one sequence"):
            backend.infer_rows([Row(0, 0, x, 0), Row(0, 0, x, 0)])
        with pytest.raises(Exception, match=r"slot 1 does not exist"):
            backend.slot_of(1)
    finally:
        backend.dispose()


@pytest.mark.parametrize(("extra", "message"), [
    ({"lm_head_target_cores": ["0:0:0", "1:0:0"]}, r"must cover exactly one device, got devices \[0, 1\]"),
    ({"shared_target_cores": ["0:2:0"]}, r"cores must be distinct, cluster 0-1 and core 0-3"),
    ({"expert_target_cores": []}, r"expert_target_cores=\[\] must be a non-empty list"),
    ({"expert_core_mode": "multi"}, r"expert_core_mode='multi': .* only 'single'"),
    ({"shared_dev_no": 1}, r"shared_dev_no=1: Mixture-of-Experts roles are placed on cores only"),
    ({"num_expert_workers": 0}, r"num_expert_workers=0 must be an int >= 1"),
    ({"expert_sum_order": "random"}, r"expert_sum_order='random' must be one of finish, expert"),
])
def test_bad_placement_keys_are_refused(moe_release, extra, message):
    artifact = json.loads((moe_release() / "config.json").read_text())
    with pytest.raises(MbltConfigError, match=message):
        MoePlacement.resolve(artifact, extra)


def test_broken_releases_are_refused_naming_the_file(moe_release, tmp_path):
    import shutil

    root = tmp_path / "rel"
    shutil.copytree(moe_release(), root)
    artifact = json.loads((root / "config.json").read_text())
    index = json.loads((root / "mxq" / "index.json").read_text())
    pack = root / "mxq" / "block_1.mxqpack"
    pack.write_bytes(pack.read_bytes()[:-1])
    with pytest.raises(MoeReleaseError, match=r"block_1\.mxqpack is \d+ bytes but its index describes \d+ bytes"):
        MoeRelease(root, artifact)
    (root / "mxq" / "index.json").write_text(json.dumps({**index, "version": 2}))
    with pytest.raises(MoeReleaseError, match=r"is not a mobilint-moe-mxqpack v1 index"):
        MoeRelease(root, artifact)
    (root / "mxq" / "index.json").write_text(json.dumps({**index, "sizes": index["sizes"][:1]}))
    with pytest.raises(MoeReleaseError, match=r"sizes must hold 2 rows of 9 sizes"):
        MoeRelease(root, artifact)
    with pytest.raises(MoeReleaseError, match=r"needs moe_mxq_pack_index, or both shared_mxq_path"):
        MoeRelease(root, {k: v for k, v in artifact.items() if k != "moe_mxq_pack_index"})


def test_output_roles_from_scales_or_the_declared_order(machine, moe_release, moe_golden):
    for options in ({"shared_output_order": ["gate", "expert_in", "residual"]},
                    {"shared_output_order": ["expert_in", "residual", "gate"], "declare_output_order": True}):
        backend = _backend(moe_release(**options), expert_sum_order="expert")
        try:
            order = options["shared_output_order"]
            layer = backend.layers[0]
            assert (layer.residual, layer.expert_in, layer.gate) == tuple(order.index(r) for r in ("residual", "expert_in", "gate"))
            got = backend.infer_rows([Row(0, 0, moe_golden.embed(PROMPT[:8]), 0)])[0]
            assert got.tobytes() == moe_golden.prefill(PROMPT[:8], moe_golden.new_cache(16))[-1].tobytes()
        finally:
            backend.dispose()
