"""The stand-in's `flash_attn.bert_padding` and `flash_attn.utils.distributed` (flash-attn 2.7's
names and return values), which trainers' sharding code imports (OpenRLHF's `ring_attn_utils`):
no kernel in them, only indexing and one collective.

- `unpad_input`, `pad_input`: transformers' own copies (`_unpad_input`, `_pad_input`, the same five
  and one return values as flash-attn 2.7's);
- `index_first_axis(x, indices)`: flash-attn's is `x[indices]` on the first axis of an already
  flattened tensor (transformers' `_index_first_axis` flattens the first two axes itself, so it is
  not the same function);
- `rearrange`: einops' (flash-attn imports it from einops the same way);
- `all_gather(x, group)`: flash-attn's `AllGatherFunc`: the group's tensors concatenated on the
  first axis, its backward the sum of the gradients over the group, this rank's rows of it
  (flash-attn reduce-scatters; gloo has no reduce-scatter, so the sum is an all-reduce, then a slice).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x[indices]


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows:(rank + 1) * rows], None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return AllGather.apply(x, group)


def _transformers_padding(name: str):
    """`unpad_input` and `pad_input`: transformers' `_unpad_input` and `_pad_input`."""
    if name not in ("unpad_input", "pad_input"):
        raise AttributeError(f"ringcheck's flash_attn.bert_padding stand-in has no {name!r}")
    from transformers import modeling_flash_attention_utils as mfa  # only when a trainer's code asks for them

    return getattr(mfa, f"_{name}")


def modules():
    """The two modules, `flash_attn.bert_padding` and `flash_attn.utils.distributed`, made once."""
    from einops import rearrange  # einops is a dependency of ring-flash-attn, as of flash-attn

    padding = types.ModuleType("flash_attn.bert_padding", "ringcheck's stand-in (ringcheck.flash_stand_in.padding)")
    padding.index_first_axis, padding.rearrange = index_first_axis, rearrange
    padding.__getattr__ = _transformers_padding  # transformers imported when a name is first asked for
    distributed = types.ModuleType("flash_attn.utils.distributed", "ringcheck's stand-in (all_gather)")
    distributed.all_gather = all_gather
    return padding, distributed
