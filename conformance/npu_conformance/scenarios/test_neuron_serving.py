"""Neuron serving scenarios: ``vllm serve`` with the Neuron plugin on ``neuron-sim`` / ``neuron-hw``.

What every serving target must do is the device-neutral suite (``test_serving.py``); these are
the Neuron behaviours of the seed (``docs/neuron.md``), through real ``vllm serve`` processes
and the planning tool ``npu-harness neuron plan``, which runs the platform's own code path
(``npu_conformance.devices.neuron``):

* ``bucket_choice_and_padding``: 3 and then 5 concurrent requests decode on the ``decode_b4`` /
  ``decode_b8`` NEFFs (padding rows visible in ``vllm_neuron:num_seqs_padding``), every prefill
  is padded to its bucket, outputs equal the golden decoder, and ``/metrics`` counters move;
* ``segmented_long_prompt``: a prompt longer than ``max_num_batched_tokens`` is prefilled in
  several one-request steps (``prefill_s512_kv512`` executions) and equals the golden decoder;
* ``prefix_reuse``: a prompt sharing 512 tokens with an earlier one hits vLLM's prefix cache
  (``vllm:prefix_cache_hits``), runs fewer prefill segments, and equals the golden decoder;
* ``runner_selection``: Model Runner V1/V2 for the seed's cases (unset, ``=0``, ``=1`` forced
  with its warning, decode context buckets, CPU sampling, enforce-eager), and the serving
  server logs ``Using the standalone V2 Neuron model runner.``;
* ``config_rejections``: every bucket, parallelism and quantization rule the seed states, each
  with its message from the planning tool, and one of them from a real ``vllm serve`` start;
* ``memory_budget``: the default and headroom formulas' figures, and the failure modes
  (below-minimum budget, bad cap fraction) from the plan and from a real start;
* ``async_flow``: the same workload on MRv2 and MRv1 (``VLLM_USE_V2_MODEL_RUNNER=0``): MRv1
  counts a sync fallback whenever a request finishes, MRv2 only when requests join;
* ``metrics``: every ``vllm_neuron:`` metric on ``/metrics`` with its type and labels;
* ``warm_start_and_compiled_artifacts``: a second start with the same configuration loads every
  NEFF from the compile cache; ``NEURON_COMPILED_ARTIFACTS`` empty is filled, then loaded from.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil

import pytest

from npu_conformance import vllm_server as vs
from npu_conformance.devices import neuron as nd
from npu_conformance.devices.base import golden_ids as _golden
from npu_conformance.devices.base import random_prompts as _prompts
from npu_conformance.vllm_server import greedy_ids as _ids

pytestmark = pytest.mark.scenario(devices=("neuron",))

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def _metrics(server) -> dict[tuple[str, str], float]:
    """``/metrics`` samples: ``(name, labels text) -> value``."""
    res = server.request("GET", "/metrics")
    assert res.status == 200, res.body
    out: dict[tuple[str, str], float] = {}
    for line in str(res.body).splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def _metric(samples, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for (n, lab), v in samples.items():
        if n == name and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            total += v
    return total


def _check_golden(lab, prompts, outs, n):
    for p, o in zip(prompts, outs):
        want = _golden(lab, p, n)
        if want is not None:
            assert o == want, f"prompt of {len(p)} tokens: {o} != golden {want}"


def test_bucket_choice_and_padding(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    before = _metrics(server)
    seen = {}
    for n, seed in ((3, 1), (5, 2)):
        prompts = _prompts(n, 40, seed=seed)
        with cf.ThreadPoolExecutor(n) as ex:
            outs = list(ex.map(lambda p: _ids(server, p, 24), prompts))
        _check_golden(lab, prompts, outs, 24)
        seen[n] = outs
    after = _metrics(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # the real request counts of decode steps on the padded NEFFs (3 -> b4, 5 -> b8)
    b4 = _metric(delta, "vllm_neuron:num_seqs_padding_count", bucket_name="decode_b4")
    b8 = _metric(delta, "vllm_neuron:num_seqs_padding_count", bucket_name="decode_b8")
    assert b4 > 0, "no decode step ran on decode_b4 for 3 concurrent requests"
    assert b8 > 0, "no decode step ran on decode_b8 for 5 concurrent requests"
    prefills = _metric(delta, "vllm_neuron:num_batched_tokens_padding_count", bucket_name="prefill_s512")
    padded = _metric(delta, "vllm_neuron:num_batched_tokens_padding_sum", bucket_name="prefill_s512")
    assert prefills == 8, f"{prefills} prefill steps for 8 prompts (one prefill per step)"
    assert padded == 8 * 512, "every prefill is padded to its 512-token bucket"
    execs = _metric(delta, "vllm_neuron:neff_execution_count_total")
    assert execs >= 8 + 23, f"NEFF executions did not move as requests were served ({execs})"
    record.figure("decode_b4_steps", int(b4))
    record.figure("decode_b8_steps", int(b8))
    real_rows = _metric(delta, "vllm_neuron:num_seqs_padding_sum", bucket_name="decode_b8")
    record.figure("decode_b8_padding_rows", int(8 * b8 - real_rows))


def test_segmented_long_prompt(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    prompt = _prompts(1, 700, seed=3)[0]
    before = _metrics(server)
    out = _ids(server, prompt, 16)
    after = _metrics(server)
    _check_golden(lab, [prompt], [out], 16)
    segs = (_metric(after, "vllm_neuron:neff_execution_count_total", bucket_name="prefill_s512_kv512")
            - _metric(before, "vllm_neuron:neff_execution_count_total", bucket_name="prefill_s512_kv512"))
    assert segs == 2, f"a 700-token prompt took {segs} prefill executions, expected 2 segments of 512"
    record.figure("segments", int(segs))


def test_prefix_reuse(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    shared = _prompts(1, 512, seed=11)[0]
    first, second = shared + _prompts(1, 60, seed=12)[0], shared + _prompts(1, 70, seed=13)[0]
    out1 = _ids(server, first, 12)
    before = _metrics(server)
    out2 = _ids(server, second, 12)
    after = _metrics(server)
    _check_golden(lab, [first, second], [out1, out2], 12)
    hits = _metric(after, "vllm:prefix_cache_hits_total") - _metric(before, "vllm:prefix_cache_hits_total")
    segs = (_metric(after, "vllm_neuron:neff_execution_count_total", bucket_name="prefill_s512_kv512")
            - _metric(before, "vllm_neuron:neff_execution_count_total", bucket_name="prefill_s512_kv512"))
    assert hits >= 512, f"the shared 512-token prefix was not reused ({hits} prefix-cache hit tokens)"
    assert segs == 1, f"the reused prompt ran {segs} prefill segments, expected 1 (the 512 reused tokens skipped)"
    record.figure("prefix_hit_tokens", int(hits))


_BASE = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
         "--block-size", "32", "--num-gpu-blocks-override", "512"]


def _neuron_cfg(**cfg) -> list[str]:
    return ["--additional-config", json.dumps({"neuron_config": cfg})]


def test_runner_selection(target, record, device_labs):
    lab = device_labs(target.name)
    cases = [
        # (args, env, use_v2, a log text that must appear in the plan's runner.logged or None)
        ([], {}, True, None),
        ([], {"VLLM_USE_V2_MODEL_RUNNER": "0"}, False, None),
        (_neuron_cfg(decode_context_length_buckets=[256]), {}, False,
         "Neuron Model Runner V2 does not yet support decode_context_length_buckets; using V1."),
        (["--no-async-scheduling", *_neuron_cfg(on_device_sampling_config=None)], {}, False,
         "Neuron Model Runner V2 does not yet support"),
        (["--enforce-eager"], {}, False, "Neuron Model Runner V2 does not yet support"),
        (_neuron_cfg(decode_context_length_buckets=[256]), {"VLLM_USE_V2_MODEL_RUNNER": "1"}, True,
         "VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported features ("),
    ]
    results = nd.plans(lab, lab.hf_dir(), [([*_BASE, *args], env) for args, env, _v2, _t in cases])
    for (args, env, v2, text), (code, plan) in zip(cases, results):
        assert code == 0 and plan is not None, f"{args} {env}: {plan and plan['errors']}"
        assert plan["runner"]["use_v2"] is v2, f"{args} {env}: {plan['runner']}"
        if text is not None:
            assert text in (plan["runner"]["logged"] or ""), f"{args} {env}: {plan['runner']}"
    server = lab.serving_server()
    assert "Using the standalone V2 Neuron model runner." in server.log_text()
    record.figure("cases", len(cases))


#: (neuron_config / extra args, env, the message the configuration must fail with)
_REJECTIONS = [
    (_neuron_cfg(num_batched_tokens_buckets=[128, 256]), {},
     "Last bucket in num_batched_tokens_buckets must equal max_num_batched_tokens (512), got 256"),
    (_neuron_cfg(num_seqs_buckets=[4, 2, 8]), {}, "num_seqs_buckets must be in strictly ascending order"),
    (_neuron_cfg(decode_context_length_buckets=[100]), {}, "must be divisible by 128"),
    (_neuron_cfg(ep_degree=2), {}, "ep_degree=2 requires --enable-expert-parallel to be set."),
    (_neuron_cfg(attention_dp_size=2), {}, "requires disaggregated inference (--kv-transfer-config)"),
    (_neuron_cfg(quantization="mxfp4"), {}, "quantization='mxfp4' is only supported for gpt-oss models"),
    (["--kv-cache-dtype", "fp8_e5m2"], {}, "Unsupported kv_cache_dtype 'fp8_e5m2' on Neuron."),
    (["--max-num-batched-tokens", "300"], {}, "max_num_batched_tokens=300 is not a supported chunked prefill size on Neuron."),
    (["--max-num-batched-tokens", "1024", "--enable-prefix-caching"], {},
     "Automatic Prefix Caching (APC) requires segmented prefill to be enabled."),
    (_neuron_cfg(bogus_key=1), {}, "Unknown neuron_config key(s) ['bogus_key']"),
    (_neuron_cfg(on_device_sampling_config=None), {}, "On-device sampling must be enabled for async execution"),
    (["--no-async-scheduling", *_neuron_cfg(on_device_sampling_config=None)], {}, None),  # valid: CPU sampling
]


def _variant(lab, name: str, **config):
    """A copy of the lab's model whose ``config.json`` is updated with ``config`` (for planning
    only: the weights are the tiny llama's)."""
    out = lab.workdir / name
    if not out.exists():
        shutil.copytree(lab.hf_dir(), out)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


_GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_local_experts": 4,
            "num_experts_per_tok": 2}
_CT_W4 = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 32}}}}}


def test_config_rejections(target, record, device_labs):
    lab = device_labs(target.name)
    # MXFP4: gpt-oss only, Trn3 only (the plan of a gpt-oss-shaped config; MoE itself is not executed)
    oss = _variant(lab, "tiny-gpt-oss-config", **_GPT_OSS)
    mx = [*_BASE, *_neuron_cfg(quantization="mxfp4")]
    ep_args = [*_BASE, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--data-parallel-size", "2",
               *_neuron_cfg(ep_degree=2)]
    (_c2, trn2), (_c3, trn3), (_ce, ep) = nd.plans(lab, oss, [(mx, {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}),
                                                             (mx, {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}),
                                                             (ep_args, {})])
    trn2, trn3, ep = trn2["errors"], trn3["errors"], ep["errors"]
    assert any("quantization='mxfp4' is not supported on TRN2. Please use quantization='bf16'" in e for e in trn2), trn2
    assert not any("mxfp4" in e for e in trn3), trn3
    assert any("Combining DP with EP requires ep_degree = TP × DP (2 × 2 = 4), got ep_degree=2." in e for e in ep), ep
    assert any("parallelism is validated by the Neuron plugin but not run" in e for e in ep), ep
    ((_cc, ct),) = nd.plans(lab, _variant(lab, "tiny-ct-w4", **_CT_W4), [(list(_BASE), {})])
    assert any("Unsupported compressed-tensors quantization scheme on Neuron" in e for e in ct["errors"]), ct["errors"]
    results = nd.plans(lab, lab.hf_dir(), [([*_BASE, *args], env) for args, env, _w in _REJECTIONS]
                       + [([*_BASE, *_neuron_cfg(ep_degree=2, quantization="mxfp4")], {})])
    for (args, env, want), (code, plan) in zip(_REJECTIONS, results):
        if want is None:
            assert code == 0 and plan is not None and not plan["errors"], f"{args}: {plan and plan['errors']}"
            continue
        errors = (plan or {}).get("errors") or []
        assert code == 1 and any(want in e for e in errors), f"{args}: {want!r} not in {errors}"
    code, plan = results[-1]  # every error of one configuration at once
    assert code == 1 and len(plan["errors"]) >= 2, plan["errors"]
    # the same rule from a real (fresh) start: the server exits with the message
    log = lab.refused_start(lab.hf_dir(), [*_BASE, *_neuron_cfg(ep_degree=2)])
    assert "ep_degree=2 requires --enable-expert-parallel to be set." in log
    record.figure("rejections", sum(1 for r in _REJECTIONS if r[2]) + 4)


