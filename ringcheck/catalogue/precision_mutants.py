"""Rings that lose a whole dtype of precision on one tensor: the precision-class mutants.

Each public function keeps the `--impl` contract with the variant keywords,

    fn(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None,
       window=None, softcap=None, sinks=None) -> (out, lse)

and is the plain correct ring `textbook_varlen` (ringcheck.catalogue.variant_textbook: float32
accumulation, one rounding at the end) with exactly one tensor rounded through a narrower
dtype on its way out: `narrow_<tensor>_<dtype>` rounds `<tensor>` (out, lse, dq, dk or dv)
through `<dtype>` (bfloat16 or float16) and back, and leaves every other tensor alone (the
forward roundings pass the gradient through unchanged; the gradient roundings leave the
forward unchanged). The defect is real where the narrow dtype has fewer significand bits
than the tensor's: bfloat16 on float16 inputs, float16 or bfloat16 on float32 inputs
(`NARROWER`), and on lse (float32) for every input dtype. That is the bug class of a backward
that rounds dq through bfloat16 for float16 inputs: 4-11x less precise than a flash kernel,
and within 3x of the naive float16 peer, so the budget rule passes it or fails it by a hair.
`ringcheck validate`'s precision-class rows fail every one of them by >= 3x
(suites/test_precision_class.py, reports/precision_class/).

`ring_results_task` runs any implementation on a list of cases on a ring (a task for
`ringcheck.launch`), and `whole_results` puts the shards together, so a sweep can judge many
cases on one ring without a validate run per case.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringcheck.adapters import load_impl
from ringcheck.flash_stand_in import install as install_stand_in
from ringcheck.judge.check import Case, Results
from ringcheck.judge.inputs import make_inputs
from ringcheck.ring.layouts import shard, unshard
from ringcheck.spec import DTYPES

from .variant_textbook import textbook_varlen

__all__ = ["NARROWER", "PRECISION_MUTANTS", "narrowing", "ring_results_task", "whole_results"]

TENSORS = ("out", "lse", "dq", "dk", "dv")
NARROW_DTYPES = ("bfloat16", "float16")
# input dtype -> the narrower dtypes a mutant's rounding is a real loss of precision for
NARROWER = {"bfloat16": (), "float16": ("bfloat16",), "float32": ("float16", "bfloat16")}


class _RoundValue(torch.autograd.Function):
    """x rounded through `narrow` and back in the forward; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, narrow):
        return x.to(narrow).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RoundGradient(torch.autograd.Function):
    """The identity in the forward; the gradient rounded through `narrow` and back."""

    @staticmethod
    def forward(ctx, x, narrow):
        ctx.narrow = narrow
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.narrow).to(grad.dtype), None


def narrowing(tensor: str, narrow: str):
    """The textbook ring with `tensor` rounded through the dtype named `narrow`."""
    if tensor not in TENSORS:
        raise ValueError(f"tensor={tensor!r} is not one of {TENSORS}")
    if narrow not in NARROW_DTYPES:
        raise ValueError(f"narrow={narrow!r} is not one of {NARROW_DTYPES}")
    dtype = DTYPES[narrow]
    grad_of = {"dq": 0, "dk": 1, "dv": 2}.get(tensor)

    def impl(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None, window=None,
             softcap=None, sinks=None):
        qkv = [q, k, v]
        if grad_of is not None:
            qkv[grad_of] = _RoundGradient.apply(qkv[grad_of], dtype)
        out, lse = textbook_varlen(*qkv, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                                   cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks)
        if tensor == "out":
            out = _RoundValue.apply(out, dtype)
        if tensor == "lse":
            lse = _RoundValue.apply(lse, dtype)
        return out, lse

    name = f"narrow_{tensor}_{narrow}"
    impl.__name__ = impl.__qualname__ = name
    impl.__module__ = __name__
    impl.__doc__ = f"the textbook ring with {tensor} rounded through {narrow}"
    return impl


# name -> (function, tensor, narrow dtype, one line)
PRECISION_MUTANTS: dict[str, tuple[Any, str, str, str]] = {}
for _tensor in TENSORS:
    for _narrow in NARROW_DTYPES:
        _fn = narrowing(_tensor, _narrow)
        globals()[_fn.__name__] = _fn
        PRECISION_MUTANTS[_fn.__name__] = (_fn, _tensor, _narrow, _fn.__doc__)


# ------------------------------------------------------------------------ sweeps on a ring

def ring_results_task(member, impl_name: str, layout: str, cases: list[Case],
                      stand_in: bool = False) -> list[dict[str, Any]]:
    """On every rank of a ring (`ringcheck.launch` task): `--impl impl_name` forward and
    backward on each case (inputs from `make_inputs`, sharded for `layout`); returns this
    rank's shards per case (out, lse, dq, dk, dv and dsinks, on the CPU). `stand_in`: install
    the CPU flash-attn stand-in first (`--flash-attn-stand-in`), for rings built on flash-attn."""
    if stand_in:
        install_stand_in()
    impl = load_impl(impl_name, layout=layout)
    rank, world = dist.get_rank(member.group), dist.get_world_size(member.group)
    results = []
    for case in cases:
        spec = case.spec
        if case.ring.world_size != world or case.ring.layout != layout:
            raise ValueError(f"case {case.describe()} is for a ring of {case.ring.world_size} ({case.ring.layout}); "
                             f"this one has {world} ranks ({layout})")
        inputs = make_inputs(spec, seed=case.seed, distribution=case.distribution, ring=case.ring)
        cu = spec.variant.cu_seqlens

        def mine(t, cu=cu):
            return shard(t, layout=layout, rank=rank, world_size=world, cu_seqlens=cu)

        q, k, v = (mine(t).detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
        sinks = None if inputs.sinks is None else inputs.sinks.detach().clone().requires_grad_(True)
        extra = {**spec.variant_kwargs(), **({} if sinks is None else {"sinks": sinks})}
        out, lse = impl.call(q, k, v, causal=spec.causal, softmax_scale=spec.scale, group=member.group,
                             layout=layout, **extra)
        leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
        grads = torch.autograd.grad(out, leaves, mine(inputs.dout))
        results.append({"out": out.detach(), "lse": lse.detach().float(), "dq": grads[0], "dk": grads[1],
                        "dv": grads[2], "dsinks": None if sinks is None else grads[3]})
    return results


def whole_results(parts: list[dict[str, Any]], case: Case) -> Results:
    """Every rank's shards of one case (in rank order) as whole tensors; dsinks is rank 0's."""
    cu = case.spec.variant.cu_seqlens

    def cat(name, dim):
        return unshard([p[name] for p in parts], layout=case.ring.layout, dim=dim, cu_seqlens=cu)

    return Results(cat("out", 1), cat("lse", 2), cat("dq", 1), cat("dk", 1), cat("dv", 1), parts[0]["dsinks"])
