"""The real optimum-rbln 0.12.0 (a pinned test dependency, unpatched) compiles, saves, reloads
and runs greedy ``generate()`` on ``npusim.rbln`` as its ``rebel``.

Greedy tokens must equal the golden decoder's (``npusim.llm``) exactly. Compiles are shared per
module (one per configuration, ~2 s each).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.rbln") is None:
    pytest.skip("optimum-rbln (a pinned test dependency) is not installed", allow_module_level=True)

PROMPTS = ([5, 17, 33, 90, 4], [300, 2, 2, 7, 11, 500, 61, 12, 9])
NEW = 10


@pytest.fixture(scope="module")
def rebel():
    """``import rebel`` on the simulator for this module only: the alias and the ``rebel``
    entries of ``sys.modules`` are removed afterwards, so later tests see no ``rebel``."""
    import sys

    from npusim import alias

    alias.activate("rebel")
    import rebel as mod

    assert mod.SIMULATOR.startswith("npusim.rbln"), "the alias must resolve to the simulator"
    yield mod
    alias.deactivate("rebel")
    for name in [n for n in sys.modules if n == "rebel" or n.startswith("rebel.")]:
        del sys.modules[name]


def _compile(rebel, src: Path, out: Path, cls_name: str, **rbln_config):
    import optimum.rbln as orbln

    cls = getattr(orbln, cls_name)
    return cls.from_pretrained(str(src), export=True, model_save_dir=str(out), rbln_config=rbln_config)


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def compiled(rebel, tiny_model_dir, tmp_path_factory):
    """``compiled(arch, **rbln_config) -> (model, saved_dir)``, one compile per combination."""
    cache: dict[str, tuple[object, Path]] = {}

    def get(arch: str, **cfg):
        key = json.dumps([arch, cfg], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"rbln-{arch}")
            cls = {"llama": "RBLNLlamaForCausalLM", "qwen3": "RBLNQwen3ForCausalLM"}[arch]
            cache[key] = (_compile(rebel, tiny_model_dir(arch), out, cls, **cfg), out)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eager_attention_greedy_equals_golden(compiled, golden_decoder, arch):
    model, _ = compiled(arch, batch_size=1, max_seq_len=256)
    golden = golden_decoder(arch)
    for prompt in PROMPTS:
        assert _greedy(model, list(prompt)) == golden.generate_greedy(prompt, NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flash_attention_auto_blocks_greedy_equals_golden(compiled, golden_decoder, arch):
    model, saved = compiled(arch, batch_size=1, max_seq_len=2048, kvcache_partition_len=1024,
                            attn_impl="flash_attn")
    cfg = json.loads((saved / "rbln_config.json").read_text())
    # Automatic KV blocks: the tiny model fits every full block in an ATOM's DRAM.
    assert cfg["kvcache_num_blocks"] == 2048 // 1024
    golden = golden_decoder(arch)
    for prompt in PROMPTS:
        assert _greedy(model, list(prompt)) == golden.generate_greedy(prompt, NEW)


def test_batch_of_two_with_decoders_two_and_one(compiled, golden_decoder):
    model, _ = compiled("llama", batch_size=2, decoder_batch_sizes=[2, 1], max_seq_len=256)
    golden = golden_decoder("llama")
    a, b = PROMPTS
    width = max(len(a), len(b))
    ids = torch.tensor([[0] * (width - len(a)) + list(a), [0] * (width - len(b)) + list(b)])
    mask = torch.tensor([[0] * (width - len(a)) + [1] * len(a), [0] * (width - len(b)) + [1] * len(b)])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert out[0, width:].tolist() == golden.generate_greedy(a, NEW)
    assert out[1, width:].tolist() == golden.generate_greedy(b, NEW)
    # a lone request runs on the batch-1 decoder
    assert _greedy(model, list(b)) == golden.generate_greedy(b, NEW)
    assert sorted(model.decoders) == [1, 2]


def test_reload_compiled_directory_without_compiling(compiled, golden_decoder, rebel, monkeypatch):
    from optimum.rbln import RBLNLlamaForCausalLM

    _, saved = compiled("llama", batch_size=1, max_seq_len=256)

    def no_compile(*a, **k):
        raise AssertionError("a reload must not compile")

    monkeypatch.setattr(rebel, "compile_from_torch", no_compile)
    model = RBLNLlamaForCausalLM.from_pretrained(str(saved))
    assert _greedy(model, list(PROMPTS[1])) == golden_decoder("llama").generate_greedy(PROMPTS[1], NEW)


def test_two_loads_of_one_model_keep_separate_kv_buffers(compiled):
    from optimum.rbln import RBLNLlamaForCausalLM

    _, saved = compiled("llama", batch_size=1, max_seq_len=256)
    one = RBLNLlamaForCausalLM.from_pretrained(str(saved))
    two = RBLNLlamaForCausalLM.from_pretrained(str(saved))
    p1, d1 = one.model[0], one.model[1]
    p2 = two.model[0]
    assert p1.buffers is d1.buffers, "prefill and decoder of one model share the KV buffers"
    assert p1.buffers is not p2.buffers, "two loaded models must not share KV buffers"
    assert set(p1.buffers) == {f"past_key_values_{i}" for i in range(4)}


def test_multiplied_buffers_persist_in_the_saved_file(compiled, rebel):
    _, saved = compiled("llama", batch_size=1, max_seq_len=2048, kvcache_partition_len=1024,
                        attn_impl="flash_attn")
    cm = rebel.RBLNCompiledModel(saved / "prefill.rbln")
    assert cm.header.multipliers == {f"past_key_values_{i}": 2 for i in range(4)}
    sizes = cm.exp_get_dram_tensor_sizes()
    # [2 blocks, 2 KV heads, 1024 slots, 32 dims] float32, on one ATOM chiplet
    assert sizes["past_key_values_0"] == [[2 * 2 * 1024 * 32 * 4]]
    assert cm.buffer_shape("past_key_values_0") == [2, 2, 1024, 32]


def test_corrupt_file_fails_to_load_with_a_clear_error(compiled, tmp_path, rebel):
    from optimum.rbln import RBLNLlamaForCausalLM

    _, saved = compiled("llama", batch_size=1, max_seq_len=256)
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    data = bytearray((bad / "decoder_batch_1.rbln").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "decoder_batch_1.rbln").write_bytes(bytes(data))
    with pytest.raises(rebel.RBLNFileError, match=r"decoder_batch_1\.rbln: checksum mismatch"):
        RBLNLlamaForCausalLM.from_pretrained(str(bad))
    (bad / "prefill.rbln").write_bytes(b"not a program")
    with pytest.raises(rebel.RBLNFileError, match="bad magic"):
        rebel.RBLNCompiledModel(bad / "prefill.rbln")


def test_no_npu_fails_where_the_real_stack_does(rebel, tiny_model_dir, tmp_path, monkeypatch):
    from optimum.rbln import RBLNLlamaForCausalLM

    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": []}))
    assert rebel.get_npu_name() is None and rebel.device_count() == 0
    with pytest.raises(ValueError, match=r"^Device 0 is not a valid NPU device\. Please check your "
                                         r"NPU status with 'rbln-smi' command\.$"):
        RBLNLlamaForCausalLM.from_pretrained(str(tiny_model_dir("llama")), export=True,
                                             model_save_dir=str(tmp_path / "a"),
                                             rbln_config={"max_seq_len": 256})
    # A compile-only host names its target and creates no runtimes.
    model = RBLNLlamaForCausalLM.from_pretrained(
        str(tiny_model_dir("llama")), export=True, model_save_dir=str(tmp_path / "b"),
        rbln_config={"max_seq_len": 256, "npu": "RBLN-CA25", "create_runtimes": False})
    assert (tmp_path / "b" / "prefill.rbln").is_file()
    with pytest.raises(rebel.RBLNDeviceError, match="Device 0 is not a valid NPU device"):
        rebel.Runtime(rebel.RBLNCompiledModel(tmp_path / "b" / "prefill.rbln"))
    del model


def test_runtime_refuses_shapes_it_was_not_compiled_for(compiled, rebel):
    _, saved = compiled("llama", batch_size=1, max_seq_len=256)
    rt = rebel.Runtime(rebel.RBLNCompiledModel(saved / "decoder_batch_1.rbln"))
    ok = [torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
          torch.zeros(1, 1, dtype=torch.int16)]
    assert rt(*ok).shape == (1, 1, 1024)
    with pytest.raises(rebel.RBLNInputError, match=r"input 'input_ids': got \[2, 1\] int64, the program "
                                                  r"was compiled for \[1, 1\] int64"):
        rt(torch.zeros(2, 1, dtype=torch.int64), *ok[1:])
    with pytest.raises(rebel.RBLNInputError, match=r"input 'cache_position': got \[1, 1\] int64"):
        rt(ok[0], torch.zeros(1, 1, dtype=torch.int64), ok[2])
    with pytest.raises(rebel.RBLNInputError, match="takes 3 inputs"):
        rt(*ok[:2])
    with pytest.raises(rebel.RBLNInputError, match="block id 7, outside the KV cache's 1 blocks"):
        rt(ok[0], ok[1], torch.full((1, 1), 7, dtype=torch.int16))


def test_injected_fault_fails_the_nth_runtime_call(compiled, rebel, monkeypatch, tmp_path):
    from npusim.rbln import runtime

    model, _ = compiled("llama", batch_size=1, max_seq_len=256)
    log = tmp_path / "faults.log"
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps(
        {"fault": {"after_calls": runtime.calls() + 3, "times": 1}, "fault_log": str(log)}))
    with pytest.raises(rebel.RBLNRuntimeFault, match="injected fault"):
        _greedy(model, list(PROMPTS[0]))
    assert log.read_text().count("injected fault") == 1
    _greedy(model, list(PROMPTS[0]))  # `times: 1`: the next calls succeed


def test_kv_buffers_that_do_not_fit_fail_to_allocate(compiled, rebel, monkeypatch):
    _, saved = compiled("llama", batch_size=1, max_seq_len=2048, kvcache_partition_len=1024,
                        attn_impl="flash_attn")
    # A card with 6 MiB per chiplet (1 MiB reserved): the weights fit, 4 x 1 MiB of KV do not.
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"dram_per_chiplet": 6 * 2**20}))
    with pytest.raises(rebel.RBLNOutOfMemoryError, match=r"device 0 \(RBLN-CA25\) chiplet 0: cannot allocate"):
        rebel.Runtime(rebel.RBLNCompiledModel(saved / "prefill.rbln"))


def test_device_discovery_from_the_forced_npu_name(rebel, monkeypatch):
    monkeypatch.delenv("NPUSIM_RBLN", raising=False)
    monkeypatch.setenv("RBLN_FORCE_NPU_NAME", "RBLN-CR13")
    assert rebel.get_npu_name() == "RBLN-CR13" and rebel.npu_is_available(0)
    assert rebel.get_npu_name(1) is None and rebel.device_count() == 1
    monkeypatch.delenv("RBLN_FORCE_NPU_NAME")
    monkeypatch.setenv("RBLN_TARGET_SOC", "RBLN-CA22")
    assert rebel.get_npu_name() == "RBLN-CA22"
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": ["RBLN-CR03", "RBLN-CR03"]}))
    assert rebel.device_count() == 2 and rebel.get_npu_name(1) == "RBLN-CR03"
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": ["GPU-0"]}))
    with pytest.raises(rebel.RBLNDeviceError, match="unknown NPU name 'GPU-0'"):
        rebel.get_npu_name()


def test_prefix_start_off_the_chunk_grid_is_refused_by_optimum(compiled):
    model, _ = compiled("llama", batch_size=1, max_seq_len=2048, kvcache_partition_len=1024,
                        attn_impl="flash_attn")
    ids = torch.tensor([list(range(10, 110))])
    with pytest.raises(Exception, match=r"Prefix Caching is not supported yet for non-multiple of prefill_chunk_size\."):
        model.prefill_decoder(input_ids=ids, cache_position=torch.arange(64, 164, dtype=torch.int32).unsqueeze(0),
                              block_tables=torch.tensor([0, 1], dtype=torch.int16))


def test_kv_block_copy_reuses_a_prefix_exactly(compiled, golden_decoder):
    """The worker's prefix reuse on the device: prefill a prompt into block 0, copy its first
    128 slots to block 1 with ``_copy_kv_cache``, then prefill only the rest of a second
    prompt sharing those 128 tokens into block 1: its logits equal the golden decoder's."""
    import numpy as np

    model, _ = compiled("llama", batch_size=1, max_seq_len=2048, kvcache_partition_len=1024,
                        attn_impl="flash_attn")
    rng = np.random.default_rng(3)
    shared, tail = rng.integers(10, 1000, 128).tolist(), rng.integers(10, 1000, 30).tolist()
    first = shared + rng.integers(10, 1000, 40).tolist()
    model.prefill_decoder(input_ids=torch.tensor([first]),
                          cache_position=torch.arange(len(first), dtype=torch.int32).unsqueeze(0),
                          block_tables=torch.tensor([0, 0], dtype=torch.int16))
    runtime = model.model[0]
    runtime._copy_kv_cache(0, 1, 128)
    second = shared + tail
    out = model.prefill_decoder(input_ids=torch.tensor([tail]),
                                cache_position=torch.arange(128, len(second), dtype=torch.int32).unsqueeze(0),
                                block_tables=torch.tensor([1, 1], dtype=torch.int16)).logits
    golden = golden_decoder("llama")
    want = golden.generate_greedy(second, 1)
    assert int(out.reshape(-1, out.shape[-1])[-1].argmax()) == want[0]
    with pytest.raises(Exception, match=r"_copy_kv_cache\(0, 9, 4\): past_key_values_\d has 2 blocks"):
        runtime._copy_kv_cache(0, 9, 4)