def test_memory_budget(target, record, device_labs):
    lab = device_labs(target.name)
    runs = [([*_BASE, "--gpu-memory-utilization", "0.5"], {}),
            (list(_BASE), {"VLLM_NEURON_RESERVED_HEADROOM_GIB": "4"}),
            ([*_BASE, "--gpu-memory-utilization", "0.1"], {}),
            (list(_BASE), {"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION": "1.5"}),
            ([*_BASE, "--gpu-memory-utilization", "0.1"], {"VLLM_NEURON_MIN_KV_BUDGET_GIB": "0"}),
            (list(_BASE), {"VLLM_NEURON_RESERVED_HEADROOM_GIB": "30"})]
    (_, frac), (_, head), (low_code, low), (cap_code, cap), (off_code, off), (big_code, big) = nd.plans(
        lab, lab.hf_dir(), runs)
    b = frac["kv_budget"]
    total = int(b["logical_core_hbm_bytes"] * 0.5)
    assert b["mode"] == "fractional_cap" and b["total_budget"] == total
    assert b["available_bytes"] == max(min(max(total - b["model_weight_bytes"], 0), int(total * 0.30)), 0)
    h = head["kv_budget"]
    assert h["available_bytes"] == max(h["logical_core_hbm_bytes"] - h["model_weight_bytes"] - 4 * 2**30, 0)
    assert h["effective_gpu_memory_utilization"] == 1.0
    assert low_code == 1 and any("Computed KV cache budget is below minimum threshold." in e for e in low["errors"])
    assert cap_code == 1 and any("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION must be in (0, 1]. Got 1.5." in e
                                 for e in cap["errors"]), cap["errors"]
    assert off_code == 0, off["errors"]
    assert big_code == 1 and any("below minimum threshold" in e and "VLLM_NEURON_RESERVED_HEADROOM_GIB" in e
                                 for e in big["errors"]), big["errors"]
    log = lab.refused_start(lab.hf_dir(), [*_BASE, "--gpu-memory-utilization", "0.1"])  # a refused start
    assert "Computed KV cache budget is below minimum threshold." in log
    record.figure("fractional_cap_gib", round(b["available_bytes"] / 2**30, 3))
    record.figure("headroom_gib", round(h["available_bytes"] / 2**30, 3))


