"""The reports' plots, as PNG bytes for the HTML pages (matplotlib on the Agg backend): drift's
figures (`drift_plots`) and validate's error over budget (`validate_plot`).

`drift_plots` draws three kinds of figure, each built by its own function:

- `_error_figure`: max abs error against ring size, one per backend and mode (rows: dtypes,
  columns: tensors; one colour per distribution, solid = float32 merge, dashed = round trip,
  dotted = the budget), each panel drawn by `_error_lines`;
- `_step_figure`: the per-step drift of the running output at the largest ring size, one per
  backend (rows: modes, columns: dtypes), each panel drawn by `_step_lines`;
- `_slope_figure`: the fitted slopes, one point per tensor, one panel per mode
  (`_slope_points`).

Every drift figure is `FIGURE_WIDTH_IN` inches wide at `FIGURE_DPI`: `FIGURE_WIDTH_PX` pixels,
the content width of the HTML page, shown at its own size (the page scales it down, never up).
`error_plots` are the figures the report shows right under its verdict, `detail_plots` the
rest. matplotlib is imported when the first figure is drawn (`load_pyplot`), not when ringcheck
starts.
"""

from __future__ import annotations

import io
import math

from .drift_content import (
    ACC_LABEL,
    accumulations,
    case_of,
    fit_of,
    ring_sizes,
    tensor_names,
    unit_roundoff,
)
from .markdown import tensor_words

# the drift figures' size: the HTML page's content width (`ringcheck.render.html`), at a
# resolution where 8 to 10 pt text reads at 11 to 14 px
FIGURE_DPI = 100
FIGURE_WIDTH_IN = 12.6
FIGURE_WIDTH_PX = round(FIGURE_WIDTH_IN * FIGURE_DPI)


def drift_plots(doc: dict) -> list[tuple[str, bytes]]:
    """(title, PNG bytes) of every figure of a drift document, in the report's order:
    `error_plots`, then `detail_plots`."""
    return error_plots(doc) + detail_plots(doc)


def error_plots(doc: dict) -> list[tuple[str, bytes]]:
    """(title, PNG bytes) of the error against ring size, one figure per backend and mode."""
    spec = doc["spec"]
    colours = _colours(spec["distributions"])
    return [(f"Error against ring size: {mode} ({backend})",
             figure_png(_error_figure(doc, backend, mode, colours), dpi=FIGURE_DPI))
            for backend in spec["backends"] for mode in spec["modes"]]


def detail_plots(doc: dict) -> list[tuple[str, bytes]]:
    """(title, PNG bytes) of the per-step drift at the largest P per backend (when the cases
    recorded steps), then the fitted slopes."""
    spec = doc["spec"]
    colours = _colours(spec["distributions"])
    pngs = []
    if any("steps" in c for c in doc["cases"].values()):
        pmax = ring_sizes(doc)[-1]
        for backend in spec["backends"]:
            pngs.append((f"Per-step drift at P={pmax} ({backend})",
                         figure_png(_step_figure(doc, backend, colours), dpi=FIGURE_DPI)))
    pngs.append(("Fitted slopes", figure_png(_slope_figure(doc), dpi=FIGURE_DPI)))
    return pngs


# --- matplotlib ----------------------------------------------------------------------------------


def load_pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    # imported here, not at the top: matplotlib adds about a second to the start of every
    # command, and only the HTML reports draw figures
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (start-up time, as above)

    return plt


def figure_png(fig, *, dpi: int = 80) -> bytes:
    """The figure as a PNG with a 64-colour palette (a third of the bytes of a full-colour one,
    the same to the eye), so the HTML page stays small; closes the figure."""
    # Pillow comes with matplotlib and is needed only with it: imported when a figure is drawn
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    load_pyplot().close(fig)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=64, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _colours(distributions: list[str]) -> dict:
    """One tab10 colour per distribution."""
    cmap = load_pyplot().get_cmap("tab10")
    return {d: cmap(i % 10) for i, d in enumerate(distributions)}


def _style(acc: str) -> dict:
    """Line style of an accumulation: solid = float32 merge, dashed = per-hop round trip."""
    return {"float32": dict(linestyle="-", marker="o", markersize=3),
            "input": dict(linestyle="--", marker="x", markersize=4)}.get(acc, dict(linestyle=":", marker="."))


