"""The rows of validate's verdict table: `CheckRow`, and how judged cases become rows (the
worst error / budget per tensor, the failing ranks and CP groups), plus the rows that judge no
tensor (finiteness, shape, work balance, the flash-attn stand-in)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ...judge.check import Results, seq_dim, spec_floors, token_owners
from ...judge.inputs import Inputs
from ...judge.sinks import judge_sinks
from ...judge.verdict import Verdict, judge
from ...ring.layouts import work_counts
from ...spec import AttentionSpec, Budget, RingSpec


@dataclass
class CheckRow:
    """One row of the verdict table. status: "pass", "fail", "info" (never gates), "not run", or
    "flag": a measurement that found the ring off one of its promises (memory, communication,
    overlap; `promises`), which gates only when `required` (``--require``).

    Rows that judge tensors also carry `tensors`: per tensor in order, {"passed", "ratio" (the
    worst error / budget over the row's cases), "ranks" (the ranks holding elements over
    budget)}, `failing_ranks`, the union of those ranks, and `failing_groups`, the CP groups
    of a mesh (in words, with their global ranks) whose results failed; `detail` locates the
    worst element. `figures`: what a row measured beyond the tensors, by name (the recompute
    and compile rows: `ringcheck.commands.validate.wrapped`), empty for the others."""

    check: str
    status: str
    error: float | None = None
    budget: float | None = None
    detail: str = ""
    tensors: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    failing_ranks: list[int] = dataclasses.field(default_factory=list)
    failing_groups: list[str] = dataclasses.field(default_factory=list)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    promise: str = ""        # the promise a measurement row measures ("memory", ...); "" for the others
    required: bool = False   # its FLAG fails the run (--require)

    @property
    def passed(self) -> bool:
        return self.status != "fail" and not (self.status == FLAG and self.required)


def judge_rows(spec: AttentionSpec, ring: RingSpec, got: Results, true: Results, peer_r: Results,
               rows: torch.Tensor, tensors, budget: Budget, inputs: Inputs, peer_errors=None) -> Verdict:
    """`got` on the sampled query `rows` (dk, dv of every key) against the row references `true`
    and `peer_r`; `peer_errors` (`ringcheck.judge.peers.whole_peer_errors`), where given, are the
    peer's errors per tensor measured over the whole tensor, in place of the sampled rows' own."""
    peer_errors = peer_errors or {}

    def peer_of(name):
        said = peer_errors.get(name)
        return {} if said is None else {"peer_stats": said.stats, "peer_words": said.words}
    verdict = Verdict(f"full length {spec.seq_len}, {len(rows)} sampled rows")
    floors = spec_floors(spec, inputs, rows)
    owner, _ = token_owners(spec.seq_len, ring, spec.variant.cu_seqlens)
    if true.dsinks is not None and got.dsinks is not None:  # (not under --forward-only)
        tensors = (*tensors, "dsinks")
    for name in tensors:
        dtype = torch.float32 if name == "lse" else spec.torch_dtype
        if name == "dsinks":  # one value per head: no rank or row to name; each rank's, under its convention
            verdict.tensors.append(judge_sinks(lambda value: judge(
                name, value, true.dsinks, peer_r.dsinks, k=budget.k_for(name), dtype=dtype,
                floor=floors.get(name, 0.0), **peer_of(name)), got))
            continue
        keys = name in ("dk", "dv")
        ranks = owner if keys else owner[rows]  # out, lse, dq: of the sampled rows only

        def locate(index, keys=keys, ranks=ranks, dim=seq_dim(name)):
            i, head = index[dim], index[3 - dim]
            return (f"rank {int(ranks[i])} of {ring.world_size} ({ring.layout}), "
                    + (f"key {i}, kv head {head}" if keys else f"sampled row {int(rows[i])}, head {head}"))
        verdict.tensors.append(judge(name, got.get(name), true.get(name), peer_r.get(name),
                                     k=budget.k_for(name), dtype=dtype, locate=locate,
                                     floor=floors.get(name, 0.0), owner=(seq_dim(name), ranks), **peer_of(name)))
    return verdict


def _ratio(t) -> float:
    return t.error / t.budget if t.budget > 0 else (math.inf if t.error > 0 else 0.0)


def summarise(label: str, verdicts: list[Verdict], tensors) -> CheckRow:
    """One row over several cases: per tensor the worst error / budget and the failing ranks;
    the row's error, budget and detail are those of the worst element (largest ratio)."""
    judged = [(v, t) for v in verdicts for t in v.tensors if t.tensor in tensors]
    if not judged:
        return CheckRow(label, "info", detail="not checked (no lse returned)")
    per: dict[str, dict[str, Any]] = {}
    for _, t in judged:
        s = per.setdefault(t.tensor, {"passed": True, "ratio": 0.0, "ranks": []})
        s["passed"] = s["passed"] and t.passed
        s["ratio"] = max(s["ratio"], _ratio(t))
        s["ranks"] = sorted(set(s["ranks"]) | set(t.failing_ranks))
    v, t = max(judged, key=lambda vt: _ratio(vt[1]))
    failing = [t for _, t in judged if not t.passed]
    groups = list(dict.fromkeys(v.group for v, t in judged if not t.passed and v.group))
    detail = t.describe() + f" [{v.case}{', ' + v.group if v.group else ''}]"
    if failing:
        detail = f"{len(failing)} of {len(judged)} tensor checks over budget; worst: " + detail
        if groups:
            detail += "; failing in " + "; ".join(groups)
    return CheckRow(label, "fail" if failing else "pass", t.error, t.budget, detail, per,
                    sorted({r for s in per.values() for r in s["ranks"]}), groups)


