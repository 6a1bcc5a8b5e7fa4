"""Implementations that break the `--impl` contract in ways `validate` must report as usage
errors (exit code 2, a clear message, never a traceback or a hang), and correct ones that use
its optional parts (no lse; the `layout` keyword)."""

import time

import torch
import torch.distributed as dist

from ringcheck import ring_attention
from ringcheck.catalogue.mutants import textbook

NOT_CALLABLE = 42


def wrong_signature(q, k):
    return q


def wrong_shape(q, k, v, *, causal, softmax_scale, group=None):
    out, lse = textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)
    return out[:, :-1]


def wrong_dtype(q, k, v, *, causal, softmax_scale, group=None):
    out, lse = textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)
    return out.double(), lse


def raises_on_rank_one(q, k, v, *, causal, softmax_scale, group=None):
    if dist.get_rank(group) == 1:
        raise RuntimeError("rank 1 ran out of patience")
    return textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)


def never_returns_on_rank_zero(q, k, v, *, causal, softmax_scale, group=None):
    if dist.get_rank(group) == 0:
        while True:
            time.sleep(0.5)
    return textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)


def no_gradient_to_k(q, k, v, *, causal, softmax_scale, group=None):
    out, lse = textbook(q, k.detach(), v, causal=causal, softmax_scale=softmax_scale, group=group)
    return out, lse


def only_out(q, k, v, *, causal, softmax_scale, group=None):
    """Correct, but returns no lse: validate must pass it and say lse was not checked."""
    return textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)[0]


def layout_aware(q, k, v, *, causal, softmax_scale, group=None, layout):
    """Correct on every layout, and only when told which: `layout` is a required keyword (a
    call without it raises TypeError) and it runs our ring with the layout it is given."""
    if layout not in ("contiguous", "zigzag", "striped"):
        raise ValueError(f"layout_aware was given layout={layout!r}")
    return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                          return_lse=True)


def layout_through_kwargs(q, k, v, *, causal, softmax_scale, group=None, **options):
    """`layout_aware` taking its optional keywords through **kwargs."""
    return layout_aware(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=options["layout"])


def raises_on_rank_one_in_our_ring(q, k, v, *, causal, softmax_scale, group=None):
    """Rank 1 raises; the others enter our ring (`RingComm`), where the stop flag reaches them."""
    if dist.get_rank(group) == 1:
        raise RuntimeError("rank 1 ran out of patience\nsecond line of the message")
    return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout="zigzag",
                          return_lse=True)


def inference_only(q, k, v, *, causal, softmax_scale, group=None):
    """A correct forward with no backward (an inference ring): validate needs --forward-only."""
    with torch.no_grad():
        return textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)
