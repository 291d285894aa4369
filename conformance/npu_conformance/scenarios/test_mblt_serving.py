"""MBLT serving scenarios: ``vllm serve`` with the MBLT plugin on ``mblt-sim`` / ``mblt-hw`` (issue 4).

What every serving target must do (greedy and streaming output equal to the golden decoder,
load, hostile input, in-flight faults) is the device-neutral suite, ``test_serving.py``; these
are the MBLT-specific behaviours. Each scenario drives real ``vllm serve`` processes
(``npu_conformance.devices.mblt``, the same lab and servers as the serving suite) through the
OpenAI-compatible HTTP API, the way a plugin engineer would on a board:

* ``scheduler_from_artifact``: the seed's chunked-prefill and batch-capacity examples, read
  from vLLM's resolved engine config with the MBLT platform.
* ``prefix_snapshot_load_and_recompute``: a finished request's snapshot is loaded for a
  request sharing 2 KV blocks and recomputed for one sharing 1 block (min-hit rule); both
  answers stay correct. ``prefix_cost_model_measured`` (simulator only): with the device's
  load cost made huge or tiny, the measured threshold recomputes or loads.
* ``slot_thrash_batch1``: 4 concurrent requests on a batch-1 artifact sharing one cache slot
  all complete, each equal to running it alone.
* ``multi_card_batching``: ``dev_no=[0, 1]`` with ``max_batch_size = 2K`` puts one instance on
  each card; concurrent requests equal their solo runs.
* ``refuses_oversized_max_model_len``: a ``--max-model-len`` above the MXQ's KV capacity
  stops the server naming both.
* ``trace_file_written``: ``/start_profile`` + ``/stop_profile`` write the NPU trace.
* ``injected_startup_faults`` (simulator only): BadAlloc at launch and a missing device stop
  the server with the runtime's error (faults of requests in flight: ``test_serving.py``).
* Mixture-of-Experts releases (issue 13; on ``mblt-hw`` the release named by
  ``NPU_HARNESS_MBLT_MOE_RELEASE``): ``moe_greedy`` (golden on the simulator; on a board, where
  the expert sum in finish order may change a token, the agreement of two runs is a figure),
  ``moe_start_rules`` (batch serving refused, ``max_model_len`` clamped to the shared MXQs' KV
  capacity, an explicit larger value refused naming it) and ``moe_placement_overrides``
  (prefixed role keys move the lm_head and set the expert workers; unprefixed keys are logged
  as unused).
* EAGLE-3 releases (issue 13 §2; on ``mblt-hw`` the release named by
  ``NPU_HARNESS_MBLT_EAGLE3_RELEASE``): ``eagle3_greedy`` (equal to the base's plain greedy
  decoding on the simulator; a rerun agrees on a board), ``eagle3_streaming_arrives_in_rounds``
  (chunks of several tokens, the same tokens), ``eagle3_request_refusals`` (400 naming each
  parameter but temperature/top_k/top_p) and ``eagle3_start_rules`` (batch refused, prefix
  caching off, one sequence).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time

import pytest

from npu_conformance.devices.base import ArtifactUnavailable
from npu_conformance.devices.base import random_prompts as _prompts
from npu_conformance.vllm_server import completion_ids
from npu_conformance import vllm_server as vs

pytestmark = pytest.mark.scenario(devices=("mblt",))

MAX_MODEL_LEN = "1024"
SEED_CHUNKS = {"single": 64, "global4": 256, "global8": 512}


def _lab(device_labs, target):
    return device_labs(target.name)


def _artifact(lab, **kw):
    try:
        return lab.artifact(**kw)
    except ArtifactUnavailable as exc:
        pytest.skip(str(exc))


def _main_server(lab):
    """The serving suite's server (K=4, the seed's chunk dict, tracing on, min-hit 256)."""
    return lab.serving_server()


def _solo_then_concurrent(server, prompts, max_tokens=16):
    solo = [completion_ids(server.complete(p, max_tokens, return_token_ids=True)) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: completion_ids(server.complete(p, max_tokens, return_token_ids=True)),
                               prompts))
    return solo, together


def test_scheduler_from_artifact(target, record, device_labs):
    lab = _lab(device_labs, target)
    batch1 = _artifact(lab, k=0 if not lab.simulated else 1, core_mode="auto",
                       edits={"npu_prefill_chunk_size": SEED_CHUNKS, "max_batch_size": 1})
    batch4 = _artifact(lab, k=4, chunk=256)
    default_chunk = _artifact(lab, k=0 if not lab.simulated else 1, core_mode="auto",
                              edits={"max_batch_size": 1}, drop=("npu_prefill_chunk_size",))
    runs = {
        # seed: "With this command, vllm-mblt selects 256 for global4"
        "dict_global4": ["--model", str(batch1), "--model-loader-extra-config",
                         json.dumps({"dev_no": 0, "core_mode": "global4", "target_clusters": [0]})],
        # seed: the smaller of the user's --max-num-batched-tokens and the model's value
        "user_tokens_smaller": ["--model", str(batch1), "--max-num-batched-tokens", "100",
                                "--model-loader-extra-config", json.dumps({"core_mode": "global4"})],
        "dict_single": ["--model", str(batch1), "--model-loader-extra-config",
                        json.dumps({"core_mode": "single"})],
        # fallback 128 when the config names no chunk size
        "fallback_128": ["--model", str(default_chunk)],
        # batch-compiled: max_num_seqs from max_batch_size, chunk clamped to 128
        "batch4_clamped": ["--model", str(batch4)],
        "batch4_user_seqs_2": ["--model", str(batch4), "--max-num-seqs", "2"],
        "batch4_user_seqs_64": ["--model", str(batch4), "--max-num-seqs", "64"],
    }
    got = dict(zip(runs, lab.engine_configs([r + ["--max-model-len", "512"] for r in runs.values()])))
    for name, cfg in got.items():
        assert "error" not in cfg, f"{name}: {cfg}"
        assert cfg["worker_cls"] == lab.worker_class
    assert got["dict_global4"]["max_num_batched_tokens"] == 256
    assert got["user_tokens_smaller"]["max_num_batched_tokens"] == 100
    assert got["dict_single"]["max_num_batched_tokens"] == 64
    assert got["fallback_128"]["max_num_batched_tokens"] == 128
    assert got["dict_global4"]["max_num_seqs"] == 1 and got["dict_global4"]["block_size"] == 128
    k = lab.base_k(batch4)
    assert got["batch4_clamped"]["max_num_seqs"] == k
    assert got["batch4_clamped"]["long_prefill_token_threshold"] == 128
    assert got["batch4_clamped"]["max_num_batched_tokens"] == 128 * k
    assert got["batch4_user_seqs_2"]["max_num_seqs"] == 2
    assert got["batch4_user_seqs_64"]["max_num_seqs"] == k
    record.figure("configs_checked", len(runs))


def test_prefix_snapshot_load_and_recompute(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = _main_server(lab)
    base = _prompts(1, 400, seed=7)[0]
    first = completion_ids(server.complete(base, 4, return_token_ids=True))
    assert first
    long_hit = base[:300] + _prompts(1, 20, seed=8)[0]   # vLLM finds 2 blocks (256 tokens) cached
    short_hit = base[:200] + _prompts(1, 20, seed=9)[0]  # 1 block (128 tokens): below min-hit 256
    before = server.log_text()
    got_long = completion_ids(server.complete(long_hit, 8, return_token_ids=True))
    got_short = completion_ids(server.complete(short_hit, 8, return_token_ids=True))
    log = server.log_text()[len(before):]
    golden = lab.golden()
    if golden is not None:
        assert got_long == golden.generate_greedy(long_hit, 8)
        assert got_short == golden.generate_greedy(short_hit, 8)
    else:  # hardware: the same prompts again must answer the same
        assert completion_ids(server.complete(long_hit, 8, return_token_ids=True)) == got_long
    assert re.search(r"MBLT prefix snapshot \S+: load 256 tokens", log), f"no snapshot load logged:\n{log[-3000:]}"
    assert re.search(r"MBLT prefix snapshot \S+: recompute 128 tokens", log), f"no recompute logged:\n{log[-3000:]}"
    record.figure("snapshot_loads", 1)


@pytest.mark.parametrize("costs,decision", [
    ({"pace": True, "load_us_per_kib": 2000}, "recompute"),
    ({"pace": True, "load_us_per_kib": 0, "io_fixed_us": 0, "infer_us_per_token": 1000}, "load"),
], ids=["load_expensive", "load_cheap"])
def test_prefix_cost_model_measured(target, record, device_labs, costs, decision):
    """The first snapshot load has no load timing yet, so it loads (vllm-mblt's rule) and is
    measured; the next match is decided by ``load_ms < prefill_ms * 0.9`` on the measured
    EWMA load time and the start-up prefill calibration, with the simulated device paced to
    the given costs."""
    lab = _lab(device_labs, target)
    if not lab.simulated:
        pytest.skip("device costs can be set only on the simulator")
    art = _artifact(lab, k=4, chunk=128)
    server = lab.server(art, ["--max-model-len", MAX_MODEL_LEN], NPUSIM_MXQ=json.dumps(costs))
    base = _prompts(1, 300, seed=11)[0]
    completion_ids(server.complete(base, 2, return_token_ids=True))   # snapshot on slot 0
    decisions = []
    for i in range(2):
        # keep slot 0 busy, so the probe runs on another slot and the snapshot must move
        with cf.ThreadPoolExecutor(1) as ex:
            busy = ex.submit(server.complete, _prompts(1, 20, seed=12 + i)[0], 48)
            time.sleep(1.0)
            before = len(server.log_text())
            probe = base[:260] + _prompts(1, 10, seed=20 + i)[0]
            got = completion_ids(server.complete(probe, 6, return_token_ids=True))
            busy.result()
        assert got == lab.golden().generate_greedy(probe, 6)
        found = re.findall(r"MBLT prefix snapshot \S+: (load|recompute) (\d+) tokens", server.log_text()[before:])
        assert found, f"no snapshot decision logged:\n{server.log_text()[-3000:]}"
        decisions.append(found[0])
    assert decisions[0] == ("load", "256"), decisions      # no load timing yet: load and measure
    assert decisions[1] == (decision, "256"), decisions    # measured: the cost model decides
    record.figure("decision_" + decision, 1)


def test_slot_thrash_batch1(target, record, device_labs):
    lab = _lab(device_labs, target)
    # No max_batch_size in config.json: the scheduler keeps several requests running and they
    # all share the batch-1 MXQ's one cache slot, saved and restored around every infer.
    art = _artifact(lab, k=0 if not lab.simulated else 1, drop=("max_batch_size",))
    server = lab.server(art, ["--max-model-len", MAX_MODEL_LEN, "--max-num-seqs", "4"])
    prompts = _prompts(4, 150, seed=3)
    solo, together = _solo_then_concurrent(server, prompts, max_tokens=24)
    assert together == solo
    golden = lab.golden()
    if golden is not None:
        assert solo == [golden.generate_greedy(p, 24) for p in prompts]
    record.figure("concurrent_requests", len(prompts))


def test_multi_card_batching(target, record, device_labs):
    lab = _lab(device_labs, target)
    env = {}
    if lab.simulated:
        env["NPUSIM_MXQ"] = json.dumps({"devices": 2})
        art = _artifact(lab, k=1)
    else:
        import importlib

        devices = importlib.import_module("qbruntime").get_available_device_numbers()
        if len(devices) < 2:
            pytest.skip(f"needs 2 Mobilint cards; qbruntime sees {devices}")
        art = _artifact(lab, k=0)
    k = lab.base_k(art)
    extra = {"dev_no": [0, 1], "max_batch_size": 2 * k}
    server = lab.server(art, ["--max-model-len", MAX_MODEL_LEN, "--model-loader-extra-config", json.dumps(extra)],
                        **env)
    prompts = _prompts(2 * k if k > 1 else 4, 30, seed=5)
    solo, together = _solo_then_concurrent(server, prompts)
    assert together == solo
    golden = lab.golden()
    if golden is not None:
        assert solo == [golden.generate_greedy(p, 16) for p in prompts]
    assert re.search(r"MBLT backend: 2 MXQ instance\(s\) on device\(s\) \[0, 1\]", server.log_text()), \
        "no placement on devices [0, 1] logged"
    record.figure("instances", 2)


def test_refuses_oversized_max_model_len(target, record, device_labs):
    lab = _lab(device_labs, target)
    art = _artifact(lab, k=1, max_cache_size=256) if lab.simulated else _artifact(lab, k=0)
    capacity = lab.kv_capacity(art)
    args = ["--max-model-len", str(capacity * 2)]
    try:  # a fresh start: the start itself must be refused
        log = lab.refused_start(art, args)
    except AssertionError as exc:  # it started: show what a prompt past the KV capacity then does
        srv = lab.start(art, args, lab.workdir / "oversized-started.log")
        try:
            prompt = _prompts(1, capacity + capacity // 2, seed=31)[0]
            res = srv.complete(prompt, 4, return_token_ids=True)
            after = "healthy" if srv.healthy() else "not healthy"
        finally:
            srv.stop()
        raise AssertionError(f"{exc}; a {len(prompt)}-token prompt then got HTTP {res.status} and the server was "
                             f"{after} (KV capacity {capacity} tokens per cache id)") from None
    assert f"max_model_len={capacity * 2}" in log and f"({capacity} tokens per cache id)" in log, log[-3000:]
    # refused by the platform in the API server, before an engine core started
    assert "Initializing a V1 LLM engine" not in log, log[-3000:]
    record.figure("capacity_tokens", capacity)


def test_trace_file_written(target, record, device_labs):
    lab = _lab(device_labs, target)
    server = _main_server(lab)
    trace_dir = lab.trace_dir
    before = set(trace_dir.glob("*.mblt_npu_rank*.json"))
    assert server.request("POST", "/start_profile").status == 200
    completion_ids(server.complete(_prompts(1, 20, seed=6)[0], 4, return_token_ids=True))
    assert server.request("POST", "/stop_profile").status == 200
    new = sorted(set(trace_dir.glob("*.mblt_npu_rank*.json")) - before)
    assert len(new) == 1, new
    assert re.fullmatch(r".+_\d+\.mblt_npu_rank0\.\d+\.json", new[0].name), new[0].name
    events = json.loads(new[0].read_text())
    names = {e["name"] for e in events}
    assert {"infer", "run npu"} <= names, names
    record.figure("trace_events", len(events))


def test_injected_startup_faults(target, record, device_labs):
    lab = _lab(device_labs, target)
    if not lab.simulated:
        pytest.skip("faults are injected only into the simulator")
    art = _artifact(lab, k=4, chunk=128)
    # fresh starts: the faults strike at launch, and the starts must be refused
    log = lab.refused_start(art, ["--max-model-len", MAX_MODEL_LEN], NPUSIM_MXQ=json.dumps({"bad_alloc_at_launch": 1}))
    assert "MobilintBackendAllocError" in log and "BadAlloc" in log, log[-3000:]
    log = lab.refused_start(art, ["--max-model-len", MAX_MODEL_LEN], NPUSIM_MXQ=json.dumps({"no_device": True}))
    assert "Acc_DeviceNotFound" in log or "Driver_NotInitialized" in log, log[-3000:]
    record.figure("refused_starts", 2)


# ------------------------------------------------------------------ Mixture-of-Experts releases


def _moe(lab):
    try:
        return lab.moe_release()
    except ArtifactUnavailable as exc:
        pytest.skip(str(exc))


def test_moe_greedy(target, record, device_labs):
    lab = _lab(device_labs, target)
    release = _moe(lab)
    server = lab.server(release, [], **lab.moe_env())
    prompts = _prompts(3, 90, seed=41)
    got = [completion_ids(server.complete(p, 12, return_token_ids=True, ignore_eos=True)) for p in prompts]
    golden = lab.moe_golden()
    if golden is not None:
        assert got == [golden.generate_greedy(p, 12) for p in prompts]
    else:  # the board adds expert outputs in finish order: a rerun may differ; report how often it agrees
        again = [completion_ids(server.complete(p, 12, return_token_ids=True, ignore_eos=True)) for p in prompts]
        record.figure("rerun_agreement", sum(a == b for a, b in zip(got, again)) / len(prompts))
    assert all(len(g) == 12 for g in got)
    record.figure("prompts", len(prompts))


def test_moe_start_rules(target, record, device_labs):
    lab = _lab(device_labs, target)
    release = _moe(lab)
    # fresh starts: each rule is a start refused (no engine is started for the second)
    log = lab.refused_start(release, ["--model-loader-extra-config", json.dumps({"max_batch_size": 2})],
                            **lab.moe_env())
    assert ("Mixture-of-Experts models support only non-batch serving, but max_batch_size=2 was configured."
            in log), log[-3000:]
    declared = json.loads((release / "config.json").read_text())["max_position_embeddings"]
    [cfg] = lab.engine_configs([["--model", str(release)]])
    assert "error" not in cfg, cfg
    capacity = cfg["max_model_len"]
    assert capacity < declared and cfg["max_num_seqs"] == 1, cfg
    log = lab.refused_start(release, ["--max-model-len", str(declared)], **lab.moe_env())
    assert (f"max_model_len={declared} exceeds the KV capacity of the Mixture-of-Experts release's shared MXQs "
            f"({capacity} tokens per cache id)") in log, log[-3000:]
    assert "Initializing a V1 LLM engine" not in log, log[-3000:]  # refused before an engine started
    record.figure("shared_kv_capacity", capacity)


def test_moe_placement_overrides(target, record, device_labs):
    lab = _lab(device_labs, target)
    release = _moe(lab)
    cfg = json.loads((release / "config.json").read_text())
    lm_dev = 0 if int(str(cfg.get("lm_head_target_cores", ["0:0:0"])[0]).split(":")[0]) else 1
    extra = {"lm_head_target_cores": [f"{lm_dev}:1:3"], "num_expert_workers": 4, "dev_no": 0}
    server = lab.server(release, ["--model-loader-extra-config", json.dumps(extra)], **lab.moe_env())
    prompt = _prompts(1, 40, seed=43)[0]
    got = completion_ids(server.complete(prompt, 8, return_token_ids=True, ignore_eos=True))
    golden = lab.moe_golden()
    if golden is not None:
        assert got == golden.generate_greedy(prompt, 8)
    log = server.log_text()
    assert f"lm_head on device {lm_dev}; 4 expert workers" in log, log[-3000:]
    assert "unprefixed layout keys ['dev_no'] are not used for Mixture-of-Experts releases" in log, log[-3000:]
    record.figure("lm_head_device", lm_dev)


# ------------------------------------------------------------------ EAGLE-3 releases

#: Request parameters an EAGLE-3 server refuses (HTTP 400 naming the parameter): it samples with
#: temperature, top_k and top_p only (the seed's "Serve an EAGLE-3 Model"). ``min_p`` comes with a
#: temperature: vLLM drops it from greedy requests before any platform sees it.
EAGLE3_REFUSED: tuple[tuple[str, dict], ...] = (
    ("logprobs", {"logprobs": 2}),
    ("prompt_logprobs", {"prompt_logprobs": 1}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.3}),
    ("min_p", {"min_p": 0.2, "temperature": 0.8}),
    ("min_tokens", {"min_tokens": 3}),
    ("seed", {"seed": 7, "temperature": 0.8}),
    ("logit_bias", {"logit_bias": {"5": 2.0}}),
    ("allowed_token_ids", {"allowed_token_ids": [5, 6, 7]}),
    ("bad_words", {"bad_words": ["zebra"]}),
    ("structured_outputs", {"structured_outputs": {"choice": ["yes", "no"]}}),
)


def _eagle3(lab):
    try:
        return lab.eagle3_release()
    except ArtifactUnavailable as exc:
        pytest.skip(str(exc))


def test_eagle3_greedy(target, record, device_labs):
    """Speculation must not change greedy output: on the simulator every completion equals the
    base's plain greedy decoding token for token (max_tokens cutting rounds at several points)."""
    lab = _lab(device_labs, target)
    release = _eagle3(lab)
    server = lab.server(release, [])
    prompts = _prompts(3, 60, seed=47)
    lengths = (24, 7, 13)
    got = [completion_ids(server.complete(p, n, return_token_ids=True, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    assert [len(g) for g in got] == list(lengths)
    golden = lab.eagle3_golden()
    if golden is not None:
        assert got == [golden.generate_greedy(p, n) for p, n in zip(prompts, lengths)]
    else:  # a board: greedy is deterministic, so a rerun must agree
        again = [completion_ids(server.complete(p, n, return_token_ids=True, ignore_eos=True))
                 for p, n in zip(prompts, lengths)]
        assert again == got
    record.figure("prompts", len(prompts))


def test_eagle3_streaming_arrives_in_rounds(target, record, device_labs):
    """Each engine step returns all of a speculative round's tokens, so a stream arrives a few
    tokens per chunk; the streamed tokens are the non-streamed completion's."""
    lab = _lab(device_labs, target)
    release = _eagle3(lab)
    server = lab.server(release, [])
    prompt = _prompts(1, 50, seed=53)[0]
    want = completion_ids(server.complete(prompt, 40, return_token_ids=True, ignore_eos=True))
    chunks: list[list[int]] = []
    for obj in vs.stream_lines(server, "/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 40,
                                                            "temperature": 0.0, "ignore_eos": True,
                                                            "return_token_ids": True}):
        ids = (obj.get("choices") or [{}])[0].get("token_ids")
        if ids:
            chunks.append(list(ids))
    assert [t for c in chunks for t in c] == want
    assert max(len(c) for c in chunks) > 1, f"every chunk carried one token: {chunks}"
    record.figure("chunks", len(chunks))
    record.figure("tokens_per_chunk", round(len(want) / len(chunks), 2))


def test_eagle3_request_refusals(target, record, device_labs):
    """Every sampling parameter but temperature, top_k and top_p gets HTTP 400 naming it; the
    server keeps serving (greedy, and sampling with temperature/top_k/top_p)."""
    lab = _lab(device_labs, target)
    release = _eagle3(lab)
    server = lab.server(release, [])
    prompt = _prompts(1, 20, seed=59)[0]
    served: list[str] = []  # every parameter not refused with a 400 naming it, in order
    for name, params in EAGLE3_REFUSED:
        res = server.complete(prompt, 4, **params)
        if res.status != 400 or name not in json.dumps(res.body):
            served.append(f"{name} (HTTP {res.status})")
    assert not served, f"not refused with a 400 naming it: {', '.join(served)}"
    sampled = server.complete(prompt, 12, temperature=0.9, top_k=20, top_p=0.9, return_token_ids=True, ignore_eos=True)
    assert len(completion_ids(sampled)) == 12
    golden = lab.eagle3_golden()
    got = completion_ids(server.complete(prompt, 10, return_token_ids=True, ignore_eos=True))
    if golden is not None:
        assert got == golden.generate_greedy(prompt, 10)
    assert server.healthy()
    record.figure("refused_parameters", len(EAGLE3_REFUSED))


def test_eagle3_start_rules(target, record, device_labs):
    """One sequence per base MXQ: a configured max_batch_size above 1 stops the server naming it;
    prefix caching is off and max_num_seqs is 1 (every request feeds its whole prompt)."""
    lab = _lab(device_labs, target)
    release = _eagle3(lab)
    log = lab.refused_start(release, ["--model-loader-extra-config", json.dumps({"max_batch_size": 2})])  # a refused start
    assert "EAGLE-3 models serve one sequence per base MXQ, but max_batch_size=2 was configured." in log, log[-3000:]
    [cfg] = lab.engine_configs([["--model", str(release), "--enable-prefix-caching"]])
    assert "error" not in cfg, cfg
    assert cfg["enable_prefix_caching"] is False and cfg["max_num_seqs"] == 1, cfg
    record.figure("max_model_len", cfg["max_model_len"])


# ---------------------------------------------------------------------------------------------
# Qwen3-ASR (issue 14 §2)

#: The documented command line of a Qwen3-ASR server (``--max-num-seqs 1``: the artifact declares
#: no max_batch_size, so without it vLLM interleaves requests on the batch-1 decoder).
ASR_ARGS = ["--max-num-seqs", "1"]
ASR_PREFACE = "language English<asr_text>"


def _asr(lab):
    try:
        return lab.asr_release()
    except ArtifactUnavailable as exc:
        pytest.skip(str(exc))


def _pcm(wav: bytes):
    """The float32 samples of a WAV written by :func:`npu_conformance.audio.wav_bytes`, as vLLM's
    decoder reads them."""
    import numpy as np

    return np.frombuffer(wav[44:], dtype="<i2").astype(np.float32) / 32768.0


class _AsrCase:
    """The clips a scenario sends and, on the simulator, what the golden pipeline makes of them."""

    def __init__(self, lab) -> None:
        from npu_conformance.audio import wav_bytes

        self.lab = lab
        self.release = _asr(lab)
        self.golden = lab.asr_golden()
        from npusim.tinymodel import asr as tiny_asr

        self.tiny = tiny_asr
        self.names = sorted(tiny_asr.CLIPS)
        self.wav = {n: wav_bytes(tiny_asr.clip_samples(n)) for n in self.names}
        #: the samples as the server decodes the WAV (16-bit PCM / 32768)
        self.samples = {n: _pcm(w) for n, w in self.wav.items()}
        self._tok = None

    def server(self) -> vs.Server:
        return self.lab.server(self.release, ASR_ARGS)

    @property
    def tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.release))
        return self._tok

    def golden_text(self, samples, *, language: str | None = None, context: str | None = None,
                    max_new_tokens: int | None = 64) -> str | None:
        """The golden transcript of one chunk (as the server decodes it), None on hardware. The
        prompt is vLLM's Qwen3-ASR transcription prompt, built here from its documented format.
        ``max_new_tokens`` None: up to the 2048-token limit (a transcription's default)."""
        if self.golden is None:
            return None
        from npusim.llm.audio_encoder import audio_token_count
        from npusim.llm.mel import log_mel

        mel = log_mel(samples)
        n = audio_token_count(mel.shape[1])
        text = (f"<|im_start|>system\n{context}<|im_end|>\n" if context else "")
        text += (f"<|im_start|>user\n<|audio_start|>{'<|audio_pad|>' * n}<|audio_end|><|im_end|>\n"
                 "<|im_start|>assistant\n")
        if language:
            text += f"language {language}<asr_text>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        eos = json.loads((self.release / "generation_config.json").read_text())["eos_token_id"]
        if max_new_tokens is None:
            max_new_tokens = 2048 - len(ids)
        out = self.golden.generate_greedy(ids, mel, max_new_tokens, eos if isinstance(eos, list) else [eos])
        return self.tokenizer.decode(out, skip_special_tokens=True)


def _text(res) -> str:
    assert res.status == 200, (res.status, res.body)
    return res.body["text"] if isinstance(res.body, dict) else res.body


def test_asr_transcription_greedy(target, record, device_labs):
    """``/v1/audio/transcriptions``: with ``language`` the text is the transcript alone; without it
    the model's own ``language English<asr_text>`` preface is kept before it. On the simulator each
    clip's text equals the golden pipeline's (the tiny model is fitted to known transcripts); on a
    board, a rerun agrees."""
    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    for name in case.names:
        forced = _text(server.transcribe(case.wav[name], language="en", temperature=0))
        native = _text(server.transcribe(case.wav[name], temperature=0))
        if case.golden is not None:
            assert forced == case.golden_text(case.samples[name], language="English") == case.tiny.TRANSCRIPTS[name]
            assert native == case.golden_text(case.samples[name]) == ASR_PREFACE + case.tiny.TRANSCRIPTS[name]
        else:
            assert forced == _text(server.transcribe(case.wav[name], language="en", temperature=0))
            assert native.startswith("language "), native
    record.figure("clips", len(case.names))


def test_asr_long_audio_is_chunked(target, record, device_labs):
    """Audio longer than the 30 s window is split by vLLM and transcribed chunk by chunk: the text
    is the chunks' texts joined by a space, and without ``language`` the preface comes once per
    chunk."""
    from vllm.multimodal.audio import split_audio

    from npu_conformance.audio import SAMPLE_RATE, wav_bytes

    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    import numpy as np

    clip = np.concatenate([case.samples[n] for n in case.names] * 12)[: 38 * SAMPLE_RATE]
    # what vLLM 0.32's transcription endpoint does with it (its defaults: 30 s, 1 s overlap search, 1600)
    chunks = split_audio(clip.astype(np.float32), SAMPLE_RATE, max_clip_duration_s=30,
                         overlap_duration_s=1, min_energy_window_size=1600)
    assert len(chunks) == 2
    native = _text(server.transcribe(wav_bytes(clip), temperature=0))
    if case.golden is not None:  # the tiny model is fitted on short clips: a 30 s chunk gives other text
        parts = split_audio(_pcm(wav_bytes(clip)), SAMPLE_RATE, max_clip_duration_s=30, overlap_duration_s=1,
                            min_energy_window_size=1600)
        assert native == " ".join(case.golden_text(p, max_new_tokens=None) for p in parts)
    else:  # a real model prefaces each chunk's text
        assert native.count(ASR_PREFACE.split("<")[0]) == len(chunks), native
    record.figure("chunks", len(chunks))


def _audio_part(wav: bytes) -> dict:
    import base64

    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def _chat(server, messages, max_tokens: int = 64):
    return server.request("POST", "/v1/chat/completions", {"model": server.model, "messages": messages,
                                                           "max_tokens": max_tokens, "temperature": 0})


def test_asr_prompt_and_chat(target, record, device_labs):
    """The transcription ``prompt`` reaches the model as context (a system turn); on the chat
    endpoint only the system message and the audio are kept (a user text part changes nothing),
    and the reply starts with the model's preface."""
    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    name = case.names[0]
    context = "tones and beeps"
    with_prompt = _text(server.transcribe(case.wav[name], language="en", prompt=context, temperature=0))
    system = {"role": "system", "content": context}
    res = _chat(server, [system, {"role": "user", "content": [{"type": "text", "text": "please ignore this"},
                                                               _audio_part(case.wav[name])]}])
    assert res.status == 200, res.body
    chat = res.body["choices"][0]["message"]["content"]
    res = _chat(server, [system, {"role": "user", "content": [_audio_part(case.wav[name])]}])
    assert res.status == 200, res.body
    assert res.body["choices"][0]["message"]["content"] == chat
    if case.golden is not None:
        assert with_prompt == case.golden_text(case.samples[name], language="English", context=context)
        assert chat == case.golden_text(case.samples[name], context=context)
    else:  # a real model's reply starts with its preface (the tiny one is fitted without context)
        assert chat.startswith("language "), chat
    record.figure("chat_reply_chars", len(chat))


def test_asr_endpoint_rules(target, record, device_labs):
    """``max_model_len`` is clamped to 2048 (log line; ``/v1/models`` says so); a chat request
    whose audio runs past it gets HTTP 400, the same audio sent again gets its 400 again, and sent
    to the transcription endpoint (which splits it) it is served: the processor cache is off, so
    the refused request left nothing out of step. One clip per request: two clips get 400. ``/v1/audio/translations``
    gets 400: the model transcribes and does not translate."""
    import numpy as np

    from npu_conformance.audio import SAMPLE_RATE, wav_bytes

    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    models = server.request("GET", "/v1/models").body
    assert models["data"][0]["max_model_len"] == 2048, models
    assert "Clamping max_model_len from" in server.log_text()
    name = case.names[0]
    res = server.transcribe(case.wav[name], path="/v1/audio/translations", temperature=0)
    assert res.status == 400 and "does not translate" in json.dumps(res.body), (res.status, res.body)
    res = _chat(server, [{"role": "user", "content": [_audio_part(case.wav[name]), _audio_part(case.wav[name])]}])
    assert res.status == 400, (res.status, res.body)
    long_clip = wav_bytes(np.concatenate([case.samples[n] for n in case.names] * 60)[: 170 * SAMPLE_RATE])
    for _ in range(2):  # refused after preprocessing (2223 tokens), and the same audio again
        res = _chat(server, [{"role": "user", "content": [_audio_part(long_clip)]}])
        assert res.status == 400 and "maximum context length (2048)" in json.dumps(res.body), (
            res.status, str(res.body)[:500])
    again = server.transcribe(long_clip, language="en", temperature=0)
    assert again.status == 200 and _text(again), (again.status, str(again.body)[:500])
    assert _text(server.transcribe(case.wav[name], language="en", temperature=0)) == (
        case.golden_text(case.samples[name], language="English")
        if case.golden is not None else _text(server.transcribe(case.wav[name], language="en", temperature=0)))
    record.figure("long_clip_chars", len(_text(again)))


def test_asr_hostile_uploads(target, record, device_labs):
    """Malformed and truncated audio files each get a 4xx naming the problem, and the server
    stays up and keeps transcribing correctly (vLLM 0.11.2 could hang on some malformed long
    uploads; vLLM 0.32 must not)."""
    from npu_conformance.audio import hostile_uploads

    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    long_name = max(case.names, key=lambda n: len(case.wav[n]))
    statuses = {}
    for kind, data in hostile_uploads(case.wav[long_name]).items():
        t0 = time.monotonic()
        res = server.transcribe(data, language="en", temperature=0, timeout=120)
        statuses[kind] = res.status
        assert 400 <= res.status < 500, (kind, res.status, str(res.body)[:300])
        assert time.monotonic() - t0 < 60, kind
        assert server.healthy(), kind
    truncated = hostile_uploads(case.wav[long_name])["truncated"]
    res = _chat(server, [{"role": "user", "content": [_audio_part(truncated)]}])  # inline audio too
    assert res.status == 400 and "messages[0].content[0]" in json.dumps(res.body), (res.status, res.body)
    name = case.names[0]
    got = _text(server.transcribe(case.wav[name], language="en", temperature=0))
    if case.golden is not None:
        assert got == case.golden_text(case.samples[name], language="English")
    record.figure("hostile_uploads", len(statuses) + 1)


def test_asr_start_rules(target, record, device_labs):
    """vLLM's resolved config for a Qwen3-ASR release: ``max_model_len`` 2048 (an explicit larger
    value is clamped too), prefix caching off; more than one clip per prompt, and a top-level
    ``mxq_path`` (the release has two MXQs), stop the server naming the value."""
    lab = _lab(device_labs, target)
    release = _asr(lab)
    runs = lab.engine_configs([["--model", str(release)],
                               ["--model", str(release), "--max-model-len", "4096", "--enable-prefix-caching"],
                               ["--model", str(release), "--limit-mm-per-prompt", json.dumps({"audio": 2})]])
    for cfg in runs[:2]:
        assert "error" not in cfg, cfg
        assert cfg["max_model_len"] == 2048 and cfg["enable_prefix_caching"] is False, cfg
    assert runs[0]["max_num_seqs"] == 1, runs[0]  # no max_batch_size declared: one sequence, as --max-num-seqs 1
    assert "--limit-mm-per-prompt audio=2" in runs[2]["error"], runs[2]
    log = lab.refused_start(release, ["--model-loader-extra-config", json.dumps({"mxq_path": "decoder.mxq"})])  # refused
    assert "a single top-level mxq_path is only meaningful for single-module text models" in log, log[-3000:]
    record.figure("max_model_len", runs[0]["max_model_len"])


def test_asr_concurrent_requests(target, record, device_labs):
    """Concurrent transcriptions on the documented ``--max-num-seqs 1`` server each equal the
    same request sent alone; a streamed transcription's deltas join to the same text."""
    case = _AsrCase(_lab(device_labs, target))
    server = case.server()
    solo = [_text(server.transcribe(case.wav[n], language="en", temperature=0)) for n in case.names]
    with cf.ThreadPoolExecutor(len(case.names)) as ex:
        together = list(ex.map(lambda n: _text(server.transcribe(case.wav[n], language="en", temperature=0)),
                               case.names))
    assert together == solo
    form = {"model": server.model, "language": "en", "temperature": "0", "stream": "true"}
    body, ctype = vs.multipart(form, {"file": ("clip.wav", case.wav[case.names[0]], "audio/wav")})
    raw = server.request("POST", "/v1/audio/transcriptions", body, content_type=ctype)
    assert raw.status == 200, raw.body
    deltas = [json.loads(line[len("data: "):]) for line in str(raw.body).splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(d["choices"][0].get("delta", {}).get("content") or "" for d in deltas if d.get("choices"))
    assert streamed == solo[0], (streamed, solo[0])
    record.figure("concurrent", len(case.names))
