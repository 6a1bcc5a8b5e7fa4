"""validate's rows of the ring as training wraps it: recomputed under activation checkpointing
(`recompute_row`) and compiled (`compile_row`). Both run the run's first scaled-down case on
every CP group of its mesh; `ringcheck.harness.wrappers` makes the calls on the ranks.

Recompute is exactness. Two layers' worth (the forward of one input, the forward of another,
one backward of both), each call inside `torch.utils.checkpoint`, with ``use_reentrant=False``
and with ``True``, against the same calls without checkpointing (the first case's plain calls,
and the two plain layers where anything differs from those). The recompute runs the same
operations on the same inputs, so a deterministic ring gives the same bits, and any difference
fails the row. A ring that is not deterministic (the determinism row)
cannot give the same bits: the row says so and judges the checkpointed results by the budget
rule against float64 instead, never failing on bits that a second plain run would change too.

Compile is compatibility. The implementation's function under `torch.compile` (aot_eager on the
CPU, inductor on CUDA), called on two inputs with a backward each: whether it compiles, its
graph breaks (process-group calls break the graph: that is information), whether it would
compile whole (fullgraph). It fails only when the compiled results differ from eager: bit for
bit where the same kernels run (aot_eager, a deterministic ring), else by the budget rule. A
ring that does not compile is reported (info), not failed. It runs only when asked
(``--compile``): dynamo takes seconds per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...harness import TWO_CALLS
from ...harness.runner import SECOND
from ...harness.wrappers import COMPILE_INFO, COMPILED, MODES, differing
from ...launch import RingError
from .rows import NOT_RUN, CheckRow, summarise
from .steps import ALL_TENSORS, CONTIGUOUS, TWO_CALLS_ROW, Judge, Run, group_label, judged_tensors, short

RECOMPUTE_ROW = "recompute: two layers under torch.utils.checkpoint"
COMPILE_ROW = "compile: torch.compile of a function calling the ring"
LAYERS = ("layer 1", "layer 2")
STATE_CAUSE = ("the likely cause: the ring keeps state between its forward and its backward outside the autograd "
               "context (a module-level or per-group slot), and the backward's recompute overwrote it")
NOT_DETERMINISTIC = ("the ring is not deterministic (two runs of the same calls differ in bits: the determinism row, or "
                     "the plain calls run again), so no second run can match the first bit for bit: judged by the budget "
                     "rule against float64 instead")


def _layer_inputs(inputs, second, g: int):
    """The inputs of group `g`'s two calls: its own, then the next group's (one ring: `second`)."""
    return inputs[g], inputs[(g + 1) % len(inputs)] if second is None else second


def _run_calls(run: Run, calls: tuple[str, ...]) -> tuple[list | None, dict[str, str]]:
    """The first case's `calls` in one dispatch; where it raises, each call alone, so that the
    one that raised is named: (every group's runs, {call: what it raised})."""
    case, inputs, second, _ = run.first
    try:
        return run.runner.run(case, inputs, run.mesh, calls, second=second), {}
    except RingError:
        pass
    runs, raised = None, {}
    for call in calls:
        try:
            more = run.runner.run(case, inputs, run.mesh, (call,), second=second)
        except RingError as exc:
            raised[call] = short(exc)
            continue
        for grun, extra in zip(runs or more, more):
            grun.calls.update(extra.calls)
            grun.parts.update(extra.parts)
        runs = runs or more
    return runs, raised


def _budget_words(row: CheckRow) -> str:
    """Against float64, per tensor: the ones over budget with how far, else the worst."""
    over = [f"{t} {_times(s['ratio'])}" for t, s in row.tensors.items() if not s["passed"]]
    if over:
        return f"against float64 over the budget: {', '.join(over)} its budget"
    t, s = max(row.tensors.items(), key=lambda ts: ts[1]["ratio"], default=("", {"ratio": 0.0}))
    return f"against float64 within the budget (worst: {t} {_times(s['ratio'])} its budget)"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _differ_words(differ: dict[str, set[int]], rings: int) -> list[str]:
    """{"layer 1 dq, dk, dv": CP groups} in words: which groups, where there are several."""
    def where(groups):
        if rings == 1:
            return ""
        return " (every CP group)" if len(groups) == rings else f" (CP group {', '.join(map(str, sorted(groups)))})"
    return [f"{what}{where(groups)}" for what, groups in differ.items()]


def _reproduces(run: Run, call: str, runs) -> bool:
    """Whether `call` of the first case, run again, gives the bits it gave in `runs`: a ring that
    passed the determinism row may still not be deterministic, so bits that differ are checked
    against a second plain run before they fail (never a failure for bits a rerun changes too)."""
    again, raised = _run_calls(run, (call,))
    if again is None or raised:
        return True
    def pairs(a, b):
        return zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return not any(differing(x, y) for g0, g1 in zip(runs, again) for x, y in pairs(g0.calls[call], g1.calls[call]))


@dataclass
class _Compared:
    """Wrapped calls against their plain counterparts on every group: what differs in bits
    (`differ`: what -> word -> CP groups) and each call, to judge by the budget rule."""

    calls: list[tuple] = field(default_factory=list)  # (what, call in words, label, got, plain, inputs, differ)
    differ: dict[str, dict[str, set[int]]] = field(default_factory=dict)

    def add(self, what: str, call: str, grun, label: str, got, plain, x) -> None:
        names = differing(got, plain)
        if names:
            self.differ.setdefault(what, {}).setdefault(f"{call} {', '.join(names)}", set()).add(grun.index)
        self.calls.append((what, call, label, got, plain, x, bool(names)))

    def judged(self, judge, everything: bool) -> tuple[list, list]:
        """The budget verdicts of the wrapped calls and of their plain counterparts: every call
        (`everything`), else those whose bits differ."""
        chosen = [c for c in self.calls if everything or c[-1]]
        return ([judge.budget(got, x, label, f"{what}, {call}") for what, call, label, got, _, x, _ in chosen],
                [judge.budget(plain, x, label, f"plain, {call}") for what, call, label, _, plain, x, _ in chosen])

    def words(self, rings: int) -> dict[str, list[str]]:
        return {what: _differ_words(parts, rings) for what, parts in self.differ.items()}

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {what: {part: sorted(groups) for part, groups in parts.items()} for what, parts in self.differ.items()}


def _singles(run: Run) -> list[tuple] | None:
    """Per group, the first case's plain calls on each layer's inputs (its own, then the next
    group's or the second inputs), as the scaled cases made them: the bits each checkpointed
    layer gives when nothing differs; None where the first case's runs do not hold them."""
    _, _, second, runs = run.first
    if second is not None:
        return None if any(SECOND not in g.calls for g in runs) else [(g.calls[CONTIGUOUS], g.calls[SECOND])
                                                                     for g in runs]
    return [(g.calls[CONTIGUOUS], runs[(g.index + 1) % len(runs)].calls[CONTIGUOUS]) for g in runs]


def _compare_layers(run: Run, runs, plain, raised) -> _Compared:
    """Each checkpointed layer of every group against `plain` (per group: the two layers' results)."""
    case, inputs, second, _ = run.first
    compared = _Compared()
    for grun in runs:
        for mode in (m for m in MODES if m not in raised):
            for layer, got, without, x in zip(LAYERS, grun.calls[mode], plain[grun.index],
                                              _layer_inputs(inputs, second, grun.index)):
                compared.add(MODES[mode], layer, grun, group_label(grun, run.mesh), got, without, x)
    return compared


def recompute_row(run: Run, deterministic: bool) -> CheckRow:
    """Two layers under `torch.utils.checkpoint` (both implementations) against the same two
    layers without it: the same bits (a deterministic ring), else the budget rule. The first
    case's plain calls stand for the run without checkpointing while nothing differs from them
    (they are its bits for a ring the other rows passed); where something does, the two layers
    without checkpointing are run, and they are what the row compares with."""
    if run.target.forward_only:
        return CheckRow(RECOMPUTE_ROW, NOT_RUN, detail="--forward-only: no backward, so nothing is recomputed")
    run.note("recompute under activation checkpointing")
    case = run.first[0]
    singles = _singles(run)
    runs, raised = _run_calls(run, (*MODES,) if singles else (TWO_CALLS, *MODES))
    compared = None if runs is None or TWO_CALLS in raised else _compare_layers(
        run, runs, singles or [g.calls[TWO_CALLS] for g in runs], raised)
    if compared is not None and compared.differ and singles:  # the two layers without checkpointing themselves
        plain, raised_plain = _run_calls(run, (TWO_CALLS,))
        raised.update(raised_plain)
        if plain is not None and TWO_CALLS not in raised:
            for grun, more in zip(runs, plain):
                grun.calls[TWO_CALLS] = more.calls[TWO_CALLS]
            compared = _compare_layers(run, runs, [g.calls[TWO_CALLS] for g in runs], raised)
    if compared is None or TWO_CALLS in raised:
        return CheckRow(RECOMPUTE_ROW, "info", detail=(
            f"not judged: the two layers without checkpointing raised ({raised.get(TWO_CALLS, 'every call')}); "
            f"see '{TWO_CALLS_ROW}'"))
    if compared.differ and deterministic:
        deterministic = _reproduces(run, TWO_CALLS, runs)
    checked, plain = compared.judged(Judge(run, case, judged_tensors(run.returns_lse)), not deterministic)
    row = summarise(RECOMPUTE_ROW, checked, ALL_TENSORS) if checked else CheckRow(RECOMPUTE_ROW, "pass")
    row.figures = {"case": case.describe(), "layers": 2, "deterministic": deterministic,
                   "comparison": "bits" if deterministic else "budget rule",
                   "modes": {words: {"raised": raised.get(m), "differ": compared.to_json().get(words, {})}
                             for m, words in MODES.items()}}
    said = [f"{MODES[m]} raised: {raised[m]}" for m in MODES if m in raised]
    if not deterministic:
        located = [row.detail] if row.status == "fail" else []
        row.status = "fail" if said or row.status == "fail" else "pass"
        row.detail = "; ".join([f"{NOT_DETERMINISTIC}: checkpointed, {_budget_words(row)}", *said, *located])
        return row
    if not compared.differ and not said:
        where = f" on {run.mesh.rings} CP groups of mesh {run.mesh.text}" if run.mesh.rings > 1 else ""
        row.detail = (f"{' and '.join(MODES.values())}: out, lse and the gradients of both layers the same bits as "
                      f"without checkpointing{where} [{case.describe()}]")
        return row
    words = [f"{mode}: {'; '.join(parts)} differ from the run without checkpointing"
             for mode, parts in compared.words(run.mesh.rings).items()]
    if checked:
        words.append(f"checkpointed, {_budget_words(row)}")
        if summarise(RECOMPUTE_ROW, plain, ALL_TENSORS).status == "fail":
            words.append(f"the run without checkpointing is itself over budget: see '{TWO_CALLS_ROW}'")
    row.status = "fail"
    row.detail = "; ".join([*said, *words, STATE_CAUSE]) + f" [{case.describe()}]"
    return row


def _compile_words(infos: list[dict]) -> str:
    first = infos[0]
    counts = sorted({i["graph_breaks"] for i in infos})
    breaks = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]} (by rank)"
    reasons = "; ".join(f"{r} x{n}" for r, n in list(first["reasons"].items())[:3])
    warned = first.get("warnings") or []
    return (f"{first['backend']}: {breaks} graph break{'' if breaks == '1' else 's'}" + (f" ({reasons})" if reasons else "")
            + f", {first['graphs']} graph{'' if first['graphs'] == 1 else 's'}, fullgraph "
            + ("yes" if all(i["fullgraph"] for i in infos) else "no")
            + (f"; dynamo warned: {warned[0]}" + (f" (and {len(warned) - 1} more)" if len(warned) > 1 else "")
               if warned else ""))


