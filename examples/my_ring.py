"""A ring attention written for `ringcheck validate --impl my_ring:ring_fn`: the smallest
complete implementation of the contract, the way a user would write their own.

Every rank all-gathers K and V (an autograd Function whose backward all-reduces the gradient
in float32 and keeps this rank's slice), computes attention of its queries over the whole sequence in
float32 with autograd, and returns out (in q's dtype) and lse (float32). Grouped-query heads:
query head h uses K/V head h // (heads // kv_heads). It knows two layouts, told by the
`layout` keyword that validate passes to functions that accept it.

    PYTHONPATH=examples ringcheck validate --impl my_ring:ring_fn --layout zigzag
    PYTHONPATH=examples ringcheck validate --impl my_ring:ring_fn --layout contiguous --no-causal
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherSequence(torch.autograd.Function):
    """(batch, local_seq, heads, d) on every rank -> (batch, world * local_seq, heads, d) in
    float32, rank order. The gather sends the input dtype; the backward all-reduces the
    gradient in float32 and rounds this rank's slice once: an all-reduce in the input dtype
    would round a partial sum at every rank, an error that grows with the ring (ringcheck's
    precision class fails it at 8 ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.dtype = group, x.dtype
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1).float()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.float().contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries used every key
        n = grad.shape[1] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * n:(rank + 1) * n].to(ctx.dtype), None


def positions(layout: str, rank: int, world: int, n: int) -> torch.Tensor:
    """Global token positions of a rank's n tokens, in its local order."""
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":  # chunks r and 2P-1-r of 2P equal chunks
        half = n // 2
        first = torch.arange(rank * half, (rank + 1) * half)
        return torch.cat([first, torch.arange((2 * world - 1 - rank) * half, (2 * world - rank) * half)])
    raise ValueError(f"layout={layout!r}: this ring knows contiguous and zigzag")


def ring_fn(q, k, v, *, causal: bool, softmax_scale: float, group=None, layout: str = "zigzag"):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, n, heads, d = q.shape
    keys, values = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    group_size = heads // k.shape[2]
    qh = q.float().transpose(1, 2)                                            # (b, h, n, d)
    kh = keys.transpose(1, 2).repeat_interleave(group_size, dim=1)            # (b, h, N, d), float32
    vh = values.transpose(1, 2).repeat_interleave(group_size, dim=1)
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    if causal:
        mine = positions(layout, rank, world, n).to(q.device)
        every = torch.cat([positions(layout, r, world, n) for r in range(world)]).to(q.device)
        scores = scores.masked_fill(every[None, :] > mine[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                     # (b, h, n)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ vh
    return out.transpose(1, 2).to(q.dtype), lse
