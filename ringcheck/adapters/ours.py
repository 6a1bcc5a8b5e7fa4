"""Built-in adapter ``ringcheck``: our own ring (`ringcheck.ring_attention`), any layout, every
variant; its sinks gradient follows the declared convention (``sinks_grad``)."""

from __future__ import annotations

from ..ring import ring_attention
from .contract import Impl, ImplFn


def _ours(layout: str, backend: str, sinks_grad: str) -> ImplFn:
    def ringcheck_ring(q, k, v, *, causal, softmax_scale, group=None, cu_seqlens=None, window=None, softcap=None,
                       sinks=None):
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                              layout=layout, backend=backend, return_lse=True, cu_seqlens=cu_seqlens,
                              window=window, softcap=softcap, sinks=sinks, sinks_grad=sinks_grad)
    return ringcheck_ring


def load(*, layout: str, backend: str = "torch", sinks_grad: str = "partial") -> Impl:
    return Impl("ringcheck", _ours(layout, backend, sinks_grad))
