"""RBLN serving scenarios: ``vllm serve`` with the RBLN plugin on ``rbln-sim`` / ``rbln-hw``.

What every serving target must do is the device-neutral suite (``test_serving.py``); these are
the RBLN-specific behaviours of the seed (``docs/rbln.md``), through real ``vllm serve``
processes or vLLM's own ``EngineArgs.create_engine_config`` with the RBLN platform
(``npu_conformance.devices.rbln``):

* ``impl_matrix``: ``--model-impl`` auto / transformers / optimum / vllm x ATOM / Rebel100 x an
  architecture optimum-rbln implements or not x a compiled directory: which path each takes,
  the ``vllm`` path refused on ATOM naming the device and what selected it.
* ``option_rejections``: a ``--rbln-*`` option of the other path is rejected listing it; a
  deprecated ``VLLM_RBLN_*`` variable and a renamed ``additional_config`` key still work, with
  their warnings.
* ``compile_cache_reuse_and_invalidation``: a second start with the same configuration loads
  the compile cache (log, no compile, faster); a changed ``--max-num-seqs`` compiles anew.
* ``decode_buckets_and_padding``: concurrent requests run on the smallest compiled decoder
  that fits, padded, with outputs equal to the golden decoder.
* ``chunked_long_prompt``: a prompt of several prefill chunks equals the golden decoder.
* ``prefix_reuse``: a prompt sharing 256 tokens with a finished request takes over its KV block
  in place; one sharing them with a request still running gets them with the runtime's KV
  block copy; both equal the golden decoder (the reused start is a multiple of the chunk).
* ``compiled_dir_served``: a directory compiled ahead of time (optimum-rbln's own export) is
  served without compiling, with the scheduler taken from its ``rbln_config.json``.
* ``vllm_path_served``: ``--model-impl vllm`` on a Rebel100: vLLM's own model code compiled with
  ``rebel``'s torch.compile backend; warm-up compiles the prefill graph and one graph per decode
  bucket, completions (a chunked prompt, concurrent requests on padded buckets) and chat equal
  the golden decoder, and nothing compiles while serving; a second start of the same
  configuration loads the compile cache (the mega-cache bundle) the first one wrote.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil
import time

import pytest

from npu_conformance import prefork
from npu_conformance import vllm_server as vs
from npu_conformance.devices import rbln as rd
from npu_conformance.devices.base import golden_ids as _golden
from npu_conformance.devices.base import random_prompts as _prompts
from npu_conformance.vllm_server import greedy_ids as _ids

pytestmark = pytest.mark.scenario(devices=("rbln",))

LEN = "1024"


def _assert_golden_or_repeatable(lab, server, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    """Each of ``got`` (``n`` greedy tokens of ``prompts``, served concurrently) equals the golden
    decoder's; on a board without a golden model, a second, lone greedy run of the same prompt."""
    for p, g in zip(prompts, got):
        want = _golden(lab, p, n)
        assert g == (want if want is not None else _ids(server, p, n))


