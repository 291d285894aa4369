"""The vendor's own transformers-mblt 0.6.1 and mblt-npu-python 0.1.0 (pinned test dependencies,
installed ``--no-deps``, unpatched) run on ``npusim.mxq`` as their ``qbruntime``.

``AutoModelForCausalLM.from_pretrained(<our MXQ artifact dir>)`` is transformers-mblt's loader;
``generate`` is its generation mixin over its multi-slot NPU backend. Greedy tokens must equal the
golden decoder's (``npusim.llm``) and transformers' own model of the same checkpoint, exactly.
Sampled tokens must equal transformers' under the same torch seed (the host sampler is the same;
the logits agree to float32 rounding, far below any sampling boundary of these tiny models).

Their declared ``transformers<5.18`` pin is waived (we run transformers 5.19): this module is the
test of that waiver for the text-LLM path (docs/mblt.md, "What the pins waive").
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _tmblt_alias import transformers_mblt_on_simulator

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers_mblt") is None or importlib.util.find_spec("mblt_npu") is None:
    pytest.skip("transformers-mblt / mblt-npu-python (pinned test dependencies) are not installed",
                allow_module_level=True)

PROMPTS = ([1, 5, 9, 33, 70, 2, 11], [300, 2, 2, 7, 11, 500, 61, 12, 9], [4, 4, 8], [77, 78, 79, 80, 81, 82])
NEW = 8


@pytest.fixture(scope="module")
def qbruntime() -> Iterator[Any]:
    """``import qbruntime`` on the simulator for this module only, and transformers-mblt's
    architectures registered. Afterwards the alias and the modules bound to it are removed."""
    with transformers_mblt_on_simulator() as (mod, registered):
        assert {"llama", "qwen2", "qwen3", "exaone4"} <= set(registered)
        yield mod


@pytest.fixture
def sim(qbruntime) -> Iterator[Any]:
    """The simulated machine, fresh for each test (one card unless a test configures more)."""
    from npusim.mxq import machine

    machine.reset()
    yield machine
    machine.reset()


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory) -> Callable[..., Path]:
    """``artifact(arch, **compile_kwargs) -> Path`` of an MXQ artifact directory, compiled once per
    combination. Defaults: ``max_width=16, prefill_chunk_size=16``, so a prompt of more than 16
    tokens is chunked."""
    from npusim.mxq.compile import compile_artifact

    cache: dict[str, Path] = {}

    def get(arch: str, **kwargs: Any) -> Path:
        kw = {"max_width": 16, "prefill_chunk_size": 16, **kwargs}
        key = json.dumps([arch, kw], sort_keys=True)
        if key not in cache:
            cache[key] = compile_artifact(tiny_model_dir(arch), tmp_path_factory.mktemp(f"tmblt-{arch}"), **kw)
        return cache[key]

    return get


def _load(path: Path, **overrides: Any) -> Any:
    """transformers-mblt's loader, with config overrides as keyword arguments (its documented way)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), **overrides)
    assert type(model).__module__.startswith("transformers_mblt."), type(model)
    return model


def _generate(model: Any, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    """New tokens per prompt; prompts of unequal length are left-padded with an attention mask."""
    width = max(len(p) for p in prompts)
    pad = int(model.config.pad_token_id or 0)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=pad, **kwargs)
    return out[:, width:].tolist()


def _dispose(model: Any) -> None:
    """transformers-mblt's ``MobilintModelMixin.dispose``: frees every MXQ slot of the model."""
    model.dispose()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "exaone4", "hyperclovax"])
def test_greedy_equals_golden_and_transformers(sim, artifact, golden_decoder, hf_model, tiny_model_dir, arch):
    model = _load(artifact(arch))
    golden, hf = golden_decoder(arch), hf_model(tiny_model_dir(arch))
    try:
        for prompt in (*PROMPTS[:2], [(13 * i + 7) % 1000 + 1 for i in range(30)]):  # the last crosses
            got = _generate(model, [list(prompt)], do_sample=False)[0]                # EXAONE4's window
            assert got == golden.generate_greedy(prompt, NEW)
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()
            assert got == ref
    finally:
        _dispose(model)


