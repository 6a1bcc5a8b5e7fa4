"""Built-in adapter ``torch_cp``: PyTorch's own context-parallel ring (the private
`_templated_ring_attention`, with the CPU flash kernels on CPU); layouts contiguous
(bidirectional, and causal without load balancing) and zigzag (causal, its head-tail load
balancing); q, k and v of one head size."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..thirdparty.torch_private import (
    cp_options,
    cpu_flash_attention,
    templated_ring_attention,
    templated_ring_attention_backward,
)
from .contract import Impl, ImplFn, refuse_value_head_dim


class _TorchCPRing(torch.autograd.Function):
    """PyTorch's `_templated_ring_attention` forward and its backward, on (b, h, n, d)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, balance):
        # torch's private context-parallel API, through its door (one line where it has moved)
        options = cp_options()
        old = options.enable_load_balance
        options.enable_load_balance = balance
        try:
            out, lse = templated_ring_attention(
                group, 2, cpu_flash_attention()[0], q, k, v, is_causal=causal, dropout_p=0.0, scale=scale)[:2]
        finally:
            options.enable_load_balance = old
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.balance = causal, scale, group, balance
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        options = cp_options()
        old = options.enable_load_balance
        options.enable_load_balance = ctx.balance
        try:
            dq, dk, dv = templated_ring_attention_backward(
                ctx.group, 2, cpu_flash_attention()[1],
                grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                logsumexp=lse, is_causal=ctx.causal, dropout_p=0.0, scale=ctx.scale)[:3]
        finally:
            options.enable_load_balance = old
        return dq, dk, dv, None, None, None, None


def _torch_cp_rule(layout: str, causal: bool) -> None:
    if not causal and layout != "contiguous":
        raise ValueError("--impl torch_cp runs bidirectional attention on contiguous shards: use --layout "
                         "contiguous without --causal (causal runs contiguous, or zigzag with its head-tail "
                         "load balancing)")


def _torch_cp_check(target) -> None:
    refuse_value_head_dim("torch_cp", "PyTorch's CPU flash kernel, which needs q, k and v of one head size", target)


def _torch_cp() -> ImplFn:
    def torch_cp(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag"):
        group = group if group is not None else dist.group.WORLD
        if q.device.type == "cuda":
            raise RuntimeError("--impl torch_cp is wired to the CPU flash kernels; on CUDA use "
                               "torch.distributed.tensor.experimental.context_parallel directly")
        heads, kv_heads = q.shape[2], k.shape[2]
        # (b, n, h, d) -> (b, h, n, d); the CPU flash kernel wants as many K/V heads as q heads
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        # head-tail load balancing on zigzag shards; plain contiguous shards without it
        out, lse = _TorchCPRing.apply(qt, kt, vt, causal, softmax_scale, group, causal and layout == "zigzag")
        return out.transpose(1, 2), lse.float()
    return torch_cp


def load() -> Impl:
    return Impl("torch_cp", _torch_cp(), layouts=("contiguous", "zigzag"), rule=_torch_cp_rule,
                check_target=_torch_cp_check)
