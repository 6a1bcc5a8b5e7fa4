"""How one parameter's gradient error is scaled, and a budget that is no bound: what `ringcheck step`
and `ringcheck step --model` (`ringcheck.models.budgets`) share.

A parameter's gradient is judged relative to its own true gradient, except where that truth
cancels to the rounding of the whole gradient (at most n u ||g||: a key bias, which softmax's
shift invariance makes analytically zero). There both sides are rounding residue and a relative
error compares residue with residue (1.1 on a correct float64 step); the error is judged as a
part of the whole gradient vector instead, ||a - b|| / ||g|| (`judged_scale`).

A measured noise budget (`K_NOISE` x a parameter's own change over the noise runs) of
`UNBOUNDED` or wider admits a gradient of zeros: it is no bound, and the parameter is reported
**not judged** with its numbers (`not_judged`), never passed and never widening another's.
"""

from __future__ import annotations

import math

import torch

from ..spec import REFERENCE_DTYPES

K_NOISE = 4.0  # a measured budget: this many times the noise (docs/explanation/step-verdict.md)
UNBOUNDED = 1.0  # a relative budget this wide passes a gradient of zeros: no bound at all


def unit_roundoff(dtype: str) -> float:
    return float(torch.finfo(REFERENCE_DTYPES[dtype]).eps) / 2


def whole_norm(grads: dict) -> float:
    """The norm of the whole gradient (every parameter's, as one vector: what clipping reads)."""
    return math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads.values() if g is not None))


def judged_scale(want: torch.Tensor, whole: float, n: int, truth: str) -> tuple[float, bool]:
    """What a parameter's gradient error is divided by, and whether that is the whole gradient:
    its true gradient's norm, or the whole gradient's where the true one cancels to the rounding of
    the whole (at most n u ||g||, u the unit roundoff the truth is exact to: a key bias, which
    softmax's shift invariance makes analytically zero)."""
    norm = float(want.double().norm())
    if norm <= n * unit_roundoff(truth) * whole:
        return whole, True
    return norm, False


def case_scales(want: dict, exact: dict | None, n: int, truth: str) -> dict[str, tuple[float, bool]]:
    """Per parameter of one case, what its error is divided by and whether that is the whole
    gradient (`judged_scale`): the norms are `want`'s (the reference the run is compared with),
    the cancellation is read on `exact` (the same step's gradients in the dtype `truth` it is exact
    to: a narrowed ring's unrounded noise run, whose key bias is float64 residue where the
    reference's is its bfloat16 attention's; default `want`)."""
    exact = want if exact is None else exact
    whole, whole_exact = whole_norm(want), whole_norm(exact)
    out = {}
    for name, g in want.items():
        if g is None:
            continue
        against = exact.get(name) is not None and judged_scale(exact[name], whole_exact, n, truth)[1]
        out[name] = (whole, True) if against else (float(g.double().norm()), False)
    return out


def scaled(distance: float, scale: float) -> float:
    """A distance ||a - b|| as a relative change of `scale` (`judged_scale`)."""
    return distance / scale if scale > 0 else (0.0 if distance == 0 else math.inf)


def distance(a: torch.Tensor | None, b: torch.Tensor) -> float:
    """||a - b|| in float64 (inf where `a` is missing or not finite)."""
    if a is None:
        return math.inf
    a = a.double()
    return float((a - b.double()).norm()) if bool(torch.isfinite(a).all()) else math.inf


def against_whole(row: dict, ranks: list[dict], name: str, want: torch.Tensor, whole: float) -> dict:
    """A parameter whose true gradient cancels to the rounding of the whole gradient (at most
    n u ||g||: a key bias, which softmax's shift invariance makes analytically zero) has no
    relative error to judge: both sides are rounding residue, and ||a - b|| / ||b|| compares
    residue with residue (a correct glue read 2.6 on roberta's key.bias, a correct plain step 1.1
    on a key bias). Its error is judged as that part of the whole gradient vector: ||a - b|| /
    ||g||, against its budget (measured the same way where measured: `judged_scale`)."""
    worst = max(scaled(distance(r["grads"].get(name), want), whole) for r in ranks)
    return {**row, "error": worst, "ratio": worst / row["budget"], "against": "whole gradient (cancels to rounding)"}


def not_judged(row: dict, scale: float, against_whole: bool, noise: float) -> dict:
    """A gradient row whose budget is no bound (`UNBOUNDED` or wider): reported, never passed."""
    what = "of the whole gradient" if against_whole else "of its true gradient"
    why = (f"its budget {row['budget']:.2g} {what} (norm {scale:.2g}) is no bound: a gradient of zeros would pass; "
           f"the noise runs move it by {noise:.2g} of that")
    return {**row, "judged": False, "why": why}