def test_a_prompt_longer_than_the_width_is_chunked(sim, artifact, golden_decoder):
    """40 tokens through an MXQ of width 16 (chunk 16): the simulator refuses any infer wider than
    16, so this passes only if transformers-mblt chunks the prefill."""
    model = _load(artifact("llama"))
    prompt = [(7 * i + 3) % 1000 + 1 for i in range(40)]
    try:
        assert _generate(model, [prompt], do_sample=False)[0] == golden_decoder("llama").generate_greedy(prompt, NEW)
    finally:
        _dispose(model)


def test_batch_mxq_k4_through_batch_param(sim, artifact, golden_decoder):
    """A batch-compiled MXQ (K=4): one Model, four cache ids, rows of unequal length in one
    generate (left-padded); each row equals its own greedy run."""
    path = artifact("llama", max_batch_size=4)
    model = _load(path)
    golden = golden_decoder("llama")
    try:
        mxqs = model.npu_backend.mxq_models
        assert len(mxqs) == 1 and mxqs[0].get_cache_infos()[0].num_batches == 4
        got = _generate(model, [list(p) for p in PROMPTS], do_sample=False)
        assert got == [golden.generate_greedy(p, NEW) for p in PROMPTS]
    finally:
        _dispose(model)


def test_two_cards_with_several_model_slots(sim, artifact, golden_decoder):
    """``max_batch_size=4`` over a K=1 MXQ on ``dev_no=[0, 1]``: four Model slots round-robin
    over two simulated cards, two slots sharing each card's explicitly named cores (the board
    time-shares them; see docs/mblt.md), rows dispatched to their slots in parallel."""
    sim.configure(devices=2)
    model = _load(artifact("qwen3"), max_batch_size=4, dev_no=[0, 1])
    golden = golden_decoder("qwen3")
    try:
        backend = model.npu_backend
        assert len(backend.mxq_models) == 4
        assert sorted(backend.model_dev_no) == [0, 0, 1, 1]
        assert [m.get_device_names() for m in backend.mxq_models] == [["aries-rb"]] * 4
        got = _generate(model, [list(p) for p in PROMPTS], do_sample=False)
        assert got == [golden.generate_greedy(p, NEW) for p in PROMPTS]
        assert sim.device(0).clock_us > 0 and sim.device(1).clock_us > 0  # both cards ran infers
    finally:
        _dispose(model)


def test_global4_artifact(sim, artifact, golden_decoder):
    model = _load(artifact("qwen2", core_mode="global4"))
    try:
        mxq = model.npu_backend.mxq_models[0]
        assert str(mxq.get_core_mode()).endswith("Global4") and len(mxq.get_target_cores()) == 4
        prompt = list(PROMPTS[1])
        assert _generate(model, [prompt], do_sample=False)[0] == golden_decoder("qwen2").generate_greedy(prompt, NEW)
    finally:
        _dispose(model)


def test_sampled_tokens_equal_transformers_under_one_seed(sim, artifact, hf_model, tiny_model_dir):
    model = _load(artifact("llama"))
    hf = hf_model(tiny_model_dir("llama"))
    prompt = list(PROMPTS[0])
    kwargs = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}
    try:
        runs = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            got = _generate(model, [prompt], **kwargs)[0]
            torch.manual_seed(seed)
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, **kwargs)[0, len(prompt):].tolist()
            assert got == ref, f"seed {seed}"
            runs.append(got)
        assert runs[0] != runs[1], "two seeds gave one sequence: the test would not see a sampling bug"
    finally:
        _dispose(model)


