"""npusim.mxq enums, value classes, QbRuntimeError and module exports (qbruntime 1.5.0 names)."""

from __future__ import annotations

import pytest

import npusim.mxq as qb

EXPORTS = ("Accelerator Model load ModelConfig CoreMode Cluster Core CoreId CoreAllocationPolicy CacheType CacheInfo "
           "BufferInfo DataType BatchParam LogLevel set_log_level start_tracing_events stop_tracing_events "
           "get_model_summary get_available_devices get_available_device_numbers QbRuntimeError __version__").split()


def test_module_exports_and_version():
    missing = [n for n in EXPORTS if not hasattr(qb, n)]
    assert missing == []
    assert qb.__version__ == "v1.5.0" and qb.__vendor__ == "Mobilint" and qb.__product__


@pytest.mark.parametrize(
    ("enum", "values"),
    [(qb.CoreMode, {"Single": 0, "Multi": 1, "Global": 2, "Global4": 3, "Global8": 4, "Auto": 14, "Error": 15}),
     (qb.Cluster, {"Cluster0": 0x10000, "Cluster1": 0x20000}),
     (qb.Core, {"Core0": 1, "Core1": 2, "Core2": 3, "Core3": 4, "All": 65532, "GlobalCore": 65534}),
     (qb.CacheType, {"Default": 0, "Batch": 1, "FixedTailCache": 2, "Error": 15})],
)
def test_enum_raw_values(enum, values):
    assert {n: int(getattr(enum, n)) for n in values} == values


def test_enum_str_and_hash():
    assert str(qb.CoreMode.Single) == "CoreMode.Single"
    assert str(qb.Cluster.Cluster1) == "Cluster.Cluster1"
    assert {qb.Cluster.Cluster0: 1}[qb.Cluster.Cluster0] == 1


def test_core_id_is_frozen_unhashable_and_ordered():
    """Unhashable as the real ``qbruntime.CoreId`` (``__eq__`` without ``__hash__``), so a
    plugin that keys a dict or set by it fails here, not first on the board."""
    a = qb.CoreId(qb.Cluster.Cluster0, qb.Core.Core3)
    b = qb.CoreId(qb.Cluster.Cluster1, qb.Core.Core0)
    assert a == qb.CoreId(qb.Cluster.Cluster0, qb.Core.Core3) and a != b
    assert a < b and not b < a and sorted([b, a]) == [a, b]
    with pytest.raises(TypeError, match="unhashable"):
        {a, b}  # noqa: B018
    with pytest.raises(AttributeError):
        a.core = qb.Core.Core0  # type: ignore[misc]


def test_batch_param_defaults_and_repr():
    assert repr(qb.BatchParam(3, 10, 1)) == "BatchParam(sequence_length=3, cache_size=10, cache_id=1)"
    p = qb.BatchParam()
    assert (p.sequence_length, p.cache_size, p.cache_id) == (0, 0, 0)
    assert qb.BatchParam(sequence_length=2, cache_id=1) == qb.BatchParam(2, 0, 1)


def test_qbruntime_error_message_and_python_construction():
    e = qb.QbRuntimeError.from_status("BadAlloc")
    assert isinstance(e, RuntimeError) and e.status == "BadAlloc"
    assert str(e) == ("BadAlloc occurred.\nPlease visit "
                      "https://docs.mobilint.com/v1.5/doxygen/html_en/group__CPPAPI.html for more details.")
    user = qb.QbRuntimeError("BadAlloc: device out of memory")
    assert str(user) == "BadAlloc: device out of memory" and user.status is None


def test_set_log_level_off_silences_details(mxq_machine, capsys):
    qb.set_log_level(qb.LogLevel.Off)
    try:
        mxq_machine.configure(devices=0)
        with pytest.raises(qb.QbRuntimeError):
            qb.Accelerator()
        assert capsys.readouterr() == ("", "")
    finally:
        qb.set_log_level(qb.LogLevel.Warn)  # the default
    with pytest.raises(qb.QbRuntimeError):
        qb.Accelerator()
    assert "No NPU device found in the system." in capsys.readouterr().out


def test_info_constructors_take_keywords_with_defaults():
    """As the real ``BufferInfo``/``CacheInfo``: every field a keyword with a default."""
    b = qb.BufferInfo(max_width=128, max_cache_size=4096)
    assert (b.max_width, b.max_cache_size, b.height, b.original_width, b.reshaped_channel) == (128, 4096, 0, 0, 0)
    c = qb.CacheInfo(name="layer0.kv", size=64)
    assert (c.cache_type, c.name, c.layer_hash, c.size, c.num_batches) == (qb.CacheType.Error, "layer0.kv", "", 64, 0)


def test_log_level_values_are_the_real_ones():
    assert [m.value for m in (qb.LogLevel.Debug, qb.LogLevel.Info, qb.LogLevel.Warn, qb.LogLevel.Err,
                              qb.LogLevel.Fatal, qb.LogLevel.Off)] == [1, 2, 3, 4, 5, 6]


def test_scale_is_a_settable_value_as_in_qbruntime():
    s = qb.Scale(0.5, False, [0.25, 0.75])
    assert (s.scale, s.is_uniform, s.scale_list, s.zero_point, s.is_asymmetric, s.zero_points) == (
        0.5, False, [0.25, 0.75], 0, False, [])
    assert s[1] == 0.75
    s.scale_list = [1.0]
    s.zero_points = [3]
    assert s[0] == 1.0 and s.zero_points == [3]
    with pytest.raises(IndexError):
        s[1]


def test_unsimulated_advanced_names_exist_with_real_signatures(mxq_machine, mxq_artifact):
    """The buffer, pinned-memory and async names no vendor path calls exist and say they are not
    simulated: a clear NotImplementedError, never an AttributeError. NPUData is real: it cannot be
    constructed directly (as qbruntime's), only acquired from a Model (test_mxq_npu_data.py)."""
    import inspect

    for cls in (qb.Buffer, qb.PinnedMemory, qb.Future):
        with pytest.raises(NotImplementedError, match=r"is not simulated by npusim\.mxq"):
            cls()
    with pytest.raises(TypeError, match=r"use Model\.acquire_input_npu_data"):
        qb.NPUData()
    m = qb.Model(str(mxq_artifact()))
    assert list(inspect.signature(m.acquire_input_npu_data).parameters) == ["shape", "idx", "upload", "dtype"]
    for call in (m.infer_speedrun, lambda: m.infer_buffer([], []), lambda: m.acquire_input_buffer(),
                 lambda: m.infer_async_to_float([]), lambda: m.infer_npu_data_chw([])):
        with pytest.raises(NotImplementedError, match=r"qbruntime Model\.\w+ is not simulated by npusim\.mxq"):
            call()
