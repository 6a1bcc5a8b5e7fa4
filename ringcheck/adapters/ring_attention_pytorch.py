"""Built-in adapter ``ring_attention_pytorch``: lucidrains' ring-attention-pytorch 0.5.20
`ring_flash_attn` (pure PyTorch, CPU and GPU); layouts contiguous and striped. It rings over
the default world group only (it takes no group), so it is never run inside a mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .contract import Impl, ImplFn

WORLD_ONLY = "ring_attention_pytorch takes no process group: it rings over the default world group only"


def _ring_attention_pytorch(layout: str) -> ImplFn:
    try:
        # optional dependency: the peer ring
        from ring_attention_pytorch import ring_flash_attn
    except ImportError as exc:
        raise RuntimeError("--impl ring_attention_pytorch needs the package: "
                           "pip install ring-attention-pytorch==0.5.20") from exc

    def ring_attention_pytorch(q, k, v, *, causal, softmax_scale, group=None):
        if group is not None and group != dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("ring_attention_pytorch rings over the default world group only; "
                             "run it with --world-size equal to the torchrun world")
        d, heads, kv_heads = q.shape[-1], q.shape[2], k.shape[2]
        # it always scales by head_dim ** -0.5: fold the requested scale into q
        q = q * (softmax_scale * d ** 0.5) if softmax_scale is not None else q
        # its GQA repeats K/V heads as '(g h)': query head i uses K/V head i % kv_heads; the
        # contract's is h // group. Reorder the query heads so both mean the same, and back.
        group = heads // kv_heads
        order = torch.tensor([j * kv_heads + h // group for h, j in ((h, h % group) for h in range(heads))])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(heads)
        out = ring_flash_attn(q[:, :, inverse], k, v, causal=causal, bucket_size=q.shape[1],
                              ring_reduce_col=True, striped_ring_attn=(layout == "striped"))
        return out[:, :, order]
    return ring_attention_pytorch


def load(*, layout: str) -> Impl:
    return Impl("ring_attention_pytorch", _ring_attention_pytorch(layout), layouts=("contiguous", "striped"),
                world_only=WORLD_ONLY)
