"""The reports as self-contained HTML pages: drift's (`drift_html`: the content blocks of
`ringcheck.render.drift_content`, and the figures of `ringcheck.render.plots` as embedded PNGs)
and validate's (`validate_html`: the verdict table and the plot of error over budget).

Both open on their verdict: drift's with the picture of error against ring size right under
it at the page's width and its reading guide folded into a `<details>` section, validate's
with the verdict table above the target. A command is shown with its flags unbroken
(`command_html`: a line breaks between two flags, never inside one)."""

from __future__ import annotations

import base64
import re
from html import escape

from .drift_content import blocks, verdict_lines
from .markdown import flag_words, mesh_words, ranks_words, status_words, tensor_words
from .plots import FIGURE_WIDTH_PX, detail_plots, error_plots, validate_plot

# the content width of drift's page is that of its figures (FIGURE_WIDTH_PX); a figure is shown
# at its own size, and scaled down, never up, in a narrower window
_CSS = f"""body{{font-family:system-ui,sans-serif;max-width:{FIGURE_WIDTH_PX}px;margin:2em auto;padding:0 1em;color:#222}}
table{{border-collapse:collapse;font-size:12px;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
th{{background:#f2f2f2}}td:nth-child(-n+4){{text-align:left}}pre{{background:#f6f6f6;padding:.6em;overflow-x:auto}}
img{{max-width:100%;border:1px solid #ddd;margin:.5em 0}}img.figure{{display:block;width:100%;height:auto}}
.good{{color:#1a7f37}}.bad{{color:#c62828}}.warn{{color:#9a6700;font-weight:600}}li{{margin:.2em 0}}
details{{margin:1em 0}}details>summary{{cursor:pointer;font-size:1.3em;font-weight:600;margin:.4em 0}}
pre.command{{white-space:pre-wrap}}pre.command .arg{{white-space:nowrap}}"""

_COMMAND_TOKEN = re.compile(r"""(?:[^\s'"]+|'[^']*'|"[^"]*")+""")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_FLAG = re.compile(r"-{1,2}[A-Za-z]")  # "-1,0" and "-0.5" are values


def command_html(command: str) -> str:
    """A command line as a `<pre class='command'>` whose line breaks fall only between flags
    (`_command_spans`); the text copies back as the command, and `data-command` holds it as one
    string (for a script reading the page, or a copy button)."""
    return f"<pre class='command' data-command='{escape(command)}'><code>{_command_spans(command)}</code></pre>"


def _command_spans(command: str) -> str:
    """Each VAR=value before the program, the program with its words, and each flag with its
    values as one unbreakable span (`.arg`: `white-space: nowrap`), joined by the spaces that
    are the only break points. Quoted values stay whole."""
    groups: list[list[str]] = []
    for token in _COMMAND_TOKEN.findall(command):
        # a new span: the first token, a flag, or anything after a VAR=value (only those come first)
        if not groups or _FLAG.match(token) or _ASSIGNMENT.match(groups[-1][0]):
            groups.append([token])
        else:
            groups[-1].append(token)
    return " ".join(f"<span class='arg'>{escape(' '.join(g))}</span>" for g in groups)


def _inline_html(text: str) -> str:
    """Escaped text with `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text))


def figures_html(figures: list[tuple[str, bytes]]) -> list[str]:
    """Each figure as an embedded PNG at the page's width, its title as the caption above."""
    parts = []
    for title, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<h3>{escape(title)}</h3><img class='figure' alt='{escape(title)}' "
                     f"src='data:image/png;base64,{data}'>")
    return parts


