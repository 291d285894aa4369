"""vllm_npu.mblt.backend / placement / dispatch against a FAKE qbruntime (fake_qbruntime.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fake_qbruntime import Cluster, Core, CoreId, QbRuntimeError, make_fake_runtime

from vllm_npu.mblt.backend import (
    BackendCapacityError,
    BackendLayout,
    MbltBackend,
    MbltBackendError,
    MbltTargetError,
    MobilintBackendAllocError,
    Row,
)
from vllm_npu.mblt.placement import resolve_targets

HIDDEN, VOCAB = 8, 16


def create(max_batch_size=1, k=1, **layout_kw):
    knobs = {key: layout_kw.pop(key) for key in list(layout_kw)
             if key not in BackendLayout.__dataclass_fields__}
    rt = make_fake_runtime(k=k, hidden=HIDDEN, vocab=VOCAB, **knobs)
    backend = MbltBackend.create(rt, "/m/model.mxq",
                                 BackendLayout(max_batch_size=max_batch_size, **layout_kw))
    return rt, backend


def row(model_idx, cache_id, value, n_tokens=1, cache_size=0):
    """A row whose token t has embedding value ``value + t`` (fake logits[0] == that)."""
    embeds = (value + np.arange(n_tokens, dtype=np.float32))[:, None].repeat(HIDDEN, axis=1)
    return Row(model_idx, cache_id, embeds, cache_size)


# ---------------------------------------------------------------------- targets
def test_single_mode_expands_every_core_of_every_device():
    p = resolve_targets((0, 1), "single", None, None, "aries")
    assert len(p.cores) == 16
    assert p.cores_for(1) == tuple((c, k) for c in range(2) for k in range(4))
    assert p.cores[0] == (0, 0, 0) and p.cores[-1] == (1, 1, 3)


@pytest.mark.parametrize("mode", ["auto", "multi", "global4", "global8"])
def test_other_modes_expand_clusters(mode):
    p = resolve_targets((3,), mode, None, None, "aries")
    assert p.clusters == ((3, 0), (3, 1)) and p.cores == ()


def test_regulus_is_one_core():
    assert resolve_targets((0,), "single", None, None, "regulus-ra").cores == ((0, 0, 0),)
    with pytest.raises(MbltTargetError, match="Regulus supports auto and single only"):
        resolve_targets((0,), "global4", None, None, "regulus-rb")


def test_explicit_targets_must_cover_exactly_dev_no():
    p = resolve_targets((0, 1), "single", ("1:0:2", "0:1:3"), None, "aries")
    assert p.cores == ((0, 1, 3), (1, 0, 2))
    with pytest.raises(MbltTargetError, match=r"target device set \[0\] does not match dev_no \[0, 1\]"):
        resolve_targets((0, 1), "multi", None, ("0:0", "0:1"), "aries")


@pytest.mark.parametrize(("cores", "clusters", "mode", "match"), [
    (None, ("0:2",), "multi", "outside"),
    (("0:0:4",), None, "single", "outside"),
    (("0:0",), None, "single", "canonical"),
    (("0:0:0", "0:0:0"), None, "single", "duplicate"),
    (("0:0:0",), None, "multi", "cannot be used with core_mode='multi'"),
    (None, ("0:0",), "global8", r"requires both clusters for device 0; got clusters \[0\]"),
])
def test_bad_targets_name_the_value(cores, clusters, mode, match):
    with pytest.raises(MbltTargetError, match=match):
        resolve_targets((0,), mode, cores, clusters, "aries")


def test_layout_validation():
    with pytest.raises(ValueError, match=r"dev_no must be distinct.*\[0, 0\]"):
        BackendLayout(dev_no=(0, 0))
    with pytest.raises(ValueError, match="core_mode='dual'"):
        BackendLayout(core_mode="dual")
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 0"):
        BackendLayout(max_batch_size=0)
    assert BackendLayout(dev_no=[0, 1]).dev_no == (0, 1)


# ---------------------------------------------------------------------- creation
@pytest.mark.parametrize(("k", "mbs", "n_models"), [
    (1, 1, 1), (1, 2, 2), (1, 5, 5), (1, 8, 8), (4, 1, 1), (4, 2, 1), (4, 5, 2), (4, 8, 2),
])
def test_n_models_is_ceil_of_batch_over_k(k, mbs, n_models):
    rt, b = create(max_batch_size=mbs, k=k)
    assert len(b.models) == n_models and b.k_per_model == k
    assert b.capacity == n_models * k >= mbs
    assert all(m.launched and not m.disposed for m in b.models)


def test_k_is_one_without_cache_infos():
    _, b = create(max_batch_size=3, k=4, no_cache_infos=True)
    assert b.k_per_model == 1 and len(b.models) == 3


def test_models_round_robin_over_devices_with_one_accelerator_each():
    rt, b = create(max_batch_size=5, dev_no=(0, 1))
    assert b.model_dev_no == [0, 1, 0, 1, 0]
    assert rt.state.accelerators == [("aries", 0), ("aries", 1)]
    assert [b.accelerators[d] for d in b.model_dev_no] == [m.acc for m in b.models]


def test_metadata_comes_from_the_mxq():
    rt, b = create(max_batch_size=4, k=4, n_layers=3, layer_bytes=100)
    assert (b.hidden_size, b.vocab_size, b.max_width, b.max_cache_size) == (HIDDEN, VOCAB, 128, 1024)
    assert b.kv_nbytes_per_cache == 300
    assert b.output_layout == "last"


@pytest.mark.parametrize(("k", "out_width", "out_max_width", "want"), [
    (1, 1, None, "last"), (1, -1, None, "all"), (4, -1, 128, "all"), (4, -1, 4, "last"),
    (4, -1, 256, "unknown"),
])
def test_output_layout_probe(k, out_width, out_max_width, want):
    _, b = create(max_batch_size=k, k=k, out_width=out_width, out_max_width=out_max_width)
    assert b.output_layout == want


def calls(model):
    return model.config.calls


def test_single_mode_instances_on_one_device_get_distinct_cores():
    rt, b = create(max_batch_size=3, core_mode="single")
    assert [calls(m) for m in b.models] == [
        [("set_single_core_mode", (None, [CoreId(Cluster.Cluster0, core)]))]
        for core in (Core.Core0, Core.Core1, Core.Core2)]
    cores = [calls(m)[0][1][1][0] for m in b.models]
    assert len(set(cores)) == 3
    # slot 0 was first built alone on its device (K unknown) and rebuilt with its own core
    assert rt.state.models[0].disposed and calls(rt.state.models[0])[0][1][1] == [
        CoreId(c, k) for c in Cluster for k in Core]


def test_single_mode_alone_on_device_gets_all_its_target_cores():
    rt, b = create(max_batch_size=2, dev_no=(0, 1), core_mode="single",
                   target_cores=("0:1:2", "0:1:3", "1:0:0"))
    assert [calls(m) for m in b.models] == [
        [("set_single_core_mode", (None, [CoreId(Cluster.Cluster1, Core.Core2),
                                          CoreId(Cluster.Cluster1, Core.Core3)]))],
        [("set_single_core_mode", (None, [CoreId(Cluster.Cluster0, Core.Core0)]))],
    ]
    assert len(rt.state.models) == 2


@pytest.mark.parametrize(("mode", "expected"), [
    ("auto", [("set_auto_core_mode", ())]),
    ("multi", [("set_multi_core_mode", ([Cluster.Cluster0, Cluster.Cluster1],))]),
    ("global4", [("set_global4_core_mode", ([Cluster.Cluster1],))]),
    ("global8", [("set_global8_core_mode", ())]),
])
def test_cluster_modes_config_per_slot(mode, expected):
    clusters = ("0:1", "1:1") if mode == "global4" else None
    _, b = create(max_batch_size=2, dev_no=(0, 1), core_mode=mode, target_clusters=clusters)
    assert [calls(m) for m in b.models] == [expected, expected]


def test_badalloc_at_launch_of_slot_2_disposes_everything():
    err = QbRuntimeError("Bad Alloc occurred.\nPlease visit https://docs.mobilint.com")
    rt = make_fake_runtime(k=1, fail={("launch", 2): err})
    with pytest.raises(MobilintBackendAllocError) as info:
        MbltBackend.create(rt, "m.mxq", BackendLayout(dev_no=(0, 1), max_batch_size=4))
    e = info.value
    assert (e.phase, e.slot, e.dev, e.succeeded_so_far, e.n_total, e.max_batch_size,
            e.k_per_model) == ("launch", 2, 0, 2, 4, 4, 1)
    assert e.original is err and e.__cause__ is err
    for text in ("launch", "slot 2", "succeeded_so_far=2", "n_total=4", "max_batch_size=4",
                 "k_per_model=1", "Lower max_batch_size", "more cards"):
        assert text in str(e)
    assert len(rt.state.models) == 3 and all(m.disposed for m in rt.state.models)


def test_badalloc_during_probe():
    rt = make_fake_runtime(fail={("probe", 0): QbRuntimeError("BadAlloc: x")})
    with pytest.raises(MobilintBackendAllocError) as info:
        MbltBackend.create(rt, "m.mxq", BackendLayout(max_batch_size=2))
    assert (info.value.phase, info.value.slot, info.value.n_total, info.value.k_per_model) == (
        "probe_k_per_model", 0, None, None)
    assert rt.state.models[0].disposed


def test_other_qbruntime_error_is_reraised_unchanged(capsys):
    err = QbRuntimeError("Model_FailedToLoadMXQ occurred.")
    rt = make_fake_runtime(fail={("create", 1): err})
    with pytest.raises(QbRuntimeError) as info:
        MbltBackend.create(rt, "m.mxq", BackendLayout(max_batch_size=3))
    assert info.value is err and type(info.value) is QbRuntimeError
    line = capsys.readouterr().err
    assert line.startswith("[Mobilint] NPU backend create failed at slot 1")
    assert line.rstrip().endswith("re-raising qbruntime error unchanged.")
    # ordinal 1's constructor raised, so no object of it reached the backend
    assert len(rt.state.models) == 2 and rt.state.models[0].disposed


def test_capacity_check(monkeypatch):
    import vllm_npu.mblt.backend as backend_mod

    monkeypatch.setattr(backend_mod.math, "ceil", lambda x: 1)  # under-provision on purpose
    rt = make_fake_runtime(k=2)
    with pytest.raises(BackendCapacityError, match=r"capacity is smaller than the vLLM scheduler "
                                                   r"capacity: backend_capacity=2, max_batch_size=3"):
        MbltBackend.create(rt, "m.mxq", BackendLayout(max_batch_size=3))
    assert all(m.disposed for m in rt.state.models)


def test_slot_of():
    _, b = create(max_batch_size=8, k=4)
    assert [b.slot_of(s) for s in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    for bad in (8, -1):
        with pytest.raises(MbltBackendError, match=rf"exceeds the loaded multi-card capacity: "
                                                   rf"cache_id={bad}, models=2, k_per_model=4"):
            b.slot_of(bad)


def test_dispose_is_idempotent_and_stops_the_pool():
    _, b = create(max_batch_size=2)
    b.infer_rows([row(0, 0, 1.0), row(1, 0, 2.0)])
    pool = b._pool
    b.dispose()
    b.dispose()
    assert all(m.disposed for m in b.models) and pool._shutdown
    with pytest.raises(MbltBackendError, match="disposed"):
        b.infer_rows([row(0, 0, 1.0)])


# ---------------------------------------------------------------------- dispatch
def test_batch_form_one_infer_per_model_rows_in_caller_order():
    rt, b = create(max_batch_size=8, k=4, dev_no=(0, 1), barrier=threading.Barrier(2, timeout=5))
    rows = [row(1, 2, 10.0, 3, cache_size=7), row(0, 1, 20.0, 2, cache_size=5),
            row(1, 0, 30.0, 1, cache_size=0), row(0, 3, 40.0, 4, cache_size=9)]
    out = b.infer_rows(rows)
    assert [o.shape for o in out] == [(VOCAB,)] * 4
    # last token of each row: value + T - 1
    np.testing.assert_allclose([o[0] for o in out], [12.0, 21.0, 30.0, 43.0])
    np.testing.assert_allclose(out[0][1] - out[0][0], 0.001, rtol=1e-3)
    by_model = {c["model"]: c for c in rt.state.infer_calls}
    assert len(rt.state.infer_calls) == 2
    assert by_model[1]["params"] == [rt.BatchParam(3, 7, 2), rt.BatchParam(1, 0, 0)]
    assert by_model[0]["params"] == [rt.BatchParam(2, 5, 1), rt.BatchParam(4, 9, 3)]
    assert by_model[1]["shape"] == (1, 1, 4, HIDDEN) and by_model[0]["shape"] == (1, 1, 6, HIDDEN)
    assert all(c["dtype"] == np.float32 and c["cache_size"] == 0 for c in rt.state.infer_calls)
    # both waited on a 2-party barrier: they ran at the same time, on the pool's threads
    assert {c["thread"].split("_")[0] for c in rt.state.infer_calls} == {"mblt-slot"}
    assert len({c["thread"] for c in rt.state.infer_calls}) == 2


def test_one_model_runs_on_the_calling_thread():
    rt, b = create(max_batch_size=4, k=4)
    b.infer_rows([row(0, 1, 1.0), row(0, 0, 2.0)])
    assert rt.state.infer_calls[0]["thread"] == threading.current_thread().name
    assert b._pool is None


def test_all_layout_returns_every_token():
    _, b = create(max_batch_size=8, k=4, out_width=-1)
    assert b.output_layout == "all"
    out = b.infer_rows([row(1, 0, 5.0, 2), row(0, 0, 1.0, 3)])
    assert [o.shape for o in out] == [(2, VOCAB), (3, VOCAB)]
    np.testing.assert_allclose(out[1][:, 0], [1.0, 2.0, 3.0])
    np.testing.assert_allclose(out[0][:, 0], [5.0, 6.0])


def test_unknown_layout_is_pinned_by_row_count():
    _, b = create(max_batch_size=4, k=4, out_width=-1, out_max_width=256)
    assert b.output_layout == "unknown"
    out = b.infer_rows([row(0, 0, 1.0), row(0, 1, 2.0)])  # ambiguous: one token each
    assert [o.shape for o in out] == [(VOCAB,), (VOCAB,)] and b.output_layout == "unknown"
    out = b.infer_rows([row(0, 0, 1.0, 3)])
    assert b.output_layout == "all" and out[0].shape == (3, VOCAB)


def test_non_batch_form_for_k1():
    rt, b = create(max_batch_size=2, k=1, dev_no=(0, 1))
    out = b.infer_rows([row(1, 0, 4.0, 3, cache_size=11), row(0, 0, 9.0, 1, cache_size=2)])
    np.testing.assert_allclose([o[0] for o in out], [6.0, 9.0])
    by_model = {c["model"]: c for c in rt.state.infer_calls}
    assert by_model[1]["params"] is None and by_model[1]["cache_size"] == 11
    assert by_model[0]["params"] is None and by_model[0]["cache_size"] == 2
    assert by_model[1]["shape"] == (1, 1, 3, HIDDEN)


def test_two_rows_on_a_k1_model_are_refused():
    rt, b = create(max_batch_size=2, k=1)
    with pytest.raises(MbltBackendError, match="2 rows on model_idx=0.*k_per_model=1"):
        b.infer_rows([row(0, 0, 1.0), Row(0, 0, np.ones((1, HIDDEN)), 0)])
    assert rt.state.infer_calls == []


@pytest.mark.parametrize(("rows", "match"), [
    ([(0, 0), (0, 0)], r"same slot \(model_idx=0, cache_id=0\)"),
    ([(2, 0)], r"model_idx=2, cache_id=0\) is outside"),
    ([(0, 4)], r"model_idx=0, cache_id=4\) is outside"),
])
def test_bad_slots_are_refused(rows, match):
    _, b = create(max_batch_size=8, k=4)
    with pytest.raises(MbltBackendError, match=match):
        b.infer_rows([row(m, c, 1.0) for m, c in rows])


def test_hidden_mismatch_is_refused():
    _, b = create(max_batch_size=4, k=4)
    with pytest.raises(MbltBackendError, match="hidden size 5 does not match the MXQ's hidden size 8"):
        b.infer_rows([Row(0, 0, np.ones((2, 5)), 0)])


def test_row_validation():
    with pytest.raises(ValueError, match=r"T >= 1, got shape \(0, 8\)"):
        Row(0, 0, np.ones((0, 8)), 0)
    with pytest.raises(ValueError, match="cache_size must be a non-negative int, got -1"):
        Row(0, 0, np.ones((1, 8)), -1)


def test_wrong_output_row_count_is_reported():
    _, b = create(max_batch_size=4, k=4, wrong_rows=1)
    with pytest.raises(MbltBackendError, match=r"Unexpected batched MXQ output row count 1 "
                                               r"\(vocab=16, raw size=16\) for active=2, "
                                               r"total_tokens=5: expected 2 \(per-item last row\) "
                                               r"or 5 \(per-token flat\).*batch 1"):
        b.infer_rows([row(0, 0, 1.0, 2), row(0, 1, 1.0, 3)])


def test_infer_error_propagates_unchanged_after_all_finish():
    err = QbRuntimeError("Model_CacheOverflow occurred.")
    rt, b = create(max_batch_size=3, k=1, fail={("infer", 1): err})
    with pytest.raises(QbRuntimeError) as info:
        b.infer_rows([row(0, 0, 1.0), row(1, 0, 2.0), row(2, 0, 3.0)])
    assert info.value is err
    assert sorted(c["model"] for c in rt.state.infer_calls) == [0, 1, 2]


def test_dump_and_load_round_trip():
    rt, b = create(max_batch_size=8, k=4, n_layers=2, layer_bytes=4)
    blobs = [b"abcd", b"efgh"]
    b.load(1, 3, blobs)
    assert b.dump(1, 3) == blobs
    assert b.dump(0, 3) == [bytes(4), bytes(4)]
    with pytest.raises(MbltBackendError, match="cache_id=4"):
        b.dump(0, 4)
