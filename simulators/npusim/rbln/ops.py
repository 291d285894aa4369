"""The ``torch.ops.rbln_custom_ops`` operators the decoder path of optimum-rbln calls.

Registered (with fake kernels, so ``torch.export`` traces through them) on import of
:mod:`npusim.rbln`:

* ``linear(input, weight, bias=None)``: ``input @ weight.T + bias``. optimum-rbln swaps
  ``torch.nn.functional.linear`` for it during a compile.
* ``paged_causal_attn_{prefill,decode}`` and ``paged_flash_causal_attn_{prefill,decode}``
  (``partition`` added), and the masked ``paged_attn_*``/``paged_flash_attn_*``: write the new
  keys/values into the paged KV cache and attend over it. ``kcache``/``vcache`` are mutated in
  place (declared in the schema).

Shapes (``Hkv`` KV heads, ``R`` query heads per KV head, ``D`` head size, ``BS`` block size)::

    q        [B, Hkv, R, Q, D]         B = 1 for prefill, Q = 1 for decode
    k, v     [B, Hkv, 1, Q, D]
    kcache   [NB, Hkv, 1, BS, D]       vcache alike
    seq      [B, 1] int32              position of the first query token of each row
    block_table  [n] (prefill) or [B, n] (decode), integer block ids in position order
    mask     optional {0,1}, broadcastable to [B, 1, 1, Q, n*BS]
    returns  [B, Hkv, R, Q, D]

Query token ``t`` of row ``b`` sits at position ``seq[b] + t``; without a mask it sees cache
positions ``0 .. seq[b] + t`` (``is_bidirectional``: ``0 .. seq[b] + Q - 1``). Positions beyond
the row's block table are not written (the zero padding of a last prefill chunk past the
sequence's capacity). A block id outside ``0 .. NB-1`` is an error naming it, where the device
would read or write another sequence's memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from .errors import RBLNInputError

__all__ = ["OPS", "host_kernel", "paged_attention"]

_linear = torch._C._nn.linear  # the original: optimum-rbln rebinds F.linear to our op


@torch.library.custom_op("rbln_custom_ops::linear", mutates_args=())
def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _linear(input, weight, bias)


@linear.register_fake
def _(input, weight, bias=None):
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kcache: torch.Tensor,
                    vcache: torch.Tensor, seq: torch.Tensor, scale: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, *, mask: torch.Tensor | None,
                    bidirectional: bool, op: str) -> torch.Tensor:
    """The reference computation of every paged attention op (see the module docstring).

    Raises:
        RBLNInputError: shapes that do not line up, or a block id outside the cache.
    """
    B, hkv, r, nq, d = q.shape
    nb, chkv, _, bs, cd = kcache.shape
    if (chkv, cd, bs) != (hkv, d, block_size) or k.shape != (B, hkv, 1, nq, d) or vcache.shape != kcache.shape:
        raise RBLNInputError(
            f"{op}: shapes do not line up: q {tuple(q.shape)}, k {tuple(k.shape)}, kcache "
            f"{tuple(kcache.shape)}, block_size {block_size}")
    tables = block_table.reshape(1, -1) if block_table.dim() == 1 else block_table
    if tables.shape[0] != B:
        raise RBLNInputError(f"{op}: block_table has {tables.shape[0]} rows for a batch of {B}")
    tables = tables.to(torch.int64)
    lo, hi = int(tables.min()), int(tables.max())
    if lo < 0 or hi >= nb:
        raise RBLNInputError(
            f"{op}: block_table holds block id {lo if lo < 0 else hi}, outside the KV cache's {nb} blocks")
    starts = seq.reshape(B, -1)[:, 0].to(torch.int64)
    capacity = tables.shape[1] * bs
    kflat, vflat = kcache.view(nb, hkv, bs, d), vcache.view(nb, hkv, bs, d)
    if nq == 1 and mask is None:
        return _decode_attention(q, k, v, kflat, vflat, starts, scale, tables, bs, capacity)
    # Write every row's new K/V (positions past the row's block table are dropped).
    pos = starts.reshape(B, 1) + torch.arange(nq).reshape(1, nq)          # [B, Q]
    last = int(pos.max())
    if last < capacity:  # every position is inside its row's blocks (always, for a decode)
        rows = torch.arange(B).repeat_interleave(nq)
        cols = torch.arange(nq).repeat(B)
    else:
        rows, cols = (pos < capacity).nonzero(as_tuple=True)
    if rows.numel():
        p = pos[rows, cols]
        bid, off = tables[rows, p // bs].reshape(-1, 1), (p % bs).reshape(-1, 1)
        heads = torch.arange(hkv).reshape(1, -1)
        kflat.index_put_((bid, heads, off), k[rows, :, 0, cols, :].to(kcache.dtype))
        vflat.index_put_((bid, heads, off), v[rows, :, 0, cols, :].to(vcache.dtype))
    # Attend over the first `length` positions of every row's blocks.
    length = min(last + 1, capacity)
    keys, vals = _gather(kflat, vflat, tables, length)
    f32 = torch.float32
    qf = (q if q.dtype == f32 else q.to(f32)).reshape(B * hkv, r * nq, d)
    kf = (keys if keys.dtype == f32 else keys.to(f32)).reshape(B * hkv, length, d)
    vf = (vals if vals.dtype == f32 else vals.to(f32)).reshape(B * hkv, length, d)
    scores = torch.bmm(qf, kf.transpose(1, 2)).view(B, hkv, r, nq, length) * scale.to(f32)
    kpos = torch.arange(length)
    if mask is not None:
        m = mask.reshape(mask.shape[0], -1, mask.shape[-1])[:, -nq:, :length].to(torch.bool)
        allowed = m.reshape(m.shape[0], 1, 1, nq, length)
    elif bidirectional:
        allowed = (kpos.reshape(1, 1, length) < (starts + nq).reshape(B, 1, 1)).reshape(B, 1, 1, 1, length)
    else:
        allowed = (kpos.reshape(1, 1, length) <= pos.reshape(B, nq, 1)).reshape(B, 1, 1, nq, length)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.bmm(probs.view(B * hkv, r * nq, length), vf).view(B, hkv, r, nq, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _gather(kflat: torch.Tensor, vflat: torch.Tensor, tables: torch.Tensor, length: int):
    """Every row's keys and values at positions ``0 .. length-1``: ``[B, Hkv, length, D]`` each,
    read through the rows' block tables (one block: sliced before gathering, so only
    ``length`` slots are copied)."""
    B, (_, hkv, bs, d) = tables.shape[0], kflat.shape
    if length <= bs:
        first = tables[:, 0]
        return (torch.index_select(kflat[:, :, :length], 0, first),
                torch.index_select(vflat[:, :, :length], 0, first))
    nblk = -(-length // bs)
    return tuple(flat[tables[:, :nblk]].permute(0, 2, 1, 3, 4).reshape(B, hkv, nblk * bs, d)[:, :, :length]
                 for flat in (kflat, vflat))


def _decode_attention(q, k, v, kflat, vflat, starts, scale, tables, bs: int, capacity: int):
    """:func:`paged_attention` for one query token per row and no mask (every decode step):
    the same result with fewer host operations."""
    B, hkv, r, _, d = q.shape
    last = int(starts.max())
    if last < capacity:
        blk = tables.gather(1, (starts // bs).unsqueeze(1)).squeeze(1)
        off = starts % bs
        kflat[blk, :, off] = k[:, :, 0, 0, :].to(kflat.dtype)
        vflat[blk, :, off] = v[:, :, 0, 0, :].to(vflat.dtype)
    else:  # some rows past their blocks: write only the others
        live = (starts < capacity).nonzero(as_tuple=True)[0]
        if live.numel():
            blk = tables[live].gather(1, (starts[live] // bs).unsqueeze(1)).squeeze(1)
            off = starts[live] % bs
            kflat[blk, :, off] = k[live, :, 0, 0, :].to(kflat.dtype)
            vflat[blk, :, off] = v[live, :, 0, 0, :].to(vflat.dtype)
    length = min(last + 1, capacity)
    keys, vals = _gather(kflat, vflat, tables, length)
    f32 = torch.float32
    qf = (q if q.dtype == f32 else q.to(f32)).reshape(B * hkv, r, d)
    kf = (keys if keys.dtype == f32 else keys.to(f32)).reshape(B * hkv, length, d)
    vf = (vals if vals.dtype == f32 else vals.to(f32)).reshape(B * hkv, length, d)
    scores = torch.bmm(qf, kf.transpose(1, 2)).view(B, hkv * r, length) * scale.to(f32)
    allowed = torch.arange(length).reshape(1, 1, length) <= starts.reshape(B, 1, 1)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.bmm(probs.view(B * hkv, r, length), vf).view(B, hkv, r, 1, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _define(name: str, *, flash: bool) -> None:
    mutated = ("kcache", "vcache")

    def body(q, k, v, kcache, vcache, seq, scale, block_table, block_size, mask, is_bidirectional):
        return paged_attention(q, k, v, kcache, vcache, seq, scale, block_table, block_size,
                               mask=mask, bidirectional=bool(is_bidirectional), op=name)

    if flash:
        @torch.library.custom_op(f"rbln_custom_ops::{name}", mutates_args=mutated)
        def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kcache: torch.Tensor,
               vcache: torch.Tensor, seq: torch.Tensor, scale: torch.Tensor,
               block_table: torch.Tensor, block_size: int, partition: int,
               mask: Optional[torch.Tensor] = None, is_bidirectional: bool = False,
               k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
               s_aux: Optional[torch.Tensor] = None) -> torch.Tensor:
            if partition % block_size and block_size % partition:
                raise RBLNInputError(f"{name}: partition {partition} and block_size {block_size} "
                                     "must divide one another")
            return body(q, k, v, kcache, vcache, seq, scale, block_table, block_size, mask, is_bidirectional)
    else:
        @torch.library.custom_op(f"rbln_custom_ops::{name}", mutates_args=mutated)
        def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kcache: torch.Tensor,
               vcache: torch.Tensor, seq: torch.Tensor, scale: torch.Tensor,
               block_table: torch.Tensor, block_size: int,
               mask: Optional[torch.Tensor] = None, is_bidirectional: bool = False,
               k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
               s_aux: Optional[torch.Tensor] = None) -> torch.Tensor:
            return body(q, k, v, kcache, vcache, seq, scale, block_table, block_size, mask, is_bidirectional)

    @op.register_fake
    def _(q, *args, **kwargs):
        return torch.empty_like(q)

    OPS[name] = op
    _SPECS[name] = flash


def host_kernel(name: str):
    """The host function that runs ``rbln_custom_ops.<name>`` when a runtime executes a program
    (:func:`npusim.rbln.runtime.lower`), bypassing the dispatcher's custom-op wrappers: the
    same computation as the registered op, called directly. None for an unknown name."""
    if name == "linear":
        return _linear
    spec = _SPECS.get(name)
    if spec is None:
        return None

    def kernel(q, k, v, kcache, vcache, seq, scale, block_table, block_size, partition=None,
               mask=None, is_bidirectional=False, k_scale=None, v_scale=None, s_aux=None):
        return paged_attention(q, k, v, kcache, vcache, seq, scale, block_table, block_size,
                               mask=mask, bidirectional=bool(is_bidirectional), op=name)

    return kernel


_SPECS: dict[str, bool] = {}
OPS: dict[str, object] = {"linear": linear}
for _flash in (False, True):
    for _masked in (False, True):
        for _phase in ("prefill", "decode"):
            _name = ("paged_flash_" if _flash else "paged_") + ("attn_" if _masked else "causal_attn_") + _phase
            _define(_name, flash=_flash)