_ASYNC_LINE = re.compile(r"Neuron async flow \(Model Runner (V[12])\): (\d+) async steps, (\d+) sync fallbacks")


def _async_counts(log: str) -> tuple[str, int, int]:
    found = _ASYNC_LINE.findall(log)
    assert found, "no async-flow line logged"
    runner, steps, fallbacks = found[-1]
    return runner, int(steps), int(fallbacks)


def test_async_flow(target, record, device_labs):
    """The same workload (4 requests finishing at different steps) on MRv2 and MRv1: the seed's
    MRv1 breaks the async flow whenever the batch composition changes, MRv2 only when new
    requests join."""
    lab = device_labs(target.name)
    prompts = _prompts(4, 16, seed=41)
    lengths = (40, 80, 120, 180)

    def run(server) -> str:
        with cf.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda pl: _ids(server, pl[0], pl[1]), zip(prompts, lengths)))
        for p, n, o in zip(prompts, lengths, outs):
            _check_golden(lab, [p], [o], n)
        return server.log_text()

    counts = []
    for i, env in enumerate(({}, {"VLLM_USE_V2_MODEL_RUNNER": "0"})):  # a fresh server each: fresh counters
        srv = vs.start(lab.hf_dir(), lab.serving_args(), env=lab.env(**env), log=lab.workdir / f"async-{i}.log")
        try:
            counts.append(_async_counts(run(srv)))
        finally:
            srv.stop()
    (r2, _s2, fb2), (r1, _s1, fb1) = counts
    assert (r1, r2) == ("V1", "V2")
    assert fb1 >= 3, f"MRv1: {fb1} sync fallbacks for 3 finishing requests"
    assert fb2 < fb1, f"MRv2 ({fb2}) must break the async flow less often than MRv1 ({fb1})"
    record.figure("v1_sync_fallbacks", fb1)
    record.figure("v2_sync_fallbacks", fb2)


