"""``npu-harness rbln compile``: an ahead-of-time optimum-rbln compile into a directory that
``vllm serve DIR`` loads, on the ``npusim.rbln`` simulator.

Every run of the verb is a subprocess (``python -m npu_conformance.cli``) so the ``rebel`` alias it
activates does not leak into this process; ``NPU_HARNESS_TARGET``/``NPUSIM_ALIAS`` are cleared
unless a test sets them. Runs that do not depend on each other start together.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("torch", "tokenizers", "optimum")) or \
        importlib.util.find_spec("optimum.rbln") is None:
    pytest.skip("needs torch, tokenizers and optimum-rbln (pinned test dependencies)", allow_module_level=True)

from vllm_npu.rbln.compile_plan import CompiledModelSpec, SchedulerPlan, scheduler_plan  # noqa: E402
from vllm_npu.rbln.model_impl import is_compiled_dir  # noqa: E402

PROMPTS = ([5, 17, 33, 90, 4], [300, 2, 2, 7, 11, 500, 61, 12, 9])
NEW = 8
PREFIX = "npu-harness rbln compile: "


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPU_HARNESS_TARGET", "NPUSIM_ALIAS", "NPUSIM_RBLN", "RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC")}
    env.update(extra)
    return env


def _start(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "npu_conformance.cli", "rbln", "compile", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env(), cwd=cwd)


def _finish(procs: dict[str, subprocess.Popen[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from npusim import tinymodel

    return tinymodel.build("llama", tmp_path_factory.mktemp("hf") / "llama", head_dim=64)


@pytest.fixture(scope="module")
def compiled(hf_dir, tmp_path_factory):
    """Two compiles, run together: the defaults (eager, batch 1, the simulator's NPU) and flash
    attention with 3 decoders for a Rebel100, with ``NPU_HARNESS_TARGET=rbln-sim``."""
    root = tmp_path_factory.mktemp("compiled")
    outs = {"eager": root / "eager", "flash": root / "flash"}
    runs = _finish({
        "eager": _start(str(hf_dir), "--out", str(outs["eager"])),
        "flash": _start(str(hf_dir), "--out", str(outs["flash"]), "--max-model-len", "2048",
                        "--block-size", "1024", "--max-num-seqs", "4", "--decoder-batch-sizes", "4,2,1",
                        "--npu", "RBLN-CR03", env=_env(NPU_HARNESS_TARGET="rbln-sim")),
    })
    for name, proc in runs.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    return {name: (outs[name], runs[name]) for name in outs}


_LOAD = textwrap.dedent("""
    import json, os, sys
    from npusim import alias
    alias.activate("rebel")
    import rebel, torch
    from optimum.rbln import RBLNLlamaForCausalLM
    from transformers import AutoTokenizer
    assert rebel.SIMULATOR.startswith("npusim.rbln")
    hf, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    tok_hf = AutoTokenizer.from_pretrained(hf)
    text = "hello world <|im_start|>user"
    results = {}
    for arg in sys.argv[4:]:
        name, npu, out = arg.split("=", 2)
        os.environ["RBLN_FORCE_NPU_NAME"] = npu   # the card the runtimes are created on
        model = RBLNLlamaForCausalLM.from_pretrained(out)
        tokens = []
        for p in prompts:
            ids = torch.tensor([p])
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
            tokens.append(res[0, len(p):].tolist())
        tok_out = AutoTokenizer.from_pretrained(out)
        results[name] = {"tokens": tokens, "decoders": sorted(model.decoders),
                         "same_tokenizer": tok_out(text)["input_ids"] == tok_hf(text)["input_ids"]
                                           and tok_out.eos_token == tok_hf.eos_token}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def loaded(compiled, hf_dir):
    """Both compiled directories loaded by optimum-rbln (one subprocess with the alias), greedy
    ``generate()`` of :data:`PROMPTS`."""
    npus = {"eager": "RBLN-CA25", "flash": "RBLN-CR03"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, str(hf_dir), json.dumps(PROMPTS), str(NEW),
         *(f"{name}={npus[name]}={out}" for name, (out, _) in compiled.items())],
        capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_defaults_compile_eager_for_the_simulated_npu(compiled, hf_dir):
    out, proc = compiled["eager"]
    assert "rebel: simulator npusim.rbln" in proc.stdout
    assert f"written to {out}; serve it with: vllm serve {out}" in proc.stdout
    names = {p.name for p in out.iterdir()}
    assert {"prefill.rbln", "decoder_batch_1.rbln", "rbln_config.json", "config.json",
            "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    # optimum-rbln (transformers 5) does not write special_tokens_map.json: copied from HF_DIR
    assert (out / "special_tokens_map.json").read_bytes() == (hf_dir / "special_tokens_map.json").read_bytes()
    assert "copied from" in proc.stdout and "special_tokens_map.json" in proc.stdout
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert is_compiled_dir(out)
    assert not [p for p in out.parent.iterdir() if "partial" in p.name]
    spec = CompiledModelSpec.from_dir(out)
    assert (spec.model_class, spec.batch_size, spec.max_seq_len, spec.block_size, spec.prefill_chunk_size,
            spec.decoder_batch_sizes, spec.attn_impl) == ("RBLNLlamaForCausalLM", 1, 1024, 1024, 128, (1,), "eager")
    assert scheduler_plan(spec) == SchedulerPlan(1, 1024, 1024, 128, spec.kvcache_num_blocks + 1)
    raw = json.loads((out / "rbln_config.json").read_text())
    assert "create_runtimes" not in raw, "a runtime-only option is not saved"
    assert {c["npu"] for c in raw["_compile_cfgs"]} == {"RBLN-CA25"}


def test_flash_attention_with_decoder_buckets_for_rebel100(compiled):
    out, proc = compiled["flash"]
    assert "rebel: simulator npusim.rbln" in proc.stdout
    names = {p.name for p in out.iterdir()}
    assert {"prefill.rbln", "decoder_batch_1.rbln", "decoder_batch_2.rbln", "decoder_batch_4.rbln"} <= names
    spec = CompiledModelSpec.from_dir(out)
    assert (spec.batch_size, spec.max_seq_len, spec.block_size, spec.prefill_chunk_size,
            spec.decoder_batch_sizes, spec.attn_impl) == (4, 2048, 1024, 512, (1, 2, 4), "flash_attn")
    assert spec.kvcache_num_blocks == 4 * 2
    assert scheduler_plan(spec, user_max_num_batched_tokens=512, user_block_size=1024) == \
        SchedulerPlan(4, 2048, 1024, 512, 9)
    raw = json.loads((out / "rbln_config.json").read_text())
    assert {c["npu"] for c in raw["_compile_cfgs"]} == {"RBLN-CR03"}
    assert "KV block 1024 (flash_attn), 8 KV blocks, prefill chunk 512" in proc.stdout


@pytest.mark.parametrize("name", ["eager", "flash"])
def test_the_compiled_directory_generates_the_golden_greedy_tokens(loaded, hf_dir, name):
    from npusim.llm import Decoder

    golden = Decoder.from_pretrained(hf_dir)
    assert loaded[name]["tokens"] == [golden.generate_greedy(list(p), NEW) for p in PROMPTS]
    assert loaded[name]["decoders"] == ([1] if name == "eager" else [1, 2, 4])
    assert loaded[name]["same_tokenizer"]


# ---------------------------------------------------------------------------- bad input

BAD = {
    # name: (args after HF_DIR (with {out}), extra env, message in the one stderr line)
    "unknown-arch": (["--out", "{out}"], {}, "Model architectures ['FooForCausalLM'] are not supported on RBLN for now."),
    "no-config": (["--out", "{out}"], {}, "config.json: cannot read the model's config.json"),
    "block-does-not-divide": (["--out", "{out}", "--block-size", "300"], {},
                              "--block-size 300 must divide --max-model-len 1024 (the KV partition of flash "
                              "attention), or equal it (eager attention)"),
    "block-zero": (["--out", "{out}", "--block-size", "0"], {}, "--block-size 0 must be a positive integer"),
    "override-conflict": (["--out", "{out}", "--npu", "RBLN-CA25", "--optimum-overrides", '{"batch_size": 2}'], {},
                          "rbln_overrides conflict with vllm-derived compile config: batch_size (compiled=1, override=2)"),
    "override-eager-partition": (["--out", "{out}", "--optimum-overrides", '{"kvcache_partition_len": 512}'], {},
                                 "rbln_overrides conflict with vllm-derived compile config: kvcache_partition_len "
                                 "(compiled=None, override=512)"),
    "override-not-json": (["--out", "{out}", "--optimum-overrides", "{batch"], {}, "--optimum-overrides='{batch' is not valid JSON"),
    "override-not-object": (["--out", "{out}", "--optimum-overrides", "[1]"], {},
                            "--optimum-overrides='[1]' must be a JSON object, got list"),
    "bucket-too-big": (["--out", "{out}", "--max-num-seqs", "2", "--decoder-batch-sizes", "4,2"], {},
                       "--decoder-batch-sizes 4,2: every size must be between 1 and --max-num-seqs 2"),
    "bucket-not-a-list": (["--out", "{out}", "--decoder-batch-sizes", "4;2"], {},
                          "--decoder-batch-sizes '4;2' must be comma-separated positive integers"),
    "out-not-empty": (["--out", "{nonempty}"], {}, "exists and is not an empty directory"),
    "unknown-npu": (["--out", "{out}", "--npu", "GPU-0"], {},
                    "--npu 'GPU-0': Unknown NPU device 'GPU-0'; expected an ATOM (ca) or REBEL (cr) device."),
    "no-npu": (["--out", "{out}"], {"NPUSIM_RBLN": '{"devices": []}'},
               "Could not determine the RBLN NPU name (rebel.get_npu_name(0) returned None)."),
    "hardware-target": (["--out", "{out}"], {"NPU_HARNESS_TARGET": "rbln-hw"},
                        "the npusim simulator stands in only when NPU_HARNESS_TARGET is unset or rbln-sim, not 'rbln-hw'"),
    "partition-out-of-range": (["--out", "{out}", "--block-size", "512"], {},
                               "optimum-rbln refused the compile: `kvcache_partition_len` (512) is out of the "
                               "ATOM supported range"),
}


@pytest.fixture(scope="module")
def bad_runs(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    foo = root / "foo"
    foo.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (foo / "config.json").write_text(json.dumps(dict(cfg, architectures=["FooForCausalLM"])))
    (root / "empty").mkdir()
    nonempty = root / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("x")
    procs = {}
    for name, (args, env, _) in BAD.items():
        src = {"unknown-arch": foo, "no-config": root / "empty"}.get(name, hf_dir)
        args = [a.replace("{out}", str(root / f"out-{name}")).replace("{nonempty}", str(nonempty)) for a in args]
        procs[name] = _start(str(src), *args, env=_env(**env))
    return root, _finish(procs)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_clear_line_and_exit_2(bad_runs, name):
    root, runs = bad_runs
    proc = runs[name]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(PREFIX)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and BAD[name][2] in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (root / f"out-{name}").exists(), "nothing is written on bad input"
    assert not [p for p in root.iterdir() if "partial" in p.name]
    if name == "out-not-empty":
        assert [p.name for p in (root / "nonempty").iterdir()] == ["keep.txt"]


def test_parsers():
    from vllm_npu.rbln import aot_compile as aot

    assert aot.parse_batch_sizes("4,2,1") == [4, 2, 1] and aot.parse_batch_sizes(None) is None
    assert aot.parse_overrides(None) == {} and aot.parse_overrides('{"a": {"b": 1}}') == {"a": {"b": 1}}
    for text in ("", "4,,2", "0", "-1,2", "x"):
        with pytest.raises(aot.AotInputError, match="must be comma-separated positive integers"):
            aot.parse_batch_sizes(text)
