"""The train report's figures, as PNG bytes for its HTML page (matplotlib on the Agg backend,
imported when the first figure is drawn: `ringcheck.render.plots.load_pyplot`).

- `loss_figure`: the loss per step of the ring and the reference with the noise band drawn
  around the reference (top), and the gap in units of the noise floor with the band's edges
  at +-k (bottom): where the ring's curve leaves the band is where the run failed;
- `gradient_figure`: each parameter's step-0 error over its budget (log axis, the limit 1 a
  dashed line, parameters over it red and named);
- `norm_figure`: the gradient norm per step, ring and reference.
"""

from __future__ import annotations

import math

from .plots import FIGURE_DPI, FIGURE_WIDTH_IN, figure_png, load_pyplot, ratio_range

_RING, _REF, _BAND, _BAD, _GOOD = "#c62828", "#1f4e9c", "#9db8e8", "#c62828", "#1a7f37"


def train_plots(doc: dict) -> list[tuple[str, bytes]]:
    """(title, PNG bytes) of every figure, in the report's order."""
    return [("Loss per step, and the gap in units of the noise floor", figure_png(loss_figure(doc), dpi=FIGURE_DPI)),
            ("Step-0 gradient error over its budget, per parameter",
             figure_png(gradient_figure(doc), dpi=FIGURE_DPI)),
            ("Gradient norm per step", figure_png(norm_figure(doc), dpi=FIGURE_DPI))]


def loss_figure(doc: dict):
    plt = load_pyplot()
    steps = doc["steps"]
    t = [s["step"] for s in steps]
    ref = [s["reference_loss"] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(FIGURE_WIDTH_IN, 6.4), sharex=True, layout="constrained",
                                      height_ratios=(3, 2))
    top.fill_between(t, [r - s["band"] for r, s in zip(ref, steps)], [r + s["band"] for r, s in zip(ref, steps)],
                     color=_BAND, alpha=0.6, linewidth=0, label=f"noise band (k = {doc['rule']['k_loss']:g})")
    for name in doc["rule"]["noise_runs"]:
        top.plot(t, [s["noise_losses"][name] for s in steps], color="#888", linewidth=0.8, alpha=0.7)
    top.plot([], [], color="#888", linewidth=0.8, label="noise runs")
    top.plot(t, ref, color=_REF, linewidth=1.5, label="reference (one device)")
    top.plot(t, [s["ring_loss"] if math.isfinite(s["ring_loss"]) else math.nan for s in steps], color=_RING,
             linewidth=1.2, linestyle="--", marker=".", markersize=4, label="ring")
    top.set_ylabel("loss", fontsize=9)
    top.legend(fontsize=8, frameon=False)
    k = doc["rule"]["k_loss"]
    gaps = [s["gap_over_floor"] if math.isfinite(s["gap_over_floor"]) else math.nan for s in steps]
    bottom.axhspan(-k, k, color=_BAND, alpha=0.6, linewidth=0)
    bottom.axhline(0, color=_REF, linewidth=1)
    bottom.plot(t, gaps, color=_RING, marker=".", markersize=4, linewidth=1)
    out = [s["step"] for s in steps if not s["in_band"]]
    if out:
        bottom.axvline(out[0], color=_BAD, linestyle=":", linewidth=1)
        bottom.annotate(f"leaves the band at step {out[0]}", (out[0], k), fontsize=8, color=_BAD,
                        xytext=(4, 4), textcoords="offset points")
    finite = [abs(g) for g in gaps if math.isfinite(g)]
    if finite and max(finite) > 20 * k:
        bottom.set_yscale("symlog", linthresh=k)
    bottom.set_ylabel("(ring - reference) / noise floor", fontsize=9)
    bottom.set_xlabel("step", fontsize=9)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    return fig


def gradient_figure(doc: dict):
    plt = load_pyplot()
    rows = doc["gradients"]
    lo, hi = ratio_range([g["ratio"] for g in rows])
    fig, ax = plt.subplots(figsize=(FIGURE_WIDTH_IN, 0.28 * len(rows) + 1.4), layout="constrained")
    ax.axvspan(1.0, hi, color=_BAD, alpha=0.06, linewidth=0)
    ax.axvline(1.0, color=_BAD, linestyle="--", linewidth=1)
    for i, g in enumerate(rows):
        x = hi if not math.isfinite(g["ratio"]) else min(max(g["ratio"], lo), hi)
        ax.barh(i, x - lo, left=lo, height=0.6, color=_GOOD if g["passed"] else _BAD)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [g["name"] for g in rows], fontsize=8)
    for label, g in zip(ax.get_yticklabels(), rows):
        label.set_color(_BAD if not g["passed"] else "#222")
    ax.set_xlabel(f"||g_ring - g_ref|| / budget (k = {doc['rule']['k_grad']:g} x the noise floor; over 1 fails)",
                  fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
    return fig


def norm_figure(doc: dict):
    plt = load_pyplot()
    steps = doc["steps"]
    t = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(FIGURE_WIDTH_IN, 2.8), layout="constrained")
    ax.plot(t, [s["reference_grad_norm"] for s in steps], color=_REF, linewidth=1.5, label="reference")
    ax.plot(t, [s["ring_grad_norm"] if math.isfinite(s["ring_grad_norm"]) else math.nan for s in steps],
            color=_RING, linestyle="--", marker=".", markersize=4, linewidth=1.2, label="ring")
    ax.set_yscale("log")
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel("gradient norm", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, frameon=False)
    return fig
