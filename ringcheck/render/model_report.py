"""`ringcheck step --model`'s presentation: the model and the glue, the case table (terminal and
Markdown), the diagnosis by semantics and the cases not run."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from .step_report import VERDICT_WORDS, budgets_text, write_step_reports

_STYLE = {"pass": "bold green", "fail": "bold red", "no verdict": "bold yellow"}
HEADERS = ("case", "tokens, shard", "loss error", "logits error", "logits budget", "worst gradient error", "gradient budget",
           "first parameter out", "verdict")


def case_rows(doc: dict) -> list[tuple[str, ...]]:
    rows = []
    for c in doc["cases"]:
        shape = (c.get("shape") or {}).get("brief", "-")
        if c["verdict"] in ("not run", "no verdict"):
            rows.append((c["case"], shape, "-", "-", "-", "-", "-", "-", c["verdict"]))
            continue
        first = c["first_out"]
        grads = bool(c["gradients"])
        rows.append((c["case"], shape, f"{c['loss']['error']:.2g}", f"{c['logits']['error']:.2g}",
                     f"{c['logits']['budget']:.2g}", f"{c['worst_gradient']:.2g}" if grads else "-",
                     budgets_text(c) if grads else "-",
                     "-" if first is None else f"{first['name']} (x{first['factor']:.4g})", c["verdict"]))
    return rows


def model_lines(doc: dict) -> list[str]:
    """The tiny model (its layers' attention; what was scaled, kept, switched off) and the glue."""
    m, g = doc["model"], doc["glue"]
    kinds: dict[str, list[int]] = {}
    for layer in m["layers"]:
        kinds.setdefault(", ".join(layer["features"]), []).append(layer["index"])
    layers = "; ".join(f"layers {','.join(map(str, ix))}: {words}" for words, ix in kinds.items())
    scaled = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in m["scaled"].items()) or "nothing"
    kept = ", ".join(f"{k} {v}" for k, v in m["kept"].items()) or "nothing"
    off = ", ".join(f"{k} ({v})" for k, v in m["disabled"].items()) or "nothing"
    return [f"model {m['name']} (tiny{', MoE' if m['moe'] else ''}; vocab {m['vocab_size']}, {m['seq_len']} tokens): "
            f"{layers}",
            f"scaled: {scaled}", f"kept: {kept}", f"switched off: {off}",
            f"glue {g['spec']} ({g['describe'] or g['name']}): layout {g['layout']}, attn_implementation "
            f"{g['attn_implementation']!r}" + (", prepare(cu_seqlens, group) before every forward" if g["prepare"]
                                              else "") + (f"; the batch sharded by {g['sharding']}" if g.get("sharding")
                                                          else "") + (f"; shims: {'; '.join(g['shims'])}"
                                                                      if g.get("shims") else ""),
            f"truth: {doc['rule']['truth']}; {doc['rule']['precision']}"] + (
        [doc["noise"]["words"]] if doc.get("noise") else [])


def shape_lines(doc: dict) -> list[str]:
    """What each packed case's documents were (the table gives every case's tokens and shard)."""
    return [f"{c['case']}: {c['shape']['text']}" for c in doc["cases"] if (c.get("shape") or {}).get("documents")]


def finding_lines(doc: dict) -> list[str]:
    """One line per failed case (the lost semantic, or none matched) and per case not run."""
    lines = []
    floored = {f["name"]: f["noise"] for c in doc["cases"] for f in c.get("noise_floored", [])}
    if floored:
        worst = max(floored.values())
        lines.append(f"{len(floored)} parameters' gradients pass through the model's own float32 steps (e.g. "
                     f"{next(iter(floored))}): the truth itself moves by up to {worst:.2g} when its sums are reordered or its float32 steps run in float64, "
                     f"and their budget is {doc['rule']['k_noise']:g} x that, measured")
    unjudged = {g["name"]: g["why"] for c in doc["cases"] for g in c.get("not_judged", [])}
    for name, why in unjudged.items():
        lines.append(f"{name}: not judged: {why}")
    for c in doc["cases"]:
        if c["verdict"] in ("not run", "no verdict"):
            lines.append(f"{c['case']}: {c['verdict']}: {c['why']}")
        elif c["verdict"] == "fail":
            d = c.get("diagnosis") or {}
            if d.get("matched"):
                lines.append(f"{c['case']}: {d['words']}")
            else:
                lines.append(f"{c['case']}: no known loss of semantics matches" + (f" ({d['words']})"
                                                                                  if d.get("words") else ""))
    return lines


def print_model_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    for line in model_lines(doc):
        console.print(f"- {line}", markup=False, highlight=False)
    table = Table(title="the model through the glue at CP=P against its own attention at CP=1 (relative errors)",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for name in HEADERS:
        table.add_column(name, justify="left" if name in ("case", "tokens, shard", "first parameter out")
                         else "right", no_wrap=True)
    marks = {"pass": "[green]ok[/]", "fail": "[red]FAIL[/]", "not run": "[yellow]not run[/]",
             "no verdict": "[yellow]no verdict[/]"}
    for row in case_rows(doc):
        table.add_row(*row[:-1], marks[row[-1]])
    console.print(table)
    for line in shape_lines(doc) + finding_lines(doc):
        console.print(f"- {line}", markup=False, highlight=False)
    console.print(f"[{_STYLE[doc['verdict']]}]{VERDICT_WORDS[doc['verdict']]}[/]: ", end="")
    console.print(doc["why"], markup=False, highlight=False)


def model_markdown(doc: dict) -> str:
    out = [f"# ringcheck step --model {doc['model']['name']}: {VERDICT_WORDS[doc['verdict']]}", "",
           f"`{doc['command']}`", "", doc["why"], "", *[f"- {line}" for line in model_lines(doc)], "",
           "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(row) + " |" for row in case_rows(doc)]
    rule = doc["rule"]
    out += ["", *[f"- {line}" for line in shape_lines(doc) + finding_lines(doc)], "",
            f"Rule: loss {rule['loss']}; logits {rule['logits']}; gradients {rule['gradients']}.", ""]
    return "\n".join(out)


def write_model_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """step.json and step.md in `out_dir`, as `ringcheck step` writes them; returns their paths."""
    return write_step_reports(doc, out_dir, model_markdown)
