"""The verdict of `ringcheck step`: the step at CP=P against the same step at CP=1, per case.

**The budget** (derived; measured in docs/explanation/step-verdict.md). The two runs compute
the same sums in other orders: a rank's share of the tokens, then a sum over ranks, where the
reference sums all tokens at once. Reordering a sum of n terms changes it by at most
2 (n - 1) u sum|terms| (u the unit roundoff), so relative to the sum by at most 2 n u kappa,
kappa = sum|terms| / |sum| its condition. n is the case's target positions (micro-batches x
rows x tokens: the longest sum, the loss's and every weight gradient's over the tokens).

- loss: its terms (the tokens' cross-entropies) are all >= 0, so kappa = 1: |L_P - L_1| <=
  2 n u_loss |L_1|, u_loss the unit roundoff of the dtype the loss is computed in (a recipe
  that casts logits to float32 declares `loss_dtype = "float32"`), at least `K_COND` u of
  the step's dtype (the model's own roundings reach the cross-entropies);
- every parameter's gradient, normwise: ||g_P - g_1|| <= 2 n K_COND u ||g_1||, with a condition
  allowance K_COND = 16 (a gradient's per-token terms have both signs); where the true gradient
  cancels to the rounding of the whole (at most n u ||g||: a key bias, analytically zero) ||g_1||
  is the whole gradient's norm (`ringcheck.step.scales`); a narrowed ring's budget is floored
  per parameter by its own measured noise (`ringcheck.step.noise`), and a budget of 1 or more
  is no bound: that parameter is reported not judged.

A ring other than ours (torch backends) is not known to compute float64 inputs in float64
throughout (PyTorch's context parallel keeps float32 statistics): its attention's dtype is taken
as float32 (`attention_dtype`), and 2 n u32 floors both budgets (the report says so).

Correct recipes sit near 1e-15 in float64 (a few u); the reported bugs are 1e-4 to 1, a million
budgets out and more.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .scales import K_NOISE, UNBOUNDED, against_whole, case_scales, not_judged, unit_roundoff

K_COND = 16.0


def budgets(n: int, dtype: str, loss_dtype: str | None, attention_dtype: str | None = None) -> tuple[float, float]:
    """(relative loss budget, relative gradient budget) of a case of `n` target positions; an
    attention computed in a narrower `attention_dtype` (a ring not known to compute float64
    throughout) floors both at 2 n u of it."""
    u = unit_roundoff(dtype)
    u_attn = unit_roundoff(attention_dtype or dtype)
    u_loss = max(unit_roundoff(loss_dtype or dtype), K_COND * u, u_attn)
    return 2 * n * u_loss, 2 * n * max(K_COND * u, u_attn)


NARROW_LOSS_BITS = {"bfloat16": 16, "float32": 40}  # at most this many significant bits: computed in it


def significant_bits(x: float) -> int:
    """The bits of `x`'s float64 significand up to its last 1 (53 for almost every value a float64
    computation gives; a float32 value has at most 24, a sum of a few float32 values a few more)."""
    if x == 0 or not math.isfinite(x):
        return 0
    m = int(abs(math.frexp(x)[0]) * 2 ** 53)
    return 53 - ((m & -m).bit_length() - 1)


def loss_rounding(declared: str | None, dtype: str, model: str | None, losses: list[float]
                  ) -> tuple[str | None, str | None]:
    """The dtype the step's loss is computed in, and how ringcheck found it where the recipe does
    not declare it (`loss_dtype`): a transformers model's loss (`ForCausalLMLoss`) casts the
    logits to float32, whatever the model's dtype; else the reference's logged losses (every case
    at CP=1) are read: one that carries no more significant bits than a narrower dtype gives
    (`NARROW_LOSS_BITS`) was computed in it. (None, None): the step's own dtype, nothing found."""
    if declared is not None or dtype != "float64":
        return declared, None
    if model is not None:
        return "float32", (f"the model is a transformers PreTrainedModel ({model}): its loss (ForCausalLMLoss) is "
                           f"computed in float32 whatever the model's dtype, so the loss budget takes float32's unit "
                           f"roundoff (a recipe states it with loss_dtype)")
    bits = max((significant_bits(x) for x in losses if x), default=53)  # a loss of exactly 0 tells nothing
    narrow = next((name for name, most in NARROW_LOSS_BITS.items() if bits <= most), None)
    if narrow is None:
        return None, None
    return narrow, (f"the step's logged loss at CP=1 carries at most {bits} significant bits in every case (a "
                    f"float64 loss carries 53): it is computed in {narrow}, and the loss budget takes its unit "
                    f"roundoff (a recipe states it with loss_dtype)")


