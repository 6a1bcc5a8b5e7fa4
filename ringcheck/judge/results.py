"""What every judge of one case shares, below them all: an implementation's whole-sequence
`Results`, and the keyword arguments of every reference call (`reference_kwargs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import AttentionSpec
from .inputs import Inputs


@dataclass(frozen=True)
class Results:
    """Whole-sequence results of one implementation (or reference) for one case."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsinks: torch.Tensor | None = None  # (heads,), when the case has sinks
    # a ring's own: each rank's sinks gradient as it returned it, and the convention declared
    # for them (`ringcheck.judge.sinks`): dsinks is their combination under it
    dsinks_parts: tuple[torch.Tensor, ...] | None = None
    sinks_grad: str = "partial"

    def get(self, tensor: str) -> torch.Tensor:
        return getattr(self, tensor)



def reference_kwargs(spec: AttentionSpec, inputs: Inputs) -> dict:
    """The keyword arguments of every reference call for `spec` (scale, mask, variants, sinks)."""
    extra = {} if inputs.sinks is None else {"sinks": inputs.sinks}
    return {"causal": spec.causal, "softmax_scale": spec.scale, **spec.variant_kwargs(), **extra}
