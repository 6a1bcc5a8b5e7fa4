"""The verdict of a training run: the ring's against the reference, within the measured noise floor.

The noise floor is the spread of the single-device runs that differ from the reference only in
legitimate ways (`ringcheck.train.loop.SINGLE_RUNS`): how far a correct computation of the same
training can land from the reference. Two rules, each with its k (`K_GRAD`, `K_LOSS`):

- **Step-0 gradients**, per parameter, normwise: the ring's error ||g_ring - g_ref|| may be at
  most K_GRAD x the spread, max over the noise runs of ||g_noise - g_ref||, taken at no less
  than the training dtype's rounding floor u ||g_ref|| (u its unit roundoff: what one
  correctly rounded result may differ by; a run whose noise happens to agree bit for bit
  gives no budget of zero).
- **The loss trajectory**: at each step t, |L_ring(t) - L_ref(t)| may be at most K_LOSS x the
  envelope E(t), the largest spread max_noise |L_noise(s) - L_ref(s)| of any step s <= t
  (the band the spread grows into: differences grow as training goes, never shrink in
  expectation), taken at no less than float32's rounding of the loss.

A run passes when every parameter and every step does; it fails when one does not, and the
report says which parameters were out at step 0 and at which step the loss left the band.
No verdict when the reference or a noise run is not finite (the model itself diverged: nothing
can be judged). Why these k: docs/explanation/train-verdict.md, measured by
benchmarks/train_sweep.py (leave-one-out: each noise run judged against the others).

Beside the verdict, information: the TransformerEngine-style tolerances (one step's loss
within 5% relative, every gradient element within 0.05 absolute) on the same run, and the
relative loss gap at the last step with the resolution the noise floor gives it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..spec import DTYPES

K_GRAD = 3.0
K_LOSS = 5.0
TE_LOSS_RTOL = 0.05   # TransformerEngine's CP test framework: loss within 5% relative,
TE_GRAD_ATOL = 0.05   # every gradient within 0.05 absolute


def unit_roundoff(dtype: str) -> float:
    """2^-p, p the significand bits (with the implicit one): 2^-24 float32, 2^-8 bfloat16, 2^-11 float16."""
    return float(torch.finfo(DTYPES[dtype]).eps) / 2


def _finite(values) -> bool:
    return all(math.isfinite(x) for x in values)


def _ratio(error: float, budget: float) -> float:
    if error == 0:
        return 0.0
    return math.inf if budget == 0 or not math.isfinite(error) else error / budget


def gradient_rows(dtype: str, ring: dict, ref: dict, noise: dict[str, dict], k: float = K_GRAD) -> list[dict]:
    """One row per parameter: the ring's normwise error at step 0 against its budget, the
    spread and floor it is made of, each noise run's error, and the largest element error
    (the TE-style measure)."""
    u = unit_roundoff(dtype)
    rows = []
    for name, g in ref.items():
        g = g.double()
        norm = float(g.norm())
        errors = {n: float((grads[name].double() - g).norm()) for n, grads in noise.items()}
        spread, floor = max(errors.values(), default=0.0), u * norm
        budget = k * max(spread, floor)
        diff = ring[name].double() - g
        error = float(diff.norm()) if bool(torch.isfinite(diff).all()) else math.inf
        ratio = _ratio(error, budget)
        rows.append({"name": name, "shape": list(g.shape), "norm": norm, "error": error, "relative": _rel(error, norm),
                     "spread": spread, "floor": floor, "budget": budget, "ratio": ratio, "passed": ratio <= 1,
                     "noise": {n: _rel(e, norm) for n, e in errors.items()},
                     "max_abs": float(diff.abs().max()) if math.isfinite(error) else math.inf})
    return rows


def _rel(error: float, norm: float) -> float:
    return error / norm if norm else (0.0 if error == 0 else math.inf)


def step_rows(ring: dict, ref: dict, noise: dict[str, dict], k: float = K_LOSS) -> list[dict]:
    """One row per step: both losses and gradient norms, every noise run's loss, the spread,
    the envelope, the band and whether the ring's loss is inside it."""
    u32 = unit_roundoff("float32")
    rows, envelope = [], 0.0
    for t, (lr, lf) in enumerate(zip(ring["losses"], ref["losses"])):
        others = {n: run["losses"][t] for n, run in noise.items()}
        spread = max((abs(x - lf) for x in others.values()), default=0.0)
        envelope = max(envelope, spread, 2 * u32 * abs(lf))
        gap = lr - lf if math.isfinite(lr) else math.inf
        band = k * envelope
        rows.append({"step": t, "ring_loss": lr, "reference_loss": lf, "noise_losses": others, "spread": spread,
                     "envelope": envelope, "band": band, "gap": gap, "gap_over_floor": gap / envelope,
                     "in_band": abs(gap) <= band, "ring_grad_norm": ring["grad_norms"][t],
                     "reference_grad_norm": ref["grad_norms"][t]})
    return rows


