"""Dense (whole-sequence, one device) attention references.

Shapes follow the ring: q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads,
head_dim); query head h uses K/V head h // (heads // kv_heads). Causal means key j is visible
to query i iff j <= i. A row with no visible key has output 0, lse -inf and zero gradients.

Arguments follow the ring's rules (`ringcheck.spec`, the one validation vocabulary), widened
only where a reference does more: float64 inputs, and query/key lengths that differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringcheck.spec import (
    REFERENCE_DTYPES,
    check_causal,
    check_cu_seqlens,
    check_dout,
    check_qkv,
    check_rows,
    check_sinks,
    check_softcap,
    check_softmax_scale,
    check_window,
)


@dataclass(frozen=True)
class _Problem:
    """The validated options of one reference call."""

    causal: bool
    scale: float
    cu_seqlens: tuple[int, ...] | None
    window: tuple[int, int]
    softcap: float | None
    sinks: torch.Tensor | None


def _check(q, k, v, causal, softmax_scale, cu_seqlens=None, window=None, softcap=None, sinks=None) -> _Problem:
    """The ring's argument rules (`ringcheck.spec`)."""
    check_qkv(q, k, v, what="sequence", dtypes=REFERENCE_DTYPES, same_length=False)
    return _Problem(check_causal(causal), check_softmax_scale(softmax_scale, q.shape[-1]),
                    check_cu_seqlens(cu_seqlens, k.shape[1]), check_window(window), check_softcap(softcap),
                    check_sinks(sinks, q.shape[2], q.device))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, kv_heads, d) -> (b, heads, s, d), repeating each K/V head over its group."""
    return x.transpose(1, 2).repeat_interleave(heads // x.shape[2], dim=1)


def _query_positions(sq: int, sk: int, rows: torch.Tensor | None) -> torch.Tensor:
    """Global positions of the query rows: rows[i], or without rows the last sq positions of
    the sk keys (bottom-right aligned, as flash-attention; for sq == sk the identity)."""
    return torch.arange(sk - sq, sk) if rows is None else rows.cpu()


def visibility(qpos: torch.Tensor, sk: int, pb: _Problem) -> torch.Tensor:
    """(sq, sk) bool: query at global position qpos[i] sees key j. Written for reading, not
    speed: documents (same document, neither side padding), causal, then the window."""
    kpos = torch.arange(sk)
    qi, kj = qpos[:, None], kpos[None, :]
    seen = torch.ones(len(qpos), sk, dtype=torch.bool)
    if pb.cu_seqlens is not None:
        cu = torch.tensor(pb.cu_seqlens)
        end = pb.cu_seqlens[-1]
        qdoc = torch.searchsorted(cu, qpos, right=True)
        kdoc = torch.searchsorted(cu, kpos, right=True)
        seen &= (qdoc[:, None] == kdoc[None, :]) & (qi < end) & (kj < end)
    if pb.causal:
        seen &= kj <= qi
    left, right = pb.window
    if left >= 0:
        seen &= kj >= qi - left
    if right >= 0:
        seen &= kj <= qi + right
    return seen


def attention_mask(seq_len: int, *, causal: bool = False, cu_seqlens=None, window=None, rows=None,
                   key_len: int | None = None) -> torch.Tensor:
    """(queries, keys) bool: which key each query sees, with the references' semantics (the
    query rows are `rows`, or all; keys the `key_len` (default seq_len) positions)."""
    sk = seq_len if key_len is None else key_len
    pb = _Problem(check_causal(causal), 1.0, check_cu_seqlens(cu_seqlens, sk), check_window(window), None, None)
    return visibility(_query_positions(seq_len, sk, None if rows is None else check_rows(rows, seq_len)), sk, pb)


def _padding_rows(qpos: torch.Tensor, pb: _Problem) -> torch.Tensor:
    """(sq,) bool: query rows that are padding (past the last document)."""
    if pb.cu_seqlens is None:
        return torch.zeros(len(qpos), dtype=torch.bool)
    return qpos >= pb.cu_seqlens[-1]


def _check_rows(rows, q: torch.Tensor) -> torch.Tensor | None:
    return None if rows is None else check_rows(rows, q.shape[1])


def _scores(qh, kh, pb: _Problem, qpos, device):
    """Capped and masked scores (b, h, sq, sk) in qh's dtype, and tanh of the uncapped ones
    (None without a softcap) for the backward."""
    s = torch.matmul(qh, kh.transpose(-1, -2)) * pb.scale
    t = None
    if pb.softcap is not None:
        t = torch.tanh(s / pb.softcap)
        s = pb.softcap * t
    seen = visibility(qpos, kh.shape[-2], pb).to(device)
    return s.masked_fill(~seen, float("-inf")), t


def _sink_column(pb: _Problem, s: torch.Tensor, qpos) -> torch.Tensor | None:
    """(b, h, sq, 1) sink logits in s's dtype, -inf on padding rows (which get no sink)."""
    if pb.sinks is None:
        return None
    b, h, sq, _ = s.shape
    col = pb.sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    pad = _padding_rows(qpos, pb).to(s.device).view(1, 1, sq, 1)
    return col.masked_fill(pad, float("-inf"))


