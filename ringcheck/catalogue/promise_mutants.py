"""Rings that are exact and break one of the ring's other promises, under the `--impl` contract
(zig-zag shards, like `mutants`): each gives the right values, passes every exactness check of
validate, and is caught by one measurement row of it (`ringcheck.commands.validate.promises`):

- ``all_gather_kv`` (memory): an all-gather context parallel ring. It gathers every rank's K/V
  (one ``all_gather`` of the packed K/V, started before it computes its own block, so the
  transfer is hidden), computes against the whole sequence's keys, and in the backward
  all-reduces the whole dK/dV (started before it computes dq). Exact, its communication at the
  ring's minimum, its transfers overlapped; but a rank holds O(N): the peak grows with the ring
  at a fixed local length, and it runs out of memory at the length a ring was bought for.
- ``kv_twice`` (communication): `mutants.textbook` sending its K/V twice on every hop (the copy
  dropped on arrival): twice the ring's minimum in the forward.
- ``waits_each_transfer`` (overlap): `mutants.textbook` waiting for every transfer as soon as
  it posts it, before it computes: no communication hidden behind compute.

This module stands for someone else's code: it does not use ringcheck's ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringcheck.ring.layouts import positions

from .mutants import LAYOUT, mutant_of

SWITCHED = {
    "kv_twice": "K/V sent twice on every hop (the second copy dropped): twice the ring's minimum traffic",
    "waits_each_transfer": "every transfer waited for as soon as it is posted, before computing: nothing overlapped",
}
for _name, _doc in SWITCHED.items():
    globals()[_name] = mutant_of(_name, _doc)


def _masks(rank: int, world: int, n: int, causal: bool, device):
    """(this rank's keys visible to its queries (n, n) or None, the others' (n, (P-1) n) or None,
    the ranks in the order of the others' keys), on `device`."""
    others = [s for s in range(world) if s != rank]
    if not causal:
        return None, None, others
    seq = n * world
    qpos = positions(layout=LAYOUT, rank=rank, world_size=world, seq_len=seq)
    mine = positions(layout=LAYOUT, rank=rank, world_size=world, seq_len=seq)
    rest = torch.cat([positions(layout=LAYOUT, rank=s, world_size=world, seq_len=seq) for s in others]) if others \
        else torch.empty(0, dtype=torch.int64)
    return (mine[None, :] <= qpos[:, None]).to(device), (rest[None, :] <= qpos[:, None]).to(device), others


def _attend(q, k, v, mask, scale):
    """float32 (out, lse) of q against k, v (kv heads repeated for the query heads)."""
    h = q.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], dim=2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(h // v.shape[2], dim=2)), lse


class _GatherRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        b, n, h, _ = q.shape
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        parts = [torch.empty_like(packed) for _ in range(world)]
        gathering = dist.all_gather(parts, packed, group=group, async_op=True)  # in flight while we compute
        mine_mask, rest_mask, others = _masks(rank, world, n, causal, q.device)
        qf = q.float()
        out, lse = _attend(qf, k.float(), v.float(), mine_mask, scale)
        gathering.wait()
        cut = k.numel()
        keys = torch.cat([k.float()] + [parts[s][:cut].view(k.shape).float() for s in others], dim=1)
        values = torch.cat([v.float()] + [parts[s][cut:].view(v.shape).float() for s in others], dim=1)
        if others:
            rest_out, rest_lse = _attend(qf, keys[:, n:], values[:, n:], rest_mask, scale)
            new_lse = torch.logaddexp(lse, rest_lse)
            safe = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
            out = (out * torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
                   + rest_out * torch.exp(rest_lse - safe).transpose(1, 2).unsqueeze(-1))
            lse = new_lse
        ctx.save_for_backward(qf, keys, values, out, lse)  # every rank's K/V: O(N) on every rank
        ctx.causal, ctx.scale, ctx.group, ctx.dtype, ctx.rank = causal, scale, group, q.dtype, rank
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, keys, values, out, lse = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        b, n, h, d = q.shape
        kvh = keys.shape[2]
        mine_mask, rest_mask, _ = _masks(ctx.rank, world, n, ctx.causal, q.device)
        mask = None if mine_mask is None else torch.cat([mine_mask, rest_mask], dim=1)
        dout = dout.float()
        delta = (dout * out).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse
        kk, vv = (t.repeat_interleave(h // kvh, dim=2) for t in (keys, values))
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * ctx.scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, vv) - delta.unsqueeze(-1))
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q).mul_(ctx.scale).view(b, -1, kvh, h // kvh, d).sum(3)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout).view(b, -1, kvh, h // kvh, dout.shape[-1]).sum(3)
        # this rank's keys come first, then the others in rank order: put them in rank order to sum
        order = [ctx.rank] + [s for s in range(world) if s != ctx.rank]
        by_rank = torch.empty(world, *dk.shape[:1], n, kvh, d + dv.shape[-1], device=dk.device)
        for i, r in enumerate(order):
            by_rank[r] = torch.cat([dk[:, i * n:(i + 1) * n], dv[:, i * n:(i + 1) * n]], dim=-1)
        summing = dist.all_reduce(by_rank, group=ctx.group, async_op=True)  # in flight while dq is computed
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * ctx.scale
        summing.wait()
        mine = by_rank[ctx.rank]
        return (dq.to(ctx.dtype), mine[..., :d].to(ctx.dtype).contiguous(), mine[..., d:].to(ctx.dtype).contiguous(),
                None, None, None)


def all_gather_kv(q, k, v, *, causal, softmax_scale, group=None):
    """An all-gather ring: exact, its transfers overlapped, its memory O(N) on every rank."""
    group = group if group is not None else dist.group.WORLD
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _GatherRing.apply(q, k, v, causal, scale, group)


# name -> (the row that catches it, what it is)
PROMISE_MUTANTS = {
    "all_gather_kv": ("memory", "an exact all-gather ring: every rank holds the whole sequence's K/V (O(N) memory); "
                                "validate's memory row flags it"),
    "kv_twice": ("communication", SWITCHED["kv_twice"] + "; validate's communication row flags it"),
    "waits_each_transfer": ("overlap", SWITCHED["waits_each_transfer"] + "; validate's overlap row flags it"),
}
