"""The noise of a narrowed attention: how far a correct step moves when its attention rounds otherwise.

A ring that runs only narrower dtypes than the step (flash-attn's rings: bfloat16 and float16)
is called with q, k, v cast to `--attention-dtype` and out cast back (`CP.attention`); the
reference is the same step at CP=1 with our ring called the same way. Two correct attentions
in a narrow dtype then differ by a few of its roundings per element, and that moves the loss and
the gradients by amounts no float64 derivation bounds usefully (2 n u of bfloat16 is 50% at
n = 64). So the budget is measured (`ringcheck.train`'s habit): the step at CP=1 with two other
legitimate attentions (`NOISE_RUNS`) against the reference, over the run's cases and the
training cases every recipe runs (`NOISE_CASES`: the unit is the recipe's, not one case's), and
the budget is `K_NOISE` x the largest relative change of the loss, and per parameter `K_NOISE`
x the largest change of its own gradient, scaled as it is judged (`ringcheck.step.scales`); a
parameter whose budget is 1 or more of itself is not judged, said (docs/explanation/step-verdict.md
gives the measurements behind K_NOISE).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ringcheck.reference.dense import peer_attention

from .scales import K_NOISE, UNBOUNDED, case_scales, distance, scaled
from .verdict import relative

# the legitimate attentions of the noise runs, at CP=1: the step's own dtype (no rounding of the
# attention at all), and naive attention in the narrow dtype (every matmul and the softmax in it)
NOISE_RUNS = ("unrounded", "naive")
NOISE_CASES = ("one_sequence", "uneven", "batch2", "two_micro_batches")  # every recipe runs these
NAIVE = "ringcheck.step.noise:naive_attention"


def naive_attention(q, k, v, *, causal, softmax_scale, group=None, cu_seqlens=None):
    """The `--impl` contract on a group of one: `ringcheck.reference.dense.peer_attention` on the whole
    sequence, in the input dtype."""
    cu = None if cu_seqlens is None else tuple(int(x) for x in torch.as_tensor(cu_seqlens).tolist())
    return peer_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu)


def noise_cases(names: tuple[str, ...]) -> tuple[str, ...]:
    """The cases the noise runs and the reference run: the run's, and `NOISE_CASES`."""
    return tuple(dict.fromkeys((*names, *NOISE_CASES)))


def noise_unit(ref: dict[str, dict], runs: dict[str, dict[str, dict]], names: tuple[str, ...],
               targets: dict[str, int], dtype: str) -> dict[str, Any]:
    """The largest relative change of the loss, and per parameter of its own gradient, over the
    noise runs (`runs`: run -> case -> {loss, grads}) and the cases `names`, against the reference
    (`ref`: case -> {loss, grads}); each gradient's change scaled as it is judged (relative to its
    own reference gradient, or to the whole gradient where its truth cancels to rounding, read on
    the unrounded run in `dtype`: `case_scales`; `targets`: each case's target positions). One
    unit for every parameter, the largest change of any, made every budget the widest one's (a
    key bias's: 2.7, where a layer's gradient halved is 0.5 off). Per run and case the figures."""
    rows, loss, units, finite = [], 0.0, {}, True
    for name in names:
        want = ref[name]["grads"]
        exact = runs["unrounded"][name]["grads"] if "unrounded" in runs else None
        scales = case_scales(want, exact, targets[name], dtype)
        for run, cases in runs.items():
            got = cases[name]
            le = relative(got["loss"], ref[name]["loss"])
            dists = {p: distance(got["grads"].get(p), want[p]) for p in scales}
            finite = finite and math.isfinite(le) and all(math.isfinite(d) for d in dists.values())
            changes = {p: scaled(d, scales[p][0]) for p, d in dists.items()}
            for p, v in changes.items():
                units[p] = max(units.get(p, 0.0), v)
            rows.append({"run": run, "case": name, "loss": le, "gradient": max(changes.values(), default=0.0)})
            loss = max(loss, le)
    bounded = [p for p, v in units.items() if K_NOISE * v < UNBOUNDED]
    return {"loss": loss, "gradient": max((units[p] for p in bounded), default=0.0),
            "least": min((units[p] for p in bounded), default=0.0), "gradients": units,
            "floors": {p: K_NOISE * v for p, v in units.items()}, "unbounded": sorted(set(units) - set(bounded)),
            "k": K_NOISE, "finite": finite, "rows": rows}


def narrowed_words(impl: str, dtype: str, attention_dtype: str, noise: dict[str, Any]) -> str:
    """What a narrowed run did and what its budget is made of, in one sentence for the report."""
    off = noise.get("unbounded", [])
    tail = (f"; {len(off)} gradient(s) whose own noise is no bound ({noise['k']:g} x it is {UNBOUNDED:g} or more of "
            f"the gradient: e.g. {off[0]}, {noise['gradients'][off[0]]:.2g}): not judged" if off else "")
    return (f"--impl {impl} was called in {attention_dtype} (q, k, v cast to it, its out cast back; the model and the "
            f"step in {dtype}), the reference's attention the same way (our ring at CP=1 in {attention_dtype}); the "
            f"budgets are {noise['k']:g} x the noise, the largest relative change of the loss ({noise['loss']:.2g}) "
            f"and, per parameter, of its own gradient ({noise.get('least', 0.0):.2g} to {noise['gradient']:.2g}) when "
            f"the reference's attention is {dtype} unrounded or naive {attention_dtype} instead, over the cases "
            f"{', '.join(dict.fromkeys(r['case'] for r in noise['rows']))}" + tail)
