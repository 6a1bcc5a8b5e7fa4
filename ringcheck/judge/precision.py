"""The precision-class check: is each tensor as precise as a correct flash-style kernel on one
device would make it?

The budget rule (`verdict.judge`) measures a ring against the *naive* same-dtype peer, which
rounds every intermediate to the input dtype and is therefore far less precise than a flash
kernel (float32 accumulation, one rounding at the end). A defect that costs a whole dtype of
precision - a tensor rounded through bfloat16 on float16 inputs, through float16 or bfloat16
on float32 inputs - fits under that budget or fails it by a hair. This check compares each
tensor with what the flash class reaches instead (`class_reference`):

- for bfloat16 / float16 inputs the class error is that of the float64 truth rounded once to
  the input dtype, for every tensor (lse and dsinks are delivered in float32 but carry the
  inputs' precision); for float32 inputs, that of a float32 flash-style computation on one
  device (`flash_class`), whose arithmetic is then the class. It is never taken below one
  rounding of a generic tensor (`one_rounding`): `GENERIC_ROUNDING` u ||truth||_2, and, per
  element below 1.36 x the dtype's smallest normal number, the RMS of a rounding on its
  subnormal spacing (absolute there), so a tensor near the subnormal range is judged on what
  one rounding can give;
- per tensor the error is normwise, e = ||got - truth||_2 (the same infinity on both sides
  counts 0), and also against the float64 truth of each computation convention a correct
  kernel may follow (`ringcheck.judge.conventions`: D from the stored, rounded output; a
  flash kernel's or a ring of flash kernels' roundings of P, dS and each step's partials to
  the input dtype), the smallest counting;
- a ring of PyTorch's own CPU flash kernel over the same shards (`kernel_class`, where the
  kernel runs the case) is a second legitimate computation, measured like the ring under test:
  e_k, its error against its nearest convention, carries the machine's float32 arithmetic
  (AVX2's fast exponential) into the budget, so the verdict does not flip with the CPU;
- the tensor passes when e <= max(k e_c, PEER_K e_k) + f, with f = ||u32 A||_2, one float32
  unit roundoff of the absolute terms of every element (`verdict.float32_floors` with C = 1);
  k per input dtype (`CLASS_K`).

Normwise, because rounding through a narrower dtype perturbs every element by its own
relative amount: in the 2-norm the perturbation is ~0.42 u_narrow ||truth||, whatever the
values, while an elementwise ratio is unbounded near zeros of the truth and would need a
floor that hides exactly this defect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ringcheck.reference import attention_mask

from ..spec import AttentionSpec, Budget
from ..thirdparty.torch_private import cpu_flash_attention
from .check import Case, Results, judge_results, peer, reference_kwargs, seq_dim, token_owners, truth
from .conventions import convention_truths
from .inputs import Inputs
from .metrics import abs_error, unit_roundoff
from .scores import scores
from .verdict import FLOAT32_FLOOR_C, TENSORS, Verdict, float32_floors

# k of the rule e <= k e_c + f, per input dtype (reports/precision_class/ measures both sides).
# bfloat16 / float16: one rounding through bfloat16 costs ~8x the class in the 2-norm (2^-8 /
# 2^-11; 7.2x at the 5-seed sweep's least). Correct rings, measured against the conventions
# they follow, stay within ~1.2x (PyTorch's ring, torch_cp; ours and the textbook ring 1.0x:
# one rounding); against the exact truth alone torch_cp reaches 3.2x on tie-heavy rows, which
# no k could tell from the narrowing by 3x. k = 2: correct rings <= 0.59 of the budget, the
# narrowing fails by >= 3.62x. float32: the class is float32 arithmetic, which a ring repeats
# in its merges (~sqrt(P)) and other kernels order differently; k = 16, while the narrowest
# defect (float16 on float32: 2^13 u32 per element) fails by >= 8x.
CLASS_K = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 16.0}

# the normwise error of rounding a generic tensor once, in units of u ||truth||_2: round to
# nearest errs uniformly within half a spacing, and with significands log-uniform in [1, 2)
# the mean of (spacing / value)^2 / 12 is u^2 (4 x 0.541 / 12): sqrt(0.541 / 3) = 0.425. The
# class error is never taken below it: a truth that happens to sit on the dtype's grid (ties,
# exact ones) is no reason to ask a kernel, whose intermediates are rounded too, to hit it.
GENERIC_ROUNDING = (0.541 / 3) ** 0.5

# Below the smallest normal number of a dtype rounding is absolute: the spacing is eps x tiny
# whatever the value, and a value rounded to it errs uniformly within half of it, RMS
# eps x tiny / sqrt(12). The relative rule above does not see that: for a tensor whose norm lies
# near the subnormal range (a bfloat16 case's dsinks at 1e-38: bfloat16 shares float32's range)
# it asks for less than one rounding can give, so a correct kernel 2.00x a lucky class error
# failed by its last bit. Each element's least is the larger of the two (`one_rounding`).
SUBNORMAL_ROUNDING = 12 ** -0.5


def one_rounding(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """The least class error of `truth` in `dtype`: the normwise error of rounding a generic
    tensor once, per element the larger of `GENERIC_ROUNDING` u |t| and `SUBNORMAL_ROUNDING`
    eps tiny (the dtype's spacing below its smallest normal number); non-finite entries count 0.
    For every element above 1.36 tiny it is the relative term, so it changes nothing there."""
    info = torch.finfo(dtype)
    t = truth.detach().double()
    finite = torch.isfinite(t)
    per = (GENERIC_ROUNDING * unit_roundoff(dtype) * t.abs()).clamp_min(SUBNORMAL_ROUNDING * info.eps * info.tiny)
    return _norm(per.masked_fill(~finite, 0.0))


def flash_class(spec: AttentionSpec, inputs: Inputs) -> Results:
    """What a correct flash-style kernel computes on one device: float32 throughout (lse, then
    P = exp(s - lse), O = P V, D = rowsum(dO * O), dS = P (dP - D)), each result rounded once
    to its output dtype (out, dq, dk, dv: the input dtype; lse and dsinks float32)."""
    f32, dt = torch.float32, spec.torch_dtype
    sc = scores(spec, inputs, f32)
    out = torch.matmul(sc.p, sc.v)
    delta = (sc.dout * out).sum(-1, keepdim=True)
    ds = sc.p * (sc.dp - delta)
    dq, dk = sc.grads(ds)
    dv = sc.home(torch.matmul(sc.p.transpose(-1, -2), sc.dout))
    dsinks = None if inputs.sinks is None else -(sc.p_all[..., -1] * delta[..., 0]).sum((0, 2))
    return Results(out.transpose(1, 2).to(dt), sc.lse, dq.to(dt), dk.to(dt), dv.to(dt), dsinks)


# PyTorch's CPU flash kernel splits more than this many query rows into blocks and sums dk, dv
# over them in a way no convention follows (0.7 u at 64 rows on its portable path): it is a
# peer for blocks up to this size only (its qSplitSize below 192 query rows).
KERNEL_BLOCK_ROWS = 32

# A ring of the machine's own kernel over the same shards makes the roundings a correct ring of
# such kernels makes, up to its float32 merge order: a ring may be PEER_K times its error (two
# independent samples of one rounding process differ by about sqrt(2) in the 2-norm at most).
# Smaller than k, because this peer is no idealised class: on AVX2 it costs 0.6 u on normal rows
# (k = 2 of it would let a bfloat16 narrowing, 3.4 u, pass at 2.8x).
PEER_K = 1.5


def kernel_class(spec: AttentionSpec, inputs: Inputs, owner: torch.Tensor,
                 max_rows: int | None = KERNEL_BLOCK_ROWS) -> Results | None:
    """A correct ring of PyTorch's own one-device flash kernel on this machine's CPU, over the
    case's shards (`owner`: each token's rank; one rank: the kernel on the whole sequence), in
    the input dtype: for each query block and key block that it sees,
    `_scaled_dot_product_flash_attention_for_cpu` and its backward on the rows that see a key
    of the block (K and V repeated per query head, the mask explicit); the forward's partial
    outputs merged by their lse in float32, the backward's partial dq, dk, dv (each delivered in
    the input dtype) summed in float32, each K/V head's group summed in float32, each result
    rounded once. None where it cannot run the case: softcap, sinks, a value head dim of its
    own, a block of more than `max_rows` rows (`KERNEL_BLOCK_ROWS`; None: any, for a budget that
    takes the kernel's max abs error rather than its convention), a row that sees no key, a
    NaN/Inf, a kernel this torch lacks.

    A legitimate computation beside the class reference whose float32 arithmetic is the
    machine's: on AVX2 CPUs the kernel's half-precision path computes the probabilities with a
    fast exponential, so on tie-heavy rows its roundings of P and dS go the other way in
    correlated groups and it lands ~0.7 u from every convention, where on the portable path it
    matches the flash convention bit for bit (docs/explanation/precision-class.md)."""
    variant = spec.variant_kwargs()
    if (variant.get("softcap") is not None or inputs.sinks is not None or spec.dv != spec.head_dim
            or inputs.q.device.type != "cpu"):
        return None
    blocks = [(owner == r).nonzero().flatten() for r in sorted(set(owner.tolist()))]
    if max_rows is not None and max(len(b) for b in blocks) > max_rows:
        return None
    n, g, dt, f32 = spec.seq_len, spec.heads // spec.kv_heads, spec.torch_dtype, torch.float32
    seen = attention_mask(n, causal=spec.causal, cu_seqlens=variant.get("cu_seqlens"), window=variant.get("window"))
    if not bool(seen.any(-1).all()):
        return None  # padding rows: the kernel has no convention for a row that sees nothing
    q, dout = (t.detach().transpose(1, 2) for t in (inputs.q, inputs.dout))
    k, v = (t.detach().transpose(1, 2).repeat_interleave(g, 1) for t in (inputs.k, inputs.v))
    fwd, bwd = cpu_flash_attention()  # aten's private ops, through torch's door
    work = []  # (query rows, keys, additive mask) of every block pair with a visible key
    for qi in blocks:
        for kj in blocks:
            block = seen[qi][:, kj]
            rows = qi[block.any(-1)]
            if len(rows):
                mask = torch.zeros(len(rows), len(kj), dtype=dt).masked_fill(~seen[rows][:, kj], float("-inf"))
                work.append((rows, kj, mask))
    b, h, d = q.shape[0], q.shape[1], q.shape[3]
    acc = torch.zeros(b, h, n, d, dtype=f32)
    lse = torch.full((b, h, n), float("-inf"), dtype=f32)
    try:
        parts = []
        for rows, keys, mask in work:
            o, l_ = fwd(q[:, :, rows].contiguous(), k[:, :, keys].contiguous(), v[:, :, keys].contiguous(), 0.0,
                        False, attn_mask=mask, scale=spec.softmax_scale)[:2]
            parts.append((rows, o.float(), l_.float()))
            lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], l_.float())
        for rows, o, l_ in parts:
            acc[:, :, rows] += torch.exp(l_ - lse[:, :, rows]).unsqueeze(-1) * o
        out = acc.to(dt)
        dq, dk, dv = (torch.zeros(b, h, n, d, dtype=f32) for _ in range(3))
        for rows, keys, mask in work:
            gq, gk, gv = bwd(dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(), k[:, :, keys].contiguous(),
                             v[:, :, keys].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                             0.0, False, attn_mask=mask, scale=spec.softmax_scale)
            dq[:, :, rows] += gq.float()
            dk[:, :, keys] += gk.float()
            dv[:, :, keys] += gv.float()
    except (RuntimeError, NotImplementedError):  # a dtype or shape this torch's kernel does not take
        return None

    def home(t):  # (b, h, n, d) float32 -> (b, n, kv_heads, d): each head rounded, the group summed in float32
        return t.to(dt).float().view(b, spec.kv_heads, g, n, d).sum(2).transpose(1, 2).to(dt)

    got = Results(out.transpose(1, 2), lse, dq.to(dt).transpose(1, 2), home(dk), home(dv))
    if not all(bool(torch.isfinite(t).all()) for t in (got.out, got.lse, got.dq, got.dk, got.dv)):
        return None
    return got


@dataclass(frozen=True)
class ClassVerdict:
    """One tensor's precision-class verdict (normwise; the interface of `TensorVerdict` that
    `summarise` reads: tensor, passed, error, budget, failing_ranks, describe())."""

    tensor: str
    passed: bool
    error: float          # ||got - truth||_2
    class_error: float    # ||flash_class - truth||_2
    k: float
    floor: float          # ||u32 A||_2
    units: float          # error / (u ||truth||_2), u of the output dtype
    class_units: float
    nonfinite: int = 0
    failing_ranks: tuple[int, ...] = ()
    rank_ratios: dict[int, float] = field(default_factory=dict)
    by_peer: bool = False  # the class error is a peer's (`kernel_class`), scaled by PEER_K / k

    @property
    def budget(self) -> float:
        return self.k * self.class_error + self.floor

    @property
    def ratio(self) -> float:
        """error / budget: over 1 fails."""
        return self.error / self.budget if self.budget > 0 else (math.inf if self.error > 0 else 0.0)

    def describe(self) -> str:
        head = "ok" if self.passed else "FAILED"
        text = (f"{self.tensor} {head} (precision class): normwise error {self.error:.3e} = {self.units:.2f} u, "
                f"{self.error / self.class_error if self.class_error else math.inf:.2f}x a flash-style one-device "
                f"kernel's {self.class_error:.3e} ({self.class_units:.2f} u); budget {self.budget:.3e} = "
                f"{self.k:g} x it + float32 floor {self.floor:.1e}; error / budget {self.ratio:.2f}")
        if self.by_peer:
            text += (f" (the class error is set by a ring of PyTorch's CPU flash kernel over the same shards: "
                     f"{PEER_K:g} x its error / {self.k:g})")
        if self.nonfinite:
            text += f"; {self.nonfinite} NaN/Inf where the truth is finite"
        if self.failing_ranks:
            text += f"; ranks over budget on their own elements: {list(self.failing_ranks)}"
        return text


def _norm(diff: torch.Tensor) -> float:
    return float(diff.norm()) if diff.numel() else 0.0


def judge_class(tensor: str, got: torch.Tensor, truth: torch.Tensor, reference: torch.Tensor, *, k: float,
                dtype: torch.dtype, floor: torch.Tensor | float = 0.0, conventions: Sequence[torch.Tensor] = (),
                owner: tuple[int, torch.Tensor] | None = None,
                peers: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]] = ()) -> ClassVerdict:
    """Judge `got` against `truth` with the budget k x ||reference - truth||_2 + ||floor||_2.

    `peers`: further legitimate computations, each (its tensor, the truths of the conventions it
    may follow), measured as `got` is (its smallest error against the truth and its
    conventions); the budget is the larger of k x the class error and `PEER_K` x each peer's
    error, so one sample of a rounding process never sets the budget alone.

    `conventions`: truths of computation conventions `got` may be measured against instead
    (`ringcheck.judge.conventions`); the smallest error counts. `dtype` is the
    unit of `units` (u of the input dtype); `floor` a per-element bound like `truth` (or a
    number). `owner` = (dim, ranks) names the ranks whose own elements are over the same rule,
    each against the truth closest to them (reported only when the tensor fails)."""
    candidates = [abs_error(got, truth), *(abs_error(got, other) for other in conventions)]
    diff, bad = min(candidates, key=lambda c: _norm(c[0].masked_fill(c[1], 0.0)))
    nonfinite = int(bad.sum())
    fdiff, fbad = abs_error(reference, truth)
    fdiff = fdiff.masked_fill(fbad, 0.0)
    floor_t = (floor.double().nan_to_num(0.0, posinf=0.0) if isinstance(floor, torch.Tensor)
               else torch.full_like(diff, float(floor)))
    t = truth.detach().double()
    scale = unit_roundoff(dtype) * _norm(t.masked_fill(~torch.isfinite(t), 0.0))
    least = one_rounding(truth, dtype)
    by_peer = False
    for other, theirs in peers:  # a peer's error counts PEER_K / k times: its budget is PEER_K x it
        pdiff = min((abs_error(other, t_) for t_ in (truth, *theirs)),
                    key=lambda c: _norm(c[0].masked_fill(c[1], 0.0)))
        pdiff = pdiff[0].masked_fill(pdiff[1], 0.0) * (PEER_K / k)
        if _norm(pdiff) > max(_norm(fdiff), least):
            fdiff, by_peer = pdiff, True
    error, class_error, floor_n = _norm(diff), max(_norm(fdiff), least), _norm(floor_t)
    passed = nonfinite == 0 and error <= k * class_error + floor_n
    ranks, per_rank = (), {}
    if owner is not None and diff.numel():
        dim, who = owner
        for r in sorted(set(who.tolist())):
            pick = (who == r).nonzero().flatten()  # each rank's elements against their closest truth
            e = min(_norm(d.index_select(dim, pick)) for d, _ in candidates)
            c, f = (_norm(x.index_select(dim, pick)) for x in (fdiff, floor_t))
            per_rank[r] = e / (k * c + f) if k * c + f > 0 else (math.inf if e > 0 else 0.0)
        ranks = () if passed else tuple(r for r, x in per_rank.items() if x > 1)
    return ClassVerdict(tensor, passed, error, class_error, k, floor_n, error / scale if scale else 0.0,
                        class_error / scale if scale else 0.0, nonfinite, ranks, per_rank, by_peer)


def class_floors(spec: AttentionSpec, inputs: Inputs) -> dict[str, torch.Tensor]:
    """u32 A per element: `verdict.float32_floors` with C = 1 (one float32 unit roundoff of the
    absolute terms of each element, weighted by its row's condition)."""
    kwargs = reference_kwargs(spec, inputs)
    kwargs["scale"] = kwargs.pop("softmax_scale")
    floors = float32_floors(inputs.q, inputs.k, inputs.v, inputs.dout, **kwargs)
    return {name: f / FLOAT32_FLOOR_C for name, f in floors.items()}


def class_reference(spec: AttentionSpec, inputs: Inputs, true: Results) -> Results:
    """The precision a correct flash-style kernel reaches: for bfloat16 / float16 inputs the
    truth rounded once to the input dtype (every tensor, lse and dsinks included: they carry
    the inputs' precision, whatever dtype they are delivered in); for float32 inputs a float32
    flash-style computation (`flash_class`), whose arithmetic is then the class."""
    dt = spec.torch_dtype
    if dt == torch.float32:
        return flash_class(spec, inputs)
    return Results(*(None if t is None else t.to(dt).double() for t in
                     (true.out, true.lse, true.dq, true.dk, true.dv, true.dsinks)))


@dataclass
class ClassContext:
    """What `judge_precision` derives from one case alone, not from the result it judges: the
    tokens' owners, PyTorch's kernel ring over the shards and its conventions, the floors and the
    class reference. Made once by `class_context` and handed to every `judge_precision` of that
    case (a suite judging many narrowings of one result), so none of it is computed again; the
    conventions of the first judged result's own output are kept (`conventions`)."""

    owner: torch.Tensor
    kernel: Results | None
    theirs: dict[str, list[torch.Tensor]]
    floors: dict[str, torch.Tensor]
    reference: Results
    seen: tuple[torch.Tensor | None, dict[str, list[torch.Tensor]]] | None = None

    def conventions(self, spec: AttentionSpec, inputs: Inputs, true: Results, out: torch.Tensor | None,
                    tensors) -> dict[str, list[torch.Tensor]]:
        """`convention_truths` of a result whose output is `out`, for `tensors`: for every tensor
        the case has when the first output is seen (kept, and read for every result with that
        output), for `tensors` alone for any other output."""
        if self.seen is None:
            every = (*TENSORS, "dsinks") if true.dsinks is not None else TENSORS
            self.seen = (out, convention_truths(spec, inputs, true, out, self.owner, every))
        if self.seen[0] is not out:
            return convention_truths(spec, inputs, true, out, self.owner, tensors)
        return {name: self.seen[1][name] for name in tensors}


def class_context(case: Case, true: Results, inputs: Inputs, *, kernel_peer: bool = True) -> ClassContext:
    """The `ClassContext` of one case (`kernel_peer` False: no kernel ring, as with a reference of
    the caller's own)."""
    spec = case.spec
    owner, _ = token_owners(spec.seq_len, case.ring, spec.variant.cu_seqlens)
    kernel = kernel_class(spec, inputs, owner) if kernel_peer else None
    every = (*TENSORS, "dsinks") if true.dsinks is not None else TENSORS
    theirs = {} if kernel is None else convention_truths(spec, inputs, true, kernel.out, owner, every)
    return ClassContext(owner, kernel, theirs, class_floors(spec, inputs), class_reference(spec, inputs, true))


def judge_precision(case: Case, got: Results, true: Results, inputs: Inputs, *, tensors=TENSORS,
                    reference: Results | None = None, k: float | None = None,
                    context: ClassContext | None = None) -> Verdict:
    """The precision-class verdict of every tensor of one case (dsinks too when the truth has
    it): `reference` defaults to `class_reference`, `k` to `CLASS_K` of the input dtype. Each
    tensor's error is the smallest against the exact truth and the computation conventions it
    may follow (`ringcheck.judge.conventions`): out, dq, dk and dv a flash kernel's or a ring
    of flash kernels' (16-bit inputs), dq, dk and dsinks the stored output's D. With the default
    reference, a ring of PyTorch's one-device kernel over the same shards (`kernel_class`, where
    it runs the case) is a second legitimate computation: the class error is the larger of the
    two, each measured as `got` is. `context`: the case's `class_context` (made here when None),
    for a caller that judges several results of one case."""
    spec = case.spec
    if context is None:
        context = class_context(case, true, inputs, kernel_peer=reference is None)
    elif reference is not None:
        raise ValueError("judge_precision: pass either reference= or context= (a context holds the class reference "
                         "and the kernel ring that goes with it), not both")
    owner, kernel = context.owner, context.kernel
    reference = reference if reference is not None else context.reference
    k = CLASS_K[spec.torch_dtype] if k is None else k
    if true.dsinks is not None and got.dsinks is not None and "dsinks" not in tensors:  # not: --forward-only
        tensors = (*tensors, "dsinks")
    conventions = context.conventions(spec, inputs, true, got.out, tensors)
    theirs = {} if got.out is None else context.theirs
    verdict = Verdict(f"precision class: {case.describe()}")
    for name in tensors:
        peers = [(kernel.get(name), theirs[name])] if theirs and kernel.get(name) is not None else []
        verdict.tensors.append(judge_class(name, got.get(name), true.get(name), reference.get(name), k=k,
                                           dtype=spec.torch_dtype, floor=context.floors.get(name, 0.0),
                                           conventions=conventions[name],
                                           owner=None if name == "dsinks" else (seq_dim(name), owner),
                                           peers=peers))
    return verdict


def judge_with_class(case: Case, got: Results, inputs: Inputs, *, budget: Budget,
                     tensors=TENSORS) -> tuple[Verdict, Verdict]:
    """One case's two verdicts on one float64 truth: the budget rule against the naive peer
    (`check.judge_results`) and the precision class (`judge_precision`)."""
    true = truth(case.spec, inputs)
    return (judge_results(case, got, true, peer(case.spec, inputs), budget=budget, tensors=tensors, inputs=inputs),
            judge_precision(case, got, true, inputs, tensors=tensors))
