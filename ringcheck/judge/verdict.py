"""The budget policy: is a computed tensor as close to the truth as the peer allows?

Per tensor (out, lse, dq, dk, dv): error <= k x peer error + slack (flash-attention's rule),
where error and peer error are max abs errors against float64, k comes from `Budget` (2 for
the forward, 3 for the backward) and slack is the rounding floor of the output dtype.
Non-finite values never pass.

The peer error is taken at no less than half an ulp of the delivered dtype at each element:
the one rounding every implementation makes when it delivers the value. flash-attention's
rule assumes tensors large enough that some element of the peer's rounds by about that much;
on a small tensor (a property-based case: 4 elements) the peer may round luckily close
everywhere, and then even a correctly rounded result would fail. With the floor a correctly
rounded result always passes, and a result rounded twice (a flash kernel's partial outputs in
the input dtype, merged and rounded again: ring-flash-attn) passes for k >= 2; on large tensors
the peer's max error is already about that high, so the floor changes nothing there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringcheck.reference import attention_mask

from .metrics import ErrorStats, abs_error, error_stats, rounding_floor, ulp

TENSORS = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class TensorVerdict:
    """One tensor's verdict. `error` and `budget` are taken at the element with the largest
    error / allowance ratio (with a per-element float32 floor that need not be the element of
    largest error, `stats.max_abs`); `slack` is the output-dtype floor plus that element's
    float32 floor. `failing_ranks`: the ranks holding the elements over budget (when `judge`
    was given an `owner` mapping; empty when it passed or was not told)."""

    tensor: str
    passed: bool
    stats: ErrorStats
    peer: ErrorStats
    k: float
    slack: float
    over_budget: int
    where: str = ""
    worst_index: tuple[int, ...] = ()
    worst_error: float | None = None
    max_allowed: float | None = None  # the largest per-element allowance (a bound for every element)
    failing_ranks: tuple[int, ...] = ()
    half_ulp: float = 0.0  # the peer error's floor at that element: half an ulp of the delivered dtype
    convention: bool = False  # the error is against a computation convention's truth (closer than the exact one)
    note: str = ""  # what the failure means, where a check knows more (e.g. the sinks gradient's convention)
    peer_words: str = ""  # which peer set the budget and how it was measured, where not the naive peer on `got`'s elements

    @property
    def error(self) -> float:
        return self.stats.max_abs if self.worst_error is None else self.worst_error

    @property
    def peer_error(self) -> float:
        return self.peer.max_abs

    @property
    def budget(self) -> float:
        return self.k * max(self.peer.max_abs, self.half_ulp) + self.slack

    def describe(self) -> str:
        s = self.stats
        loc = f" ({self.where})" if self.where else ""
        head = "ok" if self.passed else "FAILED"
        index = list(self.worst_index or s.worst_index)
        words = f" ({self.peer_words})" if self.peer_words else ""
        peer = (f"peer error {self.peer_error:.3e}{words}" if self.peer_error >= self.half_ulp else
                f"half an ulp {self.half_ulp:.3e} (the peer's error {self.peer_error:.3e}{words} is less)")
        against = " (against the closest computation convention)" if self.convention else ""
        text = (f"{self.tensor} {head}: error {self.error:.3e}{against} at index {index}{loc}; "
                f"budget there {self.budget:.3e} = {self.k:g} x {peer} + slack "
                f"{self.slack:.3e}; max abs error {s.max_abs:.3e}")
        if not self.passed:
            pct = 100.0 * self.over_budget / max(s.numel, 1)
            text += f"; {self.over_budget} of {s.numel} elements ({pct:.2f}%) over budget"
            if s.nonfinite:
                text += f"; {s.nonfinite} NaN/Inf where the truth is finite"
        if self.note:
            text += f"; {self.note}"
        return text


def _ratio(diff: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """error / allowance per element (inf where an error meets a zero allowance)."""
    return torch.where(allowed > 0, diff / allowed.clamp_min(1e-300), diff * math.inf).nan_to_num(0.0)


def _closeness(diff: torch.Tensor, bad: torch.Tensor, allowed: torch.Tensor) -> tuple[int, float]:
    """How far a result is from one truth: its non-finite count, then its worst ratio."""
    return int(bad.sum()), float(_ratio(diff, allowed).max()) if diff.numel() else 0.0


def peer_error_stats(peer: torch.Tensor, truth: torch.Tensor) -> ErrorStats:
    """The peer's error against the truth, where the peer is finite: where it is NaN/Inf (fp16
    overflow) it sets no budget, so those elements are left out."""
    _, peer_bad = abs_error(peer, truth)
    return error_stats(peer.masked_fill(peer_bad, 0.0), truth.masked_fill(peer_bad, 0.0))


def judge(tensor: str, got: torch.Tensor, truth: torch.Tensor, peer: torch.Tensor | None, *,
          k: float, dtype: torch.dtype, locate: Callable[[tuple[int, ...]], str] | None = None,
          floor: float | torch.Tensor = 0.0,
          owner: tuple[int, torch.Tensor] | None = None, conventions=(),
          peer_stats: ErrorStats | None = None, peer_words: str = "") -> TensorVerdict:
    """Judge `got` against `truth` with the budget set by `peer` (both compared to `truth`).

    Allowed per element: k x max(peer error, half an ulp of `dtype` there) + the rounding floor
    of `dtype` (the dtype `got` is delivered in) + `floor`, a float32 rounding bound the naive
    peer does not share (a number or a tensor like `truth`, see `float32_floors`). `locate`
    turns an index into words. `conventions`: truths of computation conventions `got` may be
    measured against instead (`ringcheck.judge.conventions`): the one it is closest to (the
    least worst error / allowance) counts; the allowance stays the truth's.
    `owner` = (dim, ranks): the rank holding each position along `dim` (the sequence dim; for
    dk and dv the key's owner), from which the verdict lists its `failing_ranks`.
    `peer_stats`: the peer's error measured elsewhere (`peer` is then not read): over the whole
    tensor where `got` is judged on sampled rows (`ringcheck.judge.peers`); `peer_words` says so.
    """
    diff, bad = abs_error(got, truth)
    if peer_stats is None:
        peer_stats = peer_error_stats(peer, truth)
    out_floor = rounding_floor(truth, dtype)
    floor_t = torch.as_tensor(floor, dtype=torch.float64).expand_as(diff) if not isinstance(floor, torch.Tensor) \
        else floor.double().nan_to_num(0.0, posinf=0.0)
    half_ulp = (0.5 * ulp(truth, dtype)).nan_to_num(0.0, posinf=0.0).expand_as(diff)
    allowed = k * half_ulp.clamp_min(peer_stats.max_abs) + out_floor + floor_t
    reference = truth
    if conventions:  # the convention got is closest to, if closer than the truth
        best = _closeness(diff, bad, allowed)
        for other in conventions:
            d, b = abs_error(got, other)
            if (score := _closeness(d, b, allowed)) < best:
                diff, bad, reference, best = d, b, other, score
    stats = error_stats(got, reference, (diff, bad))
    over_mask = diff > allowed
    over = int(over_mask.sum())
    passed = over == 0 and stats.nonfinite == 0
    worst, worst_error, slack, worst_half_ulp = stats.worst_index, None, out_floor, 0.0
    if diff.numel():
        flat = int(_ratio(diff, allowed).flatten().argmax())
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        worst_error = float(diff.flatten()[flat])
        slack = out_floor + float(floor_t.flatten()[flat])
        worst_half_ulp = float(half_ulp.flatten()[flat])
    where = locate(worst) if (locate is not None and worst) else ""
    max_allowed = float(allowed.max()) if diff.numel() else k * peer_stats.max_abs + out_floor
    failing_ranks: tuple[int, ...] = ()
    if owner is not None and not passed:
        dim, ranks = owner
        hit = (over_mask | bad).movedim(dim, 0).reshape(diff.shape[dim], -1).any(1)
        failing_ranks = tuple(sorted(set(ranks[hit].tolist())))
    return TensorVerdict(tensor, passed, stats, peer_stats, k, slack, over, where, worst, worst_error, max_allowed,
                         failing_ranks, worst_half_ulp, reference is not truth, peer_words=peer_words)


# Higham-style a-priori bound for float32 rounding: C u A, u = 2^-24 the float32 unit roundoff
FLOAT32_FLOOR_C = 8.0


def float32_floors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                   scale: float, causal: bool, rows: torch.Tensor | None = None, cu_seqlens=None,
                   window=None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-element float32 rounding bounds, C u A, that a ring (or any flash-style kernel)
    may carry and the naive same-dtype peer need not.

    The ring computes in float32 whatever the input dtype, and unlike the peer it stores lse
    and recomputes P = exp(s - lse) in the backward, and forms dS = P (dP - D) with
    D = rowsum(dO * O) apart from dP. A float32 computation of a sum of terms t_i errs by at
    most ~n u sum |t_i|, and an error e in an exponent becomes a relative error e in exp, so
    A is the float64 sum of the absolute terms of each result, weighted by the row's
    condition c = 1 + |lse| + max|s| (the size of the exponents whose rounding P inherits):

        out: c P|V|    lse: c    dv: (c P)^T |dO|
        dq:  scale (c P (|dO||V|^T + rowsum(|dO||O|)) t') |K|      dk: the same with Q^T
        dsinks: sum over rows of c P_sink rowsum(|dO||O|)

    with t' = 1 - tanh^2 under a softcap (1 without). With C = 8 this is negligible next to
    the peer's error for bf16/fp16; for float32 inputs, or where the peer is exact by
    structure (a single visible key, an exactly one-hot row), it is what a correct float32
    ring needs. q, k, v, dout are whole tensors (b, s, h, d); with `rows`, only those query
    rows (out, lse, dq for them; dk, dv from them alone). The variants mask and cap the
    scores as the references do (`reference.attention_mask`).
    """
    f64 = torch.float64
    h, kvh = q.shape[2], k.shape[2]
    g = h // kvh
    qr = q if rows is None else q[:, rows]
    dor = dout if (rows is None or dout.shape[1] != q.shape[1]) else dout[:, rows]
    qh = qr.to(f64).transpose(1, 2)
    kh = k.to(f64).transpose(1, 2).repeat_interleave(g, 1)
    vh = v.to(f64).transpose(1, 2).repeat_interleave(g, 1)
    doh = dor.to(f64).transpose(1, 2)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    tanh_grad = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s, tanh_grad = softcap * t, 1 - t * t
    seen = attention_mask(q.shape[1], causal=causal, cu_seqlens=cu_seqlens, window=window, rows=rows,
                          key_len=k.shape[1])
    s = s.masked_fill(~seen.to(s.device), float("-inf"))
    every = s
    if sinks is not None:  # one more column, -inf on padding rows (no query sees padding)
        col = sinks.to(f64).view(1, h, 1, 1).expand(*s.shape[:3], 1)
        every = torch.cat([s, col.masked_fill(_padding(seen, cu_seqlens, rows, q.shape[1]), float("-inf"))], dim=-1)
    lse = torch.logsumexp(every, -1, keepdim=True)
    p_all = torch.exp(every - lse.masked_fill(torch.isneginf(lse), 0.0))
    p = p_all[..., :s.shape[-1]]
    out = torch.matmul(p, vh)
    cond = (1 + lse.masked_fill(torch.isneginf(lse), 0.0).abs()
            + every.masked_fill(torch.isinf(every), 0.0).abs().amax(-1, keepdim=True))
    pc = p * cond
    d_abs = (doh.abs() * out.abs()).sum(-1, keepdim=True)
    ds = pc * (torch.matmul(doh.abs(), vh.abs().transpose(-1, -2)) + d_abs)
    if tanh_grad is not None:
        ds = ds * tanh_grad
    dk = scale * torch.matmul(ds.transpose(-1, -2), qh.abs())
    dv = torch.matmul(pc.transpose(-1, -2), doh.abs())
    b, _, sk, d = dk.shape

    def group_sum(t):
        return t.view(b, kvh, g, sk, t.shape[-1]).sum(2).transpose(1, 2)

    cu = FLOAT32_FLOOR_C * 2.0 ** -24
    floors = {"out": cu * torch.matmul(pc, vh.abs()).transpose(1, 2), "lse": cu * cond[..., 0],
              "dq": cu * scale * torch.matmul(ds, kh.abs()).transpose(1, 2),
              "dk": cu * group_sum(dk), "dv": cu * group_sum(dv)}
    if sinks is not None:
        floors["dsinks"] = cu * (p_all[..., -1:] * cond * d_abs).sum((0, 2, 3))
    return floors


def _padding(seen: torch.Tensor, cu_seqlens, rows, seq_len: int) -> torch.Tensor:
    """(1, 1, rows, 1) bool: query rows past the last document (no sink for them)."""
    pos = torch.arange(seq_len) if rows is None else torch.as_tensor(rows)
    end = seq_len if cu_seqlens is None else int(cu_seqlens[-1])
    return (pos >= end).view(1, 1, -1, 1).to(seen.device)


@dataclass
class Verdict:
    """The verdicts of one case, with the words that name the case."""

    case: str
    tensors: list[TensorVerdict] = field(default_factory=list)
    group: str = ""  # the CP group of a mesh that produced the results, in words ("": the only one)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    @property
    def failures(self) -> list[TensorVerdict]:
        return [t for t in self.tensors if not t.passed]

    def __getitem__(self, tensor: str) -> TensorVerdict:
        for t in self.tensors:
            if t.tensor == tensor:
                return t
        raise KeyError(f"no verdict for tensor {tensor!r}; have {[t.tensor for t in self.tensors]}")

    def message(self) -> str:
        lines = [f"{self.case}: {'passed' if self.passed else 'FAILED'}"]
        lines += ["  " + t.describe() for t in (self.failures or self.tensors)]
        return "\n".join(lines)

