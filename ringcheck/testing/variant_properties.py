"""Property bodies for attention variants (documents, windows, softcap, sinks, d_v != d_qk,
zigzag_docs), in the style of `ringcheck.testing.properties`: each ``check_*(case, ...,
impl=simulated_impl)`` raises AssertionError naming the case with a one-line reproduction;
`impl` is a factory ``Case -> WholeImpl`` (with sinks the WholeImpl takes them as a fourth
argument); every implementation call comes before any comparison.

Exact or within budget, and why:

- bit for bit: sinks of -inf vs no sinks (exp(-inf) = 0 adds nothing, and our merge is
  exact for it); a window covering the whole sequence vs none, and padding appended to the
  sequence, *when our ring's block plan is the same for both runs* (`same_plan`): the
  same blocks over the same rows in the same ring steps are the same float32 operations.
  Where the plan differs (the zigzag layout without documents: the variant plan cuts each
  rank's two chunks into separate blocks; contiguous or zigzag padding: tokens change ranks)
  the comparison is within the two runs' budgets;
- to rounding: softcap = 1e6 max|score| vs no softcap (bound in `check_softcap_to_infinity`);
- within the sum of the two runs' budgets: documents vs separate runs, zigzag_docs vs
  contiguous (tokens sit on other ranks and rows, so the float32 sums group differently);
- exactly: padding rows (output 0, lse -inf, dq 0) and padding keys (dk = dv = 0).
"""

from __future__ import annotations

from itertools import pairwise

import torch

from ..judge.check import Case, Results, judge_results, peer, run_whole, simulated_impl, truth
from ..judge.inputs import Inputs, make_inputs
from ..judge.verdict import TENSORS, Verdict, float32_floors
from ..ring.layouts import block_plan, positions
from ..spec import DOC_LAYOUTS, RingSpec, Variant
from .compare import Exact
from .properties import HALF_SUBNORMAL, UNIT_ROUNDOFF, gamma, present

U32 = 2.0 ** -24


def repro(check: str, case: Case, **params) -> str:
    """A one-line shell command (from the repository root) that re-runs one property."""
    args = ", ".join([repr(case)] + [f"{k}={v!r}" for k, v in params.items()])
    return (f"python -c \"from ringcheck.testing.variant_properties import {check}; "
            f"from ringcheck.judge.check import Case; from ringcheck.spec import AttentionSpec, RingSpec, Variant; "
            f"{check}({args})\"")


def failure(check: str, case: Case, what: str, **params) -> AssertionError:
    return AssertionError(f"{check} failed for {case.describe()}: {what}\n  reproduce: {repro(check, case, **params)}")


# ---- helpers ---------------------------------------------------------------------------------

def _inputs(case: Case) -> Inputs:
    return make_inputs(case.spec, seed=case.seed, distribution=case.distribution, ring=case.ring)


def _run(case: Case, inputs: Inputs, impl) -> Results:
    whole = impl(case)
    # a ring of processes hands back whole Results itself (ringcheck.testing.impl_runner.CaseRun)
    return whole.results(inputs) if hasattr(whole, "results") else run_whole(whole, inputs)


def _verdict(case: Case, inputs: Inputs, got: Results) -> Verdict:
    """The budget verdict of every tensor (dsinks too, when the inputs have sinks)."""
    true = truth(case.spec, inputs)
    if got.dsinks is None:  # not run (forward only): not judged
        true = Results(true.out, true.lse, true.dq, true.dk, true.dv)
    return judge_results(case, got, true, peer(case.spec, inputs), tensors=present(got, TENSORS), inputs=inputs)


def _names(results: Results) -> tuple[str, ...]:
    return present(results, TENSORS + ("dsinks",))  # what was run and returned


def _with(case: Case, *, ring: RingSpec | None = None, **changes) -> Case:
    """The case with spec fields (and variant fields: cu_seqlens, window, softcap) changed."""
    spec, v = case.spec, case.spec.variant
    parts = {"cu_seqlens": v.cu_seqlens, "window": v.window, "softcap": v.softcap}
    parts.update({k: changes.pop(k) for k in list(changes) if k in parts})
    return Case(spec.replace(variant=Variant(**parts), **changes), ring or case.ring, case.seed, case.distribution,
                case.backend)


