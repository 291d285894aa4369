"""``npusim.rbln.ops`` (the ``rbln_custom_ops`` paged attention ops) against an independent
float64 numpy reference.

The reference keeps every row's keys and values as a dense array by position, so it shares no
block-table or gather code with the simulator. It writes the new K/V at positions
``seq[b] .. seq[b]+Q-1`` (inside the row's blocks) and attends causally (or bidirectionally, or
through the given mask) over the positions written so far.

Tolerances: outputs are computed in float32 by the simulator; NMSE (sum of squared error over
the reference's sum of squares, as llama.cpp's test-backend-ops) must be at most 1e-10. The KV
cache writes are checked bit for bit, and every block a row does not own stays untouched.

torch-rbln 0.12.0 is not a second implementation to compare with (docs/rbln.md, "Why torch-rbln
is not a second implementation of the custom ops").
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from npusim.rbln import ops  # noqa: E402  (registers torch.ops.rbln_custom_ops)
from npusim.rbln.errors import RBLNInputError  # noqa: E402

NMSE_MAX = 1e-10
HKV, R, D, BS, NB = 2, 2, 64, 16, 12


def nmse(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(((out - ref) ** 2).sum() / (ref ** 2).sum())


def _cache(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NB, HKV, 1, BS, D)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _dense(cache: torch.Tensor, table: list[int]) -> np.ndarray:
    """A row's cache as ``[Hkv, n*BS, D]`` float64, by position (the reference's view)."""
    return np.concatenate([cache[b, :, 0].double().numpy() for b in table], axis=1)


def reference(q, k, v, kcache, vcache, starts, tables, *, mask=None, bidirectional=False):
    """float64 outputs ``[B, Hkv, R, Q, D]`` and the expected caches after the write."""
    B, hkv, r, nq, d = q.shape
    kc, vc = kcache.clone(), vcache.clone()
    out = np.zeros((B, hkv, r, nq, d))
    for b in range(B):
        table = tables[b]
        cap = len(table) * BS
        for t in range(nq):
            p = starts[b] + t
            if p < cap:
                kc[table[p // BS], :, 0, p % BS] = k[b, :, 0, t]
                vc[table[p // BS], :, 0, p % BS] = v[b, :, 0, t]
        keys, vals = _dense(kc, table), _dense(vc, table)
        for t in range(nq):
            p = starts[b] + t
            if mask is not None:
                seen = np.asarray(mask[b if mask.shape[0] > 1 else 0].reshape(-1, mask.shape[-1])[t], bool)
                seen = np.concatenate([seen, np.zeros(max(0, cap - seen.size), bool)])[:cap]
            else:
                last = starts[b] + nq - 1 if bidirectional else p
                seen = np.arange(cap) <= min(last, cap - 1)
            for h in range(hkv):
                s = q[b, h, :, t].double().numpy() @ keys[h].T / np.sqrt(d)   # [R, cap]
                s = np.where(seen, s, -np.inf)
                w = np.exp(s - s.max(axis=1, keepdims=True))
                w /= w.sum(axis=1, keepdims=True)
                out[b, h, :, t] = w @ vals[h]
    return out, kc, vc


def _args(name, q, k, v, kc, vc, starts, tables, partition=BS * 2) -> list:
    """The positional arguments of ``rbln_custom_ops.<name>``, as optimum-rbln passes them:
    ``seq`` ``[B, 1]`` int32, a float32 ``scale``, the prefill's one-row block table as ``[n]``,
    and ``partition`` for the flash ops."""
    seq = torch.tensor(starts, dtype=torch.int32).reshape(-1, 1)
    table = torch.tensor(tables, dtype=torch.int16)
    table = table[0] if "prefill" in name else table
    scale = torch.tensor(1.0 / np.sqrt(D), dtype=torch.float32)
    args = [q, k, v, kc, vc, seq, scale, table, BS]
    return args + [partition] if "flash" in name else args


def _call(name, q, k, v, kc, vc, starts, tables, *, partition=BS * 2, **extra):
    op = getattr(torch.ops.rbln_custom_ops, name)
    return op(*_args(name, q, k, v, kc, vc, starts, tables, partition), **extra)


def _inputs(gen, B, nq):
    q = torch.randn((B, HKV, R, nq, D), generator=gen)
    k = torch.randn((B, HKV, 1, nq, D), generator=gen)
    v = torch.randn((B, HKV, 1, nq, D), generator=gen)
    return q, k, v


@pytest.mark.parametrize("name", ["paged_causal_attn_prefill", "paged_flash_causal_attn_prefill"])
@pytest.mark.parametrize("start,nq", [(0, 24), (32, 16), (40, 5)])
def test_prefill_chunk_equals_the_reference(name, start, nq):
    """A chunk of a prompt starting at ``start`` over scattered blocks, attending to what
    earlier chunks left in the cache (random contents stand in for them)."""
    gen = torch.Generator().manual_seed(start + nq)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, nq)
    tables = [[7, 2, 9, 4]]
    ref, kref, vref = reference(q, k, v, kc, vc, [start], tables)
    out = _call(name, q, k, v, kc, vc, [start], tables)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert nmse(out, ref) <= NMSE_MAX
    assert torch.equal(kc, kref) and torch.equal(vc, vref), "the KV write differs from the reference"


def test_prefill_chunk_past_the_table_writes_only_inside_it():
    """The zero-padded tail of a last chunk beyond the row's blocks is not written anywhere."""
    gen = torch.Generator().manual_seed(3)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 16)
    tables = [[5, 1]]                       # 32 positions; the chunk covers 24 .. 39
    before = kc.clone()
    ref, kref, vref = reference(q, k, v, kc, vc, [24], tables)
    out = _call("paged_causal_attn_prefill", q, k, v, kc, vc, [24], tables)
    assert nmse(out[:, :, :, :8], ref[:, :, :, :8]) <= NMSE_MAX
    assert torch.equal(kc, kref) and torch.equal(vc, vref)
    untouched = [b for b in range(NB) if b != 1]
    assert torch.equal(kc[untouched], before[untouched])


