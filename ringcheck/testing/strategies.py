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
from ..judge.inputs import TILES
from ..spec import DTYPES, LAYOUTS, AttentionSpec, RingSpec, check_int, is_custom_layout
from .profiles import PROFILES, Bounds, Profile

__all__ = ["PROFILES", "TILES", "Bounds", "Profile", "cases", "ragged_cases", "tile_tokens", "tokens_per_rank",
           "world_sizes"]
NEAR_TILE = 3  # how far from a tile `tile_tokens` leans (tile - 3 .. tile + 3)
RAGGED_ABOVE = 64  # the ragged tests' shards are longer than this (one flash-attn tile)


def world_sizes(max_world_size: int) -> st.SearchStrategy[int]:
    """Ring sizes 1..max, weighted towards small rings (a ring of P ranks costs P^2 block
    calls): two thirds of the draws are at most 4 (or 8), a third anywhere up to the max."""
    check_int("max_world_size", max_world_size)
    return st.one_of(st.integers(1, min(4, max_world_size)), st.integers(1, min(8, max_world_size)),
                     st.integers(1, max_world_size))


def tile_tokens(low: int, high: int) -> st.SearchStrategy[int]:
    """Tokens per rank in low..high, leaning to a tile of `TILES` +/- `NEAR_TILE` tokens (where a
    kernel's last, partial tile is one token, or a few, or none): half the draws there, half
    anywhere; shrinking goes towards `low`."""
    check_int("low", low)
    near = [t for t in TILES if t + NEAR_TILE >= low and t - NEAR_TILE <= high]
    anywhere = st.integers(low, high)
    if not near:
        return anywhere
    return st.one_of(anywhere, st.sampled_from(near).flatmap(
        lambda t: st.integers(max(low, t - NEAR_TILE), min(high, t + NEAR_TILE))))


def _tokens(draw, bounds: Bounds, p: int, layout: str, ragged: bool) -> int:
    """Tokens per rank: up to max_tokens_per_rank; with `ragged`, above `RAGGED_ABOVE` up to
    max(72, max_ragged_tokens); where max_ragged_tokens is the larger (nightly, deep), a third
    of the draws lean to the tiles up to it, within the profile's sequence length. Even for
    zigzag (two equal chunks per rank)."""
    step = 2 if layout == "zigzag" else 1
    if ragged:
        tokens = draw(tile_tokens(RAGGED_ABOVE + 1, max(72, bounds.max_ragged_tokens)), label="tokens per rank")
        return tokens + tokens % step
    most = min(bounds.max_ragged_tokens, bounds.max_world_size * bounds.max_tokens_per_rank // p)
    if most > bounds.max_tokens_per_rank and draw(st.integers(0, 2)) == 2:
        tokens = draw(tile_tokens(1, most), label="tokens per rank")
        return max(step, tokens - tokens % step)
    return step * draw(st.integers(1, bounds.max_tokens_per_rank // step))


@st.composite
def _cases(draw, bounds: Bounds, dtypes, distributions, layouts, causal, backends, world_size, min_group,
           ragged=False):
    distribution = draw(st.sampled_from(distributions))
    is_causal = draw(st.sampled_from(causal))
    layout = draw(st.sampled_from(layouts))
    p = world_size if world_size is not None else draw(world_sizes(bounds.max_world_size))
    ring = RingSpec(p, layout)
    tokens = _tokens(draw, bounds, p, layout, ragged)
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
          world_size: int | None = None, min_group: int = 1, ragged: bool = False) -> st.SearchStrategy[Case]:
    """Cases within `bounds`: every combination of mode (causal and layout), GQA ratio, odd
    and even head dims, tokens per rank from 1 (even for zigzag), dtype and distribution.

    `world_size` pins the ring size (a distributed run can only use its own); otherwise it
    is drawn by `world_sizes`. `min_group` > 1 draws only grouped-query attention (heads a
    multiple >= min_group of kv_heads).

    Where the profile's max_ragged_tokens exceeds max_tokens_per_rank (nightly, deep), a third
    of the draws take longer shards, leaning to a tile +/- a few tokens (`tile_tokens`). With
    `ragged`, every draw is a ragged shard longer than 64 tokens per rank (`ragged_cases`).

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
    return _cases(bounds, dtypes, distributions, layouts, causal, backends, world_size, min_group, ragged)


RAGGED_SIZES = Bounds(max_world_size=4, max_tokens_per_rank=8, max_batch=2, max_heads=4, max_head_dim=32)


def ragged_cases(bounds: Bounds = Bounds(), **kwargs) -> st.SearchStrategy[Case]:
    """Cases whose shards are longer than a tile of 64 and lean to a tile +/- a few tokens (up
    to max(72, bounds.max_ragged_tokens) per rank), on rings of up to 4 ranks with the small
    shapes of `RAGGED_SIZES` (a ragged shard costs what a dozen small cases do): where kernels'
    last, partial tiles break. The drawn "tokens per rank" is shown with the case."""
    small = Bounds(max_world_size=min(bounds.max_world_size, RAGGED_SIZES.max_world_size),
                   max_tokens_per_rank=bounds.max_tokens_per_rank, max_batch=min(bounds.max_batch, 2),
                   max_heads=min(bounds.max_heads, RAGGED_SIZES.max_heads),
                   max_head_dim=min(bounds.max_head_dim, RAGGED_SIZES.max_head_dim),
                   max_ragged_tokens=bounds.max_ragged_tokens)
    return cases(small, ragged=True, **kwargs)


def tokens_per_rank(case: Case) -> int:
    return case.spec.seq_len // case.ring.world_size
