"""npusim.mxq tracing: one process-global trace, Chrome JSON written only at stop, device-clock timestamps."""

from __future__ import annotations

import json

import numpy as np

import npusim.mxq as qb


def test_empty_window_writes_exactly_brackets(mxq_machine, tmp_path):
    p = tmp_path / "t.json"
    assert qb.start_tracing_events(str(p)) is True
    assert not p.exists()
    qb.stop_tracing_events()
    assert p.read_text() == "[\n\n]"


def test_second_start_is_refused(mxq_machine, tmp_path):
    assert qb.start_tracing_events(str(tmp_path / "a.json")) is True
    assert qb.start_tracing_events(str(tmp_path / "b.json")) is False
    qb.stop_tracing_events()
    assert (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_spans_of_infer_dump_and_load(mxq_machine, mxq_artifact, tmp_path):
    mxq_machine.configure(infer_fixed_us=100, infer_us_per_token=1, io_fixed_us=10)
    m = qb.Model(str(mxq_artifact()))
    m.launch(qb.Accelerator())
    m.infer([np.zeros((1, 1, 128), np.float32)], None, 0)  # before the window: not recorded
    p = tmp_path / "trace.json"
    qb.start_tracing_events(p)
    m.infer([np.ones((1, 1, 4, 128), np.float32)], None, 1)
    blobs = m.dump_cache_memory(0)
    m.load_cache_memory(blobs, 0)
    end = m.device_clock_us()
    assert not p.exists()
    qb.stop_tracing_events()
    events = json.loads(p.read_text())
    assert all(set(e) == {"name", "cat", "ph", "pid", "tid", "ts"} for e in events)
    spans = [(e["name"], e["ts"]) for e in events]
    t0 = 2 * 10 + 100 + 1
    assert spans[:10] == [
        ("infer", t0), ("infer", t0 + 124),
        ("lock core", t0), ("lock core", t0),
        ("copy to npu", t0), ("copy to npu", t0 + 10),
        ("run npu", t0 + 10), ("run npu", t0 + 114),
        ("copy from npu", t0 + 114), ("copy from npu", t0 + 124)]
    assert [e["ph"] for e in events] == ["B", "E"] * (len(events) // 2)
    assert [n for n, _ in spans[10:]] == ["read device", "read device", "copy to npu", "copy to npu"]
    assert events[-1]["ts"] == round(end, 3)
    assert {e["pid"] for e in events} == {0} and {e["tid"] for e in events} == {m.get_identifier()}
