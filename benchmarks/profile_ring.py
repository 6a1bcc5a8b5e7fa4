"""Where the time goes: torch.profiler op tables of our ring and a peer, on rank 0 of a local
gloo ring, for one `ringcheck bench` case (the README's "where we are slower" evidence).

    python -m benchmarks.profile_ring --dtype bfloat16 --tokens 4096 \
        --ring-size 2 --mode causal_balanced --passes fwd+bwd --systems ringcheck,torch_cp
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.profiler import ProfilerActivity, profile

from ringcheck.commands.bench.tasks import (
    BenchCase,
    call,
    case_inputs,
    ring_fn,
    system_layout,
)
from ringcheck.launch import LocalRings
from ringcheck.ring.layouts import shard


def profile_task(member, case, systems, rows):
    torch.set_num_threads(1)
    inputs, _ = case_inputs(case)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    tables = {}
    for system in systems:
        layout, _ = system_layout(system, case.mode)
        fn = ring_fn(system, layout, case.causal, 1 / math.sqrt(case.head_dim), member.group)
        parts = [shard(t, layout=layout, rank=member.rank, world_size=member.world_size, dim=1) for t in (q, k, v, dout)]
        call(fn, case.passes, tuple(parts[:3]), parts[3])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call(fn, case.passes, tuple(parts[:3]), parts[3])
        if member.rank == 0:
            tables[system] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return tables


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ring-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mode", default="causal_balanced")
    p.add_argument("--passes", default="fwd+bwd")
    p.add_argument("--systems", default="ringcheck,torch_cp")
    p.add_argument("--rows", type=int, default=15)
    a = p.parse_args()
    case = BenchCase(a.dtype, a.ring_size, a.tokens, a.mode, a.passes, a.heads, 64, 16, 0)
    with LocalRings(timeout=300) as rings:
        tables = rings.run(a.ring_size, profile_task, case, tuple(a.systems.split(",")), a.rows)[0]
    for system, table in tables.items():
        print(f"== {system}: {case.key()} (rank 0, 1 thread)\n{table}")


if __name__ == "__main__":
    main()
