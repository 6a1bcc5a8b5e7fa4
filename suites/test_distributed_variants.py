"""The variants on torch.distributed: `ring_attention` with documents, padding, windows,
softcap, sinks and a value head dim of its own equals the simulated ring bit for bit (out,
lse, dq, dk, dv and dsinks), on local gloo rings (or the torchrun world, see
suites/test_distributed.py for how tasks run). dsinks under both conventions: each rank's share
("partial", the default), whose sum over the ranks in rank order is the simulated ring's, and the
whole ring's sum on every rank ("reduced")."""

import pytest
import torch
import torch.distributed as dist

import ringcheck
from ringcheck.judge.inputs import make_inputs
from ringcheck.ring.loops import sum_in_rank_order
from ringcheck.testing.variant_cases import DISTRIBUTED_VARIANT_CASES

# largest first: its local ring then serves the smaller ones; make test runs 4, 3 and 1 (even, odd, one),
# 8 and 2 carry the marker thorough (make test-thorough, in CI)
SIZES = [pytest.param(8, marks=pytest.mark.thorough), 4, 3, pytest.param(2, marks=pytest.mark.thorough), 1]
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def variant_task(member, cases):
    """Each case through ring_attention on this rank's shards and through simulate_ring on the
    whole inputs, cut to this rank; returns the mismatches this rank sees (none expected)."""
    bad = []
    for case in cases:
        s, ring = case.spec, case.ring
        inputs = make_inputs(s, seed=case.seed, distribution=case.distribution, device=member.device)
        kwargs = s.variant_kwargs()
        cu = kwargs.get("cu_seqlens")

        def cut(t, dim=1, ring=ring, cu=cu):
            return ringcheck.shard(t, layout=ring.layout, rank=member.rank, world_size=ring.world_size, dim=dim,
                                   cu_seqlens=cu)

        sinks = [] if inputs.sinks is None else _leaves(inputs.sinks)
        extra = {"sinks": sinks[0]} if sinks else {}
        q, k, v = _leaves(*(cut(t) for t in (inputs.q, inputs.k, inputs.v)))
        out, lse = ringcheck.ring_attention(q, k, v, causal=s.causal, group=member.group, layout=ring.layout,
                                            return_lse=True, timeout=member.timeout, **kwargs, **extra)
        grads = torch.autograd.grad(out, [q, k, v, *sinks], cut(inputs.dout))
        got = dict(zip(TENSORS, (out, lse, *grads)))
        if sinks:  # this rank's share: the framework's sum (in rank order) is the whole gradient
            shares = [torch.empty_like(got["dsinks"]) for _ in range(ring.world_size)]
            dist.all_gather(shares, got["dsinks"].contiguous(), group=member.group)
            got["dsinks"] = sum_in_rank_order(shares)
            rq, rk, rv, rs = _leaves(q, k, v, sinks[0])
            rout = ringcheck.ring_attention(rq, rk, rv, causal=s.causal, group=member.group, layout=ring.layout,
                                            timeout=member.timeout, sinks_grad="reduced", **kwargs, sinks=rs)
            got["dsinks reduced"] = torch.autograd.grad(rout, [rs], cut(inputs.dout))[0]

        wsinks = [] if inputs.sinks is None else _leaves(inputs.sinks)
        wq, wk, wv = _leaves(inputs.q, inputs.k, inputs.v)
        wout, wlse = ringcheck.simulate_ring(wq, wk, wv, world_size=ring.world_size, causal=s.causal,
                                             layout=ring.layout, return_lse=True, **kwargs,
                                             **({"sinks": wsinks[0]} if wsinks else {}))
        wgrads = torch.autograd.grad(wout, [wq, wk, wv, *wsinks], inputs.dout)
        want = {"out": cut(wout), "lse": cut(wlse, 2), "dq": cut(wgrads[0]), "dk": cut(wgrads[1]),
                "dv": cut(wgrads[2])}
        if wsinks:
            want["dsinks"] = want["dsinks reduced"] = wgrads[3]
        for name, b in want.items():
            a = got[name]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().nan_to_num(0.0)
                bad.append(f"rank {member.rank}: {case.describe()}: {name} differs from the simulated ring "
                           f"(max {diff.max().item():.3e})")
    return bad


@pytest.mark.parametrize("world_size", SIZES)
def test_variants_distributed_equal_simulated_bit_for_bit(run_on_ring, world_size):
    cases = [c for c in DISTRIBUTED_VARIANT_CASES.values() if c.ring.world_size == world_size]
    assert cases, f"DISTRIBUTED_VARIANT_CASES has no case for world_size={world_size}"
    bad = [line for rank in run_on_ring(world_size, variant_task, cases) for line in rank]
    assert not bad, "\n".join(bad)