@pytest.mark.parametrize("name", ["paged_causal_attn_decode", "paged_flash_causal_attn_decode"])
def test_decode_batch_with_different_lengths_equals_the_reference(name):
    """Three rows at positions 0, 17 and 47 (the fast decode path), each with its own blocks."""
    gen = torch.Generator().manual_seed(11)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 3, 1)
    starts, tables = [0, 17, 47], [[3, 8, 0], [6, 10, 1], [2, 11, 5]]
    before = kc.clone()
    ref, kref, vref = reference(q, k, v, kc, vc, starts, tables)
    out = _call(name, q, k, v, kc, vc, starts, tables)
    assert nmse(out, ref) <= NMSE_MAX
    assert torch.equal(kc, kref) and torch.equal(vc, vref)
    written = {3, 10, 5}                    # tables[b][pos // BS]: 0 -> 3, 17 -> 10, 47 -> 5
    untouched = [b for b in range(NB) if b not in written]
    assert torch.equal(kc[untouched], before[untouched])


def test_decode_row_past_its_table_is_not_written_and_others_are():
    """A padding row past its blocks (a finished sequence in a bucket) changes no cache."""
    gen = torch.Generator().manual_seed(12)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 2, 1)
    starts, tables = [48, 9], [[4, 7, 9], [1, 2, 3]]
    ref, kref, vref = reference(q, k, v, kc, vc, starts, tables)
    out = _call("paged_causal_attn_decode", q, k, v, kc, vc, starts, tables)
    assert nmse(out, ref) <= NMSE_MAX
    assert torch.equal(kc, kref) and torch.equal(vc, vref)


def test_bidirectional_prefill_sees_the_whole_chunk():
    gen = torch.Generator().manual_seed(5)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 8)
    tables = [[0, 3]]
    ref, _, _ = reference(q, k, v, kc, vc, [16], tables, bidirectional=True)
    out = _call("paged_causal_attn_prefill", q, k, v, kc, vc, [16], tables, is_bidirectional=True)
    assert nmse(out, ref) <= NMSE_MAX
    causal, _, _ = reference(q, k, v, kc, vc, [16], tables)
    assert nmse(ref, causal) > 1e-3, "the case must tell bidirectional from causal"


