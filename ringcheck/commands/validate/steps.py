"""The steps of a validate run: the scaled-down cases on a mesh (every group, every call), the
full length on sampled rows, determinism, and what the mesh found.

Determinism is measured, not gated: a ring whose second run of the first case changes bits
within the two runs' budgets of each other (the other float32 roundings of atomic adds, as
flash-attn's and SDPA's backward give on GPUs) is FLAGged, a gate only where required
(``--require determinism``, or ``torch.use_deterministic_algorithms(True)`` where validate
starts); a second run further off than that fails.

Each scaled-down case runs in one dispatch on every CP group of the mesh at once: the contiguous
shards, and two calls before one backward on views (the first of a fused QKV projection, the
second with k and v of other strides and the other group's data). The contiguous results are
judged by the budget rule and the precision class. Where the two calls on views give the same
bits as the contiguous runs of the same data, the views and the second call add nothing to
judge (that they are bit-identical is reported as information); where they differ, each
embedding runs on its own (`DETAIL_CALLS`: each input layout, two contiguous calls) and is
judged by the budget rule, so a failure names the one that caused it. When a dispatch fails,
its calls are run one by one to name the one that raised, and a ring that raises inside the
mesh but not alone is run alone from then on (the mesh row fails and says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringcheck.reference import mp_attention

from ...harness import TWO_CALLS, Mesh, Runner
from ...harness.embedding import GROUP_SEED, LIKELY_CAUSES, embedding_message
from ...harness.runner import SECOND, TWO_CALLS_ON_VIEWS
from ...judge.check import Case, Results, judge_results, peer, reference_kwargs, row_results, truth
from ...judge.inputs import Inputs, make_inputs, sample_rows, with_sampled_rows
from ...judge.precision import ClassContext, class_context, judge_precision
from ...judge.verdict import TENSORS, Verdict
from ...launch import RingError
from ...spec import AttentionSpec, Budget
from .rows import BACKWARD, FLAG, NOT_RUN, CheckRow, backward_row, class_rows, judge_rows, same_results, summarise
from .target import Target, scaled_cases

CONTIGUOUS = "contiguous"
LAYOUT_CALLS = ("fused_qkv", "kv_strides")
DETAIL_CALLS = (*LAYOUT_CALLS, TWO_CALLS)  # each embedding of the inputs on its own
LAYOUTS_ROW = "input layouts: fused qkv views, k/v strides, non-contiguous dout"
TWO_CALLS_ROW = "two calls before backward"
ALL_TENSORS = (*TENSORS, "dsinks")
FULL_SEED = 100003  # the full-length inputs' seed offset
DETERMINISM = "determinism"  # what --require names to make the determinism row's FLAG a gate
DETERMINISM_ROW = "determinism (two runs, same bits)"


def judged_tensors(returns_lse: bool, forward_only: bool = False) -> tuple[str, ...]:
    return tuple(t for t in TENSORS if (returns_lse or t != "lse") and not (forward_only and t in BACKWARD))


def short(exc: BaseException) -> str:
    """The first line of each failing rank's words (a `RingError`'s), for a row's detail."""
    failures = getattr(exc, "failures", None) or {}
    said = {str(t).strip().splitlines()[0] for t in failures.values() if str(t).strip()}
    return "; ".join(sorted(said)[:2]) or str(exc).splitlines()[0]


