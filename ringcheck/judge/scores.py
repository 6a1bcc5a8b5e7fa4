"""One case's attention probabilities in a chosen compute dtype, with the operands the
gradients need: what the precision class (`precision`) and the computation conventions
(`conventions`) compute their tensors from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ringcheck.reference import attention_mask

from ..spec import AttentionSpec
from .inputs import Inputs
from .results import reference_kwargs


@dataclass(frozen=True)
class Scores:
    """P (b, h, n, keys) with the sink column last when there are sinks, and the operands
    (b, h, ., d) the gradients need."""

    p_all: torch.Tensor
    lse: torch.Tensor  # (b, h, n)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    tanh: torch.Tensor | None
    scale: float
    kv_heads: int

    @property
    def p(self) -> torch.Tensor:
        return self.p_all[..., :self.k.shape[2]]

    @cached_property
    def dp(self) -> torch.Tensor:
        """dP = dO V^T (b, h, n, keys), computed once for every convention that needs it."""
        return torch.matmul(self.dout, self.v.transpose(-1, -2))

    def home(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, keys, d) -> (b, keys, kv_heads, d): each K/V head sums its group of query heads."""
        b, h, sk, d = t.shape
        return t.view(b, self.kv_heads, h // self.kv_heads, sk, d).sum(2).transpose(1, 2)

    def capped(self, ds: torch.Tensor) -> torch.Tensor:
        """dS with the softcap's tanh' applied (the gradient of the scores before the cap)."""
        return ds if self.tanh is None else ds * (1 - self.tanh * self.tanh)

    def grads(self, ds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dq (b, n, h, d) and dk (b, keys, kv_heads, d) of dS (before the softcap's tanh')."""
        ds = self.capped(ds)
        return (torch.matmul(ds, self.k) * self.scale).transpose(1, 2), \
            self.home(torch.matmul(ds.transpose(-1, -2), self.q) * self.scale)


def scores(spec: AttentionSpec, inputs: Inputs, dtype: torch.dtype) -> Scores:
    """P = exp(s - lse) computed in `dtype` from the exact inputs, masks, softcap and sinks as
    the references (`reference.attention_mask`); padding rows get no sink."""
    kwargs = reference_kwargs(spec, inputs)
    q, k, v, dout = (t.detach().to(dtype) for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    b, n, h, _ = q.shape
    g, scale, cap = h // k.shape[2], kwargs["softmax_scale"], kwargs.get("softcap")
    qh, doh = q.transpose(1, 2), dout.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(g, 1) for t in (k, v))
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    tanh = None
    if cap is not None:
        tanh = torch.tanh(s / cap)
        s = cap * tanh
    seen = attention_mask(n, causal=spec.causal, cu_seqlens=kwargs.get("cu_seqlens"), window=kwargs.get("window"))
    s = s.masked_fill(~seen, float("-inf"))
    if inputs.sinks is not None:
        end = n if kwargs.get("cu_seqlens") is None else int(kwargs["cu_seqlens"][-1])
        col = inputs.sinks.to(dtype).view(1, h, 1, 1).expand(b, h, n, 1)
        s = torch.cat([s, col.masked_fill((torch.arange(n) >= end).view(1, 1, n, 1), float("-inf"))], -1)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p_all = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0))
    return Scores(p_all, lse[..., 0], qh, kh, vh, doh, tanh, scale, k.shape[2])
