"""`ringcheck validate`: judge a ring implementation on a set of cases."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

from .check import MODES, Case, run_case
from .spec import AttentionSpec, Budget, RingSpec
from .verdict import Verdict


def default_cases(world_size: int = 4, *, backend: str = "torch") -> list[Case]:
    """The built-in default: every mode, float32 and bfloat16, MHA and GQA, at small shapes."""
    RingSpec(world_size)  # a bad world size is reported as such, before any shape built from it
    cases = []
    for mode, dtype, (heads, kv_heads) in itertools.product(
            ("bidirectional", "causal", "zigzag", "striped"), ("float32", "bfloat16", "float16"),
            ((4, 4), (4, 2))):
        causal, layout = MODES[mode]
        spec = AttentionSpec(batch=2, heads=heads, kv_heads=kv_heads, seq_len=16 * world_size,
                             head_dim=32, dtype=dtype, causal=causal)
        cases.append(Case(spec, RingSpec(world_size, layout), seed=len(cases), backend=backend))
    return cases


def validate(cases: Iterable[Case], *, budget: Budget = Budget(),
             progress: Callable[[Case], None] | None = None, ring=None) -> list[Verdict]:
    """Judge our ring on every case: distributed on `ring` (local gloo rings or the torchrun
    world, see `ringcheck.launch`) when given, else simulated in this process."""
    if ring is not None:
        from .distributed import judge_case, run_cases_on_ring

        cases = list(cases)
        verdicts = []
        for case, got in zip(cases, run_cases_on_ring(cases, ring)):
            if progress is not None:
                progress(case)
            verdicts.append(judge_case(case, got, budget=budget))
        return verdicts
    verdicts = []
    for case in cases:
        if progress is not None:
            progress(case)
        verdicts.append(run_case(case, budget=budget))
    return verdicts