def test_cache_copy_and_restore_through_dump_and_load(sim, artifact, golden_decoder, tmp_path):
    """Prefill a prompt into a MobilintCache, snapshot it (``dump_cache_memory``, and to files with
    ``dump_cache_memory_to``), run on, then restore each snapshot: the continuation after each
    restore equals the golden decoder's greedy continuation of the prompt."""
    model = _load(artifact("llama"))
    prompt = list(PROMPTS[1])
    want = golden_decoder("llama").generate_greedy(prompt, NEW)
    try:
        torch.set_grad_enabled(False)  # a manual forward, as transformers-mblt's callers run it
        from transformers_mblt.utils.cache_utils import build_mobilint_cache_from_model

        cache = build_mobilint_cache_from_model(model, 1)
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        assert first == want[0]
        cache.dump_cache_memory()
        cache.dump_cache_memory_to(str(tmp_path))
        twin = cache.copy()

        def continue_from(token: int, kv: Any = None) -> list[int]:
            kv = cache if kv is None else kv
            got = [token]
            for _ in range(NEW - 1):
                step = model(torch.tensor([[got[-1]]]), past_key_values=kv, use_cache=True, logits_to_keep=1)
                got.append(int(step.logits[0, -1].argmax()))
            return got

        assert continue_from(first) == want
        assert continue_from(first, twin) == want  # the copy is independent of the cache run on
        cache.load_cache_memory()
        assert cache.get_seq_length() == len(prompt)
        assert continue_from(first) == want
        cache.load_cache_memory_from(str(tmp_path))
        assert cache.get_seq_length() == len(prompt)
        assert continue_from(first) == want
    finally:
        torch.set_grad_enabled(True)
        _dispose(model)


@pytest.mark.parametrize("output_logits", ["last", "all"])
def test_keep_all_logits_equal_golden_at_every_position(sim, artifact, golden_decoder, output_logits):
    """A keep-all forward (``logits_to_keep=0``) of a 20-token prompt: on a last-only MXQ
    transformers-mblt runs one infer per kept position (its fallback), on an ``all`` MXQ one infer
    per chunk. Either way every position's logits equal the golden decoder's, NMSE <= 1e-10
    (float32 rounding; a wrong position or a stale cache gives NMSE near 1)."""
    from npusim.q4x32.metrics import nmse

    model = _load(artifact("qwen3", output_logits=output_logits))
    prompt = [(11 * i + 2) % 1000 + 1 for i in range(20)]
    golden = golden_decoder("qwen3")
    want = golden.prefill(prompt, golden.new_cache(64))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # its "slow fallback" notice on last-only MXQs
            got = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=0).logits[0].numpy()
        assert got.shape == want.shape
        for pos in range(len(prompt)):
            assert nmse(got[pos], want[pos]) <= 1e-10, pos
    finally:
        _dispose(model)


def test_tracing_around_generate(sim, qbruntime, artifact, tmp_path):
    """``qbruntime.start_tracing_events`` / ``stop_tracing_events`` around ``generate`` (the calls
    transformers-mblt's ``benchmark_utils.start_qbruntime_trace`` makes; that module itself needs
    matplotlib, which we do not install) write one infer span per NPU call."""
    model = _load(artifact("llama"))
    trace = tmp_path / "trace.json"
    prompt = [(5 * i + 1) % 1000 + 1 for i in range(20)]  # 2 prefill chunks of width 16
    try:
        qbruntime.start_tracing_events(str(trace))
        _generate(model, [prompt], do_sample=False)
        qbruntime.stop_tracing_events()
    finally:
        _dispose(model)
    events = json.loads(trace.read_text(encoding="utf-8"))
    begins = [e for e in events if e["ph"] == "B" and e["name"] == "run npu"]
    assert len(begins) == 2 + (NEW - 1), [e["name"] for e in events][:20]
    assert all(e["cat"] == "qbruntime" and e["pid"] == 0 for e in events)


# ------------------------------------------------------------------ Mixture-of-Experts releases
LONG = [(13 * i + 7) % 1000 + 1 for i in range(40)]  # 16 + 16 + 8: the chunk path, then the token path


