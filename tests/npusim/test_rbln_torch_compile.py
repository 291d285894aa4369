"""``rebel.core.torch_compile.rbln_backend`` of ``npusim.rbln``: the torch.compile backend of the
RBLN ``vllm`` model path, as a compiled RBLN program behaves.

Each test compiles a small module with ``torch.compile(..., backend=rbln_backend,
dynamic=False)`` (or calls the backend on a traced graph) and checks one rule of
``simulators/npusim/rbln/core/torch_compile.py``: static shapes (a new shape is a new compile,
recorded; a dynamic dimension is refused naming the input), the program accepts only its
compiled shapes and dtypes, options and modes are checked by name, the device must be present
unless ``compile_only``, an injected fault strikes a program call, and the paged attention
operators inside a graph update a KV cache passed in.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from npusim.rbln import ops  # noqa: E402, F401  (registers torch.ops.rbln_custom_ops)
from npusim.rbln.core import torch_compile as tc  # noqa: E402
from npusim.rbln.errors import (RBLNCompileError, RBLNDeviceError, RBLNInputError,  # noqa: E402
                                RBLNRuntimeFault)


@pytest.fixture(autouse=True)
def _device(monkeypatch):
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": ["RBLN-CR13"]}))
    monkeypatch.delenv("RBLN_FORCE_NPU_NAME", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _compiled(fn, **options):
    return torch.compile(fn, backend=tc.rbln_backend, dynamic=False, fullgraph=True, options=options or None)


def test_results_equal_eager_and_each_new_shape_is_a_new_compile():
    model = Mlp().eval()
    run = _compiled(model, mode=["strict"])
    before = len(tc.compiled_graphs())
    with torch.no_grad():
        for rows in (4, 4, 2, 4):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(run(x), model(x), rtol=0, atol=0)
    records = tc.compiled_graphs()[before:]
    assert len(records) == 2, "two shapes compile twice; a repeated shape reuses its program"
    assert all(r.npu == "RBLN-CR13" and r.modes == ("strict",) for r in records)
    # the parameters are graph inputs too (Dynamo lifts them); the activations differ
    assert [((4, 8), "float32") in r.inputs for r in records] == [True, False]
    assert [((2, 8), "float32") in r.inputs for r in records] == [False, True]


def test_the_program_takes_its_compiled_shapes_and_dtypes_only():
    gm = torch.fx.symbolic_trace(Mlp().eval())
    prog = tc.rbln_backend(gm, [torch.randn(3, 8)])
    assert prog(torch.randn(3, 8)).shape == (3, 4)
    with pytest.raises(RBLNInputError, match=r"input 0: got \[5, 8\] float32, compiled for \[3, 8\] float32"):
        prog(torch.randn(5, 8))
    with pytest.raises(RBLNInputError, match=r"input 0: got \[3, 8\] float64, compiled for \[3, 8\] float32"):
        prog(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RBLNInputError, match="takes 1 inputs, got 2"):
        prog(torch.randn(3, 8), torch.randn(3, 8))


def test_a_dynamic_shape_is_refused_naming_the_input():
    model = Mlp().eval()
    run = torch.compile(model, backend=tc.rbln_backend, dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match=r"graph input \d+ (has a dynamic dimension|is a symbolic int).*static shapes only"):
        run(torch.randn(6, 8))


def test_unknown_options_and_modes_are_errors_naming_them():
    gm = torch.fx.symbolic_trace(Mlp().eval())
    with pytest.raises(RBLNCompileError, match=r"unknown options \['cache_dri'\]"):
        tc.rbln_backend(gm, [torch.randn(2, 8)], {"cache_dri": "/tmp"})
    with pytest.raises(RBLNCompileError, match=r"mode \['fast'\] is not one of \['compile_only', 'strict'\]"):
        tc.rbln_backend(gm, [torch.randn(2, 8)], {"mode": ["fast"]})
    with pytest.raises(RBLNDeviceError, match="unknown NPU name 'RBLN-XX1'"):
        tc.rbln_backend(gm, [torch.randn(2, 8)], {"npu": "RBLN-XX1"})


def test_no_device_fails_as_the_real_stack_unless_compile_only(monkeypatch):
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": []}))
    gm = torch.fx.symbolic_trace(Mlp().eval())
    with pytest.raises(RBLNDeviceError, match=r"Device 0 is not a valid NPU device\. Please check your NPU "
                                              r"status with 'rbln-smi' command\."):
        tc.rbln_backend(gm, [torch.randn(2, 8)])
    prog = tc.rbln_backend(gm, [torch.randn(2, 8)], {"mode": ["compile_only"], "npu": "RBLN-CR13"})
    assert prog.record.npu == "RBLN-CR13"
    with pytest.raises(RBLNDeviceError, match="compile_only"):
        prog(torch.randn(2, 8))


def test_an_injected_fault_strikes_a_program_call(monkeypatch, tmp_path):
    from npusim.rbln import runtime

    gm = torch.fx.symbolic_trace(Mlp().eval())
    prog = tc.rbln_backend(gm, [torch.randn(2, 8)])
    log = tmp_path / "faults.log"
    monkeypatch.setenv("NPUSIM_RBLN", json.dumps({"devices": ["RBLN-CR13"], "fault_log": str(log),
                                                  "fault": {"after_calls": runtime.calls() + 1, "times": 1}}))
    prog(torch.randn(2, 8))
    with pytest.raises(RBLNRuntimeFault, match="injected fault"):
        prog(torch.randn(2, 8))
    prog(torch.randn(2, 8))
    assert log.read_text().count("injected fault") == 1


def test_paged_attention_in_a_graph_updates_the_kv_cache_passed_in():
    """A decode step of the vllm path's shape: the op writes the new key into the cache."""
    hkv, r, d, bs, nb = 2, 2, 64, 16, 4

    def step(q, k, v, kcache, vcache, seq, table):
        return torch.ops.rbln_custom_ops.paged_causal_attn_decode(
            q=q, k=k, v=v, kcache=kcache, vcache=vcache, seq=seq, scale=torch.tensor(0.125),
            block_table=table, block_size=bs)

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, hkv, r, 1, d, generator=gen)
    k, v = torch.randn(2, hkv, 1, 1, d, generator=gen), torch.randn(2, hkv, 1, 1, d, generator=gen)
    kc, vc = torch.zeros(nb, hkv, 1, bs, d), torch.zeros(nb, hkv, 1, bs, d)
    seq = torch.tensor([[0], [3]], dtype=torch.int32)
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    want_k, want_v = kc.clone(), vc.clone()
    want = step(q, k, v, want_k, want_v, seq, table)
    out = _compiled(step)(q, k, v, kc, vc, seq, table)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(kc, want_k) and torch.equal(kc[1, :, 0, 0], k[0, :, 0, 0])
    assert torch.equal(kc[2, :, 0, 3], k[1, :, 0, 0]) and not kc[0].any() and not kc[3].any()