def _attention(q, k, v, pb: _Problem, compute_dtype, rows=None):
    """Naive attention computed in `compute_dtype`; returns out (b, s, h, dv), lse (b, h, s)."""
    h = q.shape[2]
    qpos = _query_positions(q.shape[1], k.shape[1], rows)
    if rows is not None:
        q = q[:, rows]
    qh = q.transpose(1, 2).to(compute_dtype)
    kh, vh = _expand(k, h).to(compute_dtype), _expand(v, h).to(compute_dtype)
    s, _ = _scores(qh, kh, pb, qpos, q.device)
    sink = _sink_column(pb, s, qpos)
    every = s if sink is None else torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(every.float() if compute_dtype != torch.float64 else every, dim=-1)
    p = torch.softmax(every, dim=-1)
    # rows with no visible key (and no sink): softmax gives NaN, the answer is 0; the masking
    # above gives such rows zero gradients
    p = torch.nan_to_num(p, nan=0.0)[..., :s.shape[-1]]
    out = torch.matmul(p.to(compute_dtype), vh)
    return out.transpose(1, 2), lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, return_lse: bool = False, rows=None,
                    cu_seqlens=None, window=None, softcap=None, sinks=None):
    """Attention in float64 on whole tensors; differentiable (also in `sinks`); returns float64.
    With `rows` (query indices), only those query rows: out (b, len(rows), h, dv), lse
    (b, h, len(rows)). `cu_seqlens`, `window`, `softcap`, `sinks`: see `dense_grads`."""
    pb = _check(q, k, v, causal, softmax_scale, cu_seqlens, window, softcap, sinks)
    out, lse = _attention(q, k, v, pb, torch.float64, _check_rows(rows, q))
    return (out, lse) if return_lse else out


def peer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: float | None = None, return_lse: bool = False, rows=None,
                   cu_seqlens=None, window=None, softcap=None, sinks=None):
    """The same-dtype peer: naive attention with every matmul and the softmax in the input
    dtype (lse from the input-dtype scores, in float32). Differentiable (autograd in the
    input dtype), so its gradients are the peer's gradients too. Other arguments as in
    dense_attention."""
    pb = _check(q, k, v, causal, softmax_scale, cu_seqlens, window, softcap, sinks)
    out, lse = _attention(q, k, v, pb, q.dtype, _check_rows(rows, q))
    return (out, lse) if return_lse else out


def dense_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                causal: bool = False, softmax_scale: float | None = None, rows=None,
                cu_seqlens=None, window=None, softcap=None, sinks=None):
    """Analytic float64 forward and backward: returns (out, lse, dq, dk, dv), all float64, and
    dsinks (heads,) as a sixth tensor when `sinks` is given.

    dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS' K,
    dK = scale dS'^T Q with dS' = dS (1 - tanh^2) under a softcap (dS' = dS without); dK and dV
    are summed over each K/V head's group of query heads. dP - D is formed relative to each
    row's most probable column (see below), which keeps dq and dk exact to ~1e-15 under a
    dominant sink key (the naive form loses ~1e-16 e^gap).

    Variants (all optional, the ring's semantics): `cu_seqlens` global document boundaries
    (tokens past the last one are padding: output 0, lse -inf, zero gradients), `window`
    (left, right) as flash-attention (-1 unbounded), `softcap` (scores softcap tanh(s /
    softcap)), `sinks` (heads,) logits that join every non-padding row's softmax denominator
    with no value: the sink is treated as one more column whose dP is 0, so dsinks[h] =
    -sum exp(sink - lse) D over batch and rows. q, k may have a head dim other than v's.

    With `rows` (query indices) only those query rows take part: out, lse and dq are for
    those rows, and dk, dv (all keys) and dsinks are the gradients when dout is zero on every
    other row (`dout` may be given whole, (b, seq, h, dv), or for the rows only).
    O(len(rows) x seq).
    """
    pb = _check(q, k, v, causal, softmax_scale, cu_seqlens, window, softcap, sinks)
    rows = _check_rows(rows, q)
    qpos = _query_positions(q.shape[1], k.shape[1], rows)
    if rows is not None:
        if isinstance(dout, torch.Tensor) and dout.shape[:3] == q.shape[:3]:
            dout = dout[:, rows]
        q = q[:, rows]
    check_dout(dout, q, v)
    b, n, h, d = q.shape
    kvh, sk = k.shape[2], k.shape[1]
    f64 = torch.float64
    with torch.no_grad():
        qh = q.transpose(1, 2).to(f64)
        kh, vh = _expand(k, h).to(f64), _expand(v, h).to(f64)
        doh = dout.transpose(1, 2).to(f64)
        s, t = _scores(qh, kh, pb, qpos, q.device)
        sink = _sink_column(pb, s, qpos)
        if sink is not None:  # the sink is one more column, with no value (dP = 0)
            s = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
        pk = p[..., :sk]
        out = torch.matmul(pk, vh)
        dv = torch.matmul(pk.transpose(-1, -2), doh)
        # dS = P (dP - D) with D = rowsum(dO * O) = sum_k P_k dP_k. Formed naively, dP - D
        # cancels catastrophically in a dominant (sink) column, where P ~ 1 and the true value
        # is O(e^-gap); relative to the row's most probable column m it does not:
        # dP_j - D = x_j - sum_k P_k x_k with x_j = dP_j - dP_m, and x_m = 0 exactly.
        dp = torch.matmul(doh, vh.transpose(-1, -2))
        if sink is not None:
            dp = torch.cat([dp, dp.new_zeros(b, h, n, 1)], dim=-1)
        x = dp - dp.gather(-1, p.argmax(-1, keepdim=True))
        ds = p * (x - (p * x).sum(-1, keepdim=True))
        dsinks = ds[..., sk].sum((0, 2)) if sink is not None else None
        ds = ds[..., :sk]
        if t is not None:
            ds = ds * (1 - t * t)
        dq = torch.matmul(ds, kh) * pb.scale
        dk = torch.matmul(ds.transpose(-1, -2), qh) * pb.scale
        group = h // kvh
        dk = dk.view(b, kvh, group, -1, d).sum(2)
        dv = dv.view(b, kvh, group, -1, vh.shape[-1]).sum(2)
    grads = (out.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))
    return grads if dsinks is None else (*grads, dsinks)
