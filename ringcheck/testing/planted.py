"""Planted bugs in our own ring: each is `RingParts` with one real piece swapped for a wrong
one, injected through the ring's explicit seam (``simulate_ring(..., parts=...)``,
``simulated_impl(case, parts=...)``), never by patching module attributes.

`PLANTED` names them; the suites assert that the checks reject each (and that the real
ring passes the same cases), which is the proof that those checks can fail.
"""

from __future__ import annotations

import torch

from ..ring.layouts import Block, block_plan
from ..ring.loops import REAL_PARTS, Post, RingParts, Wait, backward_loop


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


def with_backend(backend) -> RingParts:
    """The real ring with `backend` (a `BlockBackend` instance, e.g. a broken kernel) in place
    of the one its config names."""
    return REAL_PARTS.replace(backend=backend)
