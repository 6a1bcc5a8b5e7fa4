"""The HTML reports as a reader meets them (issue 25, item 9): validate's verdict before its
target, a command that never breaks inside a flag, a legend whose verdict colours do not look
like a tensor's marker, the failing tensors named once per row; drift's picture of error
against ring size right under the verdict at the page's width, its reading guide folded away;
validate's mesh line where the document has one. Synthetic documents and a tiny simulated
sweep: no ring is started."""

import base64
import re
import struct
from html import escape, unescape

import pytest

from ringcheck.commands.drift import DriftSpec, run_drift
from ringcheck.render.html import command_html, drift_html, validate_html
from ringcheck.render.markdown import drift_markdown, validate_markdown
from ringcheck.render.plots import FIGURE_WIDTH_PX, validate_figure

COMMAND = ("PYTHONPATH=/home/me/proj ringcheck validate --seq-len 2048 --heads 4 --kv-heads 2 --dtype bfloat16 "
           "--causal --layout zigzag --world-size 4 --impl my_ring:ring_fn --backend torch --window -1,0 "
           "--documents '3, 5' --seed 0 --quick --timeout 60")
TINY = {"dtypes": ("bfloat16",), "ring_sizes": (1, 2, 4), "distributions": ("normal",), "modes": ("zigzag",),
        "seeds": 1, "tokens_per_rank": 4, "head_dim": 8, "heads": 2, "kv_heads": 1}


def _row(check: str, ratios: dict[str, float]) -> dict:
    tensors = {name: {"passed": r <= 1.0, "ratio": r, "ranks": [] if r <= 1.0 else [1, 3]}
               for name, r in ratios.items()}
    failed = any(not t["passed"] for t in tensors.values())
    worst = max(ratios.values())
    return {"check": check, "status": "fail" if failed else "pass", "error": worst * 1e-3, "budget": 1e-3,
            "detail": f"{check}: worst {worst}", "tensors": tensors, "failing_ranks": [1, 3] if failed else []}


def _validate_doc(*, mesh: dict | None = None) -> dict:
    checks = []
    for dist in ("normal", "near-uniform", "wide", "outlier", "sink", "late-max"):
        checks.append(_row(f"forward {dist} (local 2,6)", {"out": 0.2, "lse": 1e-4}))
        checks.append(_row(f"backward {dist} (local 2,6)", {"dq": 0.1, "dk": 128.0, "dv": 91.0}))
    checks.append({"check": "no NaN/Inf", "status": "pass", "error": None, "budget": None, "detail": "finite",
                   "tensors": {}, "failing_ranks": []})
    target = {f"key_{i}": i for i in range(25)}  # the 25-row target table of the issue
    doc = {"schema": "ringcheck.validate", "schema_version": 1, "passed": False, "target": target,
           "command": COMMAND, "checks": checks, "meta": {"command": COMMAND, "elapsed_s": 1.0}}
    if mesh is not None:
        doc["mesh"] = mesh
    return doc


@pytest.fixture(scope="module")
def validate_page():
    return validate_html(_validate_doc())


@pytest.fixture(scope="module")
def drift_doc():
    return run_drift(DriftSpec(**TINY))


# --- validate ------------------------------------------------------------------------------------


def test_validate_html_puts_the_headline_and_the_verdict_table_above_the_target(validate_page):
    page = validate_page
    headline, verdicts, target = page.index("id='headline'"), page.index("id='verdicts'"), page.index("id='target'")
    assert headline < verdicts < target
    assert "FAILED</b>: 6 of 13 checks failed" in page[headline:verdicts]
    first_table = page.index("<table>")
    assert verdicts < first_table < target and "<th>check</th>" in page[first_table:first_table + 80]
    assert page.index("<img", verdicts) < target  # the plot of the verdicts is above the target too


def test_a_command_breaks_only_between_flags():
    """Each flag with its values is one unbreakable span; the spaces between spans are the only
    places a line may break; the text reads back as the command (a value like -1,0 is no flag,
    a quoted value stays whole)."""
    html = command_html(COMMAND)
    assert html.startswith(f"<pre class='command' data-command='{escape(COMMAND)}'><code>")
    assert html.endswith("</code></pre>")
    spans = [unescape(s) for s in re.findall(r"<span class='arg'>(.*?)</span>", html)]
    assert " ".join(spans) == COMMAND
    assert spans[:3] == ["PYTHONPATH=/home/me/proj", "ringcheck validate", "--seq-len 2048"]
    assert "--backend torch" in spans and "--window -1,0" in spans and "--documents '3, 5'" in spans
    assert "--causal" in spans and all(s.startswith("--") for s in spans[2:])
    assert unescape(re.sub(r"<[^>]+>", "", html)) == COMMAND  # the text copies back as the command


