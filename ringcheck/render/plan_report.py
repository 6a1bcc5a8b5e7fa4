"""`ringcheck plan`'s presentation: the per-GPU memory table, the ring step table, the verdict
(terminal and Markdown, from the same rows)."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from ..documents import save

MEMORY_HEADERS = ("per GPU", "bytes", "what")
RING_HEADERS = ("ring step (one layer)", "sent per step", "transfer", "compute", "hidden", "transfer / compute",
                "hidden from")


def _size(x: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds else "0"


def headline(doc: dict) -> str:
    s, m = doc["settings"], doc["model"]
    return (f"{m['parameters'] / 1e9:.2f}B parameters, {s['model']['layers']} layers; {s['seq_len']:,} tokens on a ring "
            f"of P = {s['cp']} ({m['tokens_per_gpu']:,} per GPU), dp = {s['dp']}, {s['dtype']}")


def memory_rows(doc: dict) -> list[tuple[str, str, str]]:
    mem, s = doc["memory"], doc["settings"]
    acts, ring = mem["activations"], mem["activations"]["ring_call_detail"]
    layers = s["model"]["layers"]
    rows = [("weights", _size(mem["weights"]), f"zero {s['zero']}"),
            ("gradients", _size(mem["gradients"]), ""),
            ("optimizer state", _size(mem["optimizer"]), s["optimizer"]),
            ("activations kept", _size(acts["kept"]), (f"every layer's, {layers} layers (no checkpointing)"
                                                       if s["checkpointing"] == "none" else
                                                       f"segment inputs, {layers} layers ({s['checkpointing']} "
                                                       f"checkpointing)")),
            ("  attention per layer", _size(acts["attention_per_layer"]), "the ring's q, k, v, float32 out, lse"),
            ("  rest per layer", _size(acts["rest_per_layer"]), "norms, projections' inputs, SwiGLU"),
            ("  one layer's input", _size(acts["layer_input"]), "what a checkpoint keeps"),
            ("loss", _size(acts["loss"]), "logits, float32 log-softmax and its gradient"),
            ("layer backward", _size(acts["recompute"] + acts["backward_working"] + acts["ring_call"]),
             "recomputed segment + gradients + the ring's call"),
            ("  ring buffers in flight", _size(ring["kv_buffers"] + ring["grad_buffers"]),
             f"K/V {_size(ring['kv_buffers'])}, dK/dV {_size(ring['grad_buffers'])} "
             f"({'backward' if ring['pass'] else 'forward'} step {ring['step']})"),
            ("  block kernel", _size(ring["kernel"]), s["kernel"]),
            ("peak activations", _size(acts["peak"]), f"at the {acts['peak_moment']}"),
            ("total", _size(mem["total"]), f"of {_size(mem['usable'])} usable: {doc['verdict']}")]
    return rows


def ring_rows(doc: dict) -> list[tuple[str, ...]]:
    rows = []
    for name, p in doc["ring"]["passes"].items():
        for label, step in (("first step", p["first"]), ("steady step", p["steady"])):
            rows.append((f"{name}, {label}", _size(step["bytes"]), _ms(step["comm_s"]), _ms(step["compute_s"]),
                         "yes" if step["hidden"] else "NO", f"{step['comm_s'] / step['compute_s']:.3g}"
                         if step["compute_s"] else "-",
                         f"{p['hiding_tokens']:,.0f} tokens per GPU" if label == "steady step" else ""))
    return rows


def text_lines(doc: dict) -> list[str]:
    ring, hw, step = doc["ring"], doc["hardware"], doc["step"]
    lines = [f"device: {hw['device_what']}, {hw['tflops']:g} TFLOPS used ({hw['device_source']})",
             f"link: {hw['link_what']}, {ring['link_gb_per_s']:g} GB/s per direction ({hw['link_source']})"]
    passes = ring["passes"]
    if passes:
        exposed = sum(p["exposed_s"] for p in passes.values())
        compute = sum(p["compute_s"] for p in passes.values())
        lines.append(f"one layer's attention: {_ms(compute)} of compute on the busiest GPU, {_ms(exposed)} of transfer "
                     f"not hidden behind it")
    lines.append(f"optimizer step: {step['micro_batches']} micro-batch(es), {step['tokens_per_gpu']:,} tokens per GPU, "
                 f"{step['compute_s']:.3g} s of compute at the rate used; gradient synchronisation over the dp x cp GPUs "
                 f"{_size(step['sync_bytes'])} in {step['sync_s']:.3g} s"
                 + (" (longer than the compute: it cannot hide behind it)" if step["sync_s"] > step["compute_s"] else ""))
    lines += [f"smallest ring: {doc['smallest_cp']['why']}"]
    lines += [f"note: {note}" for note in doc["notes"]]
    lines += [f"convention: {c}" for c in doc["conventions"]]
    return lines


def print_plan(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"ringcheck plan: {headline(doc)}", markup=False, highlight=False)
    table = Table(box=box.SIMPLE_HEAD)
    for name in MEMORY_HEADERS:
        table.add_column(name, justify="right" if name == "bytes" else "left", no_wrap=name != "what")
    for row in memory_rows(doc):
        table.add_row(*row)
    console.print(table)
    if doc["ring"]["passes"]:
        ring = Table(box=box.SIMPLE_HEAD)
        for name in RING_HEADERS:
            ring.add_column(name, justify="left" if name.startswith("ring") else "right", no_wrap=True)
        for row in ring_rows(doc):
            ring.add_row(*row)
        console.print(ring)
    for line in text_lines(doc):
        console.print(f"- {line}", markup=False, highlight=False)
    style = "bold green" if doc["fits"] else "bold red"
    console.print(f"[{style}]{'FITS' if doc['fits'] else 'DOES NOT FIT'}[/]: ", end="")
    console.print(doc["why"], markup=False, highlight=False)


def _table(headers, rows) -> list[str]:
    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def plan_markdown(doc: dict) -> str:
    out = [f"# ringcheck plan: {doc['verdict']}", "", f"`{doc['meta']['command']}`", "", headline(doc), "",
           doc["why"], "", *_table(MEMORY_HEADERS, memory_rows(doc)), ""]
    if doc["ring"]["passes"]:
        out += [*_table(RING_HEADERS, ring_rows(doc)), ""]
    out += [f"- {line}" for line in text_lines(doc)]
    return "\n".join(out) + "\n"


def write_plan_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """plan.json and plan.md in `out_dir`; returns their paths."""
    out = Path(out_dir)
    paths = {"json": save(doc, out / "plan.json"), "md": out / "plan.md"}
    paths["md"].write_text(plan_markdown(doc), encoding="utf-8")
    return paths
