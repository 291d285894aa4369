"""The RBLN ``vllm`` model path's rules and parts, without an engine:

* :mod:`vllm_npu.rbln.vllm_path`: decode batch buckets per strategy, the KV plan and its DRAM
  check, the parts' DRAM (:func:`vllm_npu.rbln.device.dram_bytes`);
* ``VLLM_RBLN_COMPILE_STRICT_MODE`` parsing;
* :class:`vllm_npu.rbln.sequences.SequenceTable` with vLLM's shared blocks (a prefix hit starts
  the prefill where vLLM's blocks end);
* :class:`vllm_npu.rbln.attention.RblnAttentionImpl` on the ``rbln_custom_ops`` of the
  simulator against a dense float64 reference (prefill chunks from a non-zero start with a
  padded tail, a padded decode batch), NMSE <= 1e-10, padding writing only the null block.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_npu.rbln import device, vllm_path
from vllm_npu.rbln.sequences import SequenceStateError, SequenceTable
from vllm_npu.rbln.vllm_path import VllmPathError, decode_buckets, kv_plan


@pytest.mark.parametrize("args, want", [
    ((8, "exponential"), [8]),
    ((8, "exponential", 1, 2, 3), [2, 4, 8]),
    ((8, "exponential", 1, 2, 10), [1, 2, 4, 8]),
    ((8, "exponential", 3, 2, 10), [4, 8]),
    ((8, "linear", 1, 3, 10), [2, 5, 8]),
    ((8, "linear", 4, 2, 10), [4, 6, 8]),
    ((6, "manual", 1, 2, 1, [6, 1, 3]), [1, 3, 6]),
])
def test_decode_buckets(args, want):
    assert decode_buckets(*args) == want


def test_manual_buckets_must_end_at_max_num_seqs():
    with pytest.raises(VllmPathError, match=r"\[1, 2\] must include max_num_seqs 4 as its largest entry"):
        decode_buckets(4, "manual", manual=[1, 2])
    with pytest.raises(VllmPathError, match="must include max_num_seqs 4"):
        decode_buckets(4, "manual", manual=[1, 8])


def _plan(**kw):
    base = dict(npu="RBLN-CR13", max_num_seqs=4, max_model_len=1000, block_size=128, num_layers=2,
                num_kv_heads=2, head_size=64, dtype_bytes=4, weight_bytes=10_000, memory_utilization=0.9)
    return kv_plan(**{**base, **kw})


def test_kv_plan_sizes_blocks_for_every_sequence_plus_the_null_block():
    p = _plan()
    assert p.num_blocks == 4 * 8 + 1
    assert p.block_bytes == 2 * 2 * 2 * 128 * 64 * 4
    assert _plan(override=20).num_blocks == 20


def test_kv_plan_refuses_what_the_part_cannot_hold():
    with pytest.raises(VllmPathError, match=r"holds less than one sequence of max_model_len 1000 \(8 blocks"):
        _plan(override=8)
    atom = device.dram_bytes("RBLN-CA25")
    assert atom == 16 * 2**30 - 288 * 2**20 and device.dram_bytes("RBLN-CR13") == 4 * 35 * 2**30
    with pytest.raises(VllmPathError, match=r"does not fit RBLN-CA25: \d+ bytes are left at gpu_memory_utilization "
                                            r"0\.5 after \d+ bytes of weights"):
        _plan(npu="RBLN-CA25", memory_utilization=0.5, weight_bytes=atom // 2 - 1000)
    with pytest.raises(device.UnknownDeviceError):
        device.dram_bytes("RBLN-X1")


def test_strict_mode_defaults_on():
    from vllm_npu.rbln.vllm_worker import strict_mode

    assert strict_mode({}) and strict_mode({"VLLM_RBLN_COMPILE_STRICT_MODE": "1"})
    assert not strict_mode({"VLLM_RBLN_COMPILE_STRICT_MODE": "0"})
    assert not strict_mode({"VLLM_RBLN_COMPILE_STRICT_MODE": "False"})


def test_shared_blocks_start_a_prefill_at_vllms_prefix_hit():
    t = SequenceTable(16, 4, 32, [1, 2, 4], shared_blocks=True)
    t.add("a", list(range(10)), None, None, [1, 2, 3], 8)   # vLLM found 8 tokens in blocks 1, 2
    plan = t.plan({"a": 2})
    (p,) = plan.prefills
    assert (p.start, p.ids) == (8, list(range(10))) and plan.decode is None
    t.done(plan)
    t.seqs["a"].output_ids.append(5)
    assert t.plan({"a": 1}).decode.positions[0] == 10
    # a hit of all but the last prompt token is a 1-token prefill, not a decode
    t.add("b", list(range(9)), None, None, [4, 5, 6], 8)
    (p,) = t.plan({"b": 1}).prefills
    assert p.start == 8
    # without shared blocks a prefix hit is a configuration mismatch
    with pytest.raises(SequenceStateError, match="prefix caching is off"):
        SequenceTable(16, 4, 32, [1]).add("c", [1, 2, 3, 4, 5], None, None, [1, 2], 4)


def test_resumed_request_keeps_vllms_hit():
    t = SequenceTable(16, 4, 32, [1], shared_blocks=True)
    t.add("a", list(range(10)), None, None, [1, 2, 3], 0)
    t.done(t.plan({"a": 10}))
    t.preempt("a")
    t.update("a", [7, 8, 9], True, 4, list(range(10)) + [3])
    (p,) = t.plan({"a": 7}).prefills
    assert p.start == 4 and len(p.ids) == 11


# ---------------------------------------------------------------------- the attention impl

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def _reference(q, k_all, v_all, scale):
    """Dense causal attention in float64: q [T, H, D] at the last T positions of k_all/v_all
    [L, Hkv, D]."""
    q, k_all, v_all = (np.asarray(x, np.float64) for x in (q, k_all, v_all))
    t, h, d = q.shape
    hkv = k_all.shape[1]
    length = k_all.shape[0]
    out = np.zeros((t, h, d))
    for i in range(t):
        pos = length - t + i
        for hh in range(h):
            kv = hh // (h // hkv)
            s = k_all[: pos + 1, kv] @ q[i, hh] * scale
            p = np.exp(s - s.max())
            out[i, hh] = (p / p.sum()) @ v_all[: pos + 1, kv]
    return out


def _nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


@pytest.mark.parametrize("block_size", [8, 64])  # several blocks (flash op), one block (eager op)
def test_attention_impl_equals_dense_attention(block_size):
    import npusim.rbln  # noqa: F401  (the simulator's rbln_custom_ops)
    from vllm_npu.rbln.attention import RblnAttentionImpl, RblnAttentionMetadata

    h, hkv, d, nb, chunk = 4, 2, 64, 12, 16
    width = 64 // block_size
    impl = RblnAttentionImpl(h, d, d ** -0.5, hkv, None, None, "auto")
    gen = torch.Generator().manual_seed(3)
    kv = torch.zeros(2, nb, hkv, 1, block_size, d)
    blocks = [3, 5, 7, 9, 11, 2, 4, 6][:width]
    table = torch.zeros(width, dtype=torch.int32)
    table[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    keys = torch.randn(40, hkv, d, generator=gen)
    vals = torch.randn(40, hkv, d, generator=gen)
    qs = torch.randn(40, h, d, generator=gen)
    # prefill 37 tokens in chunks of 16 from position 0; the last chunk is padded
    for start in range(0, 37, chunk):
        n = min(chunk, 37 - start)
        pad = lambda x: torch.cat([x[start:start + n], torch.zeros(chunk - n, *x.shape[1:])])  # noqa: E731
        md = RblnAttentionMetadata("prefill", torch.tensor([[start]], dtype=torch.int32), table, block_size)
        out = torch.empty(chunk, h * d)
        impl.forward(None, pad(qs), pad(keys), pad(vals), kv, md, out)
        want = _reference(qs[start:start + n], keys[:start + n], vals[:start + n], d ** -0.5)
        assert _nmse(out.view(chunk, h, d)[:n].numpy(), want) <= 1e-10
    # a decode batch of 4: row 0 at position 37, rows 1-3 padding on the null block 0
    md = RblnAttentionMetadata("decode", torch.tensor([[37], [0], [0], [0]], dtype=torch.int32),
                               torch.stack([table, *[torch.zeros(width, dtype=torch.int32)] * 3]), block_size)
    out = torch.empty(4, h * d)
    before = kv[:, [b for b in range(nb) if b not in (0, *blocks)]].clone()
    q4 = torch.cat([qs[37:38], torch.randn(3, h, d, generator=gen)])
    impl.forward(None, q4, torch.cat([keys[37:38], torch.randn(3, hkv, d)]),
                 torch.cat([vals[37:38], torch.randn(3, hkv, d)]), kv, md, out)
    want = _reference(qs[37:38], keys[:38], vals[:38], d ** -0.5)
    assert _nmse(out.view(4, h, d)[:1].numpy(), want) <= 1e-10
    assert torch.equal(kv[:, [b for b in range(nb) if b not in (0, *blocks)]], before), \
        "padding rows and chunks wrote outside the sequence's blocks and the null block"


def test_attention_impl_refuses_what_the_kernels_lack():
    from vllm_npu.rbln.attention import RblnAttentionError, RblnAttentionImpl

    with pytest.raises(RblnAttentionError, match="sliding_window, logits_soft_cap"):
        RblnAttentionImpl(4, 64, 0.1, 2, None, 128, "auto", logits_soft_cap=30.0)
    with pytest.raises(RblnAttentionError, match="kv_cache_dtype=fp8"):
        RblnAttentionImpl(4, 64, 0.1, 2, None, None, "fp8")


def test_graph_cache_signature_changes_with_what_changes_the_programs(tmp_path):
    from vllm_npu.rbln import graph_cache

    plan = {"max_num_seqs": 4, "decode_buckets": [1, 2, 4], "chunk": 128, "num_blocks": 33, "block_size": 128,
            "max_seq_len": 1024, "npu": "RBLN-CR13"}
    sig = graph_cache.signature("abc", plan, "0.12.0", {})
    assert sig == graph_cache.signature("abc", dict(plan), "0.12.3", {}), "patch releases share programs"
    changed = [graph_cache.signature("abd", plan, "0.12.0", {}),
               graph_cache.signature("abc", {**plan, "decode_buckets": [4]}, "0.12.0", {}),
               graph_cache.signature("abc", {**plan, "npu": "RBLN-CR03"}, "0.12.0", {}),
               graph_cache.signature("abc", plan, "0.13.0", {}),
               graph_cache.signature("abc", plan, "0.12.0", {"VLLM_RBLN_NUM_HIDDEN_LAYERS": "1"})]
    assert len({sig, *changed}) == 6
    path = graph_cache.bundle_path(str(tmp_path), "/models/my llama", sig)
    assert path.startswith(str(tmp_path / "rbln")) and path.endswith(f"/{sig}/rank0/mega_cache.bin")


def test_graph_cache_load_and_save_with_the_simulator(tmp_path, caplog):
    import logging

    import npusim.rbln as rebel
    from vllm_npu.rbln import graph_cache

    path = graph_cache.bundle_path(str(tmp_path), "m", "0123456789abcdef")
    with caplog.at_level(logging.INFO, logger="vllm.vllm_npu.rbln"):
        assert graph_cache.load(rebel, str(tmp_path), path) is None
        rebel.core.mega_cache.add(graph_cache.cache_root(str(tmp_path)), "sig1", {"npu": "RBLN-CR13", "inputs": []})
        assert graph_cache.save(rebel, str(tmp_path), path) > 0
        assert graph_cache.load(rebel, str(tmp_path), path)["programs"] >= 1
        with open(path, "r+b") as fh:
            fh.seek(-5, 2)
            fh.write(b"XXXXX")
        assert graph_cache.load(rebel, str(tmp_path), path) is None
    assert "Ignored an unreadable rbln mega-cache bundle at" in caplog.text
    assert not [p for p in (tmp_path / "rbln").rglob("*.tmp")], "a temporary bundle was left behind"
