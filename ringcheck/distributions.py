"""Named generators of (q, k, v, dout) in float32 on the CPU, cast later to the spec's dtype.

`normal`: every entry N(0, 1); logits then have std ~ sqrt(head_dim) x scale = 1.
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


DISTRIBUTIONS: dict[str, Generator] = {"normal": normal}


def generate(name: str, spec: AttentionSpec, gen: torch.Generator):
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution={name!r} is unknown; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name](spec, gen)
