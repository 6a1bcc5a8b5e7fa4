"""The train report as Markdown (`train_markdown`) and as one self-contained HTML page
(`train_html`: the same content blocks, `ringcheck.render.train_content`, with the figures of
`ringcheck.render.train_plots` embedded right under the verdict's findings)."""

from __future__ import annotations

from html import escape

from .html import blocks_html, figures_html
from .markdown import blocks_markdown
from .train_content import blocks
from .train_plots import train_plots

_CSS = """body{font-family:system-ui,sans-serif;max-width:1260px;margin:2em auto;padding:0 1em;color:#222}
h1.good{color:#1a7f37}h1.bad{color:#c62828}h1.none{color:#9a6700}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f2f2f2}td:first-child{text-align:left}pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
pre.command{white-space:pre-wrap}pre.command .arg{white-space:nowrap}img{max-width:100%;border:1px solid #ddd}
img.figure{display:block;width:100%;height:auto}li{margin:.2em 0}"""


def train_markdown(doc: dict) -> str:
    """The report as Markdown; the plots are only in the HTML page."""
    parts = blocks_markdown(blocks(doc))
    parts.insert(5, "Plots (loss per step with the noise band, the gap in units of the noise floor, each "
                    "parameter's step-0 error over its budget, gradient norms): see `train.html` next to this file.")
    return "\n\n".join(parts) + "\n"


def train_html(doc: dict, *, plots: bool = True) -> str:
    """A self-contained HTML page: the verdict, its findings, the figures, then the rule and tables."""
    content = blocks(doc)
    style = {"pass": "good", "fail": "bad"}.get(doc["verdict"], "none")
    head, rest = content[:5], content[5:]
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
             f"<title>{escape(head[0][1])}</title><style>{_CSS}</style></head><body>",
             f"<h1 class='{style}'>{escape(head[0][1])}</h1>"]
    parts += blocks_html(head[1:], {}, False, doc)
    if plots:
        parts += figures_html(train_plots(doc))
    parts += blocks_html(rest, {}, False, doc)
    parts.append("</body></html>\n")
    return "\n".join(parts)
