"""The ring as one `torch.autograd.Function` over the ranks a driver holds locally.

Forward runs every local rank's `forward_loop` through the driver; backward runs their
`backward_loop` through the same driver (the loops come from `config.parts`).
"""

from __future__ import annotations

import torch

from .backends import get_backend
from .drivers import Driver
from .loops import RankShard, RingConfig, StepObserver, sum_in_rank_order


class RingFunction(torch.autograd.Function):
    """Ring attention over the ranks a driver runs locally (all P simulated, or one).

    Inputs are the sinks (heads,) or None, then the local ranks' q shards, k shards and v
    shards; outputs are their outputs then their lse. The gradient of the sinks follows
    `config.sinks_grad`: this rank's rows' share ("partial"; all P simulated ranks' shares
    summed), or the whole ring's on every rank ("reduced")."""

    @staticmethod
    def forward(ctx, config: RingConfig, driver: Driver, observer, sinks, *tensors):
        backend = config.parts.backend or get_backend(config.backend)
        m = len(driver.local_ranks)
        qs, ks, vs = tensors[:m], tensors[m:2 * m], tensors[2 * m:]
        extra = {} if sinks is None else {"sinks": sinks}  # loops written before sinks still run
        results = driver.run([
            config.parts.forward(config, RankShard(r, config.world_size), q, k, v, backend, observer, **extra)
            for r, q, k, v in zip(driver.local_ranks, qs, ks, vs)])
        outs = [res[0] for res in results]
        lses = [res[1] for res in results]
        ctx.config, ctx.driver, ctx.m, ctx.sinks = config, driver, m, sinks
        ctx.save_for_backward(*qs, *ks, *vs, *[res[2] for res in results], *lses)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        config, driver, m = ctx.config, ctx.driver, ctx.m
        backend = config.parts.backend or get_backend(config.backend)
        saved = ctx.saved_tensors
        qs, ks, vs = saved[:m], saved[m:2 * m], saved[2 * m:3 * m]
        outs32, lses = saved[3 * m:4 * m], saved[4 * m:]
        douts, dlses = grads[:m], grads[m:]
        sinks = ctx.sinks
        extra = {} if sinks is None else {"sinks": sinks}
        results = driver.run([
            config.parts.backward(config, RankShard(r, config.world_size), q, k, v, o, l,
                                  torch.zeros_like(o, dtype=q.dtype) if do is None else do, dl, backend, **extra)
            for r, q, k, v, o, l, do, dl in zip(driver.local_ranks, qs, ks, vs, outs32, lses, douts, dlses)])
        dqs = [res[0] for res in results]
        dks = [res[1] for res in results]
        dvs = [res[2] for res in results]
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            if config.sinks_grad == "partial" and m > 1:  # every simulated rank's share, summed as the ring would
                dsinks = sum_in_rank_order([res[3] for res in results]).to(sinks.dtype)
            else:  # one rank's own share ("partial"), or the whole ring's sum that every rank holds ("reduced")
                dsinks = results[0][3].to(sinks.dtype)
        return (None, None, None, dsinks, *dqs, *dks, *dvs)


def run_ring(config: RingConfig, driver: Driver, qs, ks, vs, observer: StepObserver | None = None,
             sinks: torch.Tensor | None = None):
    """Run `RingFunction` for the local ranks of `driver`; returns (outs, lses) lists."""
    m = len(driver.local_ranks)
    results = RingFunction.apply(config, driver, observer, sinks, *qs, *ks, *vs)
    return list(results[:m]), list(results[m:])
