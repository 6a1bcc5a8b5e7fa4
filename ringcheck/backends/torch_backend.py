"""The plain PyTorch block backend: readable float32 matmuls, the backend every other is
compared with. Inputs are upcast to float32 once per block; grouped-query attention is
computed by broadcasting each K/V head over its group of query heads (K/V are not copied)."""

from __future__ import annotations

import torch


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, kv_heads, group, s, d) float32; query head h is in group h // group."""
    b, s, h, d = q.shape
    return q.float().view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _kv(x: torch.Tensor) -> torch.Tensor:
    """(b, s, kv_heads, d) -> (b, kv_heads, 1, s, d) float32, broadcast over the group."""
    return x.float().permute(0, 2, 1, 3).unsqueeze(2)


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """(b, kv_heads, group, s, d) -> (b, s, heads, d)."""
    b, kvh, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, kvh * g, d)


def _scores(qg: torch.Tensor, kg: torch.Tensor, scale: float, mask: str, diagonal: int) -> torch.Tensor:
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if mask == "causal":
        sq, sk = s.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(diagonal)
        s = s.masked_fill(~visible, float("-inf"))
    elif mask != "full":
        raise ValueError(f"mask={mask!r} is unknown; choose 'full' or 'causal'")
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # exp(s - lse) with empty rows (lse = -inf) giving 0 instead of NaN
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    return torch.exp(s - safe.unsqueeze(-1))


class TorchBackend:
    name = "torch"

    def forward(self, q, k, v, *, scale, mask, diagonal=0):
        kvh = k.shape[2]
        s = _scores(_grouped(q, kvh), _kv(k), scale, mask, diagonal)   # (b, kvh, g, sq, sk)
        lse = torch.logsumexp(s, dim=-1)                                  # (b, kvh, g, sq)
        out = torch.matmul(_probabilities(s, lse), _kv(v))
        b, _, _, sq = lse.shape
        return _ungroup(out), lse.reshape(b, -1, sq)

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0):
        kvh = k.shape[2]
        qg, kg, vg, dog = _grouped(q, kvh), _kv(k), _kv(v), _grouped(dout, kvh)
        b, h, sq = lse.shape
        p = _probabilities(_scores(qg, kg, scale, mask, diagonal), lse.view(b, kvh, h // kvh, sq))
        dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)               # (b, kvh, sk, d)
        dp = torch.matmul(dog, vg.transpose(-1, -2))
        ds = p * (dp - delta.view(b, kvh, h // kvh, sq).unsqueeze(-1))
        dq = torch.matmul(ds, kg) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
        return _ungroup(dq), dk.transpose(1, 2), dv.transpose(1, 2)
