"""validate's ragged shards: every distribution at tokens per rank longer than the tiles block
kernels walk and a multiple of none (`target.RAGGED_LENGTHS`, 66 and 130), judged on
sampled query rows that hold every rank's ragged tails and on every key; and the calls that
change length (long, short, long again in one process). docs/explanation/ragged-lengths.md says
why these lengths."""

from __future__ import annotations

import torch

from ...harness import Mesh
from ...judge.check import Case, row_results
from ...judge.inputs import TILES, Inputs, sample_rows, with_sampled_rows
from ...judge.peers import whole_peer_errors
from ...judge.verdict import Verdict
from ...launch import RingError
from ...ring.layouts import positions
from .rows import NOT_RUN, CheckRow, same_results, summarise
from .steps import ALL_TENSORS, CONTIGUOUS, Run, group_label, judge_sampled, judged_tensors, short
from .target import ragged_cases, ragged_fit


def ragged_rows_sampled(case: Case, count: int, seed: int) -> torch.Tensor:
    """The query rows a ragged case judges: on every rank, the rows of the last, ragged tile of
    each tile size (`TILES`) that the shard straddles, the last row of each zig-zag chunk (a
    kernel may walk each chunk alone) and the shard's first and last rows, where a tail bug
    shows (by global position, through the layout); plus `count` rows at random (`sample_rows`).
    dK and dV are judged for every key: the last row of the sequence is among these, so every
    key has a judged row that sees it."""
    n, ring = case.spec.seq_len, case.ring
    local = n // ring.world_size
    picks = {0, local - 1, local // 2 - 1, local // 2} | {local // t * t for t in TILES if t < local and local % t}
    rows = set(sample_rows(n, count, seed).tolist())
    for rank in range(ring.world_size):
        held = positions(layout=ring.layout, rank=rank, world_size=ring.world_size, seq_len=n,
                         cu_seqlens=case.spec.variant.cu_seqlens)
        rows |= {int(held[i]) for i in picks if 0 <= i < len(held)}
    return torch.tensor(sorted(rows), dtype=torch.int64)


def _ragged_label(lengths) -> str:
    return f"ragged shards ({', '.join(map(str, sorted(lengths)))} tokens per rank)"


def _bundle_inputs(run: Run, bundle: list[Case], rows: torch.Tensor, mesh: Mesh) -> list[Inputs]:
    """Every group's inputs of one ragged call: each distribution's, dout kept on `rows` only,
    one after another along the batch."""
    per_case = [[with_sampled_rows(x, rows) for x in run.group_inputs(c, c.seed, mesh)] for c in bundle]
    return [Inputs(*(torch.cat([getattr(xs[g], t) for xs in per_case]) for t in ("q", "k", "v", "dout")),
                   per_case[0][g].sinks) for g in range(mesh.rings)]


def _batch_of(x: Inputs, part: slice) -> Inputs:
    return Inputs(x.q[part], x.k[part], x.v[part], x.dout[part], x.sinks)


def _judge_call(run: Run, bundle, runs, inputs, rows, tensors, mesh: Mesh, which: str) -> list[Verdict]:
    """One ragged call's verdicts: every distribution of `bundle` (a slice of the call's batch) in
    every group, on the sampled `rows` and every key, against the peer's whole-tensor error."""
    judged = []
    for j, case in enumerate(bundle):
        part = slice(j * case.spec.batch, (j + 1) * case.spec.batch)
        for grun, whole in zip(runs, inputs):
            x = _batch_of(whole, part)
            refs = (row_results(case.spec, x, rows, low=False), row_results(case.spec, x, rows, low=True))
            peers = whole_peer_errors(case.spec, x, rows, *refs, tensors)
            verdict = judge_sampled(run, case.spec, grun.calls[CONTIGUOUS], x, rows, refs, tensors,
                                    group_label(grun, mesh), part, peers)
            verdict.case = f"{case.describe()}, {which}, {len(rows)} sampled rows"
            judged.append(verdict)
    return judged


def ragged_rows(run: Run, full: Mesh) -> tuple[list[CheckRow], list[Verdict]]:
    """The ragged shards (`ragged_cases`: every distribution at tokens per rank longer than the
    tiles and a multiple of none), judged on sampled query rows (`ragged_rows_sampled`) and every
    key; and the calls that change length: in one process the ring called long, short,
    long again (the first call's inputs: its bits, or else judged on its own), each judged, by
    the budget rule with the peer's error over the whole tensor (`judge.peers`: the naive peer's
    or the one-device kernel's, the larger), not over the sampled rows alone. One
    contiguous call per length, every distribution a slice of its batch judged on its own (its
    own budget: a distribution of large values never widens another's), on `full` (where the
    full length runs: the ring alone by default; the mesh, the views and two calls are judged at
    the scaled lengths)."""
    target = run.target
    mesh = Mesh.ring(target.world_size) if run.mesh_raised else full
    fit, left_out = ragged_fit(target)
    label = _ragged_label(target.ragged_lengths)
    order = sorted(set(fit), reverse=True)
    if not fit:
        why = "; ".join(left_out) or "no ragged lengths asked for (--ragged-lengths none)"
        return [CheckRow(label, NOT_RUN, detail=f"not run: {why}"),
                CheckRow("calls that change length", NOT_RUN, detail=f"not run: {why}")], []
    calls = ragged_cases(target)
    verdicts: list[list[Verdict]] = []
    first_bits, raised, again = None, "", True

    def submit(bundle):
        rows = ragged_rows_sampled(bundle[0], target.sample_rows, bundle[0].seed)
        inputs = _bundle_inputs(run, bundle, rows, mesh)
        spec = bundle[0].spec.replace(batch=bundle[0].spec.batch * len(bundle))
        return rows, inputs, run.runner.submit(Case(spec, target.ring, backend=target.backend), inputs, mesh,
                                               (CONTIGUOUS,))

    pending = submit(calls[0])
    for i, bundle in enumerate(calls):
        n = bundle[0].spec.seq_len // target.world_size
        run.note(f"ragged shards: {n} tokens per rank, {len(bundle)} distribution(s)")
        rows, inputs, result = pending
        try:
            runs = result()
        except RingError as exc:
            raised = f"[{bundle[0].describe()}] raised: {short(exc)}"
            break
        if i + 1 < len(calls):  # the ranks compute the next call while this one is judged
            pending = submit(calls[i + 1])
        if i == 0:  # (where no scaled case ran before: --only ragged)
            run.returns_lse = runs[0].calls[CONTIGUOUS].lse is not None
        tensors = judged_tensors(run.returns_lse, target.forward_only)
        bits = [grun.calls[CONTIGUOUS] for grun in runs]
        if i and bundle is calls[0]:  # the first call again: its bits add nothing to judge
            again = all(same_results(a, b) for a, b in zip(first_bits, bits))
            if again:
                verdicts.append([])
                continue
        first_bits = first_bits or bits
        verdicts.append(_judge_call(run, bundle, runs, inputs, rows, tensors, mesh, f"call {i + 1} of {len(calls)}"))
    every = [v for judged in verdicts for v in judged]
    changing = f"calls that change length ({', '.join(map(str, [*order, order[0]]))} tokens per rank, one process)"
    if raised:
        return [CheckRow(label, "fail", detail=raised), CheckRow(changing, "fail", detail=raised)], every
    row = summarise(label, every, ALL_TENSORS)
    if left_out:
        row.detail += "; " + "; ".join(left_out)
    if len(order) < 2:
        return [row, CheckRow("calls that change length", NOT_RUN,
                              detail=f"not run: one ragged length ({order[0]} tokens per rank)")], every
    after = [v for judged in verdicts[1:] for v in judged]  # every call after the first (at another length)
    calls_row = summarise(changing, after, ALL_TENSORS)
    calls_row.detail += ("; the last call (the first call's inputs again, after a shorter one) gave " +
                         ("the same bits as the first (its verdict is the first's)" if again else
                          "other bits than the first (judged on its own; the determinism row judges bits)"))
    return [row, calls_row], every