# ---------------------------------------------------------------------- rebel.core.mega_cache

def test_mega_cache_round_trip_hits_and_unreadable_bundles(tmp_path):
    import io

    from npusim.rbln.core import mega_cache

    cache = tmp_path / "rbln"
    mega_cache.set_dir(cache)
    model = Mlp().eval()
    first = _compiled(model, cache_dir=str(cache))
    with torch.no_grad():
        first(torch.randn(3, 8))
    assert tc.compiled_graphs()[-1].from_cache is False
    buf = io.BytesIO()
    assert mega_cache.write_bundle(buf) > 0
    data = buf.getvalue()

    other = tmp_path / "other"   # a new process's store: what the bundle brings
    mega_cache.set_dir(other)
    assert mega_cache.read_bundle(io.BytesIO(data)) == {"programs": 1, "compiler": "npusim.rbln 0.12.0"}
    torch._dynamo.reset()
    with torch.no_grad():
        _compiled(model, cache_dir=str(other))(torch.randn(3, 8))   # the same program: a hit
        _compiled(model, cache_dir=str(other))(torch.randn(5, 8))   # a new shape: a miss
    assert [r.from_cache for r in tc.compiled_graphs()[-2:]] == [True, False]
    for bad in (data[:-10], data.replace(b'"npusim.rbln 0.12.0"', b'"npusim.rbln 0.11.0"'),
                data.replace(b"\n1\n", b"\n9\n", 1), b"garbage"):
        assert mega_cache.read_bundle(io.BytesIO(bad)) is None


# ---------------------------------------------------------------------- torch.ops.rbln sampler ops

def test_sampler_ops():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    assert torch.equal(torch.ops.rbln.argmax(logits), logits.argmax(-1).to(torch.int32))
    probs = torch.softmax(logits, -1)
    ones = torch.ones(4, dtype=torch.int32)
    assert torch.equal(torch.ops.rbln.top_k_top_p(probs, ones, None), logits.argmax(-1).to(torch.int32))
    torch.manual_seed(0)
    top3 = set(probs[0].topk(3).indices.tolist())
    draws = {int(torch.ops.rbln.top_k_top_p(probs[:1], torch.tensor([3]), None)[0]) for _ in range(200)}
    assert draws <= top3 and len(draws) > 1
    # top-p 0: only the most likely token survives (it alone reaches the nucleus)
    assert torch.equal(torch.ops.rbln.top_k_top_p(probs, None, torch.zeros(4)), logits.argmax(-1).to(torch.int32))
    with pytest.raises(RBLNInputError, match=r"k must be \[4\], got \[3\]"):
        torch.ops.rbln.top_k_top_p(probs, torch.ones(3, dtype=torch.int32), None)
    # non-finite and negative entries weigh nothing (vllm-rbln's warm-up samples torch.empty
    # logits: a device kernel returns a token, it does not raise); a row without mass gives token 0
    junk = torch.tensor([[float("nan")] * 5, [float("inf"), 1.0, -1.0, 0.0, 0.0],
                         [0.0] * 5, [float("nan"), 0.0, 0.0, 0.7, 0.0]])
    got = torch.ops.rbln.top_k_top_p(junk, torch.tensor([0, 2, 0, 0]), torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert got.dtype == torch.int32 and got.tolist() == [0, 1, 0, 3], got