def relative(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """||a - b|| / ||b|| (||a - b|| where b is 0; inf where a is not finite)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if not bool(torch.isfinite(a).all()):
        return math.inf
    diff, norm = float((a - b).norm()), float(b.norm())
    return diff / norm if norm > 0 else diff


def scale_of(a: torch.Tensor, b: torch.Tensor) -> float:
    """The least-squares factor f of a ~ f b (how far out, as a factor)."""
    a, b = a.double().flatten(), b.double().flatten()
    den = float(b @ b)
    return float(a @ b) / den if den > 0 else math.nan


def gradient_rows(ranks: list[dict], ref: dict[str, torch.Tensor | None], budget: float) -> list[dict[str, Any]]:
    """Per parameter: the worst rank's normwise error against the reference, its ratio to the
    budget and the factor it is out by."""
    rows = []
    for name, want in ref.items():
        if want is None:
            continue
        worst, where, factor = 0.0, None, 1.0
        for r in ranks:
            got = r["grads"].get(name)
            err = math.inf if got is None else relative(got, want)
            if err > worst or where is None:
                worst, where = err, r["where"]
                factor = math.nan if got is None else scale_of(got, want)
        rows.append({"name": name, "error": worst, "budget": budget, "ratio": worst / budget, "rank": where,
                     "factor": factor, "missing": any(r["grads"].get(name) is None for r in ranks)})
    return rows


def reference_is_finite(ref: dict) -> bool:
    grads = [g for g in ref["grads"].values() if g is not None]
    return math.isfinite(ref["loss"]) and all(bool(torch.isfinite(g).all()) for g in grads)


def judged_gradients(ranks: list[dict], ref: dict, derived: float, floors: dict[str, float] | None,
                     scales: dict[str, tuple[float, bool]]) -> list[dict[str, Any]]:
    """Per parameter, its row against its own budget: the derived one, floored by its own measured
    noise budget (`floors`, a narrowed ring's; a parameter the noise runs did not measure has
    none: unbounded); its error relative to its own reference gradient, or to the whole gradient
    where its truth cancels to rounding (`scales`: `ringcheck.step.scales.case_scales`). A budget
    of `UNBOUNDED` or wider is no bound: the row is not judged (`not_judged`)."""
    rows = []
    for name, want in ref.items():
        if want is None:
            continue
        budget = derived if floors is None else max(derived, floors.get(name, math.inf))
        (row,) = gradient_rows(ranks, {name: want}, budget)
        scale, against = scales[name]
        row["scale"] = scale
        if against:
            row = against_whole(row, ranks, name, want, scale)
        if not budget < UNBOUNDED:
            row = not_judged(row, scale, against, budget / K_NOISE)
        rows.append(row)
    return rows


def _blind(ref: dict, floor: tuple[float, dict[str, float]] | None) -> str | None:
    if not reference_is_finite(ref):  # the step itself gives NaN/Inf at CP=1: nothing to compare with
        return "the reference (the same step at CP=1) is not finite: nothing can be judged"
    if floor is not None and not (math.isfinite(floor[0]) and all(math.isfinite(f) for f in floor[1].values())):
        return "a noise run (the step at CP=1 with another legitimate attention) is not finite: no budget"
    return None


def judge_case(name: str, ranks: list[dict], ref: dict, n: int, dtype: str, loss_dtype: str | None,
               evaluate: bool, attention_dtype: str | None = None,
               floor: tuple[float, dict[str, float]] | None = None, exact: dict | None = None) -> dict[str, Any]:
    """One case: every rank of the CP=P run (`ranks`: {where, loss, grads}) against the reference
    (`ref`: rank 0 of the CP=1 run); `floor`: the loss budget and each parameter's gradient budget
    measured for a narrowed attention (`ringcheck.step.noise`), where wider than the derived ones;
    `exact`: the case's gradients in the step's own dtype throughout (a narrowed ring's unrounded
    noise run), on which a gradient that cancels to rounding is told (default the reference's)."""
    loss_budget, grad_budget = budgets(n, dtype, loss_dtype, attention_dtype)
    if floor is not None:
        loss_budget = max(loss_budget, floor[0])
    blind = _blind(ref, floor)
    if blind is not None:
        return {"case": name, "verdict": "no verdict", "targets": n,
                "loss": {"ring": ranks[0]["loss"], "reference": ref["loss"], "error": math.nan, "budget": loss_budget,
                         "ratio": math.nan},
                "gradient_budget": grad_budget, "worst_gradient": math.nan, "first_out": None, "gradients": [],
                "not_judged": [], "why": blind}
    loss_err = max(relative(r["loss"], ref["loss"]) for r in ranks)
    scales = case_scales(ref["grads"], exact, n, attention_dtype or dtype)
    grads = [] if evaluate else judged_gradients(ranks, ref["grads"], grad_budget, floor and floor[1], scales)
    judged = [g for g in grads if g.get("judged", True)]
    out = [g for g in judged if not g["ratio"] <= 1]
    passed = loss_err <= loss_budget and not out
    first = out[0] if out else None
    return {"case": name, "verdict": "pass" if passed else "fail", "targets": n,
            "loss": {"ring": ranks[0]["loss"], "reference": ref["loss"], "error": loss_err, "budget": loss_budget,
                     "ratio": loss_err / loss_budget},
            "gradient_budget": max((g["budget"] for g in judged), default=grad_budget),
            "gradient_budgets": [min((g["budget"] for g in judged), default=grad_budget),
                                 max((g["budget"] for g in judged), default=grad_budget)],
            "worst_gradient": max((g["error"] for g in judged), default=0.0),
            "not_judged": [{k: g[k] for k in ("name", "budget", "why")} for g in grads if not g.get("judged", True)],
            "first_out": None if first is None else {k: first[k] for k in ("name", "error", "ratio", "factor", "rank")},
            "gradients": grads}


def data_row(groups: list[list[dict]]) -> dict[str, Any] | None:
    """The loader check: every rank of a CP group got the same micro-batches (`data`: a digest
    per rank), and the data-parallel replicas (the CP groups) different ones; None without a
    loader hook (or at CP=1)."""
    digests = [[r.get("data") for r in g] for g in groups]
    if any(d is None for g in digests for d in g):
        return None
    split = [(i, g) for i, g in enumerate(digests) if len(set(g)) > 1]
    firsts = [g[0] for g in digests]
    same = [(i, j) for i in range(len(firsts)) for j in range(i + 1, len(firsts)) if firsts[i] == firsts[j]]
    if split:
        i, g = split[0]
        ranks = ", ".join(f"rank {r}: {d}" for r, d in enumerate(g))
        words = (f"the ranks of CP group {i} got different batches from the loader ({ranks}): a sampler seeded by "
                 f"the global rank instead of the data-parallel rank (LlamaFactory #10559, axolotl #3920)")
    elif same:
        words = (f"data-parallel replicas {same[0][0]} and {same[0][1]} got the same batch: seed the sampler by the "
                 f"data-parallel rank")
    else:
        words = "every rank of a CP group got the same batch, every replica its own"
    return {"verdict": "fail" if split or same else "pass", "class": "data", "words": words, "digests": digests}
