"""Block backends: attention of one (query chunk, K/V chunk) block of the ring.

The contract every backend keeps (the ring calls nothing else):

``forward(q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None) -> (out, lse)``
    q is (batch, sq, heads, head_dim), k (batch, sk, kv_heads, head_dim) and v (batch, sk,
    kv_heads, v_head_dim) in any supported dtype (the value head dim may differ: MLA); heads
    is a multiple of kv_heads (query head h uses K/V head h // (heads // kv_heads)). Returns
    out (batch, sq, heads, v_head_dim) and lse (batch, heads, sq), both float32. ``mask`` is
    ``"full"``, ``"causal"`` (key j visible to query i iff j - i <= diagonal) or ``"band"``
    (iff lower <= j - i <= diagonal: sliding windows); a row with no visible key has out 0 and
    lse -inf. The score is s = scale q.k, or with ``softcap`` (a float > 0)
    s = softcap * tanh(scale q.k / softcap), capped before masking.

``backward(q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None) -> (dq, dk, dv)``
    lse is the *merged* lse of the whole ring (batch, heads, sq) and delta the merged row
    statistic rowsum(dout * out) (batch, heads, sq), both float32; the block's probabilities
    are exp(s - lse). dS = P (dP - delta), times tanh' = 1 - tanh^2(scale q.k / softcap) under
    a softcap. Returns float32 gradients: dq like q, dk like k, dv like v.

Backends never import the references and never fall back silently to one another.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..merge import working_dtype
from .torch_backend import TorchBackend


class BlockBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                mask: str, diagonal: int = 0, lower: int = 0,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, *, scale: float, mask: str,
                 diagonal: int = 0, lower: int = 0,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


BACKENDS = ("torch", "torch_plain", "triton", "flash_attn")


def get_backend(name: str) -> BlockBackend:
    """The block backend called `name`; an unavailable one raises, it is never replaced."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name (one of {list(BACKENDS)}), got {type(name).__name__}")
    if name in ("torch", "torch_plain"):
        return TorchBackend(fast=(name == "torch"))
    if name == "triton":
        from .triton_backend import TritonBackend  # optional dependency: triton
        return TritonBackend()
    if name == "flash_attn":
        from .flash_attn_backend import FlashAttnBackend  # optional dependency: flash-attn (CUDA)
        return FlashAttnBackend()
    raise ValueError(f"backend={name!r} is unknown; choose one of {list(BACKENDS)}")


def row_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in out's working dtype (float32; float64 for a float64 ring), arranged
    (batch, heads, seq) like lse."""
    work = working_dtype(out.dtype)
    return (dout.to(work) * out.to(work)).sum(-1).transpose(1, 2).contiguous()