def _log_log(ax, title: str) -> None:
    """Log2 ring sizes (or steps) against a log error, titled, light grid; call it after the
    lines are drawn (the y ticks follow the range the data span, `_log_ticks`)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _log_ticks(ax.yaxis, *ax.get_ylim())
    ax.set_title(title, fontsize=10)
    ax.tick_params(which="both", labelsize=8)
    ax.grid(True, which="major", alpha=0.3)


def _log_ticks(axis, lo: float, hi: float) -> None:
    """Ticks of a log axis from `lo` to `hi`: labelled decades (at most about six), unlabelled
    minor ticks; where fewer than two decades fall in the range (the float32 panels often
    span one or two), the 2s and 5s are labelled too (and the 3s under ~0.7 decades).
    matplotlib's own choice there labels every minor tick in a large font, crowding them."""
    # (start-up time: matplotlib is imported when the first figure is drawn, see load_pyplot)
    from matplotlib.ticker import (
        FuncFormatter,
        LogFormatterSciNotation,
        LogLocator,
        NullFormatter,
    )

    ok = 0 < lo < hi
    decades = math.log10(hi / lo) if ok else 0.0
    labelled_decades = math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) + 1 if ok else 0
    axis.set_major_locator(LogLocator(base=10, numticks=7))
    axis.set_major_formatter(LogFormatterSciNotation(base=10))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=12))
    if labelled_decades >= 2:
        axis.set_minor_formatter(NullFormatter())
        return
    labelled = (2, 3, 5) if decades < 0.7 else (2, 5)

    def minor(x: float, _pos) -> str:
        exponent = math.floor(math.log10(x) + 1e-9)
        mantissa = round(x / 10 ** exponent)
        return rf"${mantissa}\times10^{{{exponent}}}$" if mantissa in labelled else ""

    axis.set_minor_formatter(FuncFormatter(minor))


def _label_edges(ax, row: int, col: int, rows: int, *, ylabel: str, xlabel: str) -> None:
    """Axis labels on the left column and the bottom row of a grid of panels only."""
    if col == 0:
        ax.set_ylabel(ylabel, fontsize=9)
    if row == rows - 1:
        ax.set_xlabel(xlabel, fontsize=9)