def blocks_html(content: list[tuple], verdict_style: dict[str, str], plots: bool, doc: dict) -> list[str]:
    parts = []
    for block in content:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{escape(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline_html(block[1])}</p>")
        elif kind == "code":
            parts.append(command_html(block[1]))
        elif kind == "list":
            items = "".join(f"<li class='{verdict_style.get(i, '')}'>{_inline_html(i)}</li>" for i in block[1])
            parts.append(f"<ul>{items}</ul>")
        elif kind == "table":
            head = "".join(f"<th>{escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>"
                           for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "details":
            inner = "\n".join(blocks_html(block[2], verdict_style, plots, doc))
            parts.append(f"<details><summary>{escape(block[1])}</summary>\n{inner}\n</details>")
        elif kind == "plots" and plots:
            if block[1] == "error":
                parts += figures_html(error_plots(doc))
            else:
                parts.append("<h2>More plots</h2>")
                parts += figures_html(detail_plots(doc))
    return parts


def drift_html(doc: dict, *, plots: bool = True) -> str:
    """A self-contained HTML page: the report's text and tables, and the plots as embedded PNGs."""
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>ringcheck drift report</title>",
             f"<style>{_CSS}</style></head><body>"]
    verdict_style = {text: style for style, text in verdict_lines(doc)}
    parts += blocks_html(blocks(doc), verdict_style, plots, doc)
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --- validate ------------------------------------------------------------------------------------

_VALIDATE_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
h1.good,.good{color:#1a7f37}h1.bad,.bad{color:#c62828}.info{color:#0b7285}.flag{color:#b26a00}
table{border-collapse:collapse;font-size:12px;margin:.6em 0}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f2f2f2}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.tensors{white-space:nowrap;font-family:ui-monospace,monospace}td.tensors span{margin-right:.8em}
td.check{white-space:nowrap}td.detail{font-size:11px;color:#444;max-width:560px}
tr.fail{background:#fdf0f0}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;white-space:pre-wrap}
pre.command .arg,td .arg{white-space:nowrap}
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
    """Key and value rows; a command (meta's) with its flags unbroken."""
    body = "".join(f"<tr><td>{escape(str(k))}</td><td>"
                   f"{_command_spans(v) if k == 'command' and isinstance(v, str) else escape(_value(v))}</td></tr>"
                   for k, v in items.items())
    return f"<table class='kv'><tbody>{body}</tbody></table>"


def validate_html(doc: dict, *, plot: bool = True) -> str:
    """validate's report as one self-contained HTML page, verdict first: the headline with its
    counts, the mesh (when the document has one), the verdict table (check, verdict,
    err/budget, per tensor, failing ranks, detail), the plot of error over budget per check and
    tensor (an embedded PNG, `ringcheck.render.plots.validate_plot`), then the re-run command
    (`command_html`), the target and the run's meta."""
    checks = doc["checks"]
    counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "info", "flag")}
    verdict = "PASSED" if doc["passed"] else "FAILED"
    summary = (f"{counts['fail']} of {len(checks)} checks failed" if counts["fail"]
               else "every check within budget") + f" ({counts['pass']} passed, {counts['info']} information" + (
        f", {counts['flag']} FLAG" if counts["flag"] else "") + ")"
    flagged = [c for c in checks if c["status"] == "flag"]
    mesh = mesh_words(doc.get("mesh"))
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
             f"<title>ringcheck validate: {verdict}</title><style>{_VALIDATE_CSS}</style></head><body>",
             f"<h1 class='{'good' if doc['passed'] else 'bad'}'>ringcheck validate: {verdict}</h1>",
             f"<p id='headline'><b class='{'good' if doc['passed'] else 'bad'}'>{verdict}</b>: {escape(summary)}</p>",
             *([f"<p id='flags' class='flag'>FLAG: {escape(flag_words(flagged))}</p>"] if flagged else []),
             *([f"<p id='mesh'>{escape(mesh)}</p>"] if mesh else []),
             *([f"<p>Variants validated: {escape(doc['variants'])}</p>"] if doc.get("variants") else []),
             "<h2 id='verdicts'>Verdicts</h2>",
             ("<table><thead><tr><th>check</th><th>verdict</th><th>err/budget</th><th>per tensor</th>"
              "<th>failing ranks</th><th>detail</th></tr></thead><tbody>")]
    for c in checks:
        status = {"pass": "pass", "fail": "FAIL"}.get(c["status"], status_words(c))
        style = {"pass": "good", "fail": "bad", "flag": "bad" if c.get("required") else "flag"}.get(c["status"], "info")
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
                  ("<p class='note'>One row per check with per-tensor results, one marker per tensor (its shape "
                   "names the tensor, its colour the verdict); right of the dashed line (error = budget) fails, "
                   "and the failing tensors are named right of the plot. Checks without tensors are in the "
                   "table only.</p>"),
                  f"<img alt='error over budget per check and tensor' src='data:image/png;base64,{data}'>"]
    parts += ["<h2>Command</h2>", command_html(doc["command"]),
              "<h2 id='target'>Target</h2>", _kv_table(doc["target"])]
    if doc.get("meta"):
        parts += ["<h2>Run</h2>", _kv_table(doc["meta"])]
    parts.append("</body></html>\n")
    return "\n".join(parts)
