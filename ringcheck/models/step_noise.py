"""The truth's own rounding: how far the gradients of a correct step move when only the order of
their sums changes.

The truth (`native_step`) is exact to float64 in its attention, but a model's own code may compute
other parts in float32 whatever the model's dtype: Gemma's RMSNorm computes `(1 + weight.float())`,
so its weights' gradients are float32 sums over the tokens. A CP run sums them per rank and then
over the ranks: a correct glue then sits ~1e-8 from the truth on those parameters (3.5e-8 to
8.4e-8 measured on gemma2, P=2), a million float64 budgets out, though nothing is wrong.

So the budget of every gradient is floored by a measurement, as `ringcheck.step.noise` does for a
narrowed attention: the truth's gradients taken once more with the targets split into the P parts
the ranks hold (one forward, one backward per part, the parts' gradients summed in float64), the
same loss summed in another order. `K_NOISE` x the relative change, per parameter, floors that
parameter's budget. Where the model computes in float64 throughout the change is ~1e-16 and the
derived budget stands (2 n K_COND u is larger); where a parameter's gradient passes through
float32, its floor says so in the report.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ring.layouts import positions
from ..spec import RingSpec
from ..step.contract import IGNORE, shift_labels
from ..step.noise import K_NOISE
from ..step.verdict import relative

__all__ = ["K_NOISE", "split_gradients", "truth_noise"]


def _part_targets(labels: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The targets (shifted on the whole sequence) of the positions `held`, IGNORE elsewhere."""
    targets = shift_labels(labels)
    out = torch.full_like(targets, IGNORE)
    keep = held[held < targets.shape[1]]
    out[:, keep] = targets[:, keep]
    return out


def split_gradients(model, batches: list[dict], logits_of, *, layout: str, world_size: int,
                    total: torch.Tensor) -> dict[str, torch.Tensor]:
    """The correct step's gradients, the loss split into the targets each of `world_size` ranks
    holds in `layout` (the sequence padded to the layout's multiple), summed part by part."""
    logits = [logits_of(model, mb["input_ids"], mb["position_ids"], mb.get("cu_seqlens")) for mb in batches]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    multiple = RingSpec(world_size, layout).chunks
    for rank in range(world_size):
        loss = 0.0
        for z, mb in zip(logits, batches):
            n = mb["input_ids"].shape[1]
            held = positions(layout=layout, rank=rank, world_size=world_size, seq_len=-(-n // multiple) * multiple)
            loss = loss + F.cross_entropy(z.to(torch.float64).flatten(0, 1),
                                          _part_targets(mb["labels"], held).flatten(), ignore_index=IGNORE,
                                          reduction="sum")
        grads = torch.autograd.grad(loss / total, [p for _, p in named], retain_graph=rank < world_size - 1,
                                    allow_unused=True)
        for (name, _), g in zip(named, grads):
            if g is not None:
                sums[name] += g.to(torch.float64)
    return sums


def truth_noise(split: dict[str, torch.Tensor], truth: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter, the relative change of its gradient between the truth and `split`."""
    return {n: relative(split[n], g) for n, g in truth.items() if g is not None and n in split}
