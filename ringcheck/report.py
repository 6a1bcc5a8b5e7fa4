"""Presentation: the only layer that imports rich (and, later, plotting)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .verdict import Verdict


def verdict_table(verdicts: list[Verdict], *, title: str = "ringcheck validate") -> Table:
    table = Table(title=title)
    label_names = list(verdicts[0].labels) if verdicts and verdicts[0].labels else ["case"]
    for name in label_names:
        table.add_column(name)
    table.add_column("verdict")
    table.add_column("worst")
    table.add_column("error", justify="right")
    table.add_column("budget", justify="right")
    table.add_column("err/budget", justify="right")
    for v in verdicts:
        worst = max(v.tensors, key=lambda t: (not t.passed, t.error / t.budget if t.budget else float("inf")))
        ratio = worst.error / worst.budget if worst.budget else float("inf")
        labels = [v.labels.get(n, "") for n in label_names] if v.labels else [v.case]
        table.add_row(*labels, "[green]pass[/]" if v.passed else "[red]FAIL[/]", worst.tensor,
                      f"{worst.error:.2e}", f"{worst.budget:.2e}", f"{ratio:.2f}")
    return table


def print_verdicts(verdicts: list[Verdict], console: Console | None = None) -> None:
    console = console or Console()
    console.print(verdict_table(verdicts))
    failed = [v for v in verdicts if not v.passed]
    for v in failed:
        console.print(v.message(), markup=False, highlight=False)
    n = len(verdicts)
    if failed:
        console.print(f"[bold red]FAILED[/]: {len(failed)} of {n} cases over budget")
    else:
        console.print(f"[bold green]PASSED[/]: all {n} cases within budget")


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
        console.print(f"[bold green]PASSED[/]: every check within budget")
