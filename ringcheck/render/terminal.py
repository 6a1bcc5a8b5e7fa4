"""Rich terminal output of every command: the console, the progress of long runs, validate's verdict table,
drift's summary and diff, bench's tables. With `ringcheck.render.plots` (matplotlib)
the only module that imports a presentation library.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from .drift_content import (
    WORST_HEADERS,
    WORST_SHORT,
    accumulations,
    separation_headers,
    separation_rows,
    verdict_lines,
    worst_cases,
    worst_row,
)
from .markdown import flag_words, ranks_words, tensor_words


def make_console() -> Console:
    """The console of a command: a pipe or a CI log gets a wide table instead of rich's
    80-column default."""
    return Console() if sys.stdout.isatty() else Console(width=160)


# --- progress of a long run -----------------------------------------------------------------------


@contextmanager
def progress(total: int | None, console: Console | None = None, *, enabled: bool = True, label: str = "",
             announce: bool = True):
    """Progress of a long run on `console`, gone when the block ends (never part of a report);
    yields `advance(text)`. With a `total`: a bar with steps done / total, the elapsed time and
    the current step's text; without: a spinner, the text and the elapsed time. `announce`:
    each call names the step about to run (the one before it is done); else the step just
    done. With `enabled` False (--quiet, or not a terminal: the caller decides) nothing is
    shown and `advance` does nothing."""
    if not enabled:
        yield lambda text: None
        return
    head = [TextColumn(label, markup=False)] if label else []
    text = TextColumn("{task.description}", markup=False)  # a case's text is not markup
    if total is None:
        columns = [SpinnerColumn(), *head, TimeElapsedColumn(), text]
    else:
        columns = [*head, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), text]
    with Progress(*columns, console=console or Console(), transient=True) as bar:
        task = bar.add_task("", total=total, completed=0)
        calls = [0]

        def advance(text: str) -> None:
            calls[0] += 1
            done = calls[0] - 1 if announce else calls[0]
            bar.update(task, completed=done if total is None else min(done, total), description=str(text))
        yield advance


# --- validate ------------------------------------------------------------------------------------


_VERDICT = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "info": "[cyan]info[/]", "flag": "[yellow]FLAG[/]"}


def _verdict(r) -> str:
    """A row's verdict cell: a FLAG that --require made a gate is red."""
    return "[red]FLAG[/]" if r.status == "flag" and r.required else _VERDICT.get(r.status, r.status)


def _ratio(r) -> str:
    if r.error is None or not r.budget:
        return ""
    ratio = r.error / r.budget
    return f"{ratio:.2f}" if ratio < 1e4 else f"{ratio:.1e}"


def check_rows_table(rows, *, title: str = "ringcheck validate", compact: bool = True) -> Table:
    """The verdict table. Compact: one line per row (check, verdict, err/budget, the
    per-tensor verdicts, the failing ranks), no detail; otherwise also error, budget and the
    detail of failing and info rows, wrapped."""
    if not compact:
        table = Table(title=title)
        for name in ("check", "verdict", "error", "budget", "err/budget", "per tensor", "failing ranks", "detail"):
            table.add_column(name, justify="right" if name in ("error", "budget", "err/budget") else "left",
                             overflow="fold")
    else:  # one line per row: on a narrow console the check's name gives way (ellipsis)
        table = Table(title=title, box=box.SIMPLE_HEAD, caption="per tensor: ok, or its worst error / budget; "
                      "ranks: the ranks holding elements over budget", caption_justify="left")
        for name, justify, width in (("check", "left", 12), ("verdict", "left", 4), ("err/bud", "right", 5),
                                     ("per tensor", "left", 22), ("ranks", "left", 5)):
            table.add_column(name, justify=justify, no_wrap=name != "check", overflow="ellipsis", min_width=width)
    for r in rows:
        words, ranks = tensor_words(r.tensors), ranks_words(r.failing_ranks)
        if compact:
            table.add_row(Text(r.check, no_wrap=True, overflow="ellipsis"), _verdict(r),
                          _ratio(r), words, ranks)
        else:
            table.add_row(r.check, _verdict(r), "" if r.error is None else f"{r.error:.2e}",
                          "" if r.budget is None else f"{r.budget:.2e}", _ratio(r), words, ranks,
                          r.detail if r.status in ("fail", "info", "flag") or r.promise else "")
    return table