@pytest.mark.parametrize("name", ["paged_attn_prefill", "paged_flash_attn_prefill"])
def test_masked_prefill_follows_the_mask(name):
    """An explicit {0,1} mask over the cache positions (a padded batch row's mask)."""
    gen = torch.Generator().manual_seed(6)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 8)
    tables = [[9, 2]]
    mask = np.tril(np.ones((8, 32)), k=16)
    mask[:, 3:6] = 0                        # holes the causal rule would not make
    mask_t = torch.tensor(mask, dtype=torch.float32).reshape(1, 1, 1, 8, 32)
    ref, _, _ = reference(q, k, v, kc, vc, [16], tables, mask=mask_t.numpy())
    out = _call(name, q, k, v, kc, vc, [16], tables, mask=mask_t)
    assert nmse(out, ref) <= NMSE_MAX


def test_a_block_id_outside_the_cache_is_an_error_naming_it():
    gen = torch.Generator().manual_seed(7)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 4)
    before = kc.clone()
    with pytest.raises(RBLNInputError, match=r"block id 12, outside the KV cache's 12 blocks"):
        _call("paged_causal_attn_prefill", q, k, v, kc, vc, [0], [[12, 1]])
    assert torch.equal(kc, before), "a refused call must write nothing"


def test_flash_partition_that_does_not_divide_the_block_is_refused():
    gen = torch.Generator().manual_seed(8)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 4)
    with pytest.raises(RBLNInputError, match="partition 24 and block_size 16 must divide one another"):
        _call("paged_flash_causal_attn_prefill", q, k, v, kc, vc, [0], [[0, 1]], partition=24)


def test_shapes_that_do_not_line_up_are_an_error_naming_them():
    gen = torch.Generator().manual_seed(9)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 1, 4)
    with pytest.raises(RBLNInputError, match=r"shapes do not line up: q \(1, 2, 2, 4, 32\)"):
        _call("paged_causal_attn_prefill", q[..., :32], k[..., :32], v[..., :32], kc, vc, [0], [[0, 1]])


def test_host_kernel_is_the_registered_op():
    """What a runtime executes (``host_kernel``) computes what the dispatcher's op computes."""
    gen = torch.Generator().manual_seed(10)
    kc, vc = _cache(gen)
    q, k, v = _inputs(gen, 2, 1)
    starts, tables = [5, 30], [[1, 2], [3, 4]]
    kc2, vc2 = kc.clone(), vc.clone()
    a = _call("paged_flash_causal_attn_decode", q, k, v, kc, vc, starts, tables)
    kernel = ops.host_kernel("paged_flash_causal_attn_decode")
    b = kernel(*_args("paged_flash_causal_attn_decode", q, k, v, kc2, vc2, starts, tables))
    assert torch.equal(a, b) and torch.equal(kc, kc2)
    assert ops.host_kernel("no_such_op") is None


@pytest.mark.parametrize("name", ["paged_causal_attn_prefill", "paged_flash_causal_attn_decode"])
def test_schema_declares_the_kv_caches_mutated_and_the_fake_kernel_matches(name):
    """``torch.library.opcheck``: the schema (``kcache``/``vcache`` mutated, nothing else), the
    fake kernel's output against the real one, and tracing under ``torch.export``-style
    functionalization."""
    gen = torch.Generator().manual_seed(13)
    kc, vc = _cache(gen)
    decode = "decode" in name
    q, k, v = _inputs(gen, 2 if decode else 1, 1 if decode else 8)
    starts = [3, 20] if decode else [0]
    tables = [[1, 2], [3, 4]] if decode else [[1, 2]]
    args = _args(name, q, k, v, kc, vc, starts, tables, partition=BS)
    op = getattr(torch.ops.rbln_custom_ops, name).default
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutable == ["kcache", "vcache"]
    torch.library.opcheck(op, tuple(args),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