def _tokens(name: str, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The token positions `index` of a whole tensor (lse: (b, h, s); dsinks has none)."""
    return t if name == "dsinks" else t.index_select(2 if name == "lse" else 1, index)


def _diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y| in float64, 0 where equal (equal infinities: padding's -inf lse); NaN stays NaN."""
    x, y = x.double(), y.double()
    return (x - y).abs().masked_fill(x == y, 0.0)


def _worst(diff: torch.Tensor, allowed: torch.Tensor | float) -> str:
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(diff)
    over = (diff - allowed).nan_to_num(nan=float("inf"))
    i = tuple(int(j) for j in torch.unravel_index(over.argmax(), over.shape))
    return (f"{int((over > 0).sum())} of {diff.numel()} elements over; worst at index {list(i)}: "
            f"|difference| {float(diff[i]):.3e} > allowed {float(allowed[i]):.3e}")


def _expect_within(check, case, what, x, y, allowed, **params) -> None:
    diff = _diff(x, y)
    if not (diff <= allowed).all():  # NaN compares False: it never passes
        raise failure(check, case, f"{what} differs by more than allowed: {_worst(diff, allowed)}", **params)


def _expect_equal(check, case, what, x, y, **params) -> None:
    if not torch.equal(x, y):
        ne = ~(x == y)
        i = [int(j) for j in torch.nonzero(ne)[0]]
        raise failure(check, case, f"{what} is not bit-identical: {int(ne.sum())} of {x.numel()} elements differ, "
                      f"first at index {i}: {float(x[tuple(i)])!r} vs {float(y[tuple(i)])!r}", **params)


def _expect_padding(check, case, got: Results, end: int, **params) -> None:
    """Rows from `end` on: output 0, lse -inf, dq 0; keys from `end` on: dk = dv = 0 (exactly)."""
    n = got.out.shape[1]
    if end >= n:
        return
    pad = torch.arange(end, n)
    for name, want in (("out", 0.0), ("lse", float("-inf")), ("dq", 0.0), ("dk", 0.0), ("dv", 0.0)):
        if got.get(name) is None:  # not run (forward only) or not returned (lse)
            continue
        t = _tokens(name, got.get(name), pad)
        _expect_equal(check, case, f"{name} of the padding tokens {end}..{n - 1}", t, torch.full_like(t, want),
                      **params)


def same_plan(a: Case, b: Case, tokens: int | None = None) -> bool:
    """Whether our ring computes the first `tokens` tokens (default: all of a's) of cases a and
    b with the same float32 operations: every token on the same rank and local row, and the
    same blocks for every (query rank, K/V rank) pair."""
    ring = a.ring
    if ring != b.ring:
        return False
    n = a.spec.seq_len if tokens is None else tokens

    def placement(case):
        spec, p = case.spec, ring.world_size
        pos = [positions(layout=ring.layout, rank=r, world_size=p, seq_len=spec.seq_len,
                         cu_seqlens=spec.variant.cu_seqlens) for r in range(p)]
        real = [(r, i, int(t)) for r in range(p) for i, t in enumerate(pos[r].tolist()) if t < n]
        plans = [block_plan(layout=ring.layout, q_rank=qr, kv_rank=kr, world_size=p, local_len=spec.seq_len // p,
                            causal=spec.causal, cu_seqlens=spec.variant.cu_seqlens, window=spec.variant.window)
                 for qr in range(p) for kr in range(p)]
        return sorted(real), plans

    return placement(a) == placement(b)


def _budget_allowed(v_a: Verdict, v_b: Verdict, name: str) -> float:
    """Two runs of one mathematical result, each within its budget of the truth, are within
    the sum of the two budgets of each other (the largest per-element allowance of each)."""
    return v_a[name].max_allowed + v_b[name].max_allowed


# ---- budget ----------------------------------------------------------------------------------

def check_variant_budget(case: Case, impl=simulated_impl) -> None:
    """Every tensor (out, lse, dq, dk, dv, and dsinks with sinks) within k x the peer's error
    + the rounding floors of the float64 truth of the variant (non-finite never passes)."""
    inputs = _inputs(case)
    verdict = _verdict(case, inputs, _run(case, inputs, impl))
    if not verdict.passed:
        raise AssertionError(verdict.message() + f"\n  reproduce: {repro('check_variant_budget', case)}")


# ---- documents -------------------------------------------------------------------------------

def document_case(case: Case, length: int) -> Case:
    """One document of `length` tokens alone, as its own sequence, with the case's window,
    softcap, sinks, dtype and mask, on the case's ring and layout (zigzag for zigzag_docs): a
    ring run alone stays in the layout it was declared with. Where the length does not fit the
    layout (1 token on a zig-zag ring, which needs 2 per rank), the document is padded to the
    layout's next multiple, cu_seqlens=(0, length) marking the padding (inert: its rows and
    keys are checked exactly 0 / -inf), so the sub-case's seq_len may exceed `length`."""
    layout = "zigzag" if case.ring.layout in DOC_LAYOUTS else case.ring.layout
    ring = RingSpec(case.ring.world_size, layout)
    padded = -(-length // ring.chunks) * ring.chunks
    return _with(case, ring=ring, seq_len=padded, cu_seqlens=None if padded == length else (0, length))


def document_inputs(x: Inputs, start: int, end: int, sub: Case) -> Inputs:
    """Tokens `start`..`end - 1` of `x`, padded with zeros to `sub`'s length (`document_case`)."""
    pad = sub.spec.seq_len - (end - start)

    def cut(t):
        part = t[:, start:end]
        return part if not pad else torch.cat([part, part.new_zeros(part.shape[0], pad, *part.shape[2:])], dim=1)
    return Inputs(*(cut(t) for t in (x.q, x.k, x.v, x.dout)), sinks=x.sinks)


def check_documents_are_separate(case: Case, impl=simulated_impl) -> None:
    """Packed documents equal separate attention per document: each document's rows (out,
    lse, dq) and keys (dk, dv) of the packed run agree with a run of that document alone
    (`document_case`), within the sum of the two runs' budgets; dsinks with the sum over the
    documents' runs; padding rows and keys are exactly 0 / -inf / 0.

    Not bit for bit: alone, a document is dealt out to other ranks and local rows than in the
    packed sequence (and its keys reach its queries at other ring steps), so its float32 sums
    are grouped differently."""
    cu = case.spec.variant.cu_seqlens
    if cu is None:
        raise ValueError("check_documents_are_separate needs a case with cu_seqlens")
    check = "check_documents_are_separate"
    x = _inputs(case)
    packed = _run(case, x, impl)
    alone = []
    for a, b in pairwise(cu):
        if b > a:
            sub = document_case(case, b - a)
            xs = document_inputs(x, a, b, sub)
            alone.append((a, b, sub, xs, _run(sub, xs, impl)))
    _expect_padding(check, case, packed, cu[-1])
    vp = _verdict(case, x, packed)
    dsinks, dsinks_allowed = 0.0, (vp["dsinks"].max_allowed if packed.dsinks is not None else 0.0)
    for a, b, sub, xs, got in alone:
        vs = _verdict(sub, xs, got)
        padded = f", padded to {sub.spec.seq_len}" if sub.spec.seq_len > b - a else ""
        _expect_padding(check, sub, got, b - a)
        for name in present(packed, TENSORS):
            _expect_within(check, case, f"{name} of document tokens {a}..{b - 1} (packed vs alone on "
                           f"P={sub.ring.world_size} {sub.ring.layout}{padded})",
                           _tokens(name, packed.get(name), torch.arange(a, b)),
                           _tokens(name, got.get(name), torch.arange(b - a)), _budget_allowed(vp, vs, name))
        if x.sinks is not None and got.dsinks is not None:
            dsinks, dsinks_allowed = dsinks + got.dsinks.double(), dsinks_allowed + vs["dsinks"].max_allowed
    if x.sinks is not None and packed.dsinks is not None:
        _expect_within(check, case, "dsinks (packed vs the sum over the documents alone)", packed.dsinks,
                       torch.as_tensor(dsinks, dtype=torch.float64).expand_as(packed.dsinks), dsinks_allowed)


# ---- windows ---------------------------------------------------------------------------------

def check_full_window_is_no_window(case: Case, left: int, right: int, impl=simulated_impl, our_plan: bool = True) -> None:
    """A window covering the whole sequence ((left, right) each -1 or >= seq_len - 1, not both
    -1) equals no window: bit for bit where our ring's block plan is the same for both
    (`same_plan`: every layout with documents, contiguous and striped without), within the
    two budgets where it is not (zigzag without documents: the variant plan cuts the rank's
    two chunks into separate blocks). The case's own window is replaced. `our_plan=False` (an
    implementation whose block plan is not ours): always within the two budgets."""
    n, check = case.spec.seq_len, "check_full_window_is_no_window"
    if (left, right) == (-1, -1) or any(0 <= w < n - 1 or w < -1 for w in (left, right)):
        raise ValueError(f"window=({left}, {right}) does not cover a sequence of {n} tokens")
    plain, full = _with(case, window=(-1, -1)), _with(case, window=(left, right))
    x = _inputs(plain)
    a, b = _run(plain, x, impl), _run(full, x, impl)
    params = {"left": left, "right": right}
    if our_plan and same_plan(plain, full):  # (a ring that is not deterministic: within the two budgets)
        exact = Exact(check, case, a, lambda: _run(plain, x, impl), impl=impl, fail=failure, **params)
        for name in _names(a):
            exact.equal(f"{name} with window ({left}, {right}) vs no window", name, b.get(name), a.get(name),
                        ((full, x, b), (plain, x, a)))
        return
    va, vb = _verdict(plain, x, a), _verdict(full, x, b)
    for name in _names(a):
        _expect_within(check, case, f"{name} with window ({left}, {right}) vs no window (plans differ)", b.get(name),
                       a.get(name), _budget_allowed(va, vb, name), **params)


# ---- softcap ---------------------------------------------------------------------------------

SOFTCAP_FACTOR = 1e6


def max_abs_score(case: Case, inputs: Inputs) -> float:
    """max |scale q.k| over every (query, key) pair of a head's group (float64)."""
    g = case.spec.group_size
    q = inputs.q.double().transpose(1, 2)
    k = inputs.k.double().transpose(1, 2).repeat_interleave(g, 1)
    return float((torch.matmul(q, k.transpose(-1, -2)) * case.spec.scale).abs().max())


def check_softcap_to_infinity(case: Case, impl=simulated_impl) -> None:
    """softcap = 1e6 x max|score| equals no softcap to rounding (the case's softcap is replaced).

    Exactly, cap tanh(s / cap) = s (1 - d) with 0 <= d <= (s / cap)^2 / 3 <= 3.4e-13; in
    float32 the division, tanh and product add <= 4u relative to each score (u = 2^-24), i.e.
    <= 4u c with the row's condition c = 1 + |lse| + max|s| of `float32_floors`, which puts
    F = 8u A (its float32 floor, A the float64 sum of absolute terms) on each result. Each
    run's float32 value is within gamma_N A + N eta32 of the exact one (Higham, N = seq_len +
    head dims + 4P + 8 operations on a path; eta32 = 2^-150, half a float32 subnormal, the
    absolute error of an operation in gradual underflow: the property search found dq of
    ~1e-45 differing by a few subnormals), and each is then rounded to its output dtype (unit
    roundoff u_d, half a subnormal eta). So per element:

        |capped - plain| <= 2 (gamma_N / (8u) + 1) F + 2 N eta32 + 2 u_d max(|capped|, |plain|) + 2 eta
    """
    plain = _with(case, softcap=None)
    x = _inputs(plain)
    cap = SOFTCAP_FACTOR * max(max_abs_score(case, x), 1.0 / SOFTCAP_FACTOR)
    capped = _with(case, softcap=cap)
    a, b = _run(plain, x, impl), _run(capped, x, impl)
    spec = case.spec
    floors = float32_floors(x.q, x.k, x.v, x.dout, scale=spec.scale, causal=spec.causal, sinks=x.sinks,
                            **{k: v for k, v in spec.variant_kwargs().items() if k != "softcap"})
    n_ops = spec.seq_len + spec.head_dim + spec.dv + 4 * case.ring.world_size + 8
    factor = 2 * (gamma(n_ops) / (8 * U32) + 1)
    for name in _names(a):
        dtype = "float32" if name in ("lse", "dsinks") else spec.dtype
        size = torch.maximum(a.get(name).double().abs(), b.get(name).double().abs()).nan_to_num(0.0, posinf=0.0)
        allowed = (factor * floors[name] + 2 * n_ops * HALF_SUBNORMAL["float32"] + 2 * UNIT_ROUNDOFF[dtype] * size
                   + 2 * HALF_SUBNORMAL[dtype])
        _expect_within("check_softcap_to_infinity", case, f"{name} with softcap {cap:.3e} vs no softcap", b.get(name),
                       a.get(name), allowed)


# ---- sinks -----------------------------------------------------------------------------------

def check_sink_minus_inf(case: Case, impl=simulated_impl) -> None:
    """Sinks all -inf equal no sinks, bit for bit for out, lse, dq, dk, dv (exp(-inf) = 0
    joins every denominator exactly), and dsinks is exactly 0 (the case's own sinks kind is
    ignored: the sinks are -inf)."""
    check, plain, sunk = "check_sink_minus_inf", _with(case, sinks=None), _with(case, sinks=case.spec.sinks or "normal")
    x = _inputs(plain)
    xs = Inputs(x.q, x.k, x.v, x.dout, torch.full((case.spec.heads,), float("-inf")))
    a, b = _run(plain, x, impl), _run(sunk, xs, impl)
    exact = Exact(check, case, a, lambda: _run(plain, x, impl), impl=impl, fail=failure)  # (not deterministic: budgets)
    for name in present(a, TENSORS):
        exact.equal(f"{name} with sinks -inf vs no sinks", name, b.get(name), a.get(name),
                    ((sunk, xs, b), (plain, x, a)))
    if b.dsinks is not None:
        _expect_equal(check, case, "dsinks with sinks -inf", b.dsinks, torch.zeros_like(b.dsinks))


# ---- padding ---------------------------------------------------------------------------------

# Input dtypes whose results our ring's torch backend makes depend on more than the values of a
# block. Was ("float32",): float32 shards reached the fused CPU flash kernel as strided views,
# whose float32 bits change with the batch stride (found by check_padding_is_inert); the
# backend now hands that kernel contiguous inputs, so every dtype is exact here.
STRIDE_SENSITIVE: tuple[str, ...] = ()


def padded_case(case: Case, extra: int) -> Case:
    """The case with `extra` padding tokens appended (cu_seqlens unchanged; (0, seq_len) when
    the case has none): `extra` must keep the sequence valid for the ring (a multiple of its
    chunks: P, or 2P for the zigzag layouts)."""
    n = case.spec.seq_len
    if extra < 1 or extra % case.ring.chunks:
        raise ValueError(f"extra={extra} padding tokens must be a positive multiple of {case.ring.chunks} "
                         f"(the {case.ring.layout} layout's chunks on P={case.ring.world_size})")
    return _with(case, seq_len=n + extra, cu_seqlens=case.spec.variant.cu_seqlens or (0, n))


def check_padding_is_inert(case: Case, extra: int, impl=simulated_impl, our_plan: bool = True) -> None:
    """Appending `extra` padding tokens (random q, k, v, dout; cu_seqlens unchanged) changes
    no earlier token's out, lse, dq, dk or dv, nor dsinks, and every padding row and key gets
    output 0, lse -inf and zero gradients (exactly).

    Bit for bit where our ring's plan for the earlier tokens is unchanged (`same_plan`:
    zigzag_docs, where the padding tail is dealt out after every document, striped, where
    token t stays at rank t mod P and row t // P, and any layout on one rank); within the two
    runs' budgets where tokens move to other ranks or rows (contiguous and zigzag on P > 1),
    and for the dtypes of `STRIDE_SENSITIVE` (none now).
    dsinks is always compared within the budgets: each rank sums its rows' terms, and the
    padding rows (exact zeros) lengthen that sum, which regroups its float32 additions (the
    property search found last-bit differences under an unchanged plan). `our_plan=False` (an
    implementation whose block plan is not ours): within the budgets wherever tokens move."""
    n, check = case.spec.seq_len, "check_padding_is_inert"
    base, long = _with(case, cu_seqlens=case.spec.variant.cu_seqlens or (0, n)), padded_case(case, extra)
    x = _inputs(base)
    tail = make_inputs(long.spec, seed=case.seed + 1_000_003)  # whatever padding holds, it must not matter
    xl = Inputs(*(torch.cat([s, t[:, n:]], dim=1) for s, t in zip((x.q, x.k, x.v, x.dout),
                                                                  (tail.q, tail.k, tail.v, tail.dout))), sinks=x.sinks)
    a, b = _run(base, x, impl), _run(long, xl, impl)
    params = {"extra": extra}
    for got in (a, b):
        _expect_padding(check, case, got, base.spec.variant.cu_seqlens[-1], **params)
    # the padding tokens of the shorter run hold no block: where they sit does not matter
    first = torch.arange(n)
    exact = (same_plan(base, long, tokens=base.spec.variant.cu_seqlens[-1]) and case.spec.dtype not in STRIDE_SENSITIVE
             and our_plan)
    budgeted = [name for name in _names(a) if not exact or name == "dsinks"]
    exact = Exact(check, case, a, lambda: _run(base, x, impl), impl=impl, fail=failure, **params)  # (or budgets)
    for name in _names(a):
        if name not in budgeted:
            exact.equal(f"{name} of the first {n} tokens after padding", name, _tokens(name, b.get(name), first),
                        a.get(name), ((long, xl, b), (base, x, a)))
    if budgeted:
        va, vb = _verdict(base, x, a), _verdict(long, xl, b)
    for name in budgeted:
        why = "" if exact else " (not the same float32 operations)"
        _expect_within(check, case, f"{name} of the first {n} tokens after padding{why}",
                       _tokens(name, b.get(name), first), a.get(name), _budget_allowed(va, vb, name), **params)


# ---- zigzag_docs -----------------------------------------------------------------------------

def zigzag_docs_positions(cu: tuple[int, ...], seq_len: int, rank: int, world_size: int) -> list[int]:
    """Rank r's tokens under zigzag_docs, built independently of the ring: chunks r and 2P-1-r
    of every document and of the padding tail, in order."""
    held = []
    for start, end in zip((*cu,), (*cu[1:], seq_len)):
        c = (end - start) // (2 * world_size)
        for chunk in (rank, 2 * world_size - 1 - rank):
            held += range(start + chunk * c, start + (chunk + 1) * c)
    return held


def check_zigzag_docs_is_contiguous_permuted(case: Case, impl=simulated_impl) -> None:
    """zigzag_docs deals every rank chunks r and 2P-1-r of every document (checked against an
    independent construction), and its results, unsharded, equal the contiguous layout's with
    the same cu_seqlens within the two runs' budgets (tokens sit on other ranks and rows)."""
    if case.ring.layout not in DOC_LAYOUTS:
        raise ValueError("check_zigzag_docs_is_contiguous_permuted needs a zigzag_docs case")
    check, spec, p = "check_zigzag_docs_is_contiguous_permuted", case.spec, case.ring.world_size
    cu = spec.variant.cu_seqlens
    for r in range(p):
        got = positions(layout=case.ring.layout, rank=r, world_size=p, seq_len=spec.seq_len, cu_seqlens=cu)
        want = zigzag_docs_positions(cu, spec.seq_len, r, p)
        if got.tolist() != want:
            raise failure(check, case, f"rank {r} holds tokens {got.tolist()}, expected {want}")
    contiguous = _with(case, ring=RingSpec(p, "contiguous"))
    x = _inputs(case)
    a, b = _run(case, x, impl), _run(contiguous, x, impl)
    va, vb = _verdict(case, x, a), _verdict(contiguous, x, b)
    for name in _names(a):
        _expect_within(check, case, f"{name} of zigzag_docs vs contiguous", a.get(name), b.get(name),
                       _budget_allowed(va, vb, name))
