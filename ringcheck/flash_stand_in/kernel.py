"""The stand-in's math: one flash-attn 2 block, forward and backward, dense, on any device.

Shapes as flash-attn's: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, d); h a multiple of
hk (query head i uses K/V head i // (h // hk)). Everything is computed in float32 from the
inputs and rounded once to the input dtype (out, dq, dk, dv); lse and softmax_d stay float32.

flash-attn's conventions, kept exactly:

- the mask is aligned to the bottom-right corner: query i sees key j when
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (a bound of -1 is unbounded; causal sets
  right = 0);
- ``softcap > 0`` caps the scaled scores: ``softcap * tanh(scale * q.k / softcap)`` (0 or None:
  no cap);
- a row that sees no key gets out 0 and lse ``+inf`` (flash-attn's ``INFINITY`` for an empty
  row), so its probabilities in a backward are exp(s - inf) = 0;
- the backward recomputes the probabilities from the lse it is given (``P = exp(s - lse)``)
  and uses ``D = rowsum(dout * out)`` of the out it is given: a ring passes the merged lse and
  out of the whole row, and that is what makes the block gradients add up.
"""

from __future__ import annotations

import torch


def visible(sq: int, sk: int, causal: bool, window: tuple[int, int], device=None) -> torch.Tensor:
    """(sq, sk) bool: which keys each query sees, flash-attn's bottom-right aligned mask."""
    left, right = (int(window[0]), int(window[1]))
    if causal:
        right = 0
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= j <= i + (sk - sq) + right
    if left >= 0:
        seen &= j >= i + (sk - sq) - left
    return seen


def check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The argument rules flash-attn 2 enforces that the math below relies on."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash-attn stand-in: q, k, v must be (batch, seq, heads, head_dim), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash-attn stand-in: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash-attn stand-in: k and v must be (batch, seq_k, kv_heads, head_dim) with q's batch "
                         f"and head_dim (flash-attn 2 has no value head dim of its own), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"flash-attn stand-in: heads={q.shape[2]} is not a multiple of kv_heads={k.shape[2]}")


def check_unsupported(dropout_p: float, alibi_slopes) -> None:
    if dropout_p:
        raise ValueError(f"flash-attn stand-in: dropout_p={dropout_p} is not supported (it computes exact "
                         f"attention); pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise ValueError("flash-attn stand-in: alibi_slopes is not supported; pass alibi_slopes=None")


def _scores(q, k, scale: float, causal: bool, window, softcap):
    """float32 scores (b, h, sq, sk) masked with -inf, and d(capped)/d(scaled) (1 without a cap)."""
    group = q.shape[2] // k.shape[2]
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    slope = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    seen = visible(q.shape[1], k.shape[1], causal, window, q.device)
    return s.masked_fill(~seen, float("-inf")), slope


def forward(q, k, v, *, scale: float, causal: bool, window=(-1, -1), softcap=None):
    """out (q's dtype, (b, sq, h, d)), lse (float32, (b, h, sq)), probabilities (float32)."""
    check_block(q, k, v)
    s, _ = _scores(q, k, scale, causal, window, softcap)
    group = q.shape[2] // k.shape[2]
    vh = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    # no keys at all (a ring's empty block): flash-attn returns out 0 and lse +inf without a kernel
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
    empty = torch.isneginf(m)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    total = p.sum(-1, keepdim=True)
    lse = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log(total)).squeeze(-1)
    probs = p / torch.where(empty, torch.ones_like(total), total)
    out = (probs @ vh).transpose(1, 2).to(q.dtype)
    return out, lse, probs


def backward(dout, q, k, v, out, lse, *, scale: float, causal: bool, window=(-1, -1), softcap=None):
    """dq, dk, dv (float32, q/k/v's shapes) and softmax_d (float32, (b, h, sq)) from the lse and
    out the caller gives (flash-attn's recomputation)."""
    check_block(q, k, v)
    s, slope = _scores(q, k, scale, causal, window, softcap)
    b, _sq, h, _d = q.shape
    hk, group = k.shape[2], h // k.shape[2]
    p = torch.exp(s - lse.float().unsqueeze(-1))            # exp(-inf - lse) = 0; exp(s - inf) = 0
    p = torch.nan_to_num(p, nan=0.0)                         # -inf - (-inf) where a row and its lse are empty
    do = dout.float().transpose(1, 2)
    vh = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    softmax_d = (do * out.float().transpose(1, 2)).sum(-1)   # D = rowsum(dout * out), (b, h, sq)
    ds = p * (do @ vh.transpose(-1, -2) - softmax_d.unsqueeze(-1))
    if slope is not None:
        ds = ds * slope
    dq = (ds @ kh) * scale
    dk = (ds.transpose(-1, -2) @ qh) * scale
    dv = p.transpose(-1, -2) @ do

    def per_kv_head(x):  # (b, h, sk, d) -> (b, sk, hk, d): sum each K/V head's query heads
        return x.reshape(b, hk, group, x.shape[2], x.shape[3]).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv), softmax_d
