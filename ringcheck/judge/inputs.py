"""Seeded inputs: the same spec and seed give the same q, k, v, dout on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import AttentionSpec, RingSpec
from .distributions import generate


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(spec: AttentionSpec, *, seed: int, distribution: str = "normal",
                device: torch.device | str = "cpu", ring: RingSpec | None = None) -> Inputs:
    """Whole-sequence inputs for `spec` in its dtype, drawn on the CPU from `seed` (so every
    rank and every device gets identical values) and then moved to `device`. `ring` is
    needed by distributions that place values by ring step (``late-max``)."""
    gen = torch.Generator().manual_seed(int(seed))
    q, k, v, dout = generate(distribution, spec, gen, ring)
    dt = spec.torch_dtype
    return Inputs(*(t.to(dt).to(device) for t in (q, k, v, dout)))