def print_check_rows(rows, passed: bool, console: Console | None = None, *, compact: bool = True) -> None:
    """validate's verdict table, then the verdict line.

    compact=True (the default): one short line per row, so a failing run's table stays as
    long as the list of checks; the located detail of each failing row (the worst element:
    tensor, rank, layout, row, error, budget, case) and the notes of info rows are printed
    after the table. compact=False: the full table with the detail wrapped in its cells."""
    console = console or Console()
    console.print(check_rows_table(rows, compact=compact))
    failed = [r for r in rows if not r.passed]
    flagged = [r for r in rows if r.status == "flag"]
    if compact:
        for r in [r for r in rows if r.status == "info" and r.detail and not r.promise]:
            value = f" {r.error:.2f};" if r.error is not None else ""
            console.print(f"note: {r.check}:{value} {r.detail}", markup=False, highlight=False)
        for r in [r for r in rows if r.promise and r.status != "flag"]:  # what each measurement found
            console.print(f"measured: {r.check}: {r.detail}", markup=False, highlight=False)
        for r in flagged:
            console.print(f"FLAG {r.check}: {r.detail}", style="red" if r.required else "yellow", markup=False,
                          highlight=False)
        for r in [r for r in failed if r.status == "fail"]:
            console.print(f"FAIL {r.check}: {r.detail}", style="red", markup=False, highlight=False)
    not_run = [r for r in rows if r.status == "not run"]
    if flagged:
        console.print(f"[bold yellow]FLAG[/]: {flag_words([vars(r) for r in flagged])}", markup=True,
                      highlight=False)
    if failed:
        console.print(f"[bold red]FAILED[/]: {len(failed)} of {len(rows)} checks")
    elif not_run:
        console.print(f"[bold green]PASSED[/] (forward only): every check that ran within budget; {len(not_run)} "
                      f"backward checks not run")
    else:
        console.print("[bold green]PASSED[/]: every check within budget")


# --- drift ---------------------------------------------------------------------------------------


def drift_progress(total: int, console: Console | None = None, *, enabled: bool = True):
    """`progress` for drift: the callback `run_drift` takes, called after every ring run."""
    return progress(total, console, enabled=enabled, label="drift", announce=False)


def print_drift_summary(doc: dict, console: Console | None = None, *, worst: int = 10) -> None:
    """Verdict first, then the separation per setting, then the worst cases."""
    console = console or Console()
    colour = {"good": "bold green", "bad": "bold red", "warn": "bold yellow", "info": ""}
    for style, text in verdict_lines(doc):
        console.print(text, style=colour[style], highlight=False)
    accs = accumulations(doc)
    if len(accs) > 1:
        table = Table(title="flagged tensors per setting, and the slope of out")
        keep = [i for i, h in enumerate(separation_headers(doc)) if not h.startswith("out projected")]
        for i in keep:
            table.add_column(separation_headers(doc)[i].replace("flagged: ", "").replace("out slope: ", "slope "))
        for row in separation_rows(doc):
            table.add_row(*[row[i] for i in keep])
        console.print(table)
    table = Table(title=f"worst {worst} cases by error / budget")
    for h in WORST_SHORT:
        table.add_column(h, justify="left" if h in ("acc", "mode", "dtype", "dist", "tensor") else "right",
                         no_wrap=True)
    for c, t, m in worst_cases(doc, worst):
        cells = worst_row(c, t, m)
        del cells[WORST_HEADERS.index("mean signed")], cells[WORST_HEADERS.index("max ULP")]
        cells[-1] = "[green]pass[/]" if m["passed"] else "[red]OVER[/]"
        table.add_row(*cells)
    console.print(table)