@dataclass
class Run:
    """One validate run's state as its steps go: where the scaled cases run, which calls are
    still made, what each step found."""

    target: Target
    runner: Runner
    mesh: Mesh
    budget: Budget
    progress: Callable[[str], None] | None
    calls: tuple[str, ...] = (CONTIGUOUS, TWO_CALLS_ON_VIEWS)
    verdicts: list[Verdict] = field(default_factory=list)       # every group's contiguous budget verdicts
    failed_cases: list[tuple[Case, list[Inputs], int]] = field(default_factory=list)  # (case, inputs, group)
    raised: dict[str, str] = field(default_factory=dict)        # call -> what it raised
    mesh_raised: str = ""                                        # what raised inside the mesh (then: alone)
    returns_lse: bool = True
    first: tuple | None = None                                   # (case, inputs, second, runs): determinism
    determinism_required: str = ""                               # why it is a gate ("": a FLAG is reported)

    def note(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    @property
    def alone_words(self) -> str:
        p = self.target.world_size
        return (f"a world of {p} ranks that is just the ring" if self.runner.processes.size is None
                else f"a ring of {p} ranks of the torchrun world")

    def group_inputs(self, case: Case, seed: int, mesh: Mesh) -> list[Inputs]:
        return [make_inputs(case.spec, seed=seed + GROUP_SEED * g, distribution=case.distribution, ring=case.ring)
                for g in range(mesh.rings)]

    def inputs_of(self, case: Case) -> tuple[list[Inputs], Inputs | None]:
        """The case's inputs on every group of the mesh, and (on one ring) the second call's."""
        inputs = self.group_inputs(case, case.seed, self.mesh)
        second = None if self.mesh.rings > 1 else make_inputs(case.spec, seed=case.seed + GROUP_SEED,
                                                             distribution=case.distribution, ring=case.ring)
        if second is not None and SECOND not in self.calls:
            self.calls = (*self.calls, SECOND)
        return inputs, second

    def submit(self, case: Case):
        """The case sent to the ranks (collected by `dispatch`), with the mesh and calls it ran on."""
        inputs, second = self.inputs_of(case)
        return case, inputs, second, self.mesh, self.calls, self.runner.submit(case, inputs, self.mesh, self.calls,
                                                                             second=second)

    def dispatch(self, sent):
        """A submitted case's runs (submitted again where the mesh or the calls changed since);
        on a failure, each call alone to name the one that raised (dropped from then on, and the
        views run call by call), and the ring alone when it raises only inside the mesh (then
        the case again, alone). (case, inputs, second, runs)."""
        case, inputs, second, mesh, calls, result = sent
        if (mesh, calls) != (self.mesh, self.calls):
            return self.dispatch(self.submit(case))
        try:
            return case, inputs, second, result()
        except RingError:
            pass
        try:
            runs = self.runner.run(case, inputs, self.mesh, (CONTIGUOUS,), second=second)
        except RingError as exc:
            if self.mesh.rings == 1 or not self.runner.alone(self.target.world_size) or \
                    not self._alone_runs(case, inputs[0]):
                raise
            self.mesh_raised, self.mesh, self.first = short(exc), Mesh.ring(self.target.world_size), None
            return self.dispatch(self.submit(case))
        others = [c for c in self.calls if c not in (CONTIGUOUS, TWO_CALLS_ON_VIEWS)]
        self.calls = (CONTIGUOUS, *dict.fromkeys([*others, *(c for c in DETAIL_CALLS if c in self.allowed)]))
        self.detail(case, inputs, second, runs, self.calls[1:])
        self.calls = tuple(c for c in self.calls if c not in self.raised)
        return case, inputs, second, runs

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(c for c in DETAIL_CALLS if not (self.target.forward_only and c == TWO_CALLS))

    def detail(self, case: Case, inputs: list[Inputs], second: Inputs | None, runs, calls) -> None:
        """`calls` one by one, merged into `runs`; the ones that raise recorded in `raised`."""
        for call in calls:
            try:
                extra = self.runner.run(case, inputs, self.mesh, (call,), second=second)
            except RingError as exc:
                self.raised[call] = short(exc)
                continue
            for run, more in zip(runs, extra):
                run.calls.update(more.calls)
                run.parts.update(more.parts)

    def _alone_runs(self, case: Case, inputs: Inputs) -> bool:
        try:
            self.runner.run(case, [inputs], Mesh.ring(self.target.world_size))
        except RingError:
            return False
        return True

    def determinism_row(self) -> CheckRow:
        """The first case again: the same bits on every rank of every group (pass); else the two
        runs judged by the budget rule against each other (`run_to_run_row`)."""
        self.note("determinism")
        case, inputs, second, runs = self.first
        again = self.runner.run(case, inputs, self.mesh, (CONTIGUOUS,), second=second)
        same = all(same_results(Results(*(p.get(t) for t in TENSORS), p.get("dsinks")),
                                Results(*(q.get(t) for t in TENSORS), q.get("dsinks")))
                   for a, b in zip(runs, again) for p, q in zip(a.parts[CONTIGUOUS], b.parts[CONTIGUOUS]))
        where = f"[{case.describe()}]" + (f" on every group of mesh {self.mesh.text}" if self.mesh.rings > 1 else "")
        if same:
            return CheckRow(DETERMINISM_ROW, "pass", detail=where, figures={"deterministic": True},
                            promise=DETERMINISM, required=bool(self.determinism_required))
        return run_to_run_row(self, runs, again, where)


def run_to_run_row(run: Run, runs, again, where: str) -> CheckRow:
    """Two runs of the first case whose bits differ, on every group: within the sum of their
    budgets against float64 (each within its own of the truth), the difference is rounding and
    the ring is not deterministic (FLAG; a gate where `run.determinism_required`); beyond it, the
    difference is no rounding (fail)."""
    case, inputs = run.first[0], run.first[1]
    judge = Judge(run, case, judged_tensors(run.returns_lse, run.target.forward_only))
    differ, worst = {}, (0.0, 0.0, 0.0, "")  # (difference / allowed, difference, allowed, tensor)
    for g, (a, b) in enumerate(zip(runs, again)):
        got, other = a.calls[CONTIGUOUS], b.calls[CONTIGUOUS]
        va, vb = (judge.budget(r, inputs[g], group_label(a, run.mesh)) for r in (got, other))
        for name in (t.tensor for t in va.tensors):
            x, y = got.get(name), other.get(name)
            if x is None or y is None or torch.equal(x, y):
                continue
            diff = float((x.double() - y.double()).abs().nan_to_num(float("inf")).max())
            allowed = va[name].max_allowed + vb[name].max_allowed
            differ[name] = differ.get(name, 0) + int((x != y).sum())
            ratio = diff / allowed if allowed > 0 else float("inf")
            worst = max(worst, (ratio, diff, allowed, name))
    ratio, diff, allowed, name = worst
    figures = {"deterministic": False, "differ": differ, "worst": {"tensor": name, "difference": diff,
                                                                    "allowed": allowed}}
    said = (f"a second run changed the bits of {', '.join(f'{t} ({n} elements)' for t, n in differ.items())}; the "
            f"largest difference, {diff:.3e} in {name}, is {ratio:.3g}x the two runs' budgets ({allowed:.3e})")
    if not ratio <= 1.0:
        return CheckRow(DETERMINISM_ROW, "fail", diff, allowed, figures=figures, detail=(
            f"{said}: beyond rounding (not the order of float32 additions: a race, or memory read before it is "
            f"written) {where}"))
    why = run.determinism_required
    gate = (f"required ({why}): the run fails" if why else
            f"reported; --require {DETERMINISM} (or torch.use_deterministic_algorithms(True)) fails the run")
    return CheckRow(DETERMINISM_ROW, FLAG, diff, allowed, figures=figures, promise=DETERMINISM, required=bool(why),
                    detail=(f"not deterministic: {said}: within rounding, as kernels that accumulate with atomic adds "
                            f"give (flash-attn's and SDPA's backward on GPUs); {gate} {where}"))


def group_label(run, mesh: Mesh) -> str:
    """Which CP group a verdict is of, shared by every row that judges groups: empty on a lone
    ring, where there is nothing to tell apart, the group's name inside a mesh."""
    return run.name if mesh.rings > 1 else ""


class Judge:
    """One case's judging: the references of each input once, every call judged against them.
    Of an input the precision class judges (`context_of`), the computation conventions of a
    result are computed once for both verdicts: the budget rule's of a tensor over its budget
    and the class's of every tensor (`ClassContext.conventions`, the same truths)."""

    def __init__(self, run: Run, case: Case, tensors):
        self.run, self.case, self.tensors, self.refs, self.contexts = run, case, tensors, {}, {}

    def refs_of(self, x: Inputs):
        if id(x) not in self.refs:
            self.refs[id(x)] = (x, truth(self.case.spec, x), peer(self.case.spec, x))
        return self.refs[id(x)][1:]

    def context_of(self, x: Inputs) -> ClassContext:
        """The precision class's context of input `x` (made once: its kernel ring, floors, reference)."""
        if id(x) not in self.contexts:
            self.contexts[id(x)] = class_context(self.case, self.refs_of(x)[0], x)
        return self.contexts[id(x)]

    def budget(self, got: Results, x: Inputs, label: str, what: str = "") -> Verdict:
        true, peer_r = self.refs_of(x)
        present = tuple(t for t in self.tensors if got.get(t) is not None)
        context = self.contexts.get(id(x))
        conventions = None if context is None else (
            lambda out, tensors: context.conventions(self.case.spec, x, true, out, tensors))
        v = judge_results(self.case, got, true, peer_r, budget=self.run.budget, tensors=present, inputs=x,
                          conventions=conventions)
        v.case, v.group = f"{v.case}{f' ({what})' if what else ''}", label
        return v


@dataclass
class _Tally:
    """The verdicts of the calls beside the contiguous one, and how many were its bits."""

    verdicts: list[Verdict] = field(default_factory=list)
    identical: int = 0
    total: int = 0

    def add(self, judge: Judge, got: Results, same_as: tuple[Results, Verdict] | None, x: Inputs, label: str,
            what: str) -> None:
        """One call's results: the same bits as the contiguous run (`same_as`: its results and
        verdict) add nothing of their own to judge (the contiguous rows hold their verdict), others
        are judged on their own by the budget rule."""
        self.total += 1
        if same_as is not None and same_results(got, same_as[0]):
            self.identical += 1
        else:
            self.verdicts.append(judge.budget(got, x, label, what))

    def same(self, count: int) -> None:
        """`count` calls known to be the contiguous run's bits."""
        self.total += count
        self.identical += count

    def row(self, name: str, raised: dict[str, str], calls) -> CheckRow:
        said = [f"{c} raised: {raised[c]}" for c in calls if c in raised]
        if said:
            return CheckRow(name, "fail", detail="; ".join(said))
        if not self.total:
            return CheckRow(name, "info", detail="not run")
        info = (f"bit-identical to the contiguous run in {self.identical} of {self.total} calls (information: their "
                f"verdict is the contiguous rows'; some correct kernels round differently on views)")
        if not self.verdicts:
            return CheckRow(name, "pass", detail=info)
        row = summarise(name, self.verdicts, ALL_TENSORS)
        row.detail = f"{row.detail}; {info}"
        return row


def _views_add_nothing(grun, runs, second: Inputs | None) -> bool:
    """Whether a group's two calls on views gave the bits of the contiguous runs of the same data
    (the first: its own; the second: the next group's, or the second inputs' alone)."""
    first_call, second_call = grun.calls[TWO_CALLS_ON_VIEWS]
    other = runs[(grun.index + 1) % len(runs)].calls[CONTIGUOUS] if second is None else grun.calls.get(SECOND)
    return (same_results(first_call, grun.calls[CONTIGUOUS]) and other is not None
            and same_results(second_call, other))


def scaled_rows(run: Run) -> list[CheckRow]:
    """Every scaled-down case on the mesh: the rows per distribution (forward, backward), the
    precision class, the input layouts and two calls before backward."""
    target, by_dist, classes, layouts, twice = run.target, {}, [], _Tally(), _Tally()
    cases = scaled_cases(target)
    sent = run.submit(cases[0])
    for i, case in enumerate(cases):
        run.note(f"{case.distribution}, {case.spec.seq_len // target.world_size} tokens per rank")
        case, inputs, second, runs = run.dispatch(sent)
        if i + 1 < len(cases):  # the ranks compute the next case while this one is judged
            sent = run.submit(cases[i + 1])
        run.first = run.first or (case, inputs, second, runs)
        run.returns_lse = runs[0].calls[CONTIGUOUS].lse is not None
        judge = Judge(run, case, judged_tensors(run.returns_lse, target.forward_only))
        judge.context_of(inputs[0])  # the precision class judges group 0 (below): its conventions serve both
        contiguous = [judge.budget(grun.calls[CONTIGUOUS], inputs[g], group_label(grun, run.mesh))
                      for g, grun in enumerate(runs)]
        for g, grun in enumerate(runs):
            x, label, got, verdict = inputs[g], group_label(grun, run.mesh), grun.calls[CONTIGUOUS], contiguous[g]
            if g == 0:  # the precision class judges the kernel's roundings: one group's data tells them
                precision = judge_precision(case, got, judge.refs_of(x)[0], x, tensors=judge.tensors,
                                            context=judge.context_of(x))
                precision.group = label
                classes.append(precision)
            by_dist.setdefault(case.distribution, []).append(verdict)
            run.verdicts.append(verdict)
            if not verdict.passed:
                run.failed_cases.append((case, inputs, g))
        if TWO_CALLS_ON_VIEWS in run.calls:  # the common path: one dispatch held every embedding
            if all(_views_add_nothing(grun, runs, second) for grun in runs):
                layouts.same(2 * len(runs))
                twice.same(2 * len(runs))
                continue
            run.detail(case, inputs, second, runs, run.allowed)
        for g, grun in enumerate(runs):
            x, label, got, verdict = inputs[g], group_label(grun, run.mesh), grun.calls[CONTIGUOUS], contiguous[g]
            for call in LAYOUT_CALLS:
                if call in grun.calls:
                    layouts.add(judge, grun.calls[call], (got, verdict), x, label, call.replace("_", " "))
            if TWO_CALLS in grun.calls:
                other = (g + 1) % len(runs)
                first_call, second_call = grun.calls[TWO_CALLS]
                twice.add(judge, first_call, (got, verdict), x, label, "first of two calls")
                alone = ((runs[other].calls[CONTIGUOUS], contiguous[other]) if second is None else
                         (grun.calls[SECOND], None) if SECOND in grun.calls else None)
                twice.add(judge, second_call, alone, inputs[other] if second is None else second, label,
                          "second of two calls")
    lengths = ",".join(str(n) for n in target.local_lengths)
    rows = []
    for name, verdicts in by_dist.items():
        rows.append(summarise(f"forward  {name} (local {lengths})", verdicts, ("out", "lse")))
        rows.append(backward_row(f"backward {name} (local {lengths})", verdicts, target.forward_only))
    rows += class_rows(classes, lengths, target.forward_only)
    rows.append(layouts.row(LAYOUTS_ROW, run.raised, LAYOUT_CALLS))
    rows.append(CheckRow(TWO_CALLS_ROW, NOT_RUN, detail="--forward-only: no backward, so two calls before one "
                                                        "are not run") if target.forward_only
                else twice.row(TWO_CALLS_ROW, run.raised, (TWO_CALLS,)))
    return rows


def _certify_row_reference(spec: AttentionSpec, sparse: Inputs, rows: torch.Tensor) -> CheckRow:
    """The float64 row reference itself, against mpmath at 30 certified digits, on a few rows."""
    few = rows[torch.linspace(0, len(rows) - 1, min(4, len(rows))).round().long().unique()]
    true = row_results(spec, sparse, few, low=False)
    mp = mp_attention(sparse.q, sparse.k, sparse.v, sparse.dout, rows=few, cache=False,
                      **reference_kwargs(spec, sparse))
    worst = 0.0
    for a, b in ((true.out, mp.out), (true.lse, mp.lse), (true.dq, mp.dq)):
        ok = torch.isfinite(b)
        worst = max(worst, float((a[ok] - b[ok]).norm() / b[ok].norm().clamp_min(1e-300)))
    return CheckRow(f"reference: float64 rows vs mpmath ({mp.certified_digits:.0f} digits, {len(few)} rows)",
                    "pass" if worst <= 1e-12 else "fail", worst, 1e-12,
                    f"normwise relative difference of out, lse, dq at rows {few.tolist()}")


def judge_sampled(run: Run, spec: AttentionSpec, whole: Results, x: Inputs, rows: torch.Tensor, refs, tensors,
                   group: str, batch: slice = slice(None), peer_errors=None) -> Verdict:
    """One group's contiguous results (`whole`; of the batch elements `batch`) on sampled query
    rows (`rows`; dk and dv of every key) against the row references `refs` (float64,
    same-dtype peer) of `x`, those batch elements' inputs (`peer_errors`: see `rows.judge_rows`)."""
    lse = whole.lse if whole.lse is not None else torch.zeros(whole.out.shape[0], whole.out.shape[2],
                                                               whole.out.shape[1])
    got = Results(whole.out[batch, rows], lse[batch][:, :, rows], None if whole.dq is None else whole.dq[batch, rows],
                  *(None if t is None else t[batch] for t in (whole.dk, whole.dv)), whole.dsinks,
                  whole.dsinks_parts, whole.sinks_grad)
    verdict = judge_rows(spec, run.target.ring, got, *refs, rows, tensors, run.budget, x, peer_errors)
    verdict.group = group
    return verdict


def full_length_rows(run: Run, full: Mesh) -> tuple[list[CheckRow], list[Verdict]]:
    """The full target length on sampled rows (dq of the rows, dk and dv of every key) on every
    group of `full` (alone where the scaled cases had to go alone), and the certification of
    the row reference."""
    target = run.target
    full = Mesh.ring(target.world_size) if run.mesh_raised else full
    spec = target.full_spec()
    run.note(f"full length {spec.seq_len}")
    rows = sample_rows(spec.seq_len, target.sample_rows, target.seed)
    sparse = [with_sampled_rows(make_inputs(spec, seed=target.seed + FULL_SEED + GROUP_SEED * g, distribution="normal",
                                            ring=target.ring), rows) for g in range(full.rings)]
    pending = run.runner.submit(Case(spec, target.ring), sparse, full)
    run.note("the row reference against mpmath")  # while the ranks compute the full length
    certified = _certify_row_reference(spec, sparse[0], rows)
    references = [(row_results(spec, x, rows, low=False), row_results(spec, x, rows, low=True)) for x in sparse]
    runs = pending()
    tensors = judged_tensors(run.returns_lse, target.forward_only)
    verdicts = [judge_sampled(run, spec, grun.calls[CONTIGUOUS], x, rows, refs, tensors, group_label(grun, full))
                for grun, x, refs in zip(runs, sparse, references)]
    where = f" on {full.rings} CP groups of mesh {full.text}" if full.rings > 1 else ""
    return [certified,
            summarise(f"forward  full length {spec.seq_len}, {len(rows)} rows{where}", verdicts, ("out", "lse")),
            backward_row(f"backward full length {spec.seq_len}, {len(rows)} rows, all keys{where}", verdicts,
                         target.forward_only)], verdicts


def mesh_row(run: Run, where) -> CheckRow:
    """What the mesh found: group handling checked (pass), a ring that passes alone and fails
    inside the mesh (fail, with the likely causes), or why it ran on one ring only (info)."""
    if where.alone:
        return CheckRow(f"mesh: {where.alone}", "info", detail=where.scaled.describe())
    mesh = where.scaled
    label = f"mesh: {mesh.text}, {mesh.rings} CP groups at once"
    if run.mesh_raised:
        return CheckRow(label, "fail", detail=(
            f"raises inside mesh {mesh.text} ({run.mesh_raised}) and runs alone ({run.alone_words}), where the rest "
            f"of this run was made: the ring does not keep to the group it is given. Likely causes: {LIKELY_CAUSES}"))
    full = where.full.describe() if where.full != mesh else "the full length on the mesh too"
    if not run.failed_cases:
        return CheckRow(label, "pass", detail=f"{mesh.describe()}; every group judged; full length: {full}")
    failing = sorted({v.group for v in run.verdicts if not v.passed and v.group})
    case, inputs, g = run.failed_cases[0]
    if not run.runner.alone(case.ring.world_size):  # a torchrun world larger than the ring has no clean room
        return CheckRow(label, "info", detail=f"[{case.describe()}] " + embedding_message(
            mesh, failing or ["the only group"], None, "") + f"; not run alone: this world has "
            f"{run.runner.processes.size} ranks, a ring alone needs a world of {case.ring.world_size}")
    run.note("the failing case alone")
    alone = run.runner.run(case, [inputs[g]], Mesh.ring(case.ring.world_size))[0].calls[CONTIGUOUS]
    judge = Judge(run, case, judged_tensors(run.returns_lse, run.target.forward_only))
    passed = judge.budget(alone, inputs[g], "").passed
    text = embedding_message(mesh, failing or ["the only group"], passed, run.alone_words)
    return CheckRow(label, "fail" if passed else "info", detail=f"[{case.describe()}] {text}")