def compile_row(run: Run, deterministic: bool) -> CheckRow:
    """`torch.compile` of a function calling the ring (with ``--compile``): it compiles or not,
    its graph breaks, and its results against eager (info where it does not compile)."""
    if not run.target.compile:
        return CheckRow(COMPILE_ROW, "info", detail="not run: dynamo takes seconds per rank; pass --compile")
    run.note("torch.compile")
    case, inputs, second, _ = run.first
    runs, raised = _run_calls(run, (CONTIGUOUS, COMPILED, *((SECOND,) if second is not None else ())))
    if runs is None or COMPILED in raised or CONTIGUOUS in raised:
        return CheckRow(COMPILE_ROW, "info", detail=f"not judged: a rank failed under torch.compile "
                                                     f"({raised.get(COMPILED) or raised.get(CONTIGUOUS)})")
    infos = [rank[0][COMPILE_INFO] for grun in runs for rank in grun.parts[COMPILED]]
    backend, said = infos[0]["backend"], _compile_words(infos)
    figures: dict[str, Any] = {"case": case.describe(), **{k: infos[0][k] for k in ("backend", "reasons", "graphs",
                                                                                   "warnings")},
                               "graph_breaks": [i["graph_breaks"] for i in infos],
                               "fullgraph": all(i["fullgraph"] for i in infos), "errors": [i["error"] for i in infos]}
    errors = [f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]]
    if errors:
        return CheckRow(COMPILE_ROW, "info", figures=figures, detail=(
            f"does not compile with {backend} (reported, not failed: a ring that cannot compile is a limit, not a "
            f"wrong result): {'; '.join(sorted(set(errors))[:2])}"))
    compared = _Compared()
    for grun in runs:
        eager = (grun.calls[CONTIGUOUS], runs[(grun.index + 1) % len(runs)].calls[CONTIGUOUS] if second is None
                 else grun.calls[SECOND])
        for call, got, want, x in zip(("call 1", "call 2"), grun.calls[COMPILED], eager,
                                      _layer_inputs(inputs, second, grun.index)):
            compared.add("compiled", call, grun, group_label(grun, run.mesh), got, want, x)
    if compared.differ and deterministic and backend == "aot_eager":
        deterministic = _reproduces(run, CONTIGUOUS, runs)
    bits = deterministic and backend == "aot_eager"
    checked, _ = compared.judged(Judge(run, case, judged_tensors(run.returns_lse, run.target.forward_only)), not bits)
    row = summarise(COMPILE_ROW, checked, ALL_TENSORS) if checked else CheckRow(COMPILE_ROW, "pass")
    row.figures = {**figures, "comparison": "bits" if bits else "budget rule",
                   "differ": compared.to_json().get("compiled", {})}
    if bits:
        differ = compared.words(run.mesh.rings).get("compiled")
        if differ:
            row.status = "fail"
            row.detail = (f"{said}; {'; '.join(differ)} differ from eager, where {backend} runs the same kernels; "
                          f"compiled, {_budget_words(row)} [{case.describe()}]")
        else:
            row.detail = f"{said}; two calls' out, lse and gradients the same bits as eager [{case.describe()}]"
        return row
    why = NOT_DETERMINISTIC if not deterministic else f"{backend} runs kernels of its own: judged by the budget rule"
    located = f"; {row.detail}" if row.status == "fail" else ""
    row.detail = f"{said}; {why}: compiled, {_budget_words(row)}{located}"
    return row