def print_drift_diff(diff, console: Console | None = None, *, limit: int = 40) -> None:
    """What got worse from A to B (then what got better, and what only one report has)."""
    console = console or Console()
    if diff.spec_differences:
        console.print("[bold yellow]warning[/]: the two reports measured different settings, so the changes "
                      "below compare different measurements (only the cases both have are compared):")
        for line in diff.spec_differences:
            console.print("  " + line, markup=False, highlight=False)
    if diff.identical:
        console.print("[bold green]identical[/]: the two reports agree on everything but meta")
        return
    if diff.worse:
        console.print(f"[bold red]WORSE[/]: {len(diff.worse)} changes (error ratio > {diff.threshold:g}, "
                      f"new budget failures, new flags, slopes up by > {diff.slope_rise:g})")
        table = Table()
        for h in ("kind", "where", "change"):
            table.add_column(h)
        for ch in diff.worse[:limit]:
            table.add_row(ch.kind, ch.key, ch.describe().removeprefix(ch.key).strip(), )
        console.print(table)
        if len(diff.worse) > limit:
            console.print(f"... and {len(diff.worse) - limit} more")
    else:
        console.print(f"[bold green]nothing got worse[/] (error ratio threshold {diff.threshold:g}, "
                      f"slope rise {diff.slope_rise:g})")
    if diff.better:
        examples = "; ".join(ch.describe() for ch in diff.better[:3])
        console.print(f"better: {len(diff.better)} changes, e.g. {examples}", highlight=False)
    for side, keys in (("A", diff.only_in_a), ("B", diff.only_in_b)):
        if keys:
            console.print(f"only in {side} (not compared): {len(keys)} keys, e.g. {', '.join(keys[:3])}",
                          highlight=False)


# --- bench ---------------------------------------------------------------------------------------
# Presentation of `ringcheck.commands.bench` documents (the measurement lives there).