def test_both_pages_keep_a_flag_on_one_line(validate_page, drift_doc):
    assert "pre.command .arg,td .arg{white-space:nowrap}" in validate_page
    assert validate_page.count("<span class='arg'>--backend torch</span>") == 2  # the command, and meta's
    page = drift_html(dict(drift_doc, meta={"command": COMMAND}), plots=False)
    assert "pre.command .arg{white-space:nowrap}" in page
    assert "<span class='arg'>--backend torch</span>" in page


def test_the_verdict_legend_is_colour_swatches_and_failing_tensors_are_named_once_per_row():
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    doc = _validate_doc()
    fig = validate_figure(doc)
    try:
        legend = fig.legends[0]
        handles = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
        # a tensor is a grey marker; a verdict a colour swatch, never a marker like out's circle
        assert isinstance(handles["out"], Line2D) and handles["out"].get_marker() == "o"
        for label in ("colour: within budget", "colour: over budget"):
            assert isinstance(handles[label], Patch), label
        ax = fig.axes[0]
        assert not ax.texts  # no label beside any point: nothing to crowd
        (right,) = ax.child_axes  # the secondary axis on the right
        names = [t.get_text() for t in right.get_yticklabels()]
        rows = [c for c in doc["checks"] if c["tensors"]]
        assert len(names) == len(rows)
        for row, name in zip(rows, names):
            assert name == ("dk 128x  dv 91x" if row["status"] == "fail" else ""), (row["check"], name)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_mesh_is_one_header_line_when_the_document_has_one():
    mesh = {"text": "cp=4,tp=2", "cp_groups": [[0, 2, 4, 6], [1, 3, 5, 7]], "tp_groups": [[0, 1], [2, 3]],
            "dims": ["cp", "tp"]}
    line = "Mesh cp=4,tp=2: cp groups [0, 2, 4, 6] [1, 3, 5, 7]; tp groups [0, 1] [2, 3]"
    page = validate_html(_validate_doc(mesh=mesh), plot=False)
    assert page.count(line) == 1 and page.index("id='headline'") < page.index(line) < page.index("id='verdicts'")
    md = validate_markdown(_validate_doc(mesh=mesh))
    assert md.count(line) == 1 and md.index(line) < md.index("| check |")
    without = validate_html(_validate_doc(), plot=False)
    assert "Mesh" not in without and "Mesh" not in validate_markdown(_validate_doc())


# --- drift ---------------------------------------------------------------------------------------


def _png_width(data_uri_b64: str) -> int:
    png = base64.b64decode(data_uri_b64)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", png[16:20])[0]  # IHDR: width, height


def test_drift_html_shows_error_against_ring_size_right_under_the_verdict_at_the_page_width(drift_doc):
    page = drift_html(drift_doc)
    verdict = page.index("<h2>Verdict</h2>")
    first_figure = page.index("<img class='figure'")
    guide = page.index("<details>")
    assert verdict < first_figure < guide
    assert "<table" not in page[verdict:first_figure]  # no table stands between the verdict and the picture
    assert "Error against ring size: zigzag (torch)" in page[verdict:first_figure + 200]
    assert page.index("<li class='warn'>NO VERDICT") < first_figure  # tiny ring sizes: no verdict, said first
    # shown at the content width: the figure is as wide as the page's content, and stretched to it
    assert f"max-width:{FIGURE_WIDTH_PX}px" in page and "img.figure{display:block;width:100%;height:auto}" in page
    widths = [_png_width(b) for b in re.findall(r"<img class='figure'[^>]*base64,([^']+)'", page)]
    # error against P, the per-step drift, the fitted slopes: all of them the page's width
    assert len(widths) == 3 and all(w == FIGURE_WIDTH_PX for w in widths) and FIGURE_WIDTH_PX >= 900, widths


def test_drift_reading_guide_is_folded_into_details(drift_doc):
    page = drift_html(drift_doc, plots=False)
    start, end = page.index("<details>"), page.index("</details>")
    guide = page[start:end]
    assert guide.startswith("<details><summary>How to read it</summary>")
    assert guide.count("<li") == 10 and "Model: least squares" in guide and "<details open" not in page
    assert "Model: least squares" not in page[:start] + page[end:]
    md = drift_markdown(drift_doc)  # the Markdown keeps it as a section, and points to the plots once
    assert "## How to read it" in md and md.count("see `drift.html`") == 1
    assert md.index("## Verdict") < md.index("see `drift.html`") < md.index("## How to read it")
