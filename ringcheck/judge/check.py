"""One case end to end: inputs -> ring -> references -> verdict.

A `Case` names everything that determines a check (spec, ring, seed, distribution, backend),
so a failure message is also a reproduction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringcheck.reference import dense_grads, peer_attention

from ..ring import simulate_ring
from ..ring.layouts import positions
from ..spec import AttentionSpec, Budget, RingSpec
from .conventions import convention_truths
from .inputs import Inputs, make_inputs
from .results import Results, reference_kwargs
from .sinks import judge_sinks
from .verdict import TENSORS, Verdict, float32_floors, judge

# what users call a "mode": (causal, layout)
MODES = {
    "bidirectional": (False, "contiguous"),
    "causal": (True, "contiguous"),
    "zigzag": (True, "zigzag"),
    "striped": (True, "striped"),
}

# whole-tensor implementation under test: (q, k, v) -> (out, lse), differentiable
WholeImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Case:
    spec: AttentionSpec
    ring: RingSpec
    seed: int = 0
    distribution: str = "normal"
    backend: str = "torch"

    def describe(self) -> str:
        s = self.spec
        mode = ("causal" if s.causal else "bidirectional")
        variant = s.describe_variant()
        return (f"P={self.ring.world_size} {self.ring.layout} {mode} {s.dtype} batch={s.batch} "
                f"heads={s.heads}/{s.kv_heads} seq={s.seq_len} d={s.head_dim} "
                f"dist={self.distribution} seed={self.seed} backend={self.backend}"
                + (f" {variant}" if variant else ""))

    def repro(self) -> str:
        """A one-line shell command (run from the repository root) that re-runs this case
        against the simulated ring and prints its verdict."""
        return ("python -c \"from ringcheck.judge.check import Case, run_case; "
                "from ringcheck.spec import AttentionSpec, RingSpec, Variant; "
                f"print(run_case({self!r}).message())\"")



def run_whole(impl: WholeImpl, inputs: Inputs) -> Results:
    """Run `impl` forward and backward (with the case's random dout) on detached copies; with
    sinks in the inputs, `impl` takes them as a fourth argument and dsinks is judged too."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    if inputs.sinks is None:
        out, lse = impl(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs.dout)
        return Results(out.detach(), lse.detach(), dq, dk, dv)
    sinks = inputs.sinks.detach().clone().requires_grad_(True)
    out, lse = impl(q, k, v, sinks)
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), inputs.dout)
    return Results(out.detach(), lse.detach(), dq, dk, dv, dsinks)


