"""Per parameter, the gradient budget of `ringcheck step --model`, and where none exists, said so.

A glue that runs the model narrower than the step (flash's bfloat16) is judged within a measured
noise budget: the model run in that dtype at CP=1 with transformers' own attentions (the noise
runs, `ringcheck.models.step_noise.narrow_noise`), against the float64 truth. Each parameter's
gradient is judged against **its own** noise: `K_NOISE` x the largest change of that parameter's
gradient over the noise runs and the cases, measured the way the parameter is judged (relative to
its true gradient, or, where that cancels to rounding, as a part of the whole gradient vector:
`judged_scale`).

One unit for every parameter, the largest relative change of any, made every budget the widest
parameter's: bert's key biases (analytically zero, their float64 truth ~1e-17, their bfloat16
gradient the bfloat16 residue of the whole) changed by 2.2e13 relative, and every gradient of
bert and its kin was judged against 9e13, which no glue fails (ringcheck's defect, see
docs/findings/trainers.md).

A budget of `UNBOUNDED` (relative 1) or wider admits a zero gradient, a contribution dropped
whole: it is no evidence, and the parameter is reported **not judged** with the numbers, never
passed. The scaling and the not-judged row are `ringcheck.step.scales`, which plain `ringcheck
step` shares.
"""

from __future__ import annotations

import math
from typing import Any

from ..step.noise import K_NOISE
from ..step.scales import UNBOUNDED, judged_scale, scaled, whole_norm


def _changes(diffs: dict[str, float], scales: dict[str, float]) -> dict[str, float]:
    return {name: scaled(diffs.get(name, math.inf), scale) for name, scale in scales.items()}  # none: no bound


def narrow_unit(cases: dict[str, dict], narrow: str, targets: dict[str, int], truth: str) -> dict[str, Any]:
    """The measured budgets of a glue run in `narrow`: `K_NOISE` x the largest relative change of
    the loss and the logits over the noise runs and the cases (the unit is the model's, not one
    case's), and per parameter `K_NOISE` x the largest change of its gradient, as it is judged
    (`judged_scale`; `targets`: each case's target positions, `truth`: the dtype the truth is
    exact to)."""
    rows, units = [], {}
    for name, case in cases.items():
        grads = case.get("grads") or {}
        whole = whole_norm(grads)
        scales = {p: judged_scale(g, whole, targets[name], truth)[0] for p, g in grads.items() if g is not None}
        for row in case.get("narrow", {}).get("rows", []):
            changes = _changes(row.get("diffs", {}), scales)
            for p, v in changes.items():
                units[p] = max(units.get(p, 0.0), v)
            rows.append({**{k: v for k, v in row.items() if k != "diffs"}, "case": name,
                         "gradient": max(changes.values(), default=0.0)})
    skipped = {run: why for c in cases.values() for run, why in c.get("narrow", {}).get("skipped", {}).items()}
    floors = {p: K_NOISE * v for p, v in units.items()}
    bounded = [p for p, f in floors.items() if f < UNBOUNDED]
    unit = {k: max((r[k] for r in rows), default=math.nan) for k in ("loss", "logits")}
    unit["gradient"] = max((units[p] for p in bounded), default=math.nan)
    floor = {k: K_NOISE * v if rows and math.isfinite(v) else math.inf for k, v in unit.items()}
    floor["gradients"] = floors
    unbounded = sorted(set(floors) - set(bounded))
    return {"dtype": narrow, "k": K_NOISE, "unit": unit, "floor": floor, "gradients": units, "rows": rows,
            "skipped": skipped, "unbounded": unbounded, "words": _words(narrow, unit, units, bounded, unbounded, rows,
                                                                       skipped)}


def _words(narrow: str, unit: dict, units: dict, bounded: list, unbounded: list, rows: list, skipped: dict) -> str:
    least = min((units[p] for p in bounded), default=math.nan)
    tail = (f"; {len(unbounded)} gradient(s) change by {K_NOISE:g} x that {UNBOUNDED:g} or more of their own "
            f"(e.g. {unbounded[0]}, {units[unbounded[0]]:.2g}): no bound, not judged" if unbounded else "")
    return (f"the glue runs the model in {narrow}: the budgets are {K_NOISE:g} x the largest relative change of the "
            f"loss ({unit['loss']:.2g}), the logits ({unit['logits']:.2g}) and, per parameter, of its own gradient "
            f"({least:.2g} to {unit['gradient']:.2g}) when the model runs in {narrow} at CP=1 with transformers' own "
            f"attention ({', '.join(sorted({r['run'] for r in rows})) or 'none ran'}) instead of the float64 truth"
            + tail + (f"; not run: {skipped}" if skipped else ""))


def gradient_budget(name: str, derived: float, own_noise: float, floor: dict | None) -> float:
    """One parameter's budget: the derived one, floored by `K_NOISE` x the truth's own rounding
    (`own_noise`) and, for a narrowed glue, by its measured floor (`floor["gradients"]`; a
    parameter the noise runs did not measure has none: unbounded)."""
    budget = max(derived, K_NOISE * own_noise)
    if floor is not None:
        budget = max(budget, floor.get("gradients", {}).get(name, math.inf))
    return budget
