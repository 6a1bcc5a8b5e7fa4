"""Hypothesis strategies that draw small attention *cases* (specs), never tensors.

A drawn `Case` names a spec (batch, heads / kv_heads, seq_len, head_dim, dtype, causal), a
ring (world size, layout), a logit distribution, a seed and a backend; the tensors are made
from it by `ringcheck.judge.inputs.make_inputs` with a seeded CPU generator, so every rank of a
distributed run builds the same data and a failing case is reproduced by its repr alone.

This module lives in the package (not in `suites/`) so that the test suite of another ring
attention library can draw the same cases for its own implementation
(``run_case(case, impl=...)``). It needs Hypothesis, a test dependency
(``pip install 'ringcheck[test]'``); nothing else in `ringcheck` imports it.

Profiles (`PROFILES`) bind a Hypothesis example count to size bounds: ``ci`` (the default;
minutes on 2 CPU cores), ``nightly`` and ``deep``. The root ``conftest.py`` registers them as
Hypothesis profiles and selects one with ``pytest --profile``.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ..judge.check import Case
from ..judge.distributions import DISTRIBUTIONS, min_head_dim
from ..spec import DTYPES, LAYOUTS, AttentionSpec, RingSpec, check_int, is_custom_layout
from .profiles import PROFILES, Bounds, Profile

__all__ = ["PROFILES", "Bounds", "Profile", "cases", "tokens_per_rank", "world_sizes"]


def world_sizes(max_world_size: int) -> st.SearchStrategy[int]:
    """Ring sizes 1..max, weighted towards small rings (a ring of P ranks costs P^2 block
    calls): two thirds of the draws are at most 4 (or 8), a third anywhere up to the max."""
    check_int("max_world_size", max_world_size)
    return st.one_of(st.integers(1, min(4, max_world_size)), st.integers(1, min(8, max_world_size)),
                     st.integers(1, max_world_size))


@st.composite
def _cases(draw, bounds: Bounds, dtypes, distributions, layouts, causal, backends, world_size, min_group):
    distribution = draw(st.sampled_from(distributions))
    is_causal = draw(st.sampled_from(causal))
    layout = draw(st.sampled_from(layouts))
    p = world_size if world_size is not None else draw(world_sizes(bounds.max_world_size))
    ring = RingSpec(p, layout)
    if layout == "zigzag":  # two equal chunks per rank
        tokens = 2 * draw(st.integers(1, bounds.max_tokens_per_rank // 2))
    else:
        tokens = draw(st.integers(1, bounds.max_tokens_per_rank))
    kv_heads = draw(st.integers(1, bounds.max_heads // min_group))
    group = draw(st.integers(min_group, bounds.max_heads // kv_heads))
    low = min_head_dim(distribution, ring)
    if low > bounds.max_head_dim:
        raise ValueError(f"distribution={distribution!r} needs head_dim >= {low} on a ring of {p}, "
                         f"but max_head_dim={bounds.max_head_dim}")
    head_dim = draw(st.integers(low, bounds.max_head_dim))
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, bounds.max_batch))
    seed = draw(st.integers(0, 2**31 - 1))
    backend = draw(st.sampled_from(backends))
    spec = AttentionSpec(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, seq_len=p * tokens,
                         head_dim=head_dim, dtype=dtype, causal=is_causal)
    return Case(spec, ring, seed=seed, distribution=distribution, backend=backend)


def _choices(name: str, values, allowed) -> tuple:
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ValueError(f"{name} has unknown values {unknown}; choose from {sorted(allowed)}")
    return values


def cases(bounds: Bounds = Bounds(), *, dtypes=tuple(DTYPES), distributions=tuple(DISTRIBUTIONS),
          layouts=LAYOUTS, causal=(False, True), backends=("torch",),
          world_size: int | None = None, min_group: int = 1) -> st.SearchStrategy[Case]:
    """Cases within `bounds`: every combination of mode (causal and layout), GQA ratio, odd
    and even head dims, tokens per rank from 1 (even for zigzag), dtype and distribution.

    `world_size` pins the ring size (a distributed run can only use its own); otherwise it
    is drawn by `world_sizes`. `min_group` > 1 draws only grouped-query attention (heads a
    multiple >= min_group of kv_heads).

    Shrinking goes towards the first distribution, bidirectional, the first layout, one rank,
    one token per rank, one head, head_dim 1, the first dtype, batch 1 and seed 0, so a
    failure shrinks to the smallest spec that still fails.
    """
    if not isinstance(bounds, Bounds):
        raise TypeError(f"bounds must be a Bounds, got {type(bounds).__name__}")
    dtypes = _choices("dtypes", dtypes, DTYPES)
    distributions = _choices("distributions", distributions, DISTRIBUTIONS)
    layouts = _choices("layouts", layouts, (*LAYOUTS, *(x for x in layouts if is_custom_layout(x))))
    causal = _choices("causal", causal, (False, True))
    backends = _choices("backends", backends, ("torch", "triton", "flash_attn"))
    if world_size is not None:
        RingSpec(world_size)
    check_int("min_group", min_group)
    if min_group > bounds.max_heads:
        raise ValueError(f"min_group={min_group} exceeds max_heads={bounds.max_heads}")
    if "zigzag" in layouts and bounds.max_tokens_per_rank < 2:
        raise ValueError("the zigzag layout needs 2 tokens per rank: raise max_tokens_per_rank "
                         "or leave zigzag out of layouts")
    return _cases(bounds, dtypes, distributions, layouts, causal, backends, world_size, min_group)


def tokens_per_rank(case: Case) -> int:
    return case.spec.seq_len // case.ring.world_size
