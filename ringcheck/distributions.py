"""Named generators of (q, k, v, dout) in float32 on the CPU, cast later to the spec's dtype.

Each generator takes the spec and a seeded `torch.Generator` and draws q, k, v, dout in that
order, so the same (spec, seed) gives the same tensors on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from .spec import AttentionSpec

Generator = Callable[[AttentionSpec, torch.Generator], tuple[torch.Tensor, ...]]


def _shapes(spec: AttentionSpec):
    q = (spec.batch, spec.seq_len, spec.heads, spec.head_dim)
    kv = (spec.batch, spec.seq_len, spec.kv_heads, spec.head_dim)
    return q, kv


def normal(spec: AttentionSpec, gen: torch.Generator):
    """Standard normal q, k, v and dout."""
    qs, kvs = _shapes(spec)
    return (torch.randn(qs, generator=gen), torch.randn(kvs, generator=gen),
            torch.randn(kvs, generator=gen), torch.randn(qs, generator=gen))


def near_uniform(spec: AttentionSpec, gen: torch.Generator):
    """Near-ties: q scaled by 0.3 so every row's probabilities are close to uniform, and V with
    a common offset of +6, so every partial output of the ring is large and of one sign. Any
    rounding of the running output (a low-precision partial at every hop) adds up here
    instead of averaging out."""
    q, k, v, dout = normal(spec, gen)
    return 0.3 * q, k, v + 6.0, dout


DISTRIBUTIONS: dict[str, Generator] = {"normal": normal, "near-uniform": near_uniform}


def generate(name: str, spec: AttentionSpec, gen: torch.Generator):
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution={name!r} is unknown; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name](spec, gen)
