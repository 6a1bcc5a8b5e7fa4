"""One rank's run of an implementation under the `--impl` contract: shard, call, backward.

Used by `ringcheck validate` (`commands/validate.py`) and by the property suites on any ring
(`testing/impl_runner.py`), so both call an implementation the same way and hold it to the same
contract: out of q's shape (with v's head dim) and dtype, lse (batch, heads, local_seq) if
returned, gradients flowing to q, k, v (and sinks). A breach is a `ContractError` naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..judge.check import Case
from ..judge.inputs import Inputs
from ..ring.layouts import shard
from .adapters import Impl


class ContractError(ValueError):
    """The implementation broke the --impl contract (shape, dtype, gradients): a usage error."""


def unpack(result: Any, q: torch.Tensor, v: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse or None) of what the implementation returned, checked against the contract."""
    if isinstance(result, torch.Tensor):
        out, lse = result, None
    elif isinstance(result, (tuple, list)) and len(result) >= 1 and isinstance(result[0], torch.Tensor):
        out = result[0]
        lse = result[1] if len(result) > 1 and isinstance(result[1], torch.Tensor) else None
    else:
        raise ContractError(f"--impl {name} returned {type(result).__name__}; the contract is out or (out, lse) "
                            f"tensors")
    want_out = (*q.shape[:3], v.shape[3])
    if tuple(out.shape) != want_out or out.dtype != q.dtype:
        raise ContractError(f"--impl {name} returned out of shape {tuple(out.shape)} and dtype {out.dtype}; the "
                            f"contract is q's shape with v's head dim {want_out} and dtype {q.dtype}")
    if lse is not None:
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ContractError(f"--impl {name} returned lse of shape {tuple(lse.shape)}; the contract is "
                                f"(batch, heads, local_seq) = {want}, float32")
        lse = lse.float()
    return out, lse


def run_shards(impl: Impl, case: Case, inputs: Inputs, rank: int, group, device: torch.device | str = "cpu", *,
               forward_only: bool = False) -> dict[str, torch.Tensor | None]:
    """This rank's shards of `inputs` through `impl` (and the backward with its shard of dout
    unless `forward_only`): its shards of out, lse, dq, dk, dv and the dsinks it holds, on the
    CPU (None: not returned, or not run)."""
    spec, ring = case.spec, case.ring
    cu = spec.variant.cu_seqlens
    device = torch.device(device)

    def mine(t):
        return shard(t, layout=ring.layout, rank=rank, world_size=ring.world_size, cu_seqlens=cu).to(device)

    grad = not forward_only
    q, k, v = (mine(t).detach().requires_grad_(grad) for t in (inputs.q, inputs.k, inputs.v))
    sinks = None if inputs.sinks is None else inputs.sinks.detach().clone().to(device).requires_grad_(grad)
    variant = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in spec.variant_kwargs().items()}
    if sinks is not None:
        variant["sinks"] = sinks
    with torch.set_grad_enabled(grad):
        result = impl.call(q, k, v, causal=spec.causal, softmax_scale=spec.scale, group=group, layout=ring.layout,
                           **variant)
    out, lse = unpack(result, q, v, impl.name)
    got = {"out": out.detach().cpu(), "lse": None if lse is None else lse.detach().cpu(),
           "dq": None, "dk": None, "dv": None, "dsinks": None}
    if forward_only:
        return got
    if not out.requires_grad:
        raise ContractError(f"--impl {impl.name} returned an out with no autograd graph (it does not require grad), "
                            f"so no gradient can reach q, k, v; an inference ring without a backward: pass "
                            f"--forward-only")
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad(out, leaves, mine(inputs.dout), allow_unused=True)
    for name, g in zip(("q", "k", "v", "sinks"), grads):
        if g is None:
            raise ContractError(f"--impl {impl.name}: no gradient flows to {name} (it must be differentiable in "
                                f"q, k, v{' and sinks' if sinks is not None else ''}; an inference ring without a "
                                f"backward: pass --forward-only)")
    got.update(dq=grads[0].cpu(), dk=grads[1].cpu(), dv=grads[2].cpu(),
               dsinks=None if sinks is None else grads[3].cpu())
    return got
