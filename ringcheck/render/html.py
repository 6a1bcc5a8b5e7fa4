"""The reports as self-contained HTML pages: drift's (`drift_html`: the content blocks of
`ringcheck.render.drift_content`, and the figures of `ringcheck.render.plots` as embedded PNGs)
and validate's (`validate_html`: the verdict table and the plot of error over budget)."""

from __future__ import annotations

import base64
import re
from html import escape

from .drift_content import blocks, verdict_lines
from .markdown import ranks_words, tensor_words
from .plots import drift_plots, validate_plot

_CSS = """body{font-family:system-ui,sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f2f2f2}td:nth-child(-n+4){text-align:left}pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}.good{color:#1a7f37}.bad{color:#c62828}
li{margin:.2em 0}"""


def _inline_html(text: str) -> str:
    """Escaped text with `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text))


def drift_html(doc: dict, *, plots: bool = True) -> str:
    """A self-contained HTML page: the report's text and tables, and the plots as embedded PNGs."""
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>ringcheck drift report</title>",
             f"<style>{_CSS}</style></head><body>"]
    verdict_style = {text: style for style, text in verdict_lines(doc)}
    for block in blocks(doc):
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{escape(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline_html(block[1])}</p>")
        elif kind == "code":
            parts.append(f"<pre><code>{escape(block[1])}</code></pre>")
        elif kind == "list":
            items = "".join(f"<li class='{verdict_style.get(i, '')}'>{_inline_html(i)}</li>" for i in block[1])
            parts.append(f"<ul>{items}</ul>")
        elif kind == "table":
            head = "".join(f"<th>{escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>"
                           for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "plots" and plots:
            parts.append("<h2>Plots</h2>")
            for title, png in drift_plots(doc):
                data = base64.b64encode(png).decode("ascii")
                parts.append(f"<h3>{escape(title)}</h3><img alt='{escape(title)}' "
                             f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --- validate ------------------------------------------------------------------------------------

_VALIDATE_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
h1.good,.good{color:#1a7f37}h1.bad,.bad{color:#c62828}.info{color:#0b7285}
table{border-collapse:collapse;font-size:12px;margin:.6em 0}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f2f2f2}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.tensors{white-space:nowrap;font-family:ui-monospace,monospace}td.tensors span{margin-right:.8em}
td.check{white-space:nowrap}td.detail{font-size:11px;color:#444;max-width:560px}
tr.fail{background:#fdf0f0}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;white-space:pre-wrap}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}.note{font-size:12px;color:#555}
table.kv td:first-child{color:#555}"""


def _err_over_budget(row: dict) -> str:
    """A row's worst error / budget as the terminal writes it ("" without a budget)."""
    if row["error"] is None or not row["budget"]:
        return ""
    ratio = row["error"] / row["budget"]
    return f"{ratio:.2f}" if ratio < 1e4 else f"{ratio:.1e}"


def _tensor_cell(tensors: dict | None) -> str:
    """Per tensor "ok" (green) or its worst error / budget (red), with its failing ranks on hover."""
    spans = []
    for name, t in (tensors or {}).items():
        word = tensor_words({name: t})
        title = f" title='over budget on ranks {ranks_words(t.get('ranks'))}'" if t.get("ranks") else ""
        spans.append(f"<span class='{'good' if t['passed'] else 'bad'}'{title}>{escape(word)}</span>")
    return "".join(spans)


def _value(v) -> str:
    """A target or meta value as a reader writes it: lists comma-separated, None as "default"."""
    if v is None:
        return "default"
    return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _kv_table(items: dict) -> str:
    body = "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(_value(v))}</td></tr>" for k, v in items.items())
    return f"<table class='kv'><tbody>{body}</tbody></table>"


def validate_html(doc: dict, *, plot: bool = True) -> str:
    """validate's report as one self-contained HTML page: the verdict with its counts, the
    re-run command, the target, the verdict table (check, verdict, err/budget, per tensor,
    failing ranks, detail), the plot of error over budget per check and tensor (an embedded
    PNG, `ringcheck.render.plots.validate_plot`), and the run's meta."""
    checks = doc["checks"]
    counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "info")}
    verdict = "PASSED" if doc["passed"] else "FAILED"
    summary = (f"{counts['fail']} of {len(checks)} checks failed" if counts["fail"]
               else "every check within budget") + f" ({counts['pass']} passed, {counts['info']} information)"
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
             f"<title>ringcheck validate: {verdict}</title><style>{_VALIDATE_CSS}</style></head><body>",
             f"<h1 class='{'good' if doc['passed'] else 'bad'}'>ringcheck validate: {verdict}</h1>",
             f"<p><b class='{'good' if doc['passed'] else 'bad'}'>{verdict}</b>: {escape(summary)}</p>",
             "<h2>Command</h2>", f"<pre><code>{escape(doc['command'])}</code></pre>",
             *([f"<p>Variants validated: {escape(doc['variants'])}</p>"] if doc.get("variants") else []),
             "<h2>Target</h2>", _kv_table(doc["target"]), "<h2>Verdicts</h2>",
             "<table><thead><tr><th>check</th><th>verdict</th><th>err/budget</th><th>per tensor</th>"
             "<th>failing ranks</th><th>detail</th></tr></thead><tbody>"]
    for c in checks:
        status = {"pass": "pass", "fail": "FAIL"}.get(c["status"], c["status"])
        style = {"pass": "good", "fail": "bad"}.get(c["status"], "info")
        err = "" if c["error"] is None else f"{c['error']:.3e}"
        bud = "" if c["budget"] is None else f"{c['budget']:.3e}"
        title = f" title='error {err}, budget {bud}'" if err else ""
        parts.append(f"<tr class='{c['status']}'><td class='check'>{escape(c['check'])}</td>"
                     f"<td class='{style}'>{status}</td><td class='num'{title}>{_err_over_budget(c)}</td>"
                     f"<td class='tensors'>{_tensor_cell(c.get('tensors'))}</td>"
                     f"<td>{escape(ranks_words(c.get('failing_ranks')))}</td>"
                     f"<td class='detail'>{escape(c['detail'])}</td></tr>")
    parts.append("</tbody></table><p class='note'>err/budget: the row's worst error over its budget (1.00 is "
                 "the limit; hover for both); per tensor: ok, or its worst error / budget (hover for the ranks); "
                 "failing ranks: the ranks holding elements over budget.</p>")
    png = validate_plot(doc) if plot else None
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        parts += ["<h2>Error over budget</h2>",
                  "<p class='note'>One row per check with per-tensor results, one marker per tensor; "
                  "right of the dashed line (error = budget) fails. Checks without tensors are in the "
                  "table only.</p>",
                  f"<img alt='error over budget per check and tensor' src='data:image/png;base64,{data}'>"]
    if doc.get("meta"):
        parts += ["<h2>Run</h2>", _kv_table(doc["meta"])]
    parts.append("</body></html>\n")
    return "\n".join(parts)
