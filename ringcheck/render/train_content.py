"""What a train report says, in every format: readings of the document (`headline`,
`gradient_table`, `step_table`, `last_step_words`, `te_words`) and the report as content
blocks (`blocks`: ("h1", text), ("p", text), ("code", command), ("list", items), ("table",
headers, rows)), which `ringcheck.render.train_report` writes as Markdown and HTML."""

from __future__ import annotations

import math
from typing import Any

VERDICT_WORDS = {"pass": "PASSED", "fail": "FAILED", "no verdict": "NO VERDICT"}


def pct(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{100 * x:+.4f}%"


def ratio_words(r: float) -> str:
    if not math.isfinite(r):
        return "inf"
    return f"{r:.2f}" if r < 100 else f"{r:.3g}"


def headline(doc: dict) -> str:
    return f"ringcheck train: {VERDICT_WORDS[doc['verdict']]}"


def gradient_table(doc: dict, *, only_worst: int | None = None,
                   per_run: bool = True) -> tuple[list[str], list[list[str]]]:
    """Per parameter: its gradient's norm, the ring's and the noise runs' normwise errors
    (each run's, or with `per_run` False their largest, the spread), the budget (relative) and
    error / budget; worst first when cut to `only_worst` (every failing parameter is kept)."""
    rows = doc["gradients"]
    if only_worst is not None:
        worst = sorted(rows, key=lambda g: g["ratio"], reverse=True)
        rows = [g for g in worst if not g["passed"]] or worst[:only_worst]
    noise = list(doc["rule"]["noise_runs"])
    columns = [f"{n} error" for n in noise] if per_run else ["noise spread"]
    headers = ["parameter", "norm", "ring error", *columns, "budget", "error/budget", "verdict"]
    table = []
    for g in rows:
        budget = g["budget"] / g["norm"] if g["norm"] else g["budget"]
        spread = [g["noise"][n] for n in noise] if per_run else [max(g["noise"].values(), default=0.0)]
        table.append([g["name"], f"{g['norm']:.3e}", f"{g['relative']:.2e}", *[f"{x:.2e}" for x in spread],
                      f"{budget:.2e}", ratio_words(g["ratio"]), "ok" if g["passed"] else "OUT"])
    return headers, table


def step_table(doc: dict, *, every: int = 1) -> tuple[list[str], list[list[str]]]:
    """Per step (every `every`-th, and every step out of the band, and the last): both losses,
    the gap, the band, the gap in units of the noise floor, both gradient norms."""
    headers = ["step", "ring loss", "reference loss", "gap", "band (+-)", "gap / floor", "in band", "ring |g|",
               "reference |g|"]
    steps = doc["steps"]
    table = []
    for s in steps:
        if s["step"] % every and s["in_band"] and s is not steps[-1]:
            continue
        table.append([str(s["step"]), f"{s['ring_loss']:.5f}", f"{s['reference_loss']:.5f}", f"{s['gap']:+.2e}",
                      f"{s['band']:.2e}", f"{s['gap_over_floor']:+.2f}", "yes" if s["in_band"] else "NO",
                      f"{s['ring_grad_norm']:.4f}", f"{s['reference_grad_norm']:.4f}"])
    return headers, table


def last_step_words(doc: dict) -> str:
    """The seed's question: how far the ring's loss is from the reference's at the last step,
    and how small a gap this run could have told apart from the noise."""
    last = doc["summary"]["last_step"]
    return (f"At the last step ({last['step']}) the ring's loss is {pct(last['relative_gap'])} from the reference's; "
            f"legitimate single-device runs differ by up to {abs(last['noise_relative']) * 100:.4f}% there, so this "
            f"run tells apart a relative loss gap of {last['resolution'] * 100:.4f}% or more (k x the noise floor) "
            f"from noise.")


def te_words(doc: dict) -> str:
    te = doc["summary"]["te_style"]
    verdict = "pass" if te["passed"] else "fail"
    return (f"TransformerEngine-style tolerances (step-0 loss within {te['loss_rtol']:.0%} relative, every gradient "
            f"element within {te['grad_atol']:g} absolute) would {verdict} this run: step-0 loss "
            f"{te['step0_loss_relative']:.2e} relative, worst gradient element {te['grad_max_abs']:.2e} absolute; "
            f"the loss within {te['loss_rtol']:.0%} at every step: "
            f"{'yes' if te['trajectory_passed'] else 'no'} (worst {te['worst_loss_relative']:.2e}).")


def band_words(doc: dict) -> str:
    s = doc["summary"]
    if s["left_band_at"] is None:
        return f"The loss stays inside the noise band at every step (worst {s['worst_step_ratio']:.2f} of the band)."
    step = doc["steps"][s["left_band_at"]]
    return (f"The loss left the noise band at step {s['left_band_at']}: gap {step['gap']:+.3e} against a band of "
            f"+-{step['band']:.3e} ({step['gap_over_floor']:+.1f} x the noise floor).")


def grads_words(doc: dict) -> str:
    s = doc["summary"]
    if not s["grads_out"]:
        return (f"Every parameter's step-0 gradient is within budget (worst {s['worst_gradient']} at "
                f"{ratio_words(s['worst_gradient_ratio'])} of its budget).")
    return (f"{len(s['grads_out'])} of {len(doc['gradients'])} parameters' step-0 gradients are out of budget: "
            f"{', '.join(s['grads_out'])} (worst {s['worst_gradient']} at {ratio_words(s['worst_gradient_ratio'])} x).")


def blocks(doc: dict) -> list[tuple]:
    """The report, verdict first."""
    rule, s = doc["rule"], doc["summary"]
    out: list[tuple[Any, ...]] = [
        ("h1", headline(doc)), ("p", doc["why"]), ("code", doc["command"]),
        ("p", f"Model: {doc['model']}. Mesh {doc['mesh']['text']}: CP groups "
              + " ".join("[" + ", ".join(map(str, g)) + "]" for g in doc["mesh"]["cp_groups"]) + "."),
        ("list", [grads_words(doc), band_words(doc), last_step_words(doc), te_words(doc)]),
        ("h2", "The rule"),
        ("list", [f"Reference: {rule['reference']}.",
                  *[f"Noise run `{n}`: {words}." for n, words in rule["noise_runs"].items()],
                  f"Gradients: {rule['gradients']}.", f"Loss: {rule['loss']}."]),
    ]
    if s.get("leave_one_out"):
        loo = s["leave_one_out"]
        out.append(("p", "Leave-one-out (each noise run judged as if it were the ring, against the others; "
                         "what k must stand above): " + "; ".join(
                             f"{n}: gradients {v['gradient_ratio']:.2f}, loss {v['loss_ratio']:.2f} of k=1"
                             for n, v in loo.items()) + "."))
    out += [("h2", "Step-0 gradients"), ("table", *gradient_table(doc)),
            ("h2", "Loss per step"), ("table", *step_table(doc)),
            ("h2", "Timing"), ("p", ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in doc["timing"].items()))]
    if doc.get("meta"):
        out.append(("p", "Run: " + ", ".join(f"{k}={v}" for k, v in doc["meta"].items())))
    return out
