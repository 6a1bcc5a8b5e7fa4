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
