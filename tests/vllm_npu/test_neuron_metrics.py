"""``vllm_npu.neuron.metrics``: the ``vllm_neuron:*`` metrics in prometheus multiprocess mode.

Each case runs in a fresh interpreter (the value class and the metric objects are per process):
a parent imports ``prometheus_client`` *before* the directory is set (as vLLM does), calls
``ensure_multiproc_dir``, observes, starts a child process that observes too, and reads both
back with ``MultiProcessCollector`` + ``generate_latest``, as vLLM's ``/metrics`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

PARENT = textwrap.dedent("""
    import json, os, subprocess, sys
    import prometheus_client  # imported before PROMETHEUS_MULTIPROC_DIR is set
    from prometheus_client import values
    assert values.ValueClass is values.MutexValue
    from vllm_npu.neuron.metrics import MULTIPROC_PREFIX, NeuronMetrics, ensure_multiproc_dir

    user = {"PROMETHEUS_MULTIPROC_DIR": "/somewhere/else"}
    kept = ensure_multiproc_dir(user) == "/somewhere/else" and user == {"PROMETHEUS_MULTIPROC_DIR": "/somewhere/else"}
    values.ValueClass = values.MutexValue  # undo the switch the call above made
    path = ensure_multiproc_dir()
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == path and os.path.isdir(path)
    assert ensure_multiproc_dir() == path  # idempotent

    m = NeuronMetrics("tiny", rank_id=0)
    m.precreate(["prefill_s128", "prefill_s256"], ["decode_b1", "decode_b2", "decode_b4"])
    m.observe_prefill(128)
    m.observe_decode(3, 4)
    m.neff_executed("prefill_s128")
    m.neff_executed("decode_b3")
    m.compiled("prefill_s128", 2.5)
    m.startup(10.0)
    m.model_loaded(1.5, 100)
    subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)

    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    print(json.dumps({"dir": os.path.basename(path), "prefix": MULTIPROC_PREFIX, "kept": kept,
                      "text": generate_latest(registry).decode()}))
""")

CHILD = textwrap.dedent("""
    from vllm_npu.neuron.metrics import NeuronMetrics
    m = NeuronMetrics("tiny", rank_id=0)
    m.observe_prefill(256)
    m.observe_decode(1, 1)
    m.neff_executed("prefill_s128")
    m.compiled("prefill_s128", 4.0)
    m.startup(7.0)
    m.model_loaded(0.5, 50)
    NeuronMetrics("tiny", rank_id=1).observe_decode(2, 2)
