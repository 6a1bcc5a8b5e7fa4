"""Planted bugs in our own ring: each is `RingParts` with one real piece swapped for a wrong
one, injected through the ring's explicit seam (``simulate_ring(..., parts=...)``,
``simulated_impl(case, parts=...)``), never by patching module attributes.

`PLANTED` names them; the suites assert that the checks reject each (and that the real
ring passes the same cases), which is the proof that those checks can fail.
"""

from __future__ import annotations

import torch

from ..ring.backends.torch_backend import TorchBackend
from ..ring.layouts import Block, block_plan
from ..ring.loops import REAL_PARTS, Post, RingParts, Wait, backward_loop, forward_loop


def merge_without_rescaling(acc, m, l, block_out, block_lse):
    """Forgets to rescale by exp(old max - new max): treats every block as if its lse were the max."""
    add = torch.ones_like(block_lse)
    return acc + block_out * add.transpose(1, 2).unsqueeze(-1), torch.maximum(m, block_lse), l + add


def merge_overflowing_past_88(acc, m, l, block_out, block_lse):
    """Keeps the first block's lse as the reference instead of moving to the new max, so it
    computes exp(block_lse - m) directly in float32: right while the gap is < 88.7, Inf (and
    then NaN) beyond."""
    ref = torch.where(torch.isneginf(m), block_lse, m)
    safe = ref.masked_fill(torch.isneginf(ref), 0.0)
    keep, add = torch.exp(m - safe), torch.exp(block_lse - safe)

    def rows(x):
        return x.transpose(1, 2).unsqueeze(-1)

    return acc * rows(keep) + block_out * rows(add), ref, l * keep + add


def diagonal_off_by_one(**kwargs):
    """The block plan with the diagonal blocks of a rank with itself seeing one future token."""
    plan = block_plan(**kwargs)
    if kwargs["q_rank"] == kwargs["kv_rank"]:
        return tuple(Block(b.q, b.kv, b.mask, b.diagonal + 1) for b in plan)
    return plan


def zigzag_plan_with_power_of_two_half(**kwargs):
    """The zig-zag plan with its half split computed as next_power_of_2(n) // 2 (a habit from
    kernels with power-of-two block sizes): right for n = 2, 4, 8, ..., wrong for 6, 10, 12."""
    plan = block_plan(**kwargs)
    if kwargs["layout"] != "zigzag" or not kwargs["causal"]:
        return plan
    n = kwargs["local_len"]
    half, wrong = n // 2, (1 << (n - 1).bit_length()) // 2

    def split(s):
        return slice(wrong if s.start == half else s.start, wrong if s.stop == half else s.stop)

    return tuple(Block(split(b.q), split(b.kv), b.mask, b.diagonal) for b in plan)


def keeps_the_last_gradients(config, shard, *args):
    """A backward loop that takes part in every exchange but keeps its own dK/dV instead of
    the ones coming home (the ring's home check must name it)."""
    loop = backward_loop(config, shard, *args)
    message, grad_posts, mine = next(loop), 0, None
    while True:
        if isinstance(message, Post) and message.channel == "grad":
            grad_posts, mine = grad_posts + 1, message.payload
        reply = yield message
        if isinstance(message, Wait) and message.channel == "grad" and grad_posts == config.world_size:
            reply = mine
        try:
            message = loop.send(reply)
        except StopIteration as stop:
            return stop.value


PLANTED: dict[str, RingParts] = {
    "merge_without_rescaling": REAL_PARTS.replace(merge=merge_without_rescaling),
    "merge_overflowing_past_88": REAL_PARTS.replace(merge=merge_overflowing_past_88),
    "diagonal_off_by_one": REAL_PARTS.replace(plan=diagonal_off_by_one),
    "zigzag_power_of_two_half": REAL_PARTS.replace(plan=zigzag_plan_with_power_of_two_half),
    "dk_dv_not_sent_home": REAL_PARTS.replace(backward_loop=keeps_the_last_gradients),
}


def keeps_every_kv_block(config, shard, *args):
    """A backward loop that keeps every K/V block it receives until it returns: exact values,
    the memory of an all-gather (P blocks per rank instead of three); `ringcheck plan`'s
    agreement with the measured peak must catch it (suites/test_plan_memory.py)."""
    loop, kept = backward_loop(config, shard, *args), []
    message = next(loop)
    while True:
        reply = yield message
        if isinstance(message, Wait) and message.channel == "kv":
            kept.append(reply)
        try:
            message = loop.send(reply)
        except StopIteration as stop:
            return stop.value


# exact rings that hold more memory than they need: the exactness checks pass them, a memory check must not
MEMORY_PLANTED: dict[str, RingParts] = {"keeps_every_kv_block": REAL_PARTS.replace(backward_loop=keeps_every_kv_block)}


def with_backend(backend) -> RingParts:
    """The real ring with `backend` (a `BlockBackend` instance, e.g. a broken kernel) in place
    of the one its config names."""
    return REAL_PARTS.replace(backend=backend)


