"""`ringcheck train`'s summary on the terminal (rich): the verdict, the worst step-0 gradients,
the loss band, the last step's gap, the TransformerEngine-style reading."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from .train_content import VERDICT_WORDS, band_words, gradient_table, grads_words, last_step_words, te_words

_STYLE = {"pass": "bold green", "fail": "bold red", "no verdict": "bold yellow"}
WORST = 6  # parameters shown when every one passes (every failing one is shown)


def print_train_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    headers, rows = gradient_table(doc, only_worst=WORST, per_run=False)
    table = Table(title="step-0 gradients (normwise relative errors; worst first)", box=box.SIMPLE_HEAD,
                  title_justify="left")
    for name in headers:
        table.add_column(name, justify="left" if name == "parameter" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row[:-1], "[green]ok[/]" if row[-1] == "ok" else "[red]OUT[/]")
    console.print(table)
    for line in (grads_words(doc), band_words(doc), last_step_words(doc), te_words(doc)):
        console.print(f"- {line}", markup=False, highlight=False)
    console.print(f"[{_STYLE[doc['verdict']]}]{VERDICT_WORDS[doc['verdict']]}[/]: ", end="")
    console.print(doc["why"], markup=False, highlight=False)
