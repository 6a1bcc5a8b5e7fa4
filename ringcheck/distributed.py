"""Cases on a real ring: every rank builds the case's inputs from its seed, runs its shard
through `ring_attention` (forward and backward with the case's dout), and the shards are
gathered into whole-tensor `Results` to be judged like any other implementation.

`ring` is anything with `run(ring_size, task, *args)` (see `launch`): local gloo rings or the
torchrun world. Tasks return CPU tensors, so results cross processes the same way everywhere.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .check import Case, Results, judge_results, peer, truth
from .comm import ring_attention
from .inputs import Inputs, make_inputs
from .layouts import shard, unshard
from .spec import Budget
from .verdict import Verdict


def shard_inputs(inputs: Inputs, *, layout: str, rank: int, world_size: int):
    """This rank's (q, k, v, dout) leaves, sharded the way `simulate_ring` shards them."""
    q, k, v, dout = (shard(t, layout=layout, rank=rank, world_size=world_size, dim=1)
                     for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    return (*(t.detach().clone().requires_grad_(True) for t in (q, k, v)), dout)


def rank_results(member, case: Case) -> Results:
    """This rank's shards of out, lse, dq, dk, dv for `case` (on the member's device)."""
    if case.ring.world_size != member.world_size:
        raise ValueError(f"case {case.describe()} needs a ring of {case.ring.world_size}, "
                         f"this rank is in a ring of {member.world_size}")
    case.ring.check_seq_len(case.spec.seq_len)
    inputs = make_inputs(case.spec, seed=case.seed, distribution=case.distribution, device=member.device)
    q, k, v, dout = shard_inputs(inputs, layout=case.ring.layout, rank=member.rank, world_size=member.world_size)
    out, lse = ring_attention(q, k, v, causal=case.spec.causal, softmax_scale=case.spec.softmax_scale,
                              group=member.group, layout=case.ring.layout, backend=case.backend,
                              return_lse=True, timeout=member.timeout)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return Results(out.detach(), lse.detach(), dq, dk, dv)


def ring_shards_task(member, cases: list[Case]) -> list[Results]:
    """Task: this rank's shards for every case (CPU tensors)."""
    return [Results(*(t.cpu() for t in (r.out, r.lse, r.dq, r.dk, r.dv)))
            for r in (rank_results(member, case) for case in cases)]


def gather_results(shards: list[Results], layout: str) -> Results:
    """Whole tensors from every rank's shards (rank order)."""
    return Results(*(unshard([getattr(s, name) for s in shards], layout=layout, dim=2 if name == "lse" else 1)
                     for name in ("out", "lse", "dq", "dk", "dv")))


def run_cases_on_ring(cases: Iterable[Case], ring) -> list[Results]:
    """Whole-tensor results of our distributed ring for every case, in order; one `ring.run`
    per ring size (process start-up and group set-up are paid once per size)."""
    cases = list(cases)
    by_size: dict[int, list[int]] = {}
    for i, case in enumerate(cases):
        by_size.setdefault(case.ring.world_size, []).append(i)
    results: list[Results | None] = [None] * len(cases)
    for size, indices in by_size.items():
        per_rank = ring.run(size, ring_shards_task, [cases[i] for i in indices])
        for j, i in enumerate(indices):
            results[i] = gather_results([rank[j] for rank in per_rank], cases[i].ring.layout)
    return results  # type: ignore[return-value]


def judge_case(case: Case, got: Results, *, budget: Budget = Budget()) -> Verdict:
    """Judge whole-tensor results of `case` against float64 and the same-dtype peer."""
    inputs = make_inputs(case.spec, seed=case.seed, distribution=case.distribution)
    return judge_results(case, got, truth(case.spec, inputs), peer(case.spec, inputs), budget=budget)