def finite_row(verdicts: list[Verdict]) -> CheckRow:
    bad = [(v.case, t.tensor, t.stats.nonfinite) for v in verdicts for t in v.tensors if t.stats.nonfinite]
    return CheckRow("no NaN/Inf", "fail" if bad else "pass", detail=(
        "; ".join(f"{n} non-finite in {t} [{c}]" for c, t, n in bad[:3]) if bad else
        f"{len(verdicts)} runs, every output and gradient finite"))


def shape_row(returns_lse: bool) -> CheckRow:
    """Shape and dtype: a violation raised ContractError already."""
    return CheckRow("output shape and dtype", "pass",
                    detail="out like q" + ("; lse (batch, heads, local_seq) float32" if returns_lse
                                           else "; no lse returned (lse not checked)"))


def balance_row(target: Any, world: int) -> CheckRow:
    """The layout's per-rank work balance (information, not a gate)."""
    spec = target.full_spec()
    counts = work_counts(layout=target.layout, world_size=world, seq_len=spec.seq_len, causal=spec.causal,
                         cu_seqlens=spec.variant.cu_seqlens, window=spec.variant.window)
    mean = sum(counts) / len(counts)
    return CheckRow("per-rank work balance (max / mean)", "info", max(counts) / mean if mean else 1.0, None,
                    f"{target.layout}{' causal' if spec.causal else ''}: visible scores per rank {counts}")


BACKWARD = ("dq", "dk", "dv", "dsinks")
NOT_RUN = "not run"  # a row's status under --forward-only: never a pass, never a gate
FLAG = "flag"        # a measurement off its promise: reported, a gate only under --require


def backward_row(label: str, verdicts: list[Verdict], forward_only: bool) -> CheckRow:
    """`summarise` of the backward tensors, or (--forward-only) a row that says they were not run."""
    if forward_only:
        return CheckRow(label, NOT_RUN, detail="--forward-only: the implementation's backward was not run, so dq, "
                                               "dk, dv (and dsinks) have no verdict")
    return summarise(label, verdicts, BACKWARD)


def class_rows(verdicts: list[Verdict], lengths: str, forward_only: bool = False) -> list[CheckRow]:
    """The precision-class rows (`ringcheck.judge.precision`) over every scaled case: per tensor
    the worst normwise error / budget, where the budget is k x the error of a flash-style
    one-device kernel (one rounding to the input dtype) plus a float32 floor."""
    return [summarise(f"precision forward  vs flash-style kernel (local {lengths})", verdicts, ("out", "lse")),
            backward_row(f"precision backward vs flash-style kernel (local {lengths})", verdicts, forward_only)]


def stand_in_row(requested: bool) -> CheckRow | None:
    """With `requested` (``--flash-attn-stand-in``): install the flash-attn stand-in in this process
    (never over a real flash-attn) and return the information row that says what happened, so
    no report is silent about it; None without it."""
    if not requested:
        return None
    # start-up time: the stand-in is imported only when asked for
    from ...flash_stand_in import install

    return CheckRow("flash-attn stand-in", "info", detail=install().describe())


def same_results(a: Results, b: Results) -> bool:
    """Whether two results are the same bits (tensors that neither returned count as equal)."""
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    return all(same(a.get(t), b.get(t)) for t in ("out", "lse", "dq", "dk", "dv", "dsinks"))
