"""The drift report as one self-contained HTML page (`drift_html`): the content blocks of
`ringcheck.render.drift_content`, and the figures of `ringcheck.render.plots` as embedded PNGs."""

from __future__ import annotations

import base64
import re
from html import escape

from .drift_content import blocks, verdict_lines
from .plots import drift_plots

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