def _unsupported_arch_dir(lab):
    """The tiny model declared as an architecture vLLM runs and optimum-rbln does not."""
    out = lab.workdir / "tiny-internlm3"
    if not out.exists():
        shutil.copytree(lab.hf_dir(), out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["architectures"] = ["InternLM3ForCausalLM"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _compiled_dir(lab):
    """optimum-rbln's own export of the tiny model (batch 2, block 1024), made in a child
    process with the target's ``rebel``."""
    out = lab.workdir / "aot-compiled"
    if not (out / "rbln_config.json").exists():
        code = ("import sys; from optimum.rbln import RBLNLlamaForCausalLM as M; "
                "M.from_pretrained(sys.argv[1], export=True, model_save_dir=sys.argv[2], "
                "rbln_config={'batch_size': 2, 'max_seq_len': 1024})")
        proc = prefork.run_python(code, [str(lab.hf_dir()), str(out)], env=lab.env(), timeout=600,
                                  python=lab.python)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_impl_matrix(target, record, device_labs):
    lab = device_labs(target.name)
    hf, other, compiled = str(lab.hf_dir()), str(_unsupported_arch_dir(lab)), str(_compiled_dir(lab))
    base = ["--max-model-len", LEN, "--block-size", LEN]
    cases = [
        # (impl flag, device, model, expected path or refusal regex)
        ("auto", "RBLN-CA25", hf, "optimum"),
        ("transformers", "RBLN-CA25", hf, "optimum"),
        ("optimum", "RBLN-CR13", hf, "optimum"),
        ("auto", "RBLN-CA25", compiled, "optimum"),
        ("auto", "RBLN-CA25", other, r"The vllm model path is not supported on RBLN-CA25; the model's "
                                     r"architecture selected it\. Use a model optimum-rbln implements\."),
        ("vllm", "RBLN-CA25", hf, r"The vllm model path is not supported on RBLN-CA25; --model-impl vllm "
                                  r"selected it\. Use --model-impl optimum\."),
        ("transformers", "RBLN-CA25", other, r"Model architectures \['InternLM3ForCausalLM'\] are not "
                                             r"supported on RBLN for now"),
        ("bogus", "RBLN-CA25", hf, r"unsupported model implementation 'bogus'; --model-impl takes "
                                   r"\['auto', 'optimum', 'transformers', 'vllm'\] on RBLN"),
        # the vllm path on Rebel100: vLLM's own model code, compiled with rbln_backend
        ("vllm", "RBLN-CR13", hf, "vllm"),
        ("auto", "RBLN-CR13", other, "vllm"),
        ("vllm", "RBLN-CR13", compiled, r"--model-impl vllm cannot serve .*aot-compiled: it holds a compiled "
                                        r"optimum-rbln artifact"),
    ]
    done = 0
    for device in ("RBLN-CA25", "RBLN-CR13"):
        mine = [c for c in cases if c[1] == device]
        runs = [["--model", m, *base, *([] if m == compiled else []), "--model-impl", flag] for flag, _, m, _ in mine]
        env = {"RBLN_FORCE_NPU_NAME": device}
        if lab.simulated:
            env["NPUSIM_RBLN"] = json.dumps({"devices": [device]})
        for (flag, _, model, want), got in zip(mine, rd.engine_configs(lab, runs, **env)):
            label = f"--model-impl {flag} on {device} with {model}"
            if want in ("optimum", "vllm"):
                assert "error" not in got, f"{label}: {got.get('error')}"
                assert got["worker_cls"] == lab.worker_classes[want], f"{label}: {got['worker_cls']}"
                if want == "vllm" and lab.writes_plan:
                    assert got["plan"]["impl"] == "vllm" and got["plan"]["npu"] == device, label
            else:
                assert "error" in got and re.search(want, got["error"]), f"{label}: {got.get('error', got)}"
            done += 1
    record.figure("cases", done)


def test_option_rejections(target, record, device_labs):
    lab = device_labs(target.name)
    hf = str(lab.hf_dir())
    base = ["--model", hf, "--max-model-len", LEN, "--block-size", LEN]
    runs = [
        [*base, "--rbln-use-w8a8"],
        [*base, "--rbln-decode-batch-bucket-strategy", "linear", "--rbln-use-w8a8"],
        [*base, "--additional-config", json.dumps({"gdn_prefill_backend": "x"})],
        [*base, "--additional-config", json.dumps({"rbln_config": {"decoder_batch_sizes": [1]}})],
        [*base, "--rbln-sub-block-size", "128"],
    ]
    got = rd.engine_configs(lab, runs, VLLM_RBLN_SAMPLER="0")
    foreign = r"additional_config takes only OptimumRBLNConfig fields, and \[{}\] are not fields\. The fields are \["
    assert re.search(foreign.format("'use_w8a8'"), got[0].get("error", "")), got[0]
    assert re.search(foreign.format("'decode_batch_bucket_strategy', 'use_w8a8'"), got[1].get("error", "")), got[1]
    assert re.search(foreign.format("'gdn_prefill_backend'"), got[2].get("error", "")), got[2]
    assert "error" not in got[3], got[3]
    assert "additional_config['rbln_config'] is deprecated and will be removed in 0.14.0; use 'optimum_overrides'." in got[3]["log"]
    if lab.writes_plan:
        assert got[3]["plan"]["rbln_config"]["decoder_batch_sizes"] == [1]
    assert "error" not in got[4], got[4]
    # once per process at least (vllm-rbln warns once; ours at every config it builds)
    assert ("These environment variables are deprecated and will be removed in 0.14.0. Use the flag instead, "
            "or the additional_config key it writes, which is the flag without the --rbln- prefix: "
            "VLLM_RBLN_SAMPLER -> --rbln-use-custom-sampler") in "".join(g["log"] for g in got)
    record.figure("rejections", 3)


def _start(lab, args, log_name: str, cache) -> tuple[vs.Server, float]:
    """A fresh server: what a start compiles, and what a restart finds in the cache, is the subject."""
    t0 = time.perf_counter()
    srv = lab.start(lab.hf_dir(), args, lab.workdir / log_name, VLLM_CACHE_ROOT=str(cache))
    return srv, time.perf_counter() - t0


def test_compile_cache_reuse_and_invalidation(target, record, device_labs):
    lab = device_labs(target.name)
    cache = lab.workdir / "cache-scenario"
    shutil.rmtree(cache, ignore_errors=True)
    args = ["--max-model-len", LEN, "--block-size", LEN, "--max-num-seqs", "2"]
    prompt = _prompts(1, 20, seed=5)[0]
    outs, times, logs = [], [], []
    for i, run_args in enumerate([args, args, [*args[:-1], "3"]]):
        srv, took = _start(lab, run_args, f"cache-{i}.log", cache)
        try:
            outs.append(_ids(srv, prompt))
        finally:
            srv.stop()
        times.append(took)
        logs.append(srv.log_text())
    cold, warm, changed = logs
    assert outs[0] == outs[1] == outs[2]
    if lab.golden() is not None:
        assert outs[0] == _golden(lab, prompt, 16)
    assert "RBLN compile: done in" in cold and "RBLN compile cache: no entry at" in cold
    assert "Found cached compiled model at" in warm
    assert "RBLN compile: done" not in warm and "RBLN compile cache: no entry" not in warm
    assert "warm start" in warm
    assert "RBLN compile: done in" in changed, "a changed --max-num-seqs must compile anew"
    compile_s = float(re.search(r"RBLN compile: done in ([\d.]+) s", cold).group(1))
    # The warm start's "no compile" is its contract; its time is a figure, not a check: on the
    # simulator a tiny model's compile (~1.6 s) and its load (~1-2 s) are within the noise of a
    # busy 2-core machine.
    load_s = float(re.search(r"compiled model \S+ in ([\d.]+) s, no compile", warm).group(1))
    record.figure("cold_start_s", round(times[0], 1))
    record.figure("warm_start_s", round(times[1], 1))
    record.figure("compile_s", compile_s)
    record.figure("cache_load_s", load_s)


def test_decode_buckets_and_padding(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    prompts = _prompts(3, 24, seed=9)
    with cf.ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda p: _ids(server, p, 24), prompts))
    _assert_golden_or_repeatable(lab, server, prompts, got, 24)
    layouts = set(re.findall(r"RBLN decode: (\d+) rows on the batch-(\d+) decoder", server.log_text()))
    assert layouts, "no decode layout logged"
    for rows, batch in layouts:
        assert int(batch) == min(b for b in (1, 2, 4) if b >= int(rows)), f"{rows} rows ran on batch {batch}"
    assert any(int(r) < int(b) for r, b in layouts), f"no padded decode among {sorted(layouts)}"
    record.figure("layouts", len(layouts))


def test_chunked_long_prompt(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    prompt = _prompts(1, 600, seed=11)[0]  # 5 prefill chunks of 128, the last padded
    got = _ids(server, prompt, 12)
    want = _golden(lab, prompt, 12)
    if want is not None:
        assert got == want
    assert re.search(r"RBLN prefill: 6\d\d tokens in 5 chunks of 128", server.log_text())
    record.figure("prompt_tokens", len(prompt))


def test_compiled_dir_served(target, record, device_labs):
    lab = device_labs(target.name)
    compiled = _compiled_dir(lab)
    srv = lab.server(compiled, ["--max-model-len", LEN])
    prompts = _prompts(2, 30, seed=13)
    with cf.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda p: _ids(srv, p), prompts))
    for p, g in zip(prompts, got):
        want = _golden(lab, p, 16)
        if want is not None:
            assert g == want
    log = srv.log_text()
    assert "RBLN load: compiled model" in log and "RBLN compile: done" not in log
    assert "max_num_seqs 2, block_size 1024, prefill chunk 128" in log
    record.figure("requests", len(prompts))