def spec_floors(spec: AttentionSpec, inputs: Inputs, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`float32_floors` of `inputs` for `spec` (its scale, mask and variants; sampled `rows`)."""
    kwargs = reference_kwargs(spec, inputs)
    kwargs["scale"] = kwargs.pop("softmax_scale")
    return float32_floors(inputs.q, inputs.k, inputs.v, inputs.dout, rows=rows, **kwargs)


def truth(spec: AttentionSpec, inputs: Inputs) -> Results:
    """float64 truth with the analytic backward."""
    return Results(*dense_grads(inputs.q, inputs.k, inputs.v, inputs.dout, **reference_kwargs(spec, inputs)))


def _peer_impl(spec: AttentionSpec, inputs: Inputs, rows=None) -> WholeImpl:
    kwargs = {k: v for k, v in reference_kwargs(spec, inputs).items() if k != "sinks"}

    def impl(q, k, v, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks}
        return peer_attention(q, k, v, return_lse=True, rows=rows, **kwargs, **extra)
    return impl


def peer(spec: AttentionSpec, inputs: Inputs) -> Results:
    """The same-dtype single-device peer (its error sets the budget)."""
    return run_whole(_peer_impl(spec, inputs), inputs)


def row_results(spec: AttentionSpec, inputs: Inputs, rows: torch.Tensor, *, low: bool = False) -> Results:
    """Reference on sampled query rows (inputs from `with_sampled_rows`): the float64 truth, or
    the same-dtype peer with `low`. out, lse and dq are of the rows; dk, dv (and dsinks) of
    every key (head)."""
    if not low:
        return Results(*dense_grads(inputs.q, inputs.k, inputs.v, inputs.dout, rows=rows,
                                    **reference_kwargs(spec, inputs)))
    got = run_whole(_peer_impl(spec, inputs, rows), Inputs(inputs.q, inputs.k, inputs.v, inputs.dout[:, rows],
                                                         inputs.sinks))
    return Results(got.out, got.lse, got.dq[:, rows], got.dk, got.dv, got.dsinks)


def token_owners(seq_len: int, ring: RingSpec, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token of the sequence, the rank that holds it under the ring's layout and its
    local row there (keys are sharded like queries, so this is also a key's owner)."""
    owner = torch.empty(seq_len, dtype=torch.int64)
    local = torch.empty(seq_len, dtype=torch.int64)
    for r in range(ring.world_size):
        pos = positions(layout=ring.layout, rank=r, world_size=ring.world_size, seq_len=seq_len, cu_seqlens=cu_seqlens)
        owner[pos] = r
        local[pos] = torch.arange(len(pos))
    return owner, local


def seq_dim(tensor: str) -> int:
    """The sequence dim of a whole tensor: (batch, heads, seq) for lse, (batch, seq, heads, d) otherwise."""
    return 2 if tensor == "lse" else 1


def locator(spec: AttentionSpec, ring: RingSpec, tensor: str) -> Callable[[tuple[int, ...]], str]:
    """Index of a whole tensor -> 'rank r, local row i, token t, head h'."""
    owner, local = token_owners(spec.seq_len, ring, spec.variant.cu_seqlens)
    s_dim, head_dim = seq_dim(tensor), 3 - seq_dim(tensor)
    head_word = "kv head" if tensor in ("dk", "dv") else "head"

    def locate(index: tuple[int, ...]) -> str:
        t = index[s_dim]
        return (f"rank {int(owner[t])} of {ring.world_size} ({ring.layout}), local row {int(local[t])}, "
                f"token {t}, {head_word} {index[head_dim]}, batch {index[0]}")

    return locate


def judge_results(case: Case, got: Results, true: Results, peer_results: Results, *,
                  budget: Budget = Budget(), tensors=TENSORS, inputs: Inputs | None = None,
                  use_float32_floors: bool = True, conventions=None) -> Verdict:
    """Judge every tensor; with `inputs`, the float32 floors of `float32_floors` apply (unless
    `use_float32_floors` is False: the bare flash-attention rule, for the suites' findings), and
    a tensor over its budget against the exact truth is judged again against the computation
    conventions it may follow (`ringcheck.judge.conventions`: a flash kernel's roundings, a
    ring of them, the stored output's D), the closest counting: a correct kernel that follows
    one is no false alarm. `conventions(out, tensors)`: those truths where the caller has them
    already (the precision class's `ClassContext.conventions` of the same case: the same
    tensors), else `convention_truths` computes them."""
    floors = spec_floors(case.spec, inputs) if inputs is not None and use_float32_floors else {}
    owner, _ = token_owners(case.spec.seq_len, case.ring, case.spec.variant.cu_seqlens)
    if true.dsinks is not None and got.dsinks is not None and "dsinks" not in tensors:  # not: --forward-only
        tensors = (*tensors, "dsinks")

    def judged(name: str, conventions=(), value=None):
        per_token = name != "dsinks"  # dsinks is per head: no rank or token to name
        if name == "dsinks" and value is None:  # each rank's sinks gradient, under its convention
            return judge_sinks(lambda parts: judged(name, conventions, parts), got)
        return judge(name, got.get(name) if value is None else value, true.get(name), peer_results.get(name),
                     k=budget.k_for(name), dtype=torch.float32 if name == "lse" else case.spec.torch_dtype,
                     locate=locator(case.spec, case.ring, name) if per_token else None,
                     floor=floors.get(name, 0.0), owner=(seq_dim(name), owner) if per_token else None,
                     conventions=conventions)

    verdict = Verdict(case.describe(), [judged(name) for name in tensors])
    over = [tv.tensor for tv in verdict.tensors if not tv.passed and tv.stats.nonfinite == 0]
    if over and inputs is not None and use_float32_floors:

        others = (conventions(got.out, over) if conventions is not None else
                  convention_truths(case.spec, inputs, true, got.out, owner, over))
        verdict.tensors = [judged(tv.tensor, others[tv.tensor]) if others.get(tv.tensor) else tv
                           for tv in verdict.tensors]
    return verdict


def simulated_impl(case: Case, **ring_options) -> WholeImpl:
    variant = case.spec.variant_kwargs()

    def impl(q, k, v, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks}
        return simulate_ring(q, k, v, world_size=case.ring.world_size, causal=case.spec.causal,
                             softmax_scale=case.spec.softmax_scale, layout=case.ring.layout,
                             backend=case.backend, return_lse=True, **variant, **extra, **ring_options)
    return impl


def run_case(case: Case, *, budget: Budget = Budget(), impl: WholeImpl | None = None,
             use_float32_floors: bool = True) -> Verdict:
    """Judge `impl` (default: our simulated ring) on `case` against float64 and the peer."""
    case.ring.check_seq_len(case.spec.seq_len)
    inputs = make_inputs(case.spec, seed=case.seed, distribution=case.distribution, ring=case.ring)
    got = run_whole(impl or simulated_impl(case), inputs)
    return judge_results(case, got, truth(case.spec, inputs), peer(case.spec, inputs), budget=budget,
                         inputs=inputs, use_float32_floors=use_float32_floors)