def _moe_greedy(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("layout", [{}, {"packed": False}, {"last_only": True},
                                    {"shared_output_order": ["gate", "residual", "expert_in"]},
                                    {"shared_output_order": ["expert_in", "gate", "residual"], "declare_output_order": True}],
                         ids=["packed", "unpacked", "last-only", "order-by-scales", "order-declared"])
def test_moe_release_greedy_equals_golden(sim, moe_release, golden_decoder, layout):
    """transformers-mblt's own MoE backend loads our release (packs and index, or one file per
    MXQ), finds the shared outputs' roles by shape and quantisation scale (or from
    ``moe_shared_output_order``), routes on the host, and greedy output equals the golden decoder's."""
    sim.configure(devices=3)
    model = _load(moe_release(**layout))
    golden = golden_decoder("qwen3_moe")
    try:
        for prompt in (PROMPTS[0], LONG):
            assert _moe_greedy(model, list(prompt)) == golden.generate_greedy(prompt, NEW)
    finally:
        _dispose(model)


def test_moe_release_placement_and_overrides(sim, moe_release):
    """The release's placement: shared MXQs round-robin over cards 0-2 (one core), expert e on card
    e % 3 with its 8 cores, the lm_head alone on 2:0:0; the prefixed keys override it."""
    from npusim.mxq import Cluster, Core, CoreId

    sim.configure(devices=3)
    model = _load(moe_release())
    backend = model.npu_backend
    try:
        assert [m._dev_no for m in model.get_shared_mxq_models()] == [0, 1]
        assert [m.get_target_cores() for m in model.get_shared_mxq_models()] == [[CoreId(Cluster.Cluster0, Core.Core0)]] * 2
        experts = backend.layers[1].experts
        assert [m._dev_no for m in experts] == [e % 3 for e in range(8)]
        assert all(len(m.get_target_cores()) == 8 for m in experts)
        assert (backend.lm_head._dev_no, backend.lm_head.get_target_cores()) == (2, [CoreId(Cluster.Cluster0, Core.Core0)])
    finally:
        _dispose(model)
    model = _load(moe_release(), lm_head_target_cores=["1:1:3"], shared_target_cores=["0:0:1"], num_expert_workers=2)
    try:
        assert model.npu_backend.lm_head._dev_no == 1
        assert model.npu_backend.lm_head.get_target_cores() == [CoreId(Cluster.Cluster1, Core.Core3)]
        assert {m._dev_no for m in model.get_shared_mxq_models()} == {0}
        assert _moe_greedy(model, PROMPTS[2]) and model.config.num_expert_workers == 2
    finally:
        _dispose(model)


def test_moe_expert_sum_in_finish_order_varies_run_to_run(sim, moe_release, golden_decoder):
    """The seed: "Greedy output can differ run to run because the Mixture-of-Experts runtime adds
    the expert outputs in the order they finish." transformers-mblt's decode adds each expert's
    output to the residual as it completes; the simulated experts finish in a varying order
    (``expert_finish_jitter_us``, on by default), so the decode logits vary in their last bits
    from run to run, while staying within 1e-4 of the golden reference."""
    sim.configure(devices=3)
    model = _load(moe_release())
    golden = golden_decoder("qwen3_moe")
    prompt = list(PROMPTS[1])
    cache = golden.new_cache(64)
    want = [golden.prefill(prompt, cache)[-1]]
    for t in golden.generate_greedy(prompt, NEW)[:-1]:
        want.append(golden.prefill([t], cache)[-1])
    runs = []
    try:
        for _ in range(6):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            logits = np.stack([lg[0].numpy() for lg in out.logits])
            assert np.abs(logits - np.stack(want)).max() < 1e-4
            runs.append(logits[1:].tobytes())  # the decode steps (the prefill is one chunk: einsum order)
    finally:
        _dispose(model)
    assert len(set(runs)) > 1, "six runs gave bit-identical decode logits: expert finish order is not simulated"


# ---------------------------------------------------------------------------------------- EAGLE-3
EAGLE3_PROMPTS = (PROMPTS[0], PROMPTS[1], [(13 * i + 7) % 1000 + 1 for i in range(30)])  # the last: 2 chunks


def _dispose_eagle3(model: Any) -> None:
    """An EAGLE-3 model has no ``dispose`` of its own: each of its three backends has one."""
    for part in (model.eagle3_base_model, model.eagle3_draft_model, model.eagle3_fc_projector):
        part.dispose()


def test_eagle3_rope_rows_are_the_vendors_table(qbruntime, eagle3_golden):
    """transformers-mblt's own RoPE table (``CachedRotaryEmbedding``) is exactly the rows our
    ``pack_rope_rows`` lays out: unpacked by the MXQ and packed again, every element returns bit
    for bit (zero padding included), and the unpacked tables are the golden cos/sin."""
    from transformers_mblt.utils.eagle3.eagle3_utils import CachedRotaryEmbedding

    from npusim.mxq.eagle3_kinds import pack_rope_rows, unpack_rope_rows

    for rope in (eagle3_golden.base.config.rope, eagle3_golden.draft.config.rope):
        table = CachedRotaryEmbedding(rope.head_dim, 64, base=int(rope.theta)).position_table
        cos, sin = unpack_rope_rows(table, rope.head_dim)
        assert np.array_equal(pack_rope_rows(cos, sin), table)
        want_cos, want_sin = rope.cos_sin(np.arange(64), dtype=np.float32)
        np.testing.assert_allclose(cos, want_cos, atol=2e-6, rtol=0)
        np.testing.assert_allclose(sin, want_sin, atol=2e-6, rtol=0)


def test_eagle3_release_loads_unpatched(sim, eagle3_release):
    """Every host weight of the release lands in transformers-mblt's module tree (none missing or
    unexpected), and the tree shape comes from the release's generation_config.json."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(eagle3_release()), output_loading_info=True)
    try:
        assert type(model).__name__ == "MobilintLlamaEagle3ForCausalLM"
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        model.configure_eagle3_tree()
        draft = model.eagle3_draft_model
        assert (draft.depth, draft.top_k, draft.max_draft_tokens) == (5, 8, 63)
        assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool and int(draft.t2d.sum()) == draft.d2t.numel()
    finally:
        _dispose_eagle3(model)


@pytest.mark.parametrize("tree", [{}, {"tree_depth": 3, "tree_top_k": 4, "num_assistant_tokens": 10}])
def test_eagle3_greedy_equals_the_base_greedy(sim, eagle3_release, eagle3_golden, tree):
    """transformers-mblt's EAGLE-3 ``generate`` (unpatched, do_sample=False) on our release gives
    the base's plain greedy continuation token for token."""
    model = _load(eagle3_release(**tree))
    try:
        for prompt, new in zip(EAGLE3_PROMPTS, (8, 24, 40)):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
            assert out[0, len(prompt):].tolist() == eagle3_golden.base.generate_greedy(prompt, new)
    finally:
        _dispose_eagle3(model)


def test_eagle3_rounds_and_acceptance(sim, eagle3_release, eagle3_golden):
    """The round API vllm-mblt serves with (``eagle3_prefill``, ``eagle3_decode_step``): the tokens
    equal the base's greedy continuation, and the fitted draft settles more than one token per
    round on average (printed: tokens per round)."""
    from transformers_mblt.utils.cache_utils import MobilintEagle3Cache

    model = _load(eagle3_release())
    model.configure_eagle3_tree()
    n = 40
    try:
        rates = []
        for prompt in EAGLE3_PROMPTS:
            cache = MobilintEagle3Cache(*model.get_cache_mxq_models())
            cache.reset()
            tokens = [int(model.eagle3_prefill(torch.tensor([prompt]), cache, max_new_tokens=n))]
            per_round = []
            while len(tokens) < n:
                step = model.eagle3_decode_step(cache, max_new_tokens=n - len(tokens) + 1)
                settled = step.tokens[0, 1:].tolist() + ([] if step.next_token is None else [int(step.next_token)])
                per_round.append(len(settled))
                tokens += settled
                if step.next_token is None:
                    break
            assert tokens[:n] == eagle3_golden.base.generate_greedy(prompt, n)
            rates.append(float(np.mean(per_round)))
            print(f"EAGLE-3 acceptance, prompt of {len(prompt)}: {rates[-1]:.2f} tokens per round "
                  f"over {len(per_round)} rounds {per_round}")
        assert np.mean(rates) > 1.2
    finally:
        _dispose_eagle3(model)
