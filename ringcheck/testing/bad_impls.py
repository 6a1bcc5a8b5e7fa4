"""Implementations that break the `--impl` contract in ways `validate` must report as usage
errors (exit code 2, a clear message, never a traceback or a hang)."""

import time

import torch.distributed as dist

from ringcheck.testing.mutants import textbook

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