def _bench_s(x) -> str:
    return "n/a" if x is None else (f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s")


def _bench_err(errors: dict | None) -> str:
    if not errors:
        return ""
    return " ".join(f"{k} {v:.1e}" for k, v in errors.items())


def _speed_parts(rows: list[dict]) -> list:
    """Median time per case and system, its ratio to the fastest peer ring, and the errors."""
    table = Table(title="speed: median time, ratio to the fastest peer ring of the same case "
                        "(< 1 faster), max abs error vs float64")
    for h in ("case", "system", "layout", "thr", "median", "ratio", "errors vs float64"):
        table.add_column(h, justify="right" if h in ("thr", "median", "ratio") else "left")
    last = None
    for r in rows:
        case = r["key"] if r["key"] != last else ""
        if r["key"] != last and last is not None:
            table.add_section()
        last = r["key"]
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        if ratio and r.get("fastest_peer") not in ("torch_cp", "ring_attention_pytorch"):
            ratio += "*"  # no peer ring ran this case: the ratio is to the fastest system
        if r.get("ratio") is not None and r["system"] == "ringcheck":
            ratio = f"[{'green' if r['ratio'] <= 1.0 else 'red'}]{ratio}[/]"
        table.add_row(case, r["system"], str(r.get("layout")), str(r.get("threads", "")),
                      _bench_s(r.get("median_s")), ratio,
                      _bench_err(r.get("errors")) if r.get("median_s") is not None else f"n/a: {r.get('na')}")
    return [table, "* no peer ring ran this case: ratio to the fastest system of the case"]


def _overlap_parts(rows: list[dict]) -> list:
    """The share of an injected transfer delay each ring hides, at two delays."""
    table = Table(title="overlap: share of the time injected into every transfer that the ring hides, each "
                        "transfer held 0.5x and 2x a ring step's compute (1.00: all)")
    for h in ("case", "system", "step", "hidden at 0.5x", "hidden at 2x", "slower at 2x"):
        table.add_column(h, justify="left" if h in ("case", "system") else "right")
    for r in rows:
        if "held" not in r:
            table.add_row(r["key"], r["system"], "", f"n/a: {r.get('na')}", "", "")
            continue
        share = ["" if h["hidden"] is None else f"{h['hidden']:.2f}" for h in r["held"]]
        table.add_row(r["key"], r["system"], " / ".join(_bench_s(t) for t in r["step_s"]), *share[:2],
                      _bench_s(r["held"][-1]["grew_s"]))
    return [table]


def _balance_parts(rows: list[dict]) -> list:
    """Per layout, how evenly causal work and time spread over the ranks."""
    table = Table(title="load balance (causal): per-rank max / mean of unmasked scores and of forward compute time")
    for h in ("P", "layout", "tokens", "work max/mean", "time max/mean", "per-rank time"):
        table.add_column(h, justify="left" if h in ("layout", "per-rank time") else "right")
    for r in rows:
        work = r["work_max_over_mean"]
        mark = "green" if r["layout"] == "contiguous" or work <= 1.05 else "red"
        table.add_row(str(r["ring_size"]), r["layout"], str(r["tokens"]), f"[{mark}]{work:.3f}[/]",
                      f"{r['time_max_over_mean']:.2f}", " ".join(f"{t * 1e3:.1f}" for t in r["time_s"]) + " ms")
    return [table]


def _memory_parts(mem: dict) -> list:
    """Peak memory per rank against tokens per rank, its fitted slopes, and a score matrix for scale."""
    table = Table(title="memory: peak tensor storage per rank during one call, beyond its shards (MiB), vs "
                        "tokens per rank")
    sizes = sorted({r["tokens_per_rank"] for r in mem["rows"]})
    for h in ("system", "mode", "pass", *[str(n) for n in sizes], "slope", "slope (upper half)"):
        table.add_column(h, justify="left" if h in ("system", "mode", "pass") else "right")
    for fit in mem["fits"]:
        cells = []
        for n in sizes:
            got = [r for r in mem["rows"] if (r["system"], r["mode"], r["passes"], r["tokens_per_rank"])
                   == (fit["system"], fit["mode"], fit["passes"], n)]
            cells.append("" if not got else ("n/a" if got[0]["peak_mib"] is None else f"{got[0]['peak_mib']:.1f}"))
        fmt = lambda s: "" if s is None else f"{s:.2f}"  # noqa: E731
        table.add_row(fit["system"], fit["mode"], fit["passes"], *cells, fmt(fit["slope"]), fmt(fit["slope_upper"]))
    nxn = {r["tokens_per_rank"]: r["nxn_mib"] for r in mem["rows"]}
    return [table, "for scale, one N_local x N_local float32 score matrix over all heads: "
            + ", ".join(f"{n}: {m:.0f} MiB" for n, m in sorted(nxn.items()))]


def _harness_parts(results: dict) -> list:
    """How long the harness's own runs took (the suites, a validate), and the references' rows per second."""
    table = Table(title="harness speed")
    for h in ("what", "result"):
        table.add_column(h)
    for name, r in results.items():
        if "wall_s" in r and r["wall_s"] is None:
            table.add_row(name, r["last_line"])
        elif "wall_s" in r:
            table.add_row(name, f"{r['wall_s']:.1f} s (exit {r['exit']}): {r['last_line']}"
                          + "".join(f"\n{line}" for line in r.get("failed", [])))
        else:
            table.add_row(name, f"{r['rows_per_s']:.1f} rows/s ({r['median_s']:.2f} s)")
    return [table]


# a bench document's sections, in the order they print: each builder takes the section and gives
# what to print (tables, then the lines under them)
_BENCH_SECTIONS = (("speed", _speed_parts), ("overlap", _overlap_parts), ("balance", _balance_parts),
                   ("memory", _memory_parts), ("harness", _harness_parts))


def print_bench(doc: dict, console: Console | None = None) -> None:
    """The tables of a `ringcheck bench` document, one per section present, between the machine it ran
    on and the time it took."""
    console = console or Console()
    meta = doc.get("meta", {})
    console.print(f"[bold]ringcheck bench[/] on {meta.get('machine')} ({meta.get('cpu')}, {meta.get('cores')} cores), "
                  f"torch {meta.get('torch')}, ring over {meta.get('ring_backend')}; load {meta.get('load_1_5_15')}; "
                  f"ring workers {meta.get('worker_threads')} thread each, parent {meta.get('parent_threads')} threads",
                  highlight=False)
    for key, parts in _BENCH_SECTIONS:
        if key in doc:
            for part in parts(doc[key]):
                console.print(part, highlight=False)
    console.print(f"elapsed {meta.get('elapsed_s')} s; load after {meta.get('load_after')}", highlight=False)
