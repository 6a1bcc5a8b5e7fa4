"""The sinks gradient of a ring, under a declared convention (`--sinks-grad`).

Sinks are a replicated parameter: every rank holds the same (heads,) logits, and each rank's
rows contribute to their gradient. Frameworks differ in who sums those contributions:

- ``partial`` (the default): each rank returns its own rows' share, and the framework reduces
  the gradients of every replicated parameter over the data x context-parallel group itself,
  as Megatron-LM and torchtitan do. ringcheck judges the sum of the ranks' shares.
- ``reduced``: the ring all-reduces inside attention, so every rank holds the whole sequence's
  gradient. ringcheck judges every rank's.

A ring that follows the other convention than the one declared fails, with a note that says
which one it follows and the flag that accepts it: a ring that all-reduces under a framework
that reduces again trains with P times the sinks gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..ring.loops import SINKS_GRAD, check_sinks_grad, sum_in_rank_order  # noqa: F401 - one vocabulary

_FOLLOWS = {
    "reduced": ("every rank holds the whole sequence's sinks gradient: this ring all-reduces it inside attention "
                "(the 'reduced' convention), but --sinks-grad partial (the default) declares that the framework sums "
                "each rank's share over the group, as Megatron-LM and torchtitan do, which would then train with P "
                "times the gradient; pass --sinks-grad reduced if nothing else reduces it, or drop the all-reduce"),
    "partial": ("each rank holds only its own rows' share of the sinks gradient (the 'partial' convention: their sum "
                "over the group is right), but --sinks-grad reduced asks for the whole sequence's on every rank; pass "
                "--sinks-grad partial (the default) where the framework reduces replicated gradients (Megatron-LM, "
                "torchtitan), or all-reduce it inside attention"),
}


def combine(parts: Sequence[torch.Tensor], convention: str) -> torch.Tensor:
    """The whole sequence's sinks gradient from each rank's (ring-rank order): under ``partial``
    their sum, added in rank order; under ``reduced`` ring rank 0's."""
    if check_sinks_grad(convention) == "reduced":
        return parts[0]
    return sum_in_rank_order(parts)


def judge_sinks(judged: Callable[[torch.Tensor], object], got) -> object:
    """The verdict of `got`'s sinks gradient (a `Results` with `dsinks_parts`, or a whole dsinks
    alone): `judged(value)` judges one (heads,) tensor; under ``reduced`` every rank's counts
    (the worst), under ``partial`` their sum. A failure that the other convention would pass
    carries the note that says so."""
    parts = got.dsinks_parts
    if not parts or len(parts) == 1:
        return judged(got.dsinks)

    def under(convention: str):
        if convention == "partial":
            return judged(combine(parts, "partial"))
        verdicts = [judged(p) for p in parts]
        return next((v for v in verdicts if not v.passed), verdicts[0])

    declared = check_sinks_grad(got.sinks_grad)
    verdict = under(declared)
    if verdict.passed:
        return verdict
    other = "reduced" if declared == "partial" else "partial"
    if under(other).passed:
        return dataclasses.replace(verdict, note=_FOLLOWS[other])
    return verdict
