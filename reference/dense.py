"""Dense (whole-sequence, one device) attention references.

Shapes follow the ring: q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads,
head_dim); query head h uses K/V head h // (heads // kv_heads). Causal means key j is visible
to query i iff j <= i. A row with no visible key has output 0, lse -inf and zero gradients.

Arguments follow the ring's rules (`ringcheck.spec`, the one validation vocabulary), widened
only where a reference does more: float64 inputs, and query/key lengths that differ.
"""

from __future__ import annotations

import torch

from ringcheck.spec import (
    REFERENCE_DTYPES,
    check_causal,
    check_dout,
    check_qkv,
    check_rows,
    check_softmax_scale,
)


def _check(q, k, v, causal, softmax_scale) -> float:
    """The ring's argument rules (`ringcheck.spec`); returns the scale."""
    check_qkv(q, k, v, what="sequence", dtypes=REFERENCE_DTYPES, same_length=False)
    check_causal(causal)
    return check_softmax_scale(softmax_scale, q.shape[-1])


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, kv_heads, d) -> (b, heads, s, d), repeating each K/V head over its group."""
    return x.transpose(1, 2).repeat_interleave(heads // x.shape[2], dim=1)


def _causal_mask(s: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Mask scores (..., sq, sk): query i at position rows[i] sees the keys <= its position.
    Without rows the queries are the last sq positions of the sk keys (bottom-right aligned,
    as flash-attention; for sq == sk that is the ordinary causal mask)."""
    sq, sk = s.shape[-2:]
    pos = torch.arange(sk - sq, sk, device=s.device) if rows is None else rows.to(s.device)
    visible = torch.arange(sk, device=s.device)[None, :] <= pos[:, None]
    return s.masked_fill(~visible, float("-inf"))


def _check_rows(rows, q: torch.Tensor) -> torch.Tensor | None:
    return None if rows is None else check_rows(rows, q.shape[1])


def _attention(q, k, v, causal, scale, compute_dtype, rows=None):
    """Naive attention computed in `compute_dtype`; returns out (b, s, h, d), lse (b, h, s)."""
    h = q.shape[2]
    if rows is not None:
        q = q[:, rows]
    qh = q.transpose(1, 2).to(compute_dtype)
    kh, vh = _expand(k, h).to(compute_dtype), _expand(v, h).to(compute_dtype)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        s = _causal_mask(s, rows)
    lse = torch.logsumexp(s.float() if compute_dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key
    out = torch.matmul(p.to(compute_dtype), vh)
    return out.transpose(1, 2), lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, return_lse: bool = False, rows=None):
    """Attention in float64 on whole tensors; differentiable; returns float64. With `rows`
    (query indices), only those query rows: out (b, len(rows), h, d), lse (b, h, len(rows))."""
    scale = _check(q, k, v, causal, softmax_scale)
    out, lse = _attention(q, k, v, causal, scale, torch.float64, _check_rows(rows, q))
    return (out, lse) if return_lse else out


def peer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: float | None = None, return_lse: bool = False, rows=None):
    """The same-dtype peer: naive attention with every matmul and the softmax in the input
    dtype (lse from the input-dtype scores, in float32). Differentiable (autograd in the
    input dtype), so its gradients are the peer's gradients too. `rows` as in dense_attention."""
    scale = _check(q, k, v, causal, softmax_scale)
    out, lse = _attention(q, k, v, causal, scale, q.dtype, _check_rows(rows, q))
    return (out, lse) if return_lse else out


def dense_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                causal: bool = False, softmax_scale: float | None = None, rows=None):
    """Analytic float64 forward and backward: returns (out, lse, dq, dk, dv), all float64.

    dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS K,
    dK = scale dS^T Q; dK and dV are summed over each K/V head's group of query heads.
    dP - D is formed relative to each row's most probable key (see below), which keeps dq and
    dk exact to ~1e-15 under a dominant sink key (the naive form loses ~1e-16 e^gap).

    With `rows` (query indices) only those query rows take part: out, lse and dq are for
    those rows, and dk, dv (all keys) are the gradients when dout is zero on every other row
    (`dout` may be given whole, (b, seq, h, d), or for the rows only). O(len(rows) x seq).
    """
    scale = _check(q, k, v, causal, softmax_scale)
    rows = _check_rows(rows, q)
    if rows is not None:
        if isinstance(dout, torch.Tensor) and dout.shape == q.shape:
            dout = dout[:, rows]
        q = q[:, rows]
    check_dout(dout, q)
    b, n, h, d = q.shape
    kvh = k.shape[2]
    f64 = torch.float64
    with torch.no_grad():
        qh = q.transpose(1, 2).to(f64)
        kh, vh = _expand(k, h).to(f64), _expand(v, h).to(f64)
        doh = dout.transpose(1, 2).to(f64)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if causal:
            s = _causal_mask(s, rows)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
        out = torch.matmul(p, vh)
        dv = torch.matmul(p.transpose(-1, -2), doh)
        # dS = P (dP - D) with D = rowsum(dO * O) = sum_k P_k dP_k. Formed naively, dP - D
        # cancels catastrophically in a dominant (sink) column, where P ~ 1 and the true value
        # is O(e^-gap); relative to the row's most probable column m it does not:
        # dP_j - D = x_j - sum_k P_k x_k with x_j = dP_j - dP_m, and x_m = 0 exactly.
        dp = torch.matmul(doh, vh.transpose(-1, -2))
        x = dp - dp.gather(-1, p.argmax(-1, keepdim=True))
        ds = p * (x - (p * x).sum(-1, keepdim=True))
        dq = torch.matmul(ds, kh) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
        group = h // kvh
        dk = dk.view(b, kvh, group, -1, d).sum(2)
        dv = dv.view(b, kvh, group, -1, d).sum(2)
    return (out.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))
