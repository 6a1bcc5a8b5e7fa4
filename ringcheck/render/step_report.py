"""`ringcheck step`'s presentation: the case table (terminal and Markdown), the diagnosis lines."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from ..documents import save

VERDICT_WORDS = {"pass": "PASSED", "fail": "FAILED", "no verdict": "NO VERDICT"}
_STYLE = {"pass": "bold green", "fail": "bold red", "no verdict": "bold yellow"}
HEADERS = ("case", "loss error", "loss budget", "worst gradient error", "gradient budget", "first parameter out",
           "verdict")


def case_rows(doc: dict) -> list[tuple[str, ...]]:
    rows = []
    for c in doc["cases"]:
        if c["verdict"] == "not run":
            rows.append((c["case"], "-", "-", "-", "-", "-", "not run"))
            continue
        first = c["first_out"]
        rows.append((c["case"], f"{c['loss']['error']:.2g}", f"{c['loss']['budget']:.2g}",
                     f"{c['worst_gradient']:.2g}" if c["gradients"] else "-",
                     budgets_text(c) if c["gradients"] else "-",
                     "-" if first is None else f"{first['name']} (x{first['factor']:.4g})", c["verdict"]))
    return rows


def budgets_text(c: dict) -> str:
    """A case's gradient budgets: one, or the range of the parameters' own (measured per parameter)."""
    low, high = c.get("gradient_budgets") or (c["gradient_budget"], c["gradient_budget"])
    return f"{high:.2g}" if f"{low:.2g}" == f"{high:.2g}" else f"{low:.2g}-{high:.2g}"


def diagnosis_lines(doc: dict) -> list[str]:
    """One line per failed case: the transformation its figures match, or the nearest ones."""
    lines = [f"found: {line}" for line in doc.get("found", [])]
    lines += [f"{c['case']}: not run: {c['why']}; fix: {c['fix']}" for c in doc["cases"] if c["verdict"] == "not run"]
    lines += [f"{c['case']}: gradient of {g['name']} not judged: {g['why']}" for c in doc["cases"]
              for g in c.get("not_judged", [])]
    for c in doc["cases"]:
        if c["verdict"] != "fail":
            continue
        d = c.get("diagnosis")
        if d is not None:
            fig = ", ".join(f"{k} to {d[k + '_error']:.1g}" for k in ("loss", "gradient")
                            if d[k + "_error"] is not None)
            lines.append(f"{c['case']}: your step equals a correct step with {d['name']} ({fig}): [{d['class']}] "
                         f"{d['words']} (as in {d['reports']})")
        else:
            near = ", ".join(f"{r['name']} ({max(r['loss_ratio'] or 0, r['gradient_ratio'] or 0):.2g} budgets)"
                             for r in c.get("candidates", [])[:3])
            hook = "" if doc.get("has_logits", True) else (" (without a logits hook only the gradient-scale "
                                                            "candidates are tried: add logits(model, input_ids, position_ids))")
            ring = ("; the loss agrees and the gradients do not: a bug in the ring's backward or in the step's "
                    "gradient path (ringcheck validate --impl judges the ring alone)"
                    if c["loss"]["ratio"] <= 1 and c["gradients"] else "")
            lines.append(f"{c['case']}: matches no known transformation" + (f"; nearest: {near}" if near else "")
                         + hook + ring)
    if doc.get("rule", {}).get("attention"):
        lines.append(doc["rule"]["attention"])
    if doc.get("data") is not None:
        lines.append(f"data ({doc['data']['verdict']}): {doc['data']['words']}")
    conv = doc.get("convention")
    if conv is not None:
        lines.append(f"convention ({conv['case']}, informative): {conv['words']}")
    return lines


def print_step_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="the step at CP=P against CP=1 (relative errors)", box=box.SIMPLE_HEAD, title_justify="left")
    for name in HEADERS:
        table.add_column(name, justify="left" if name in ("case", "first parameter out") else "right", no_wrap=True)
    for row in case_rows(doc):
        table.add_row(*row[:-1], {"pass": "[green]ok[/]", "fail": "[red]FAIL[/]", "not run": "[yellow]not run[/]"}.get(
            row[-1], "[yellow]NO VERDICT[/]"))
    console.print(table)
    for line in diagnosis_lines(doc):
        console.print(f"- {line}", markup=False, highlight=False)
    console.print(f"[{_STYLE[doc['verdict']]}]{VERDICT_WORDS[doc['verdict']]}[/]: ", end="")
    console.print(doc["why"], markup=False, highlight=False)


def step_markdown(doc: dict) -> str:
    out = [f"# ringcheck step: {VERDICT_WORDS[doc['verdict']]}", "", f"`{doc['command']}`", "", doc["why"], "",
           "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(row) + " |" for row in case_rows(doc)]
    out += ["", *[f"- {line}" for line in diagnosis_lines(doc)], "", f"Rule: loss {doc['rule']['loss']}; gradients "
            f"{doc['rule']['gradients']}.", ""]
    return "\n".join(out)


def write_step_reports(doc: dict, out_dir: str | Path, markdown=None) -> dict[str, Path]:
    """step.json and step.md in `out_dir` (`markdown`: the document's Markdown, `step_markdown`
    by default; `step --model`'s is `model_report.model_markdown`); returns their paths."""
    out = Path(out_dir)
    paths = {"json": save(doc, out / "step.json"), "md": out / "step.md"}
    paths["md"].write_text((markdown or step_markdown)(doc), encoding="utf-8")
    return paths
