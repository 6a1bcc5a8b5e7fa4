"""Rings that are right in a clean room and wrong as training embeds them, under the `--impl`
contract (zig-zag shards, like `mutants`): each has one real bug class of the embedded ring, the
kind reported in the field, and each passes a ring whose group is the whole world, whose inputs
are fresh contiguous tensors at batch 1 and whose every forward is followed by its own backward.

- Inside a mesh (`mutants.textbook` with one switch): ``default_group`` (its collectives on the
  default world group: the `group` argument lost on the way down), ``rank_from_wrong_axis`` (its
  place in the ring as ``dist.get_rank() % world_size``: right for dp x cp, wrong for a strided
  cp x tp mesh), ``group_rank_as_peer`` (its P2P peers given as ranks of the group where torch
  wants global ranks: right only where the group is global ranks 0..P-1; inside a mesh it raises).
- On views of fused projections: ``q_as_contiguous`` (a kernel reading q's memory as if it
  were contiguous), ``v_with_k_strides`` (the V tile built with K's strides), ``dout_as_contiguous``
  (the gradient of out read as contiguous).
- At batch > 1: ``batch_one_gather`` (an all-gather ring whose rank-major gathered K/V buffer is
  reinterpreted with a reshape as batch-major); `gather_textbook` is that ring without the bug.
- Two calls before a backward: ``workspace_state`` (what the backward needs kept in a module-level
  workspace instead of on the autograd context: the second call overwrites the first's).
- The sinks gradient: ``sinks_all_reduced`` (our ring all-reducing the sinks gradient inside
  attention, which under `--sinks-grad partial` the framework reduces again: P times the
  gradient).

This module stands for someone else's code: it uses ringcheck's ring only where the mutant is
"our ring, configured the other way" (``sinks_all_reduced``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringcheck.ring import ring_attention
from ringcheck.ring.layouts import positions

from .mutants import LAYOUT, mutant_of

SWITCHED = {
    "default_group": "collectives on the default world group instead of the group given",
    "rank_from_wrong_axis": "the ring position from the global rank (dist.get_rank() % world_size)",
    "group_rank_as_peer": "group ranks passed as P2P peers, which want global ranks (right on ranks 0..P-1 only)",
    "q_as_contiguous": "q read as if it were contiguous",
    "v_with_k_strides": "v read with k's strides",
    "dout_as_contiguous": "the gradient of out read as if it were contiguous",
    "workspace_state": "backward state kept in a module-level workspace, not on the autograd context",
}
for _name, _doc in SWITCHED.items():
    globals()[_name] = mutant_of(_name, _doc)


class _Gather(torch.autograd.Function):
    """All-gather along a new leading dim (rank-major: (P, *x.shape)); backward: each rank's
    slice of the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group = group
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _gather_ring(q, k, v, *, causal, softmax_scale, group=None, bugs=frozenset()):
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, n, h, d = q.shape
    kvh = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    kk, vv = _Gather.apply(k, group), _Gather.apply(v, group)  # (P, b, n, kv_heads, d)
    if "batch_one_gather" in bugs:  # the rank-major buffer reinterpreted as batch-major: right at batch 1 only
        keys, values = kk.reshape(b, world * n, kvh, d), vv.reshape(b, world * n, kvh, v.shape[-1])
    else:
        keys = kk.permute(1, 0, 2, 3, 4).reshape(b, world * n, kvh, d)
        values = vv.permute(1, 0, 2, 3, 4).reshape(b, world * n, kvh, v.shape[-1])
    seq = n * world
    kpos = torch.cat([positions(layout=LAYOUT, rank=r, world_size=world, seq_len=seq) for r in range(world)]).to(q.device)
    qpos = positions(layout=LAYOUT, rank=rank, world_size=world, seq_len=seq).to(q.device)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys.float().repeat_interleave(h // kvh, dim=2)) * scale
    if causal:
        s = s.masked_fill(~(kpos[None, :] <= qpos[:, None]).to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), values.float().repeat_interleave(h // kvh, dim=2))
    return out.to(q.dtype), lse


def gather_textbook(q, k, v, *, causal, softmax_scale, group=None):
    """A correct all-gather ring (K/V gathered, attention on the whole sequence's keys)."""
    return _gather_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)


def batch_one_gather(q, k, v, *, causal, softmax_scale, group=None):
    """An all-gather ring whose gathered K/V is laid out rank-major and read batch-major."""
    return _gather_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                        bugs=frozenset({"batch_one_gather"}))


def sinks_all_reduced(q, k, v, *, causal, softmax_scale, group=None, cu_seqlens=None, window=None, softcap=None,
                      sinks=None):
    """Our ring, all-reducing the sinks gradient inside attention (the "reduced" convention)."""
    return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=LAYOUT,
                          return_lse=True, cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks,
                          sinks_grad="reduced")


EMBEDDED_MUTANTS = {
    **SWITCHED,
    "batch_one_gather": "an all-gather ring right only at batch 1 (rank-major buffer read batch-major)",
    "sinks_all_reduced": "the sinks gradient all-reduced inside attention (under --sinks-grad partial: P times it)",
}
# what a mutant needs besides validate's defaults to show itself (its bug class's flags)
NEEDS = {"sinks_all_reduced": {"sinks": True}}
