"""vllm_npu.mblt.tracing against a FAKE qbruntime (fake_qbruntime.py)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from fake_qbruntime import make_fake_runtime

from vllm_npu.mblt import tracing
from vllm_npu.mblt.tracing import MbltTraceError, MbltTracer, active_tracer


@pytest.fixture(autouse=True)
def no_trace_left_running():
    yield
    tracer = active_tracer()
    if tracer is not None:  # a failed test must not refuse the next one's start
        tracer.shutdown()
    tracing._ACTIVE_TRACER = None


def make(tmp_path, rt=None, rank=0, **kw):
    rt = rt or make_fake_runtime()
    return rt, MbltTracer(rt, str(tmp_path / "traces"), rank, hostname="node7", pid=4242,
                          clock_ns=lambda: 1_700_000_000_123_456_789, **kw)


def test_file_name_and_round_trip(tmp_path):
    rt, tracer = make(tmp_path, rank=3)
    path = tracer.start()
    assert path == tmp_path / "traces" / "node7_4242.mblt_npu_rank3.1700000000123456789.json"
    assert path.parent.is_dir() and tracer.running and active_tracer() is tracer
    assert rt.state.trace_calls == [("start", str(path))]
    assert tracer.stop() == path
    assert path.read_text() == "[\n\n]"
    assert not tracer.running and active_tracer() is None
    assert rt.state.trace_calls[-1] == ("stop", None)


def test_runtime_refusal_is_an_error(tmp_path):
    rt, tracer = make(tmp_path, make_fake_runtime(trace_start_result=False))
    with pytest.raises(MbltTraceError, match=r"qbruntime refused to start an MBLT NPU trace at "
                                             r".*node7_4242\.mblt_npu_rank0\.\d+\.json\.$"):
        tracer.start()
    assert not tracer.running and active_tracer() is None


@pytest.mark.parametrize("same", [True, False])
def test_second_start_is_refused_with_a_warning(tmp_path, caplog, same):
    rt, first = make(tmp_path)
    second = first if same else make(tmp_path, rt, rank=1)[1]
    path = first.start()
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        assert second.start() is None
    assert "already recording" in caplog.text and str(path) in caplog.text
    assert [c for c, _ in rt.state.trace_calls] == ["start"]
    assert first.running and active_tracer() is first
    if not same:
        assert second.stop() is None  # not its trace: nothing stopped
        assert first.running
    assert first.stop() == path


def test_benchmark_helper_trace_refuses_start(tmp_path, caplog, monkeypatch):
    helper = types.ModuleType("transformers_mblt.utils.benchmark_utils")
    helper._ACTIVE_QBRUNTIME_TRACE_HANDLE = object()
    monkeypatch.setitem(sys.modules, helper.__name__, helper)
    rt, tracer = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.mblt"):
        assert tracer.start() is None
    assert "transformers_mblt" in caplog.text and rt.state.trace_calls == []


def test_stop_without_start_only_logs(tmp_path, caplog):
    rt, tracer = make(tmp_path)
    with caplog.at_level(logging.INFO, logger="vllm.vllm_npu.mblt"):
        assert tracer.stop() is None
    assert "nothing to stop" in caplog.text and rt.state.trace_calls == []


def test_unwritten_log_is_an_error_and_the_trace_is_over(tmp_path):
    rt, tracer = make(tmp_path, make_fake_runtime(trace_writes_file=False))
    path = tracer.start()
    with pytest.raises(MbltTraceError, match=r"log could not be written to .*\.json\.$") as info:
        tracer.stop()
    assert str(path) in str(info.value)
    assert not tracer.running and active_tracer() is None
    assert tracer.start() is not None  # a new window can start


@pytest.mark.parametrize("trace_dir", ["s3://bucket/traces", "gs://b/t", ""])
def test_remote_or_empty_dir_is_refused_at_construction(trace_dir):
    with pytest.raises(MbltTraceError, match="local directory"):
        MbltTracer(make_fake_runtime(), trace_dir, 0)


def test_negative_rank_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        MbltTracer(make_fake_runtime(), str(tmp_path), -1)


def test_shutdown_stops_a_running_trace(tmp_path):
    rt, tracer = make(tmp_path)
    path = tracer.start()
    assert tracer.shutdown() == path and path.is_file() and not tracer.running
    assert tracer.shutdown() is None


def test_shutdown_logs_and_swallows_errors(tmp_path, caplog):
    rt, tracer = make(tmp_path, make_fake_runtime(trace_writes_file=False))
    tracer.start()
    with caplog.at_level(logging.ERROR, logger="vllm.vllm_npu.mblt"):
        assert tracer.shutdown() is None
    assert "during shutdown" in caplog.text and not tracer.running

    def boom():
        raise RuntimeError("stop exploded")

    rt2, tracer2 = make(tmp_path)
    tracer2.start()
    rt2.stop_tracing_events = boom
    assert tracer2.shutdown() is None
    assert "stop exploded" in caplog.text and active_tracer() is None
