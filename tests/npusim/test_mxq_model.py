"""npusim.mxq.Model: logits equal the golden decoder's, KV addressing by cache id and
cache_size, every infer/dump/load error text, failed calls change nothing, poison."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.mxq import BatchParam, QbRuntimeError

T, W, K = 64, 16, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 256, n)]


def _golden(dec, ids: list[int]) -> np.ndarray:
    """Golden logits [len, vocab] of ``ids`` from an empty cache."""
    return dec.prefill(ids, dec.new_cache(T))


def _x(dec, ids: list[int], rank: int = 4) -> np.ndarray:
    e = dec.embed(ids).astype(np.float32)
    return e[None, None] if rank == 4 else e[None]


@pytest.fixture
def launched(mxq_machine, mxq_artifact):
    """``launched(**compile_kwargs) -> Model`` launched on a fresh Accelerator (disposed after)."""
    models = []

    def make(**kw):
        m = qb.Model(str(mxq_artifact(**kw)))
        m.launch(qb.Accelerator())
        models.append(m)
        return m

    yield make
    for m in models:
        m.dispose()


def _status(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value).split(" occurred.")[0]


# ---------------------------------------------------------------- numerics

def test_one_shot_prefill_matches_golden_last_row(launched, mxq_golden):
    m = launched()
    ids = _ids(12)
    [out] = m.infer([_x(mxq_golden, ids)], None, 0)
    assert out.shape == (1, 1, 1, 256) and out.dtype == np.float32
    np.testing.assert_allclose(out[0, 0, 0], _golden(mxq_golden, ids)[-1], **TOL)


def test_full_logits_artifact_returns_every_row(launched, mxq_golden):
    m = launched(output_logits="all")
    ids = _ids(9)
    [out] = m.infer([_x(mxq_golden, ids, rank=3)], None, 0)
    assert out.shape == (1, 9, 256)
    np.testing.assert_allclose(out[0], _golden(mxq_golden, ids), **TOL)


def test_chunked_prefill_and_decode_match_golden(launched, mxq_golden):
    m = launched(output_logits="all")
    ids = _ids(30, seed=1)
    ref = _golden(mxq_golden, ids)
    pos = 0
    for n in (16, 10, 1, 1, 1, 1):  # two prefill chunks, then decode steps
        [out] = m.infer([_x(mxq_golden, ids[pos : pos + n])], None, pos)
        np.testing.assert_allclose(out[0, 0], ref[pos : pos + n], **TOL)
        pos += n
    assert pos == 30


def test_batch_infer_three_cache_ids_equals_each_alone(launched, mxq_golden):
    m = launched(max_batch_size=K)
    seqs = {0: _ids(5, 10), 1: _ids(9, 11), 2: _ids(3, 12)}
    # prefill each cache id to a different length first (one call, three items)
    pre = {0: 4, 1: 7, 2: 1}
    x = np.concatenate([_x(mxq_golden, seqs[c][: pre[c]], 3) for c in (2, 0, 1)], axis=1)
    [out] = m.infer([x], None, 0, [BatchParam(pre[c], 0, c) for c in (2, 0, 1)])
    assert out.shape == (1, 3, 256)
    for row, c in enumerate((2, 0, 1)):
        np.testing.assert_allclose(out[0, row], _golden(mxq_golden, seqs[c][: pre[c]])[-1], **TOL)
    # then the rest of every sequence in one call, each at its own cache_size
    rest = {c: seqs[c][pre[c] :] for c in seqs}
    x = np.concatenate([_x(mxq_golden, rest[c], 3) for c in (0, 1, 2)], axis=1)
    [out] = m.infer([x], None, 0, [BatchParam(len(rest[c]), pre[c], c) for c in (0, 1, 2)])
    for row, c in enumerate((0, 1, 2)):
        np.testing.assert_allclose(out[0, row], _golden(mxq_golden, seqs[c])[-1], **TOL)


def test_rewind_overwrites_from_cache_size(launched, mxq_golden):
    m = launched()
    a, b = _ids(10, 20), _ids(4, 21)
    m.infer([_x(mxq_golden, a)], None, 0)
    # rewind to 6: the sequence is now a[:6] + b
    [out] = m.infer([_x(mxq_golden, b)], None, 6)
    np.testing.assert_allclose(out[0, 0, 0], _golden(mxq_golden, a[:6] + b)[-1], **TOL)


def test_poison_attending_never_written_kv_gives_nan(launched, mxq_golden):
    m = launched()
    [out] = m.infer([_x(mxq_golden, _ids(2))], None, 5)
    assert np.isnan(out).all()
    blob = np.frombuffer(m.dump_cache_memory(0)[0], np.float32)
    assert np.isnan(blob).sum() == blob.size - 2 * 2 * 2 * 32  # positions 5, 6 written (K and V, 2 heads)


def test_dump_load_moves_a_sequence_between_cache_ids_and_models(launched, mxq_golden):
    m1, m2 = launched(max_batch_size=K), launched(max_batch_size=K)
    ids = _ids(14, 30)
    m1.infer([_x(mxq_golden, ids[:12], 3)], None, 0, [BatchParam(12, 0, 2)])
    blobs = m1.dump_cache_memory(2)
    infos = m1.get_cache_infos()
    assert [len(b) for b in blobs] == [i.size for i in infos] and len(blobs) == 2
    m1.load_cache_memory(blobs, 0)
    m2.load_cache_memory(blobs, 1)
    assert m1.dump_cache_memory(0) == blobs and m2.dump_cache_memory(1) == blobs  # exact, poison included
    ref = _golden(mxq_golden, ids)[-1]
    [o1] = m1.infer([_x(mxq_golden, ids[12:], 3)], None, 0, [BatchParam(2, 12, 0)])
    [o2] = m2.infer([_x(mxq_golden, ids[12:], 3)], None, 0, [BatchParam(2, 12, 1)])
    np.testing.assert_allclose(o1[0, 0], ref, **TOL)
    np.testing.assert_allclose(o2[0, 0], ref, **TOL)


def test_dump_to_and_load_from_directory(launched, mxq_golden, tmp_path):
    m = launched()
    m.infer([_x(mxq_golden, _ids(6))], None, 0)
    m.dump_cache_memory_to(tmp_path, 0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"cache_{i.layer_hash}.bin" for i in m.get_cache_infos())
    before = m.dump_cache_memory(0)
    m.infer([_x(mxq_golden, _ids(6, 1))], None, 0)
    assert m.dump_cache_memory(0) != before
    m.load_cache_memory_from(tmp_path, 0)
    assert m.dump_cache_memory(0) == before


def test_preallocated_outputs_are_written(launched, mxq_golden):
    m = launched()
    ids = _ids(5)
    buf = np.zeros((1, 1, 256), np.float32)
    assert m.infer([_x(mxq_golden, ids, 3)], [buf], 0) is None
    np.testing.assert_allclose(buf[0, 0], _golden(mxq_golden, ids)[-1], **TOL)


# ---------------------------------------------------------------- metadata

def test_shapes_buffer_and_cache_infos_before_launch(mxq_machine, mxq_artifact):
    single = qb.Model(str(mxq_artifact()))
    assert single.get_model_input_shape() == [(1, -1, 128)]
    assert single.get_model_output_shape() == [(1, 1, 256)]
    ib, ob = single.get_input_buffer_info()[0], single.get_output_buffer_info()[0]
    assert (ib.max_width, ib.max_cache_size, ob.max_width) == (W, T, 1)
    assert ib.shape() == (1, W, 128) and ib.size() == W * 128
    infos = single.get_cache_infos()
    assert [(i.name, i.cache_type, i.num_batches, i.size) for i in infos] == [
        (f"layer{n}.kv", qb.CacheType.Default, 1, 2 * 2 * T * 32 * 4) for n in range(2)]
    batch = qb.Model(str(mxq_artifact(max_batch_size=K)))
    assert batch.get_model_output_shape() == [(1, -1, 256)]
    assert batch.get_output_buffer_info()[0].max_width == K
    assert {i.cache_type for i in batch.get_cache_infos()} == {qb.CacheType.Batch}
    assert batch.get_cache_infos()[0].num_batches == K
    full = qb.Model(str(mxq_artifact(output_logits="all")))
    assert full.get_model_output_shape() == [(1, -1, 256)] and full.get_output_buffer_info()[0].max_width == W
    again = qb.Model(str(mxq_artifact()))
    assert [i.layer_hash for i in again.get_cache_infos()] == [i.layer_hash for i in infos]
    assert single.get_num_model_variants() == 1
    h = single.get_model_variant_handle(0)
    assert h.get_variant_idx() == 0 and h.get_model_input_shape() == [(1, -1, 128)]
    assert h.get_model_output_shape() == [(1, 1, 256)]
    # as the real core: a bad variant index is a QbRuntimeError, data types are one DataType
    with pytest.raises(qb.QbRuntimeError) as exc:
        single.get_model_variant_handle(1)
    assert exc.value.status == "Model_InvalidVariantIdx"
    assert single.get_model_input_data_type() == qb.DataType.Float32 == single.get_model_output_data_type()


def test_load_creates_an_accelerator_and_launches(mxq_machine, mxq_artifact):
    """``qbruntime.load`` declares the Accelerator, the Model and launches, in one step."""
    m = qb.load(str(mxq_artifact()))
    assert m.get_device_names() == ["aries-rb"] and m.get_target_cores()
    m.dispose()


def test_lifecycle_weakref_identity_and_launch_twice(mxq_machine, mxq_artifact, glog):
    m = qb.Model(str(mxq_artifact()))
    ref = weakref.ref(m)
    other = qb.Model(str(mxq_artifact()))
    assert ref() is m and hash(m) == object.__hash__(m) and m != other and len({m, other}) == 2
    acc = qb.Accelerator()
    assert not hasattr(m, "_acc")  # as qbruntime's Python layer: set by launch, None after dispose
    m.launch(acc)
    assert m._acc is acc and m.get_device_names() == ["aries-rb"]
    assert m.get_core_mode() == qb.CoreMode.Single and len(m.get_target_cores()) == 1
    glog()
    with pytest.raises(QbRuntimeError) as exc:
        m.launch(acc)
    assert _status(exc) == "Model_AlreadyLaunched" and exc.value.status == "Model_AlreadyLaunched"
    glog()
    m.dispose()
    m.dispose()
    assert m._acc is None
    with pytest.raises(QbRuntimeError) as exc:
        m.infer([np.zeros((1, 1, 128), np.float32)])
    assert _status(exc) == "Model_NotLaunched"
    assert glog() == ["Model is not launched. Call `launch` first."]


# ---------------------------------------------------------------- errors

def _state(m: qb.Model, cache_ids=(0,)) -> list[list[bytes]]:
    return [m.dump_cache_memory(c) for c in cache_ids]


@pytest.mark.parametrize(
    ("n", "cache_size", "status", "detail"),
    [(17, 0, "Model_ShapeMismatched", "Sequence length of inputs[0] exceeds maximum value (17 > 16)"),
     (10, 55, "Model_CacheOverflow", "Sum of sequence length and cache size exceeds max cache size (65 > 64)")],
)
def test_non_batch_limits(launched, mxq_golden, glog, n, cache_size, status, detail):
    m = launched()
    m.infer([_x(mxq_golden, _ids(8))], None, 0)
    before = _state(m)
    glog()
    with pytest.raises(QbRuntimeError) as exc:
        m.infer([_x(mxq_golden, _ids(n))], None, cache_size)
    assert _status(exc) == status
    assert glog() == [detail]
    assert _state(m) == before


@pytest.mark.parametrize(
    ("params", "n", "detail"),
    [([BatchParam(1, 0, 0)] * 4, 4, "Batch size exceeds maximum value (4 > 3)"),
     ([BatchParam(2, 0, 3)], 2, "Cache Id exceeds maximum value (3 > 2)"),
     ([BatchParam(2, 0, 1), BatchParam(2, 0, 1)], 4,
      "Duplicated `cache_id` is detected (`cache_id` = 1). Please ensure that no duplicate `cache_id` exist across batches."),
     ([BatchParam(2, 0, 0), BatchParam(3, 0, 1)], 6,
      "Sequence Length is mismatched between input and `BatchParam` (expected: 6, actual: 5)")],
)
def test_batch_param_errors(launched, mxq_golden, glog, params, n, detail):
    m = launched(max_batch_size=K)
    m.infer([_x(mxq_golden, _ids(4))], None, 0, [BatchParam(4, 0, 0)])
    before = _state(m, range(K))
    glog()
    with pytest.raises(QbRuntimeError) as exc:
        m.infer([_x(mxq_golden, _ids(n))], None, 0, params)
    assert _status(exc) == "Model_InvalidBatchParam"
    assert glog() == [detail]
    assert _state(m, range(K)) == before


@pytest.mark.parametrize(
    ("params", "status", "detail"),
    [([BatchParam(3, 0, 0), BatchParam(17, 0, 1)], "Model_ShapeMismatched",
      "Sequence length of inputs[0] exceeds maximum value (17 > 16)"),
     ([BatchParam(3, 0, 0), BatchParam(10, 60, 1)], "Model_CacheOverflow",
      "Sum of sequence length and cache size exceeds max cache size (70 > 64)")],
)
def test_batch_item_limits_leave_every_cache_unchanged(launched, mxq_golden, glog, params, status, detail):
    m = launched(max_batch_size=K)
    before = _state(m, range(K))
    n = sum(p.sequence_length for p in params)
    glog()
    with pytest.raises(QbRuntimeError) as exc:
        m.infer([_x(mxq_golden, _ids(n))], None, 0, params)
    assert _status(exc) == status and glog() == [detail]
    assert _state(m, range(K)) == before


@pytest.mark.parametrize("shape", [(1, 5, 127), (2, 5, 128), (5, 128), (1, 2, 5, 128), (1, 0, 128)])
def test_bad_input_shape(launched, shape):
    m = launched()
    with pytest.raises(ValueError, match=r"^Input shape is invalid\.$"):
        m.infer([np.zeros(shape, np.float32)], None, 0)


def test_dump_and_load_errors(launched, glog):
    m = launched(max_batch_size=K)
    blobs = m.dump_cache_memory(0)
    glog()
    cases = [
        (lambda: m.dump_cache_memory(3), "Model_InvalidBatchParam",
         "Failed to dump cache memory - `cache_id` (3) exceeds maximum batch size (3)"),
        (lambda: m.load_cache_memory(blobs[:1], 1), "Model_NumCacheMismatched",
         "Failed to load cache memory - The number of cache is mismatched (expected: 2, actual: 1)"),
        (lambda: m.load_cache_memory([blobs[0], blobs[1][:-4]], 1), "Model_BufferSizeMismatched",
         f"Failed to load cache memory - layer1.kv: Wrong buffer size (expected: {len(blobs[1])}, actual: {len(blobs[1]) - 4})"),
    ]
    for call, status, detail in cases:
        with pytest.raises(QbRuntimeError) as exc:
            call()
        assert _status(exc) == status and glog() == [detail]


def test_unimplemented_apis_raise_not_implemented(launched):
    m = launched()
    for call in (lambda: m.reset_fixed_tail_cache_memory(0), lambda: m.move_cache_tail(1, 1, 4),
                 lambda: m.filter_cache_tail(4, 2, [True, False])):
        with pytest.raises(QbRuntimeError) as exc:
            call()
        assert exc.value.status == "NotImplemented"