_METRICS = {
    "vllm_neuron:num_seqs_padding": "histogram", "vllm_neuron:num_batched_tokens_padding": "histogram",
    "vllm_neuron:neff_execution_count": "counter", "vllm_neuron:compilation_time_seconds": "gauge",
    "vllm_neuron:startup_time_seconds": "gauge", "vllm_neuron:model_load_time_seconds": "gauge",
    "vllm_neuron:model_load_size_bytes": "gauge",
}


def test_metrics(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    _ids(server, _prompts(1, 20, seed=21)[0], 4)
    text = str(server.request("GET", "/metrics").body)
    for name, kind in _METRICS.items():  # a counter's TYPE line may carry the _total suffix
        assert re.search(rf"^# TYPE {re.escape(name)}(_total)? {kind}$", text, re.M), f"{name} ({kind}) missing"
    samples = _metrics(server)
    model = str(lab.hf_dir())
    assert _metric(samples, "vllm_neuron:model_load_size_bytes", model_name=model) > 0
    assert _metric(samples, "vllm_neuron:startup_time_seconds", model_name=model) > 0
    assert 'le="128.0"' in text and 'le="16384.0"' in text, "the reference's histogram buckets"
    for b in (1, 2, 4, 8):  # labels pre-created for every decode bucket
        assert f'bucket_name="decode_b{b}"' in text
    record.figure("metrics", len(_METRICS))


def test_warm_start_and_compiled_artifacts(target, record, device_labs):
    lab = device_labs(target.name)
    lab.serving_server()  # compiled the standard NEFFs into this session's cache
    art = lab.workdir / "compiled-artifacts"
    shutil.rmtree(art, ignore_errors=True)
    art.mkdir()
    prompt = _prompts(1, 30, seed=31)[0]
    logs, outs = [], []
    # fresh starts: what a start compiles, and what a restart reuses, is the subject
    for i, env in enumerate(({}, {"NEURON_COMPILED_ARTIFACTS": str(art)}, {"NEURON_COMPILED_ARTIFACTS": str(art)})):
        srv = vs.start(lab.hf_dir(), lab.serving_args(), env=lab.env(**env), log=lab.workdir / f"warm-{i}.log")
        try:
            outs.append(_ids(srv, prompt, 8))
        finally:
            srv.stop()
        logs.append(srv.log_text())
    warm, fill, load = logs
    assert "from compile cache (5 hit(s), 0 compiled)" in warm, "a warm start must reuse every cached NEFF"
    assert "Saved 5 compiled NEFFs to NEURON_COMPILED_ARTIFACTS=" in fill
    assert "loaded from NEURON_COMPILED_ARTIFACTS" in load
    assert (art / "neuron_config.json").is_file()
    assert outs[0] == outs[1] == outs[2]
    _check_golden(lab, [prompt], [outs[0]], 8)
    record.figure("neffs", 5)