# ----------------------------------------------------------------- planted bugs of the variants

def window_off_by_one(**kwargs):
    """The block plan with the sliding window one token wider on the left (i - left - 1 <= j)."""
    left, right = kwargs.get("window") or (-1, -1)
    return block_plan(**{**kwargs, "window": (left + 1 if left >= 0 else left, right)})


def documents_within_rank_only(**kwargs):
    """Document boundaries honoured only between a rank and its own K/V: the visiting shards
    are attended as if the sequence were one document (boundaries lost across ranks)."""
    if kwargs["kv_rank"] != kwargs["q_rank"] and kwargs.get("cu_seqlens") is not None:
        end = kwargs["cu_seqlens"][-1]
        return block_plan(**{**kwargs, "cu_seqlens": (0, end)})
    return block_plan(**kwargs)


def padding_attended(**kwargs):
    """The padding tail treated as one more document: padding tokens attend each other."""
    cu = kwargs.get("cu_seqlens")
    if cu is not None and cu[-1] < kwargs["local_len"] * kwargs["world_size"]:
        return block_plan(**{**kwargs, "cu_seqlens": (*cu, kwargs["local_len"] * kwargs["world_size"])})
    return block_plan(**kwargs)


class _SinkEveryBlock:
    """A backend that folds the sink into every block's partial (lse' = logaddexp(lse, sink)):
    with the ring's final normalisation the sink enters once per block plus once."""

    def __init__(self, inner, sinks):
        self.inner, self.sinks, self.name = inner, sinks, f"{inner.name}+sink-per-block"

    def forward(self, q, k, v, **kwargs):
        out, lse = self.inner.forward(q, k, v, **kwargs)
        sink = self.sinks.detach().float().view(1, -1, 1).expand_as(lse)
        new = torch.logaddexp(lse, sink)
        return out * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1), new

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


def sink_on_every_step(config, shard, q, k, v, backend, observer=None, sinks=None):
    """A forward loop that adds the sink to every block's partial, not once per row."""
    inner = backend if sinks is None else _SinkEveryBlock(backend, sinks)
    return (yield from forward_loop(config, shard, q, k, v, inner, observer, sinks=sinks))


class _NoTanhGrad:
    """A backend whose softcap backward forgets the tanh' factor: the gradient of the capped
    score is taken as that of the uncapped one (dS is not multiplied by 1 - tanh^2)."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"{inner.name}-no-tanh-grad"

    def forward(self, q, k, v, **kwargs):
        return self.inner.forward(q, k, v, **kwargs)

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        if softcap is None:
            return self.inner.backward(q, k, v, dout, lse, delta, scale=scale, mask=mask, diagonal=diagonal,
                                       lower=lower)
        # P from the capped scores, then dq = scale dS k and dk = scale dS^T q without tanh'
        g = q.shape[2] // k.shape[2]
        qf, kf, vf = q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
        kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
        s = softcap * torch.tanh(torch.matmul(qf, kf.transpose(-1, -2)) * scale / softcap)
        seen = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(diagonal)
        if mask == "band":
            seen &= torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(lower)
        elif mask == "full":
            seen[:] = True
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)).masked_fill(~seen, 0.0)
        do = dout.float().transpose(1, 2)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta.unsqueeze(-1))
        b, h, sk, _ = kf.shape

        def group(t):
            return t.view(b, h // g, g, sk, t.shape[-1]).sum(2).transpose(1, 2)

        return (torch.matmul(ds, kf).transpose(1, 2) * scale, group(torch.matmul(ds.transpose(-1, -2), qf)) * scale,
                group(torch.matmul(p.transpose(-1, -2), do)))


def padding_rows_nan(config, shard, q, k, v, backend, observer=None, sinks=None):
    """A forward loop whose final normalisation divides by the row sum unguarded: rows that
    see no key (padding) come out 0 / 0 = NaN instead of 0."""
    out, lse, out32 = yield from forward_loop(config, shard, q, k, v, backend, observer, sinks=sinks)
    empty = torch.isneginf(lse).transpose(1, 2).unsqueeze(-1)
    return out.masked_fill(empty, float("nan")), lse, out32.masked_fill(empty, float("nan"))


PLANTED.update({
    "window_off_by_one": REAL_PARTS.replace(plan=window_off_by_one),
    "documents_within_rank_only": REAL_PARTS.replace(plan=documents_within_rank_only),
    "padding_attended": REAL_PARTS.replace(plan=padding_attended),
    "sink_on_every_step": REAL_PARTS.replace(forward_loop=sink_on_every_step),
    "softcap_backward_without_tanh_grad": REAL_PARTS.replace(backend=_NoTanhGrad(TorchBackend(fast=False))),
    "padding_rows_nan": REAL_PARTS.replace(forward_loop=padding_rows_nan),
})
