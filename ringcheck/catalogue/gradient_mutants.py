"""A glue whose forward is exact and whose backward is not: ring-flash-attn's Hugging Face adapter
(`ringcheck.glues.ring_flash_attn`, bfloat16 on ringcheck's flash-attn stand-in) with the gradient
that reaches one layer's attention output halved, as a glue that averages over the ring a gradient
it should sum would (P = 2). The loss and the logits are the correct glue's; only the gradients
tell, and only where each is judged against its own measured bfloat16 noise
(`ringcheck.models.budgets`): judged against the widest parameter's noise (bert's key biases,
9e13), it passed.

`ringcheck step --model bert --glue ringcheck.catalogue.gradient_mutants:layer_gradient_halved`
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..glues.contract import Glue
from ..glues.ring_flash_attn import hf_adapter, ring_flash_attn_glue

LAYER = 1          # the layer whose attention gradient is halved (every tiny model has two)
FACTOR = 0.5       # an average over P = 2 where the ring sums
NAME = "rfa_grad_halved"  # no "flash" in it: transformers would look a "*flash*" name up as a hub kernel


class _Backward(torch.autograd.Function):
    """The identity forward; the gradient times `FACTOR` backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * FACTOR


def _attention(module, query, key, value, attention_mask, **kwargs):
    out, weights = hf_adapter().flash_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if getattr(module, "layer_idx", None) == LAYER:
        out = _Backward.apply(out)
    return out, weights


def _glue() -> Glue:
    base = ring_flash_attn_glue()

    def install(group) -> str:
        from transformers import AttentionInterface  # transformers is the optional extra `hf`
        base.install(group)
        AttentionInterface.register(NAME, _attention)
        return NAME

    return replace(base, name="ring_flash_attn_layer_gradient_halved", install=install,
                   describe=f"ring-flash-attn's adapter with layer {LAYER}'s attention gradient times {FACTOR} "
                            f"(a planted bug: ringcheck.catalogue.gradient_mutants)")


layer_gradient_halved = _glue()