def test_prefix_reuse(target, record, device_labs):
    lab = device_labs(target.name)
    server = lab.serving_server()
    base = _prompts(1, 300, seed=17)[0]
    tails = _prompts(3, 44, seed=18)
    first = base
    second = base[:256] + tails[0]
    third = base[:256] + tails[1]
    before = server.log_text()
    got1 = _ids(server, first, 8)            # fills a block, then finishes
    got2 = _ids(server, second, 8)           # the finished block is taken over in place
    # the third arrives while a request holding the same prefix is still decoding: a copy
    body = {"model": server.model, "prompt": first, "max_tokens": 48, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    stream = vs.stream_lines(server, "/v1/completions", body)
    streamed = list(next(stream)["choices"][0].get("token_ids") or [])
    got3 = _ids(server, third, 8)
    for event in stream:
        for choice in event.get("choices", []):
            streamed.extend(choice.get("token_ids") or [])
    log = server.log_text()[len(before):]
    for prompt, got in ((first, got1), (second, got2), (third, got3)):
        want = _golden(lab, prompt, 8)
        if want is not None:
            assert got == want
    if lab.golden() is not None:
        assert streamed == _golden(lab, first, 48)
    reuses = [(int(a), int(b), int(c)) for a, b, c in
              re.findall(r"RBLN prefix cache: req \S+ reuses (\d+) of (\d+) tokens \((\d+) block\(s\) copied\)", log)]
    assert (256, 300, 0) in reuses, f"no in-place reuse of 256 tokens logged: {reuses}"
    assert (256, 300, 1) in reuses, f"no copied reuse of 256 tokens logged: {reuses}"
    record.figure("reused_tokens", sum(r[0] for r in reuses))


#: The ``vllm`` model path's server: prefill chunks and KV blocks of 128, decode buckets 1, 2, 4.
VLLM_PATH_ARGS = ("--model-impl", "vllm", "--max-model-len", LEN, "--block-size", "128", "--max-num-seqs", "4",
                  "--max-num-batched-tokens", "128", "--rbln-decode-batch-bucket-limit", "3")


def test_vllm_path_served(target, record, device_labs):
    """``--model-impl vllm``: vLLM's own model code compiled with ``rebel``'s torch.compile
    backend, on a Rebel100 (the path is refused on ATOM: on an ATOM board this skips)."""
    lab = device_labs(target.name)
    env = {}
    if lab.simulated:
        env = {"RBLN_FORCE_NPU_NAME": "RBLN-CR13", "NPUSIM_RBLN": json.dumps({"devices": ["RBLN-CR13"]})}
    try:
        srv = lab.server(lab.hf_dir(), VLLM_PATH_ARGS, **env)
    except vs.ServerError as exc:
        if "The vllm model path is not supported on RBLN-CA" in str(exc):
            pytest.skip("the vllm model path runs on REBEL (RBLN-CR*) only; this board is an ATOM")
        raise
    warm = srv.log_text()
    assert "RBLN model path: vllm" in warm
    m = re.search(r"RBLN warm-up: (\d+) graphs compiled in ([\d.]+) s", warm)
    assert m and int(m.group(1)) == 4, "the prefill graph and decode buckets 1, 2 and 4 compile at warm-up"
    prompts = [_prompts(1, 300, seed=21)[0], *_prompts(3, 20, seed=22)]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: _ids(srv, p, 16), prompts))
    _assert_golden_or_repeatable(lab, srv, prompts, got, 16)
    chat = srv.request("POST", "/v1/chat/completions", {
        "model": srv.model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    assert chat.status == 200, chat.body
    chat_prompt, chat_ids = chat.body.get("prompt_token_ids"), chat.body["choices"][0].get("token_ids")
    assert chat_prompt and chat_ids
    want = _golden(lab, chat_prompt, 8)
    if want is not None:
        assert chat_ids == want
    log = srv.log_text()
    assert re.search(r"RBLN prefill: 300 tokens in 3 chunks of 128", log)
    layouts = {(int(r), int(b)) for r, b in re.findall(r"RBLN decode: (\d+) rows on the batch-(\d+) graph", log)}
    assert layouts and all(b == min(x for x in (1, 2, 4) if x >= r) for r, b in layouts), sorted(layouts)
    assert "RBLN recompile" not in log, "a shape warm-up did not compile ran while serving"
    # a second start of the same configuration loads the compile cache the first one wrote
    assert "Saved rbln mega-cache bundle to" in log
    t0 = time.perf_counter()  # a restart: it must load the mega-cache bundle instead of compiling
    again = lab.start(lab.hf_dir(), VLLM_PATH_ARGS, lab.workdir / "vllm-path-again.log", **env)
    try:
        took = time.perf_counter() - t0
        assert _ids(again, prompts[1], 16) == got[1]
    finally:
        again.stop()
    assert re.search(r"Loaded rbln mega-cache bundle from \S+ \(\{'programs': 4,", again.log_text()), \
        again.log_text()[-3000:]
    record.figure("second_start_s", round(took, 1))
    record.figure("warm_up_graphs", int(m.group(1)))
    record.figure("warm_up_s", float(m.group(2)))
    record.figure("requests", len(prompts) + 1)