""")


@pytest.fixture(scope="module")
def exposed():
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    proc = subprocess.run([sys.executable, "-c", PARENT, CHILD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    families = {f.name: f for f in text_string_to_metric_families(result["text"])}
    return result, families


def _samples(family, suffix=""):
    return [(s.labels, s.value) for s in family.samples if s.name == family.name + suffix]


def _value(family, suffix, **labels):
    found = [v for lab, v in _samples(family, suffix) if lab == labels]
    assert len(found) == 1, (labels, _samples(family, suffix))
    return found[0]


def test_directory_is_created_unless_the_user_set_one(exposed):
    result, _ = exposed
    assert result["dir"].startswith("vllm_neuron_prometheus_") and result["prefix"] == "vllm_neuron_prometheus_"
    assert result["kept"]


def test_names_and_types(exposed):
    result, families = exposed
    neuron = {name: f.type for name, f in families.items() if name.startswith("vllm_neuron:")}
    assert neuron == {
        "vllm_neuron:num_seqs_padding": "histogram",
        "vllm_neuron:num_batched_tokens_padding": "histogram",
        "vllm_neuron:neff_execution_count": "counter",
        "vllm_neuron:compilation_time_seconds": "gauge",
        "vllm_neuron:startup_time_seconds": "gauge",
        "vllm_neuron:model_load_time_seconds": "gauge",
        "vllm_neuron:model_load_size_bytes": "gauge",
    }
    assert "# TYPE vllm_neuron:num_seqs_padding histogram" in result["text"]


def test_histogram_buckets_and_values_from_both_processes(exposed):
    _, families = exposed
    seqs = families["vllm_neuron:num_seqs_padding"]
    tokens = families["vllm_neuron:num_batched_tokens_padding"]
    b4 = {"model_name": "tiny", "bucket_name": "decode_b4", "rank_id": "0"}
    les = sorted({float(lab["le"]) for lab, _ in _samples(seqs, "_bucket") if lab["bucket_name"] == "decode_b4"})
    assert les == [float(2**i) for i in range(8)] + [float("inf")]
    les = sorted({float(lab["le"]) for lab, _ in _samples(tokens, "_bucket")
                  if lab["bucket_name"] == "prefill_s128"})
    assert les == [float(2**i) for i in range(5, 15)] + [float("inf")]
    # decode_b4 saw one step of 3 real requests: counted from le=4 on, not at le=2.
    assert _value(seqs, "_bucket", **b4, le="2.0") == 0 and _value(seqs, "_bucket", **b4, le="4.0") == 1
    assert _value(seqs, "_sum", **b4) == 3
    # Pre-created series exist with zero counts; each process's own series are there too.
    assert _value(seqs, "_count", model_name="tiny", bucket_name="decode_b2", rank_id="0") == 0
    assert _value(seqs, "_count", model_name="tiny", bucket_name="decode_b1", rank_id="0") == 1
    assert _value(seqs, "_count", model_name="tiny", bucket_name="decode_b2", rank_id="1") == 1
    assert _value(tokens, "_count", model_name="tiny", bucket_name="prefill_s128", rank_id="0") == 1
    assert _value(tokens, "_sum", model_name="tiny", bucket_name="prefill_s256", rank_id="0") == 256


def test_counter_sums_and_gauge_modes(exposed):
    _, families = exposed
    labels = {"model_name": "tiny", "rank_id": "0"}
    neff = families["vllm_neuron:neff_execution_count"]
    assert _value(neff, "_total", **labels, bucket_name="prefill_s128") == 2  # both processes
    assert _value(neff, "_total", **labels, bucket_name="decode_b3") == 1
    compile_time = families["vllm_neuron:compilation_time_seconds"]
    assert _value(compile_time, "", **labels, bucket_name="prefill_s128") == 4.0  # max
    assert _value(families["vllm_neuron:startup_time_seconds"], "", **labels) == 10.0  # max
    assert _value(families["vllm_neuron:model_load_time_seconds"], "", **labels) == 1.5  # max
    assert _value(families["vllm_neuron:model_load_size_bytes"], "", **labels) == 150  # sum
    for name in ("compilation_time_seconds", "startup_time_seconds", "model_load_size_bytes"):
        assert all("pid" not in lab for lab, _ in _samples(families[f"vllm_neuron:{name}"]))


HOOK = textwrap.dedent("""
    import os
    from vllm_npu.neuron import register
    name = register()
    assert name == "vllm_npu.neuron.platform.NeuronPlatform", name
    print("AFTER_REGISTER", os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    from vllm_npu.neuron.platform import NeuronPlatform
    NeuronPlatform.pre_register_and_update()
    path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert os.path.isdir(path) and os.path.basename(path).startswith("vllm_neuron_prometheus_")
    print("AFTER_PRE_REGISTER", path)
""")


def test_the_directory_is_made_by_the_process_that_builds_the_engine_config_not_at_platform_resolution():
    """``register()`` (platform resolution, which may happen in a process that others fork
    from) sets nothing; ``NeuronPlatform.pre_register_and_update`` (vLLM calls it in the API
    server before the engine core starts) makes the directory."""
    from npu_conformance import prefork, vllm_server

    env = {k: v for k, v in vllm_server.vllm_env("neuron-sim").items() if k.lower() != "prometheus_multiproc_dir"}
    proc = prefork.run_python(HOOK, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AFTER_REGISTER None" in proc.stdout and "AFTER_PRE_REGISTER /" in proc.stdout, proc.stdout
