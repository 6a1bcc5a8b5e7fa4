"""Presentation: the only layer that imports rich and matplotlib (Agg, imported when a plot
is drawn).

- validate: `check_rows_table`, `print_check_rows`;
- drift: `print_drift_summary` (terminal), `drift_markdown`, `drift_html` (self-contained, with
  `drift_plots` as embedded PNGs), `write_drift_reports`, `drift_progress`, `print_drift_diff`.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ..documents import save


def check_rows_table(rows, *, title: str = "ringcheck validate") -> Table:
    table = Table(title=title)
    for name, justify in (("check", "left"), ("verdict", "left"), ("error", "right"), ("budget", "right"),
                          ("err/budget", "right"), ("detail", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    colours = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "info": "[cyan]info[/]"}
    for r in rows:
        ratio = f"{r.error / r.budget:.2f}" if (r.error is not None and r.budget) else ""
        table.add_row(r.check, colours.get(r.status, r.status), "" if r.error is None else f"{r.error:.2e}",
                      "" if r.budget is None else f"{r.budget:.2e}", ratio, r.detail if r.status == "fail" else
                      (r.detail if r.status == "info" else ""))
    return table


def print_check_rows(rows, passed: bool, console: Console | None = None) -> None:
    console = console or Console()
    console.print(check_rows_table(rows))
    failed = [r for r in rows if r.status == "fail"]
    if failed:
        console.print(f"[bold red]FAILED[/]: {len(failed)} of {len(rows)} checks")
    else:
        console.print("[bold green]PASSED[/]: every check within budget")

# --- drift reports ---------------------------------------------------------------------------------
# The drift document (`ringcheck.commands.drift`) is rendered from one list of content blocks, so the
# Markdown and the HTML say the same things; the HTML adds the plots, the terminal a summary.


ACC_LABEL = {"float32": "float32 merge (default)", "input": "per-hop round trip (control)"}
ACC_NAME = {"float32": "float32 merge, the default", "input": "per-hop round trip in the input dtype"}
ACC_SHORT = {"float32": "f32 merge", "input": "round trip"}


def _e(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def _f(x, digits: int = 2, sign: bool = False) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _slope(fit: dict) -> str:
    if fit["slope"] is None:
        return "n/a"
    se = f" ± {fit['slope_stderr']:.2f}" if fit["slope_stderr"] is not None else ""
    return f"{fit['slope']:+.2f}{se}"


def _projected(x) -> str:
    if x is None:
        return "never"
    if math.isinf(x) or x > 1e6:
        return "> 1e6"
    return f"~{x:,.0f}"


def _u(dtype: str) -> float:
    return {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]


def _settings(doc: dict) -> list[tuple[str, str, str, str]]:
    """(backend, mode, dtype, distribution) in sweep order."""
    spec = doc["spec"]
    return [(b, m, d, dist) for b in spec["backends"] for m in spec["modes"] for d in spec["dtypes"]
            for dist in spec["distributions"]]


def _accumulations(doc: dict) -> list[str]:
    return [a for a in doc["spec"]["accumulations"] if a in doc["summary"]["accumulations"]]


def _fit(doc, backend, mode, dtype, dist, acc, tensor):
    return doc["fits"].get("/".join((doc["implementation"], backend, mode, dtype, dist, f"acc={acc}", tensor)))


def _case(doc, backend, mode, dtype, dist, acc, p):
    return doc["cases"].get("/".join((doc["implementation"], backend, mode, dtype, dist, f"acc={acc}", f"P={p}")))


def _sizes(doc: dict) -> list[int]:
    return sorted({c["P"] for c in doc["cases"].values()})


def _tensors(doc: dict) -> list[str]:
    first = next(iter(doc["cases"].values()))
    return list(first["tensors"])


def _verdict_lines(doc: dict) -> list[tuple[str, str]]:
    """(style, text) lines: the verdict on the ring under test, then the control, then the
    separation of the two."""
    s = doc["summary"]
    lines = []
    for acc, a in s["accumulations"].items():
        flags = ", ".join(f"{k}: {v}" for k, v in a["flags"].items() if v) or "none"
        slope = "n/a" if a["max_slope"] is None else f"{a['max_slope']:+.2f}"
        what = ACC_NAME.get(acc, acc)
        if acc == s["under_test"]:
            if a["flagged"]:
                groups = [f for f in doc["fits"].values() if f["accumulation"] == acc and f["flags"]]
                named = "; ".join(_flagged_group(f) for f in groups[:6]) + ("; ..." if len(groups) > 6 else "")
                lines.append(("bad", f"FLAGGED: the ring under test ({what}) is flagged in {a['flagged']} of "
                                     f"{a['groups']} groups ({flags}); largest slope {slope}: {named}"))
            else:
                lines.append(("good", f"PASS: the ring under test ({what}) raises no flag in {a['groups']} "
                                      f"groups (mode x dtype x distribution x tensor); largest slope {slope}"))
        else:
            lines.append(("info", f"Control ({what}): flagged in {a['flagged']} of {a['groups']} groups "
                                  f"({flags}); largest slope {slope}"))
    rows = [r for r in s["settings"].values() if r["separated"] is not None]
    if rows:
        sep = [r for r in rows if r["separated"]]
        not_sep = [r for r in rows if not r["separated"]]
        text = (f"Separation: the flags tell the default ring from the per-hop round trip in {len(sep)} of "
                f"{len(rows)} settings (mode x dtype x distribution; float32 inputs left out: a round "
                "trip through float32 costs no more than float32 accumulation)")
        if not_sep:
            text += "; not in " + ", ".join(f"{r['mode']}/{r['dtype']}/{r['distribution']}" for r in not_sep)
        lines.append(("info", text))
    return lines


def _flagged_group(fit: dict) -> str:
    text = f"{fit['mode']}/{fit['dtype']}/{fit['distribution']}/{fit['tensor']} {', '.join(fit['flags'])}"
    if fit["over_budget_at"]:
        text += f" at P={', '.join(map(str, fit['over_budget_at']))}"
        if 1 in fit["over_budget_at"]:
            text += " (over budget at P=1 too, where no ring step runs: the block kernel against the peer)"
    return text + f", slope {_f(fit['slope'], 2, sign=True)}"


def _worst_cases(doc: dict, n: int = 12) -> list[tuple[dict, str, dict]]:
    rows = [(c, t, m) for c in doc["cases"].values() for t, m in c["tensors"].items()]
    rows.sort(key=lambda r: (-r[2]["budget_ratio"] if math.isfinite(r[2]["budget_ratio"]) else -math.inf,
                             r[0]["mode"], r[0]["dtype"], r[0]["distribution"], r[0]["P"], r[1]))
    return rows[:n]


WORST_HEADERS = ["accumulation", "mode", "dtype", "distribution", "P", "tensor", "max abs error",
                 "peer error", "err / budget", "max ULP", "rel / u", "mean signed", "verdict"]
WORST_SHORT = ["acc", "mode", "dtype", "dist", "P", "tensor", "error", "peer", "err/budget", "rel/u", "verdict"]


def _worst_row(c: dict, t: str, m: dict) -> list[str]:
    return [ACC_SHORT.get(c["accumulation"], c["accumulation"]), c["mode"], c["dtype"], c["distribution"],
            str(c["P"]), t, _e(m["max_abs"]), _e(m["peer_max_abs"]), _f(m["budget_ratio"]),
            _f(m["max_ulp"], 1), _f(m["rel_over_u"], 2), _e(m["mean_signed"]),
            "pass" if m["passed"] else "OVER"]


def _separation_headers(doc: dict) -> list[str]:
    accs = _accumulations(doc)
    return (["mode", "dtype", "distribution"] + [f"flagged: {ACC_SHORT.get(a, a)}" for a in accs]
            + ["separated"] + [f"out slope: {ACC_SHORT.get(a, a)}" for a in accs]
            + [f"out projected P: {ACC_SHORT.get(a, a)}" for a in accs])


def _separation_rows(doc: dict) -> list[list[str]]:
    rows = []
    accs = _accumulations(doc)
    for r in doc["summary"]["settings"].values():
        cells = [r["mode"], r["dtype"], r["distribution"]]
        for acc in accs:
            flagged = r["flagged"].get(acc, [])
            cells.append(", ".join(flagged) if flagged else "-")
        if r["separated"] is None:
            cells.append("n/a (float32)" if r["dtype"] == "float32" else "n/a")
        else:
            cells.append("yes" if r["separated"] else "no")
        cells += [_f(r["out_slope"].get(a), 2, sign=True) for a in accs]
        cells += [_projected(r["out_projected_budget_P"].get(a)) for a in accs]
        rows.append(cells)
    return rows


def _blocks(doc: dict) -> list[tuple]:
    """The content of the Markdown and HTML reports, as blocks."""
    spec, meta = doc["spec"], doc.get("meta", {})
    accs = _accumulations(doc)
    sizes = _sizes(doc)
    b: list[tuple] = [("h1", "ringcheck drift report")]
    if meta.get("command"):
        b.append(("p", "Produced by this command, run from the repository root (installed with `pip install -e .`; "
                       "or run `PYTHONPATH=. python -m ringcheck ...`). The same command on the same machine "
                       "writes the same JSON bit for bit, everything but `meta`; check with `ringcheck report "
                       "diff --exact OLD.json NEW.json`."))
        b.append(("code", meta["command"]))
    shape = (f"batch={spec['batch']}, heads={spec['heads']}/{spec['kv_heads']} (q/kv), "
             f"head_dim={spec['head_dim']}, "
             + (f"tokens per rank={spec['tokens_per_rank']} (seq_len = P x {spec['tokens_per_rank']})"
                if spec["tokens_per_rank"] is not None else f"seq_len={spec['seq_len']} for every P")
             + (f", softmax_scale={spec['softmax_scale']}" if spec["softmax_scale"] is not None else ""))
    b.append(("p", f"Implementation `{doc['implementation']}`; backends {', '.join(spec['backends'])}; "
                   f"dtypes {', '.join(spec['dtypes'])}; ring sizes {', '.join(map(str, sizes))}; distributions "
                   f"{', '.join(spec['distributions'])}; modes {', '.join(spec['modes'])}; accumulations "
                   f"{', '.join(ACC_LABEL.get(a, a) for a in accs)}; {spec['seeds']} seeds; {shape}."))
    b.append(("h2", "Verdict"))
    b.append(("list", [text for _, text in _verdict_lines(doc)]))
    b.append(("h2", "How to read it"))
    r = doc["rules"]
    b.append(("list", [f"Model: {r['fit']}.", f"Expected: {r['expected']}.", f"Diagnosis: {r['diagnosis']}.",
                       f"Slope {r['slope']}.", f"Budget {r['budget']}.", f"Bias {r['bias']}.",
                       f"Non-finite {r['nonfinite']}.", f"Projected P: {r['projected']}.",
                       "The float32 merge is the ring under test (the exit code follows it); the per-hop "
                       "round trip rounds the running output to the input dtype after every merge and is "
                       "the control that shows what the flags see. For float32 inputs the round trip "
                       "goes through float32 itself and costs no more than the accumulation, so the two "
                       "coincide there up to float32 rounding.",
                       f"Metrics {r['metrics']}."]))
    b.append(("h2", "Separation per setting"))
    b.append(("p", "Tensors flagged in each setting, per accumulation; separated = the default ring has no "
                   "flag and the control has at least one. Then the fitted slope of `out` per accumulation "
                   "and the ring size where its error is projected to reach the budget: where the flags do "
                   "not separate the two, the slopes may (flat against sqrt-like)."))
    b.append(("table", _separation_headers(doc), _separation_rows(doc)))
    b.append(("h2", "Slopes of error against ring size"))
    b.append(("p", "Slope of ln(normwise relative error) on ln(P), P >= 2, ± its standard error; diagnosis; "
                   "largest error / budget over P; the projected P where error reaches the budget; flags."))
    headers = ["mode", "dtype", "distribution", "tensor"]
    for a in accs:
        s = ACC_SHORT.get(a, a)
        headers += [f"slope ({s})", f"max err/budget ({s})", f"projected P ({s})", f"flags ({s})"]
    rows = []
    for backend, mode, dtype, dist in _settings(doc):
        for t in _tensors(doc):
            row = [mode, dtype, dist, t]
            for a in accs:
                fit = _fit(doc, backend, mode, dtype, dist, a, t)
                row += ([f"{_slope(fit)} {fit['diagnosis']}", _f(fit["max_budget_ratio"]),
                         _projected(fit["projected_budget_P"]), ", ".join(fit["flags"]) or "-"]
                        if fit else ["n/a"] * 4)
            rows.append(row)
    b.append(("table", headers, rows))
    b.append(("h2", "Worst cases"))
    b.append(("p", "By error / budget (worst seed), over every case and tensor."))
    b.append(("table", WORST_HEADERS, [_worst_row(*w) for w in _worst_cases(doc, 15)]))
    b.append(("h2", "Error against ring size"))
    b.append(("p", "out: normwise relative error in units of u of the dtype (geometric mean over seeds); "
                   "then the largest error / budget over the five tensors (worst seed)."))
    p_head = [f"P={p}" for p in sizes]
    rel_rows, ratio_rows = [], []
    for backend, mode, dtype, dist in _settings(doc):
        for a in accs:
            cases = [_case(doc, backend, mode, dtype, dist, a, p) for p in sizes]
            label = [mode, dtype, dist, ACC_SHORT.get(a, a)]
            rel_rows.append(label + [_f(c["tensors"]["out"]["rel_norm"] / _u(dtype)) if c else "" for c in cases])
            ratio_rows.append(label + [_f(max(m["budget_ratio"] for m in c["tensors"].values())) if c else ""
                                       for c in cases])
    b.append(("h3", "out: relative error / u"))
    b.append(("table", ["mode", "dtype", "distribution", "accumulation"] + p_head, rel_rows))
    b.append(("h3", "all tensors: max error / budget"))
    b.append(("table", ["mode", "dtype", "distribution", "accumulation"] + p_head, ratio_rows))
    pmax = sizes[-1]
    if any("steps" in c for c in doc["cases"].values()):
        b.append(("h2", f"Per-step drift at P={pmax}"))
        b.append(("p", "The running float32 partial output of every rank after ring step s (s shards seen) "
                       "against the float64 attention over the keys seen so far: normwise relative error "
                       "in units of u of the dtype, over all ranks (geometric mean over seeds). The float32 "
                       "merge stays far below one rounding until the final cast; the round trip adds one "
                       "rounding per hop."))
        steps = sorted({1, 2, pmax} | {2 ** i for i in range(pmax.bit_length()) if 2 ** i <= pmax})
        rows = []
        for backend, mode, dtype, dist in _settings(doc):
            for a in accs:
                c = _case(doc, backend, mode, dtype, dist, a, pmax)
                if c and "steps" in c:
                    rows.append([mode, dtype, dist, ACC_SHORT.get(a, a)]
                                + [_e(c["steps"]["out_rel_norm"][s - 1] / _u(dtype)) for s in steps])
        b.append(("table", ["mode", "dtype", "distribution", "accumulation"] + [f"s={s}" for s in steps], rows))
    b.append(("plots",))
    if meta:
        b.append(("h2", "Run"))
        b.append(("list", [f"{k}: {v}" for k, v in meta.items() if k != "command"]))
    return b


def _md_cell(x: str) -> str:
    return str(x).replace("|", "\\|")


def drift_markdown(doc: dict) -> str:
    out = []
    for block in _blocks(doc):
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "code":
            out.append("```bash\n" + block[1] + "\n```")
        elif kind == "list":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            headers, rows = block[1], block[2]
            lines = ["| " + " | ".join(map(_md_cell, headers)) + " |",
                     "|" + "|".join("---" for _ in headers) + "|"]
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "plots":
            out.append("Plots (error against ring size per dtype with the budget drawn in, per-step drift, "
                       "slopes): see `drift.html` next to this file.")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


_CSS = """body{font-family:system-ui,sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f2f2f2}td:nth-child(-n+4){text-align:left}pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}.good{color:#1a7f37}.bad{color:#c62828}
li{margin:.2em 0}"""


def drift_html(doc: dict, *, plots: bool = True) -> str:
    """A self-contained HTML page: the report's text and tables, and the plots as embedded PNGs."""
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>ringcheck drift report</title>",
             f"<style>{_CSS}</style></head><body>"]
    verdict_style = {text: style for style, text in _verdict_lines(doc)}
    for block in _blocks(doc):
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline_html(block[1])}</p>")
        elif kind == "code":
            parts.append(f"<pre><code>{html.escape(block[1])}</code></pre>")
        elif kind == "list":
            items = "".join(f"<li class='{verdict_style.get(i, '')}'>{_inline_html(i)}</li>" for i in block[1])
            parts.append(f"<ul>{items}</ul>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                           for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "plots" and plots:
            parts.append("<h2>Plots</h2>")
            for title, png in drift_plots(doc):
                data = base64.b64encode(png).decode("ascii")
                parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' "
                             f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --- plots (matplotlib, Agg) ----------------------------------------------------------------------


def _figure_png(fig) -> bytes:
    """The figure as a PNG with a 64-colour palette (a third of the bytes of a full-colour one,
    the same to the eye), so the HTML page stays small."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None})
    plt.close(fig)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=64, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _style(acc: str) -> dict:
    return {"float32": dict(linestyle="-", marker="o", markersize=3),
            "input": dict(linestyle="--", marker="x", markersize=4)}.get(acc, dict(linestyle=":", marker="."))


def drift_plots(doc: dict) -> list[tuple[str, bytes]]:
    """(title, PNG bytes): error against ring size per mode (rows: tensors, columns: dtypes;
    one colour per distribution, solid = float32 merge, dashed = round trip, dotted = the
    budget); the per-step drift at the largest P; the fitted slopes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = doc["spec"]
    accs, sizes, tensors = _accumulations(doc), _sizes(doc), _tensors(doc)
    colours = {d: plt.get_cmap("tab10")(i % 10) for i, d in enumerate(spec["distributions"])}
    pngs = []
    for backend in spec["backends"]:
        for mode in spec["modes"]:
            fig, axes = plt.subplots(len(tensors), len(spec["dtypes"]), squeeze=False, layout="constrained",
                                     figsize=(4.4 * len(spec["dtypes"]), 2.4 * len(tensors) + 0.6), sharex=True)
            for j, dtype in enumerate(spec["dtypes"]):
                for i, t in enumerate(tensors):
                    ax = axes[i][j]
                    for dist in spec["distributions"]:
                        for a in accs:
                            pts = [(p, _case(doc, backend, mode, dtype, dist, a, p)) for p in sizes]
                            pts = [(p, c["tensors"][t]) for p, c in pts if c]
                            ax.plot([p for p, _ in pts], [m["max_abs"] for _, m in pts], color=colours[dist],
                                    **_style(a))
                        ref = next((a for a in accs if a == "float32"), accs[0])
                        pts = [(p, _case(doc, backend, mode, dtype, dist, ref, p)) for p in sizes]
                        ax.plot([p for p, c in pts if c], [c["tensors"][t]["budget"] for p, c in pts if c],
                                color=colours[dist], linestyle=":", linewidth=1)
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_title(f"{dtype}: {t}", fontsize=9)
                    ax.tick_params(labelsize=7)
                    ax.grid(True, which="major", alpha=0.3)
                    if j == 0:
                        ax.set_ylabel("max abs error", fontsize=8)
                    if i == len(tensors) - 1:
                        ax.set_xlabel("ring size P", fontsize=8)
            _legend(fig, colours, accs, budget=True)
            fig.suptitle(f"{mode} ({backend}): max abs error against ring size", fontsize=11)
            pngs.append((f"Error against ring size: {mode} ({backend})", _figure_png(fig)))
    pmax = sizes[-1]
    if any("steps" in c for c in doc["cases"].values()):
        for backend in spec["backends"]:
            fig, axes = plt.subplots(len(spec["modes"]), len(spec["dtypes"]), squeeze=False, layout="constrained",
                                     figsize=(4.4 * len(spec["dtypes"]), 2.6 * len(spec["modes"]) + 0.6))
            for i, mode in enumerate(spec["modes"]):
                for j, dtype in enumerate(spec["dtypes"]):
                    ax = axes[i][j]
                    for dist in spec["distributions"]:
                        for a in accs:
                            c = _case(doc, backend, mode, dtype, dist, a, pmax)
                            if c and "steps" in c:
                                y = [max(v, 1e-12) / _u(dtype) for v in c["steps"]["out_rel_norm"]]
                                style = _style(a)
                                if pmax > 16:
                                    style["marker"] = None
                                ax.plot(range(1, pmax + 1), y, color=colours[dist], **style)
                    ax.axhline(1.0, color="grey", linewidth=0.8)
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_title(f"{mode}, {dtype}", fontsize=9)
                    ax.tick_params(labelsize=7)
                    ax.grid(True, alpha=0.3)
                    if j == 0:
                        ax.set_ylabel("out rel. error / u", fontsize=8)
                    if i == len(spec["modes"]) - 1:
                        ax.set_xlabel("ring step (shards seen)", fontsize=8)
            _legend(fig, colours, accs, budget=False)
            fig.suptitle(f"Per-step drift of the running output at P={pmax} ({backend}); grey line: one u",
                         fontsize=11)
            pngs.append((f"Per-step drift at P={pmax} ({backend})", _figure_png(fig)))
    fig, axes = plt.subplots(1, len(spec["modes"]), squeeze=False, figsize=(4.4 * len(spec["modes"]), 4.0),
                             sharey=True, layout="constrained")
    labels = [f"{d}\n{dist}" for d in spec["dtypes"] for dist in spec["distributions"]]
    for k, mode in enumerate(spec["modes"]):
        ax = axes[0][k]
        for x, (dtype, dist) in enumerate((d, dist) for d in spec["dtypes"] for dist in spec["distributions"]):
            for ai, a in enumerate(accs):
                for backend in spec["backends"]:
                    for t in tensors:
                        fit = _fit(doc, backend, mode, dtype, dist, a, t)
                        if fit and fit["slope"] is not None:
                            ax.scatter(x + (ai - (len(accs) - 1) / 2) * 0.25, fit["slope"], s=14,
                                       marker="o" if a == "float32" else "x",
                                       color="tab:blue" if a == "float32" else "tab:red",
                                       edgecolors="none" if a == "float32" else None)
        ax.axhline(0.8, color="tab:red", linewidth=0.8, linestyle="--")
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(mode, fontsize=9)
        if k == 0:
            ax.set_ylabel("slope of ln(rel. error) on ln(P)", fontsize=8)
    handles = [plt.Line2D([], [], color="tab:blue", marker="o", linestyle="", label=ACC_LABEL["float32"]),
               plt.Line2D([], [], color="tab:red", marker="x", linestyle="", label=ACC_LABEL["input"]),
               plt.Line2D([], [], color="tab:red", linestyle="--", label="slope flag (0.8)"),
               plt.Line2D([], [], color="grey", linestyle=":", label="random walk (0.5)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Fitted slopes, one point per tensor", fontsize=11)
    pngs.append(("Fitted slopes", _figure_png(fig)))
    return pngs


def _legend(fig, colours: dict, accs: list[str], *, budget: bool) -> None:
    import matplotlib.pyplot as plt

    handles = [plt.Line2D([], [], color=c, label=d) for d, c in colours.items()]
    handles += [plt.Line2D([], [], color="black", label=ACC_LABEL.get(a, a), **_style(a)) for a in accs]
    if budget:
        handles.append(plt.Line2D([], [], color="black", linestyle=":", linewidth=1, label="budget"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)


# --- terminal -----------------------------------------------------------------------------------------


@contextmanager
def drift_progress(total: int, console: Console | None = None):
    """A rich progress bar; yields the callback `run_drift` takes."""
    console = console or Console()
    with Progress(TextColumn("drift"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.description}"), console=console) as bar:
        task = bar.add_task("", total=total)
        yield lambda description: bar.update(task, advance=1, description=description)


def print_drift_summary(doc: dict, console: Console | None = None, *, worst: int = 10) -> None:
    """Verdict first, then the separation per setting, then the worst cases."""
    console = console or Console()
    colour = {"good": "bold green", "bad": "bold red", "info": ""}
    for style, text in _verdict_lines(doc):
        console.print(text, style=colour[style], highlight=False)
    accs = _accumulations(doc)
    if len(accs) > 1:
        table = Table(title="flagged tensors per setting, and the slope of out")
        keep = [i for i, h in enumerate(_separation_headers(doc)) if not h.startswith("out projected")]
        for i in keep:
            table.add_column(_separation_headers(doc)[i].replace("flagged: ", "").replace("out slope: ", "slope "))
        for row in _separation_rows(doc):
            table.add_row(*[row[i] for i in keep])
        console.print(table)
    table = Table(title=f"worst {worst} cases by error / budget")
    for h in WORST_SHORT:
        table.add_column(h, justify="left" if h in ("acc", "mode", "dtype", "dist", "tensor") else "right",
                         no_wrap=True)
    for c, t, m in _worst_cases(doc, worst):
        cells = _worst_row(c, t, m)
        del cells[WORST_HEADERS.index("mean signed")], cells[WORST_HEADERS.index("max ULP")]
        cells[-1] = "[green]pass[/]" if m["passed"] else "[red]OVER[/]"
        table.add_row(*cells)
    console.print(table)


def print_drift_diff(diff, console: Console | None = None, *, limit: int = 40) -> None:
    """What got worse from A to B (then what got better, and what only one report has)."""
    console = console or Console()
    if diff.identical:
        console.print("[bold green]identical[/]: the two reports agree on everything but meta")
        return
    if diff.worse:
        console.print(f"[bold red]WORSE[/]: {len(diff.worse)} changes (error ratio > {diff.threshold:g}, "
                      f"new budget failures, new flags, slopes up by > {diff.slope_rise:g})")
        table = Table()
        for h in ("kind", "where", "change"):
            table.add_column(h)
        for ch in diff.worse[:limit]:
            table.add_row(ch.kind, ch.key, ch.describe().removeprefix(ch.key).strip(), )
        console.print(table)
        if len(diff.worse) > limit:
            console.print(f"... and {len(diff.worse) - limit} more")
    else:
        console.print(f"[bold green]nothing got worse[/] (error ratio threshold {diff.threshold:g}, "
                      f"slope rise {diff.slope_rise:g})")
    if diff.better:
        examples = "; ".join(ch.describe() for ch in diff.better[:3])
        console.print(f"better: {len(diff.better)} changes, e.g. {examples}", highlight=False)
    for side, keys in (("A", diff.only_in_a), ("B", diff.only_in_b)):
        if keys:
            console.print(f"only in {side} (not compared): {len(keys)} keys, e.g. {', '.join(keys[:3])}",
                          highlight=False)


def write_drift_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """drift.json, drift.md and drift.html in `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": save(doc, out / "drift.json"), "md": out / "drift.md", "html": out / "drift.html"}
    paths["md"].write_text(drift_markdown(doc), encoding="utf-8")
    paths["html"].write_text(drift_html(doc), encoding="utf-8")
    return paths


# ------------------------------------------------------------------------------ ringcheck bench
# Presentation of `ringcheck.commands.bench` documents (the measurement lives there).

def _bench_s(x) -> str:
    return "n/a" if x is None else (f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s")


def _bench_err(errors: dict | None) -> str:
    if not errors:
        return ""
    return " ".join(f"{k} {v:.1e}" for k, v in errors.items())


def print_bench(doc: dict, console: Console | None = None) -> None:
    """The tables of a `ringcheck bench` document, one per section present."""
    console = console or Console()
    meta = doc.get("meta", {})
    console.print(f"[bold]ringcheck bench[/] on {meta.get('machine')} ({meta.get('cpu')}, {meta.get('cores')} cores), "
                  f"torch {meta.get('torch')}, ring over {meta.get('ring_backend')}; load {meta.get('load_1_5_15')}; "
                  f"ring workers {meta.get('worker_threads')} thread each, parent {meta.get('parent_threads')} threads",
                  highlight=False)
    if "speed" in doc:
        table = Table(title="speed: median time, ratio to the fastest peer ring of the same case "
                            "(< 1 faster), max abs error vs float64")
        for h in ("case", "system", "layout", "thr", "median", "ratio", "errors vs float64"):
            table.add_column(h, justify="right" if h in ("thr", "median", "ratio") else "left")
        last = None
        for r in doc["speed"]:
            case = r["key"] if r["key"] != last else ""
            if r["key"] != last and last is not None:
                table.add_section()
            last = r["key"]
            ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
            if ratio and r.get("fastest_peer") not in ("torch_cp", "ring_attention_pytorch"):
                ratio += "*"  # no peer ring ran this case: the ratio is to the fastest system
            if r.get("ratio") is not None and r["system"] == "ringcheck":
                ratio = f"[{'green' if r['ratio'] <= 1.0 else 'red'}]{ratio}[/]"
            table.add_row(case, r["system"], str(r.get("layout")), str(r.get("threads", "")),
                          _bench_s(r.get("median_s")), ratio,
                          _bench_err(r.get("errors")) if r.get("median_s") is not None else f"n/a: {r.get('na')}")
        console.print(table)
        console.print("* no peer ring ran this case: ratio to the fastest system of the case", highlight=False)
    if "overlap" in doc:
        table = Table(title="overlap: our ring distributed / the same loops without communication (1.0 = hidden)")
        for h in ("case", "K/V bytes per hop", "distributed", "no comm", "efficiency"):
            table.add_column(h, justify="left" if h == "case" else "right")
        for r in doc["overlap"]:
            table.add_row(r["key"], f"{r['bytes_per_step'] / 2 ** 20:.2f} MiB", _bench_s(r["distributed_s"]),
                          _bench_s(r["no_comm_s"]), f"{r['efficiency']:.2f}")
        console.print(table)
    if "balance" in doc:
        table = Table(title="load balance (causal): per-rank max / mean of unmasked scores and of forward compute time")
        for h in ("P", "layout", "tokens", "work max/mean", "time max/mean", "per-rank time"):
            table.add_column(h, justify="left" if h in ("layout", "per-rank time") else "right")
        for r in doc["balance"]:
            work = r["work_max_over_mean"]
            mark = "green" if r["layout"] == "contiguous" or work <= 1.05 else "red"
            table.add_row(str(r["ring_size"]), r["layout"], str(r["tokens"]), f"[{mark}]{work:.3f}[/]",
                          f"{r['time_max_over_mean']:.2f}", " ".join(f"{t * 1e3:.1f}" for t in r["time_s"]) + " ms")
        console.print(table)
    if "memory" in doc:
        mem = doc["memory"]
        table = Table(title="memory: peak RSS growth per rank during one call (MiB) vs tokens per rank")
        sizes = sorted({r["tokens_per_rank"] for r in mem["rows"]})
        for h in ("system", "mode", "pass", *[str(n) for n in sizes], "slope", "slope (upper half)"):
            table.add_column(h, justify="left" if h in ("system", "mode", "pass") else "right")
        for fit in mem["fits"]:
            cells = []
            for n in sizes:
                got = [r for r in mem["rows"] if (r["system"], r["mode"], r["passes"], r["tokens_per_rank"])
                       == (fit["system"], fit["mode"], fit["passes"], n)]
                cells.append("" if not got else ("n/a" if got[0]["peak_mib"] is None else f"{got[0]['peak_mib']:.1f}"))
            fmt = lambda s: "" if s is None else f"{s:.2f}"  # noqa: E731
            table.add_row(fit["system"], fit["mode"], fit["passes"], *cells, fmt(fit["slope"]), fmt(fit["slope_upper"]))
        console.print(table)
        nxn = {r["tokens_per_rank"]: r["nxn_mib"] for r in mem["rows"]}
        console.print("for scale, one N_local x N_local float32 score matrix over all heads: "
                      + ", ".join(f"{n}: {m:.0f} MiB" for n, m in sorted(nxn.items())), highlight=False)
    if "harness" in doc:
        table = Table(title="harness speed")
        for h in ("what", "result"):
            table.add_column(h)
        for name, r in doc["harness"].items():
            if "wall_s" in r:
                table.add_row(name, f"{r['wall_s']:.1f} s (exit {r['exit']}): {r['last_line']}"
                              + "".join(f"\n{line}" for line in r.get("failed", [])))
            else:
                table.add_row(name, f"{r['rows_per_s']:.1f} rows/s ({r['median_s']:.2f} s)")
        console.print(table)
    console.print(f"elapsed {meta.get('elapsed_s')} s; load after {meta.get('load_after')}", highlight=False)