def _legend(fig, colours: dict, accs: list[str], *, budget: bool) -> None:
    """Below the figure: a colour per distribution, a line style per accumulation (and the budget)."""
    plt = load_pyplot()
    handles = [plt.Line2D([], [], color=c, label=d) for d, c in colours.items()]
    handles += [plt.Line2D([], [], color="black", label=ACC_LABEL.get(a, a), **_style(a)) for a in accs]
    if budget:
        handles.append(plt.Line2D([], [], color="black", linestyle=":", linewidth=1, label="budget"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=9,
               frameon=False)


# --- error against ring size ---------------------------------------------------------------------


def _error_figure(doc: dict, backend: str, mode: str, colours: dict):
    """Max abs error against ring size of one backend and mode: rows dtypes, columns tensors,
    the page's width (`FIGURE_WIDTH_IN`)."""
    spec, tensors = doc["spec"], tensor_names(doc)
    fig, axes = load_pyplot().subplots(len(spec["dtypes"]), len(tensors), squeeze=False, layout="constrained",
                                   figsize=(FIGURE_WIDTH_IN, 2.7 * len(spec["dtypes"]) + 0.9), sharex=True)
    for i, dtype in enumerate(spec["dtypes"]):
        for j, tensor in enumerate(tensors):
            ax = axes[i][j]
            _error_lines(ax, doc, backend, mode, dtype, tensor, colours)
            _log_log(ax, f"{dtype}: {tensor}")
            _label_edges(ax, i, j, len(spec["dtypes"]), ylabel="max abs error", xlabel="ring size P")
    _legend(fig, colours, accumulations(doc), budget=True)
    fig.suptitle(f"{mode} ({backend}): max abs error against ring size", fontsize=12)
    return fig


def _error_lines(ax, doc: dict, backend: str, mode: str, dtype: str, tensor: str, colours: dict) -> None:
    """One panel: per distribution, the error of each accumulation against P, and the budget
    (of the float32 merge, dotted)."""
    accs, sizes = accumulations(doc), ring_sizes(doc)
    for dist in doc["spec"]["distributions"]:
        for a in accs:
            pts = [(p, case_of(doc, backend, mode, dtype, dist, a, p)) for p in sizes]
            pts = [(p, c["tensors"][tensor]) for p, c in pts if c]
            ax.plot([p for p, _ in pts], [m["max_abs"] for _, m in pts], color=colours[dist], **_style(a))
        ref = next((a for a in accs if a == "float32"), accs[0])
        pts = [(p, case_of(doc, backend, mode, dtype, dist, ref, p)) for p in sizes]
        ax.plot([p for p, c in pts if c], [c["tensors"][tensor]["budget"] for p, c in pts if c],
                color=colours[dist], linestyle=":", linewidth=1)


# --- per-step drift ------------------------------------------------------------------------------


def _step_figure(doc: dict, backend: str, colours: dict):
    """The running output's error after every ring step at the largest P: rows modes, columns dtypes."""
    spec, pmax = doc["spec"], ring_sizes(doc)[-1]
    fig, axes = load_pyplot().subplots(len(spec["modes"]), len(spec["dtypes"]), squeeze=False, layout="constrained",
                                   figsize=(FIGURE_WIDTH_IN, 2.6 * len(spec["modes"]) + 0.9))
    for i, mode in enumerate(spec["modes"]):
        for j, dtype in enumerate(spec["dtypes"]):
            ax = axes[i][j]
            _step_lines(ax, doc, backend, mode, dtype, pmax, colours)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            _log_log(ax, f"{mode}, {dtype}")
            _label_edges(ax, i, j, len(spec["modes"]), ylabel="out rel. error / u", xlabel="ring step (shards seen)")
    _legend(fig, colours, accumulations(doc), budget=False)
    fig.suptitle(f"Per-step drift of the running output at P={pmax} ({backend}); grey line: one u", fontsize=12)
    return fig


def _step_lines(ax, doc: dict, backend: str, mode: str, dtype: str, pmax: int, colours: dict) -> None:
    """One panel: out's relative error / u after each step, per distribution and accumulation."""
    for dist in doc["spec"]["distributions"]:
        for a in accumulations(doc):
            c = case_of(doc, backend, mode, dtype, dist, a, pmax)
            if c and "steps" in c:
                y = [max(v, 1e-12) / unit_roundoff(dtype) for v in c["steps"]["out_rel_norm"]]
                style = _style(a)
                if pmax > 16:
                    style["marker"] = None
                ax.plot(range(1, pmax + 1), y, color=colours[dist], **style)


# --- fitted slopes -------------------------------------------------------------------------------


def _slope_figure(doc: dict):
    """The fitted slope of every group, one panel per mode, with the flag and random-walk lines."""
    plt = load_pyplot()
    spec = doc["spec"]
    fig, axes = plt.subplots(1, len(spec["modes"]), squeeze=False, figsize=(FIGURE_WIDTH_IN, 4.4),
                             sharey=True, layout="constrained")
    labels = [f"{d}\n{dist}" for d in spec["dtypes"] for dist in spec["distributions"]]
    for k, mode in enumerate(spec["modes"]):
        ax = axes[0][k]
        _slope_points(ax, doc, mode)
        ax.axhline(0.8, color="tab:red", linewidth=0.8, linestyle="--")
        ax.axhline(0.25, color="tab:orange", linewidth=0.8, linestyle="--")
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title(mode, fontsize=10)
        if k == 0:
            ax.set_ylabel("slope of ln(rel. error) on ln(P)", fontsize=9)
    handles = [plt.Line2D([], [], linestyle="", label=ACC_LABEL.get(a, a), **_acc_mark(a)) for a in accumulations(doc)]
    handles += [plt.Line2D([], [], color="tab:orange", linestyle="--", label="flag, bf16/fp16 outputs (0.25)"),
                plt.Line2D([], [], color="tab:red", linestyle="--", label="flag, float32 outputs and lse (0.8)"),
                plt.Line2D([], [], color="grey", linestyle=":", label="random walk (0.5)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle("Fitted slopes, one point per tensor", fontsize=12)
    return fig


def _acc_mark(acc: str) -> dict:
    """Marker and colour of an accumulation's points: our merge, the control, any --impl."""
    return {"float32": {"marker": "o", "color": "tab:blue"}, "input": {"marker": "x", "color": "tab:red"},
            }.get(acc, {"marker": "o", "color": "tab:green"})


def _slope_points(ax, doc: dict, mode: str) -> None:
    """One panel: a point per (dtype, distribution) column, accumulation, backend and tensor."""
    spec, accs, tensors = doc["spec"], accumulations(doc), tensor_names(doc)
    for x, (dtype, dist) in enumerate((d, dist) for d in spec["dtypes"] for dist in spec["distributions"]):
        for ai, a in enumerate(accs):
            for backend in spec["backends"]:
                for t in tensors:
                    fit = fit_of(doc, backend, mode, dtype, dist, a, t)
                    if fit and fit["slope"] is not None:
                        mark = _acc_mark(a)
                        ax.scatter(x + (ai - (len(accs) - 1) / 2) * 0.25, fit["slope"], s=14, marker=mark["marker"],
                                   color=mark["color"], edgecolors="none" if mark["marker"] == "o" else None)


# --- validate: error over budget -----------------------------------------------------------------

_TENSOR_MARKERS = {"out": "o", "lse": "s", "dq": "^", "dk": "D", "dv": "v"}
_GOOD, _BAD = "#1a7f37", "#c62828"


def validate_plot(doc: dict) -> bytes | None:
    """PNG bytes of validate's error / budget per check (rows) and tensor (a marker each, side
    by side within the row) on a log axis, the limit 1.0 a dashed line, points over it red;
    the failing tensors of a row are named once, in a column right of the plot ("dk 128x  dv
    91x", as the table writes them), so labels never crowd the points. The legend shows the
    tensors' shapes in grey and the verdicts as colour swatches (not markers). None when no
    check has per-tensor results. Checks without tensors (NaN/Inf, determinism, information
    rows) are left out: they have no error over a budget to place."""
    fig = validate_figure(doc)
    return None if fig is None else figure_png(fig)


def validate_figure(doc: dict):
    """The matplotlib figure of `validate_plot` (None without per-tensor results)."""
    rows = [c for c in doc["checks"] if c.get("tensors")]
    if not rows:
        return None
    plt = load_pyplot()
    # (start-up time: matplotlib is imported when the first figure is drawn, see load_pyplot)
    from matplotlib.patches import Patch

    lo, hi = ratio_range([t["ratio"] for c in rows for t in c["tensors"].values()])
    fig, ax = plt.subplots(figsize=(13, 0.4 * len(rows) + 1.7), layout="constrained")
    ax.axvspan(1.0, hi, color=_BAD, alpha=0.06, linewidth=0)
    ax.axvline(1.0, color=_BAD, linestyle="--", linewidth=1)
    for i, row in enumerate(rows):
        if i % 2:
            ax.axhspan(i - 0.5, i + 0.5, color="black", alpha=0.035, linewidth=0)
        names = list(row["tensors"])
        for k, name in enumerate(names):
            t = row["tensors"][name]
            y = i + (k - (len(names) - 1) / 2) * 0.2
            ratio = t["ratio"]
            x = hi if not math.isfinite(ratio) else min(max(ratio, lo), hi)
            ax.scatter(x, y, marker=_TENSOR_MARKERS.get(name, "P"), s=30, color=_GOOD if t["passed"] else _BAD,
                       zorder=3, edgecolors="none")
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    _log_ticks(ax.xaxis, lo, hi)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [" ".join(c["check"].split()) for c in rows], fontsize=8.5)
    for label, row in zip(ax.get_yticklabels(), rows):
        label.set_color(_BAD if row["status"] == "fail" else "#222")
    failing = ax.secondary_yaxis("right")  # the failing tensors of each row, named once
    failing.set_yticks(range(len(rows)), ["  ".join(tensor_words({n: t}) for n, t in c["tensors"].items()
                                                    if not t["passed"] or not math.isfinite(t["ratio"]))
                                          for c in rows], fontsize=8.5, color=_BAD)
    failing.tick_params(length=0)
    ax.tick_params(axis="x", which="both", labelsize=8)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ax.set_xlabel("worst error / budget (log; over 1 fails)", fontsize=9)
    handles = [plt.Line2D([], [], color="#555", marker=m, linestyle="", label=n)
               for n, m in _TENSOR_MARKERS.items() if any(n in c["tensors"] for c in rows)]
    verdicts = {t["passed"] for c in rows for t in c["tensors"].values()}
    handles += [Patch(facecolor=_GOOD if ok else _BAD, edgecolor="none",
                      label="colour: within budget" if ok else "colour: over budget")
                for ok in (True, False) if ok in verdicts]
    handles.append(plt.Line2D([], [], color=_BAD, linestyle="--", label="limit: error = budget"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8.5, frameon=False)
    fig.suptitle("Error over budget per check and tensor (failing tensors named on the right)", fontsize=11)
    return fig


def ratio_range(ratios: list[float]) -> tuple[float, float]:
    """The x range of the error / budget plot: the finite positive ratios with a margin, and
    always 0.1 to 10 around the limit (zeros sit at the left edge, NaN/Inf at the right)."""
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    lo = min([0.1, *finite]) / 2
    hi = max([10.0, *finite]) * 3  # a margin right of the rightmost point (the names stand outside the axes)
    return max(lo, 1e-30), hi
