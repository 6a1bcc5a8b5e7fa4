"""Markdown of the documents: validate.md (`validate_markdown`) and drift.md
(`drift_markdown`, from the content blocks of `ringcheck.render.drift_content`)."""

from __future__ import annotations

from typing import Any

from .drift_content import blocks


def _md_cell(x: Any) -> str:
    return str(x).replace("|", "\\|")


def _times(ratio: float) -> str:
    if ratio != ratio or ratio == float("inf"):
        return "inf"
    return f"{ratio:.3g}x" if ratio < 10 else (f"{ratio:.0f}x" if ratio < 1e4 else f"{ratio:.0e}x")


def tensor_words(tensors: dict[str, dict] | None) -> str:
    """A check row's per-tensor verdicts, e.g. 'out ok  lse ok  dq ok  dk 62x  dv 40x': "ok"
    within budget, else the worst error / budget ("inf" for a NaN/Inf or a zero budget)."""
    return "  ".join(f"{name} {'ok' if t['passed'] else _times(t['ratio'])}" for name, t in (tensors or {}).items())


def ranks_words(ranks: list[int] | None) -> str:
    """The failing ranks of a row, e.g. '0,2,3' (empty when none)."""
    return ",".join(str(r) for r in ranks or ())


def mesh_words(mesh: dict | None) -> str:
    """validate's mesh as one line, e.g. 'Mesh cp=4,tp=2: cp groups [0, 2, 4, 6] [1, 3, 5, 7]'
    (its `text`, then every `<dim>_groups`); "" without a mesh."""
    if not mesh:
        return ""
    groups = [f"{key.removesuffix('_groups')} groups " + " ".join(f"[{', '.join(map(str, g))}]" for g in value)
              for key, value in mesh.items() if key.endswith("_groups") and isinstance(value, list)]
    return f"Mesh {mesh.get('text', '')}" + (": " + "; ".join(groups) if groups else "")


def flag_words(flagged: list[dict]) -> str:
    """The verdict line's words for validate's FLAG rows (as in the document): which promises
    the ring is off, and whether --require made that fail the run."""
    def names(required: bool) -> list[str]:
        return [r.get("promise") or r["check"] for r in flagged if bool(r.get("required")) == required]
    required, reported = names(True), names(False)
    return "; ".join([*([f"{', '.join(required)} off its promise, required (--require): the run fails"]
                        if required else []),
                      *([f"{', '.join(reported)} off its promise (reported; --require {','.join(reported)} "
                         f"would fail the run)"] if reported else [])])


def status_words(row: dict) -> str:
    """A row's status for the reports: FLAG (required) where --require made it a gate."""
    if row["status"] == "flag":
        return "FLAG (required)" if row.get("required") else "FLAG"
    return row["status"]


def validate_markdown(report: dict[str, Any]) -> str:
    """The verdict, the mesh (when the document has one), the command, one table row per check
    (with its per-tensor verdicts and failing ranks), then the run's meta."""
    mesh = mesh_words(report.get("mesh"))
    flagged = [row for row in report["checks"] if row["status"] == "flag"]
    lines = [f"# ringcheck validate: {'PASSED' if report['passed'] else 'FAILED'}", "",
             *([f"FLAG: {flag_words(flagged)}", ""] if flagged else []),
             *([mesh, ""] if mesh else []),
             f"`{report['command']}`", "",
             *([f"Variants validated: {report['variants']}", ""] if report.get("variants") else []),
             "| check | status | error | budget | per tensor | failing ranks | detail |",
             "|---|---|---|---|---|---|---|"]
    for row in report["checks"]:
        err = "" if row["error"] is None else f"{row['error']:.3g}"
        bud = "" if row["budget"] is None else f"{row['budget']:.3g}"
        lines.append(f"| {row['check']} | {status_words(row)} | {err} | {bud} | {tensor_words(row.get('tensors'))} | "
                     f"{ranks_words(row.get('failing_ranks'))} | {_md_cell(row['detail'])} |")
    if report.get("meta"):
        lines += ["", "Run: " + ", ".join(f"{k}={v}" for k, v in report["meta"].items())]
    return "\n".join(lines) + "\n"


def drift_markdown(doc: dict) -> str:
    """The drift report as Markdown; the plots are only in the HTML page."""
    return "\n\n".join(blocks_markdown(blocks(doc))) + "\n"


def blocks_markdown(content: list[tuple]) -> list[str]:
    out = []
    for block in content:
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
        elif kind == "details":  # folded away in the HTML; a section here
            out.append(f"## {block[1]}")
            out += blocks_markdown(block[2])
        elif kind == "plots" and block[1] == "error":
            out.append("Plots (error against ring size per dtype with the budget drawn in, per-step drift, "
                       "slopes): see `drift.html` next to this file.")
    return out
