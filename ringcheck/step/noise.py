"""The noise of a narrowed attention: how far a correct step moves when its attention rounds otherwise.

A ring that runs only narrower dtypes than the step (flash-attn's rings: bfloat16 and float16)
is called with q, k, v cast to `--attention-dtype` and out cast back (`CP.attention`); the
reference is the same step at CP=1 with our ring called the same way. Two correct attentions
in a narrow dtype then differ by a few of its roundings per element, and that moves the loss and
the gradients by amounts no float64 derivation bounds usefully (2 n u of bfloat16 is 50% at
n = 64). So the budget is measured (`ringcheck.train`'s habit): the step at CP=1 with two other
legitimate attentions (`NOISE_RUNS`) against the reference, over the run's cases and the
training cases every recipe runs (`NOISE_CASES`: the unit is the recipe's, not one case's), and
the budget is `K_NOISE` x the largest relative change, of the loss and of any parameter's
gradient (docs/explanation/step-verdict.md gives the measurements behind K_NOISE).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ringcheck.reference.dense import peer_attention

from .verdict import relative

# the legitimate attentions of the noise runs, at CP=1: the step's own dtype (no rounding of the
# attention at all), and naive attention in the narrow dtype (every matmul and the softmax in it)
NOISE_RUNS = ("unrounded", "naive")
NOISE_CASES = ("one_sequence", "uneven", "batch2", "two_micro_batches")  # every recipe runs these
K_NOISE = 4.0
NAIVE = "ringcheck.step.noise:naive_attention"


def naive_attention(q, k, v, *, causal, softmax_scale, group=None, cu_seqlens=None):
    """The `--impl` contract on a group of one: `ringcheck.reference.dense.peer_attention` on the whole
    sequence, in the input dtype."""
    cu = None if cu_seqlens is None else tuple(int(x) for x in torch.as_tensor(cu_seqlens).tolist())
    return peer_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu)


def noise_cases(names: tuple[str, ...]) -> tuple[str, ...]:
    """The cases the noise runs and the reference run: the run's, and `NOISE_CASES`."""
    return tuple(dict.fromkeys((*names, *NOISE_CASES)))


def noise_unit(ref: dict[str, dict], runs: dict[str, dict[str, dict]], names: tuple[str, ...]) -> dict[str, Any]:
    """The largest relative change of the loss, and of any parameter's gradient, over the noise
    runs (`runs`: run -> case -> {loss, grads}) and the cases `names`, against the reference
    (`ref`: case -> {loss, grads}); per run and case the figures, for the report."""
    rows, loss, grad = [], 0.0, 0.0
    for run, cases in runs.items():
        for name in names:
            got, want = cases[name], ref[name]
            le = relative(got["loss"], want["loss"])
            ge = max((relative(got["grads"][n], g) for n, g in want["grads"].items() if g is not None), default=0.0)
            rows.append({"run": run, "case": name, "loss": le, "gradient": ge})
            loss, grad = max(loss, le), max(grad, ge)
    finite = math.isfinite(loss) and math.isfinite(grad)
    return {"loss": loss, "gradient": grad, "k": K_NOISE, "finite": finite, "rows": rows}


def narrowed_words(impl: str, dtype: str, attention_dtype: str, noise: dict[str, Any]) -> str:
    """What a narrowed run did and what its budget is made of, in one sentence for the report."""
    return (f"--impl {impl} was called in {attention_dtype} (q, k, v cast to it, its out cast back; the model and the "
            f"step in {dtype}), the reference's attention the same way (our ring at CP=1 in {attention_dtype}); the "
            f"budgets are {noise['k']:g} x the noise, the largest relative change of the loss ({noise['loss']:.2g}) "
            f"and of any gradient ({noise['gradient']:.2g}) when the reference's attention is {dtype} unrounded or "
            f"naive {attention_dtype} instead, over the cases {', '.join(dict.fromkeys(r['case'] for r in noise['rows']))}")
