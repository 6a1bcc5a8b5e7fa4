"""Seeded inputs: the same spec and seed give the same q, k, v, dout on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import AttentionSpec


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(spec: AttentionSpec, *, seed: int, distribution: str = "normal",
                device: torch.device | str = "cpu") -> Inputs:
    """Whole-sequence inputs for `spec` in its dtype, drawn on the CPU from `seed` (so every
    rank and every device gets identical values) and then moved to `device`."""
    from .distributions import generate

    gen = torch.Generator().manual_seed(int(seed))
    q, k, v, dout = generate(distribution, spec, gen)
    dt = spec.torch_dtype
    return Inputs(*(t.to(dt).to(device) for t in (q, k, v, dout)))