def leave_one_out(dtype: str, ref: dict, noise: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each noise run judged as if it were the ring, against the floor made of the others: the
    largest gradient ratio and step ratio a legitimate run reaches (information: what k must
    stand above)."""
    out = {}
    for name, run in noise.items():
        rest = {n: r for n, r in noise.items() if n != name}
        grads = gradient_rows(dtype, run["grads"], ref["grads"], {n: r["grads"] for n, r in rest.items()}, k=1.0)
        steps = step_rows(run, ref, rest, k=1.0)
        out[name] = {"gradient_ratio": max(r["ratio"] for r in grads),
                     "loss_ratio": max(abs(s["gap"]) / s["band"] for s in steps)}
    return out


def te_style(grads: list[dict], steps: list[dict]) -> dict[str, Any]:
    """What TransformerEngine's CP test would have said of the same run: step 0's loss within
    5% relative and every step-0 gradient element within 0.05 absolute (and, looser still,
    the loss within 5% at every step)."""
    loss0 = abs(steps[0]["gap"]) / abs(steps[0]["reference_loss"])
    worst = max((abs(s["gap"]) / abs(s["reference_loss"]) for s in steps), default=0.0)
    grad = max((g["max_abs"] for g in grads), default=0.0)
    return {"loss_rtol": TE_LOSS_RTOL, "grad_atol": TE_GRAD_ATOL, "step0_loss_relative": loss0,
            "worst_loss_relative": worst, "grad_max_abs": grad,
            "passed": loss0 <= TE_LOSS_RTOL and grad <= TE_GRAD_ATOL,
            "trajectory_passed": worst <= TE_LOSS_RTOL and grad <= TE_GRAD_ATOL}


def judge(dtype: str, ring: dict, ref: dict, noise: dict[str, dict]) -> dict[str, Any]:
    """The verdict ("pass", "fail" or "no verdict", with why), the parameter and step rows,
    where the run left the rules, the last step's gap, the TE-style reading, leave-one-out."""
    grads = gradient_rows(dtype, ring["grads"], ref["grads"], {n: r["grads"] for n, r in noise.items()})
    steps = step_rows(ring, ref, noise)
    singles_finite = all(_finite(r["losses"]) and all(bool(torch.isfinite(g).all()) for g in r["grads"].values())
                         for r in (ref, *noise.values()))
    out_grads = [g["name"] for g in grads if not g["passed"]]
    left = next((s["step"] for s in steps if not s["in_band"]), None)
    last = steps[-1]
    summary = {
        "grads_out": out_grads,
        "left_band_at": left,
        "worst_gradient": max(grads, key=lambda g: g["ratio"])["name"],
        "worst_gradient_ratio": max(g["ratio"] for g in grads),
        "worst_step_ratio": max(abs(s["gap"]) / s["band"] for s in steps),
        "last_step": {"step": last["step"], "relative_gap": last["gap"] / last["reference_loss"],
                      "noise_relative": last["envelope"] / last["reference_loss"],
                      "resolution": last["band"] / last["reference_loss"]},
        "te_style": te_style(grads, steps),
        "leave_one_out": leave_one_out(dtype, ref, noise) if singles_finite and len(noise) > 1 else {},
    }
    if not singles_finite:
        verdict, why = "no verdict", ("a single-device run (the reference or a noise run) is not finite: the model "
                                      "itself diverged at these settings, so nothing can be judged; lower --steps "
                                      "or use float32")
    elif out_grads or left is not None:
        where = []
        if out_grads:
            where.append(f"step-0 gradients out of budget: {', '.join(out_grads)}")
        if left is not None:
            where.append(f"the loss left the noise band at step {left}")
        verdict, why = "fail", "; ".join(where)
    else:
        verdict, why = "pass", (f"every step-0 gradient within {K_GRAD:g} x the noise floor (worst "
                                f"{summary['worst_gradient']} at {summary['worst_gradient_ratio']:.2f} of its "
                                f"budget) and the loss inside the band at every step (worst "
                                f"{summary['worst_step_ratio']:.2f} of it)")
    return {"verdict": verdict, "why": why, "gradients": grads, "steps": steps, "summary": summary}
