"""One rank's call of an implementation under the `--impl` contract: shard, arrange, call, backward.

The inputs of a call come in one of the `INPUT_LAYOUTS` a model hands them over in:

- ``contiguous``: fresh contiguous shards, q, k, v and dout each its own tensor (the clean room);
- ``fused_qkv``: q, k and v views of one fused projection output ``(b, s, h + 2 h_kv, d)`` (with a
  value head dim of its own, q and k of one ``(b, s, h + h_kv, d)`` buffer and v its own), and
  the gradient arriving at out a transposed view;
- ``kv_strides``: k a view of a fused K/V buffer ``(b, s, 2 h_kv, d)``, v a transposed view of its
  own ``(b, h_kv, s, d_v)`` buffer (so k and v have different strides), dout a permuted view.

The buffers are leaves, as a model's projection output is not: the gradients reach them through
the views, and dq, dk, dv are read back from their slices. `run_shards` is one call and its
backward; `run_two_calls` is two layers' worth: the forward of one input, the forward of
another (same shapes, other data), then the backward of both in autograd's order (the later
call's first), as a model's second attention layer runs before the first one's backward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import ContractError, Impl, unpack
from ..judge.check import Case
from ..judge.inputs import Inputs
from ..ring.layouts import shard

INPUT_LAYOUTS = ("contiguous", "fused_qkv", "kv_strides")


def arrange(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, grad: bool):
    """(q, k, v, dout as the call gets them, the leaves, leaves' grads -> (dq, dk, dv), the
    leaves' names)."""
    if layout == "contiguous":
        leaves = tuple(t.contiguous().requires_grad_(grad) for t in (q, k, v))
        return (*leaves, dout.contiguous(), leaves, lambda g: g, ("q", "k", "v"))
    h, kvh, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if layout == "fused_qkv":
        if dv == d:  # one projection output: [q heads | k heads | v heads]
            buf = torch.cat([q, k, v], dim=2).requires_grad_(grad)
            views = (buf[:, :, :h], buf[:, :, h:h + kvh], buf[:, :, h + kvh:])
            return (*views, dout.transpose(1, 2).contiguous().transpose(1, 2), (buf,),
                    lambda g: (g[0][:, :, :h], g[0][:, :, h:h + kvh], g[0][:, :, h + kvh:]), ("the fused q/k/v",))
        qk = torch.cat([q, k], dim=2).requires_grad_(grad)
        vbuf = v.clone().requires_grad_(grad)
        return (qk[:, :, :h], qk[:, :, h:], vbuf, dout.transpose(1, 2).contiguous().transpose(1, 2), (qk, vbuf),
                lambda g: (g[0][:, :, :h], g[0][:, :, h:], g[1]), ("the fused q/k", "v"))
    if layout == "kv_strides":
        # the K/V buffer's second half holds other values (a fused projection's V slots): a
        # kernel that reads k past its view reads them, never zeros. Drawn on the CPU (the same
        # values on every device), then moved to k's device
        filler = torch.randn(k.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float32)
        kv = torch.cat([k, filler.to(device=k.device, dtype=k.dtype)], dim=2).requires_grad_(grad)
        vt = v.transpose(1, 2).contiguous().requires_grad_(grad)   # (b, h_kv, s, d_v)
        qc = q.contiguous().requires_grad_(grad)
        return (qc, kv[:, :, :kvh], vt.transpose(1, 2), dout.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3),
                (qc, kv, vt), lambda g: (g[0], g[1][:, :, :kvh], g[2].transpose(1, 2)), ("q", "k", "v"))
    raise ValueError(f"input layout {layout!r} is unknown; choose from {list(INPUT_LAYOUTS)}")


class Prepared:
    """One call's inputs on this rank: its shards arranged as `layout` says, and its sinks."""

    def __init__(self, impl: Impl, case: Case, inputs: Inputs, rank: int, device, *, grad: bool, layout: str):
        spec, ring = case.spec, case.ring
        cu = spec.variant.cu_seqlens

        def mine(t):
            return shard(t, layout=ring.layout, rank=rank, world_size=ring.world_size, cu_seqlens=cu).to(device)

        self.impl, self.case = impl, case
        self.q, self.k, self.v, self.dout, leaves, self.grads_of, names = arrange(
            layout, *(mine(t).detach() for t in (inputs.q, inputs.k, inputs.v, inputs.dout)), grad)
        self.sinks = None if inputs.sinks is None else inputs.sinks.detach().clone().to(device).requires_grad_(grad)
        self.leaves = leaves if self.sinks is None else (*leaves, self.sinks)
        self.names = names if self.sinks is None else (*names, "sinks")

    def call(self, group, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The implementation on this call's q, k, v (and sinks), or on `tensors` in their place
        (what `torch.utils.checkpoint` hands the function it recomputes)."""
        spec, device = self.case.spec, self.q.device
        q, k, v, *sinks = tensors or (self.q, self.k, self.v, *(() if self.sinks is None else (self.sinks,)))
        variant = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in spec.variant_kwargs().items()}
        if sinks:
            variant["sinks"] = sinks[0]
        result = self.impl.call(q, k, v, causal=spec.causal, softmax_scale=spec.scale, group=group,
                                layout=self.case.ring.layout, **variant)
        return unpack(result, q, v, self.impl.name)

    def results(self, out: torch.Tensor, lse: torch.Tensor | None, grads=None) -> dict[str, torch.Tensor | None]:
        """This rank's out, lse, dq, dk, dv and dsinks on the CPU (None: not returned, or not run)."""
        got: dict[str, Any] = {"out": out.detach().cpu(), "lse": None if lse is None else lse.detach().cpu(),
                               "dq": None, "dk": None, "dv": None, "dsinks": None}
        if grads is not None:
            n = len(self.leaves) - (self.sinks is not None)
            dq, dk, dv = self.grads_of(grads[:n])
            got.update(dq=dq.cpu(), dk=dk.cpu(), dv=dv.cpu(),
                       dsinks=None if self.sinks is None else grads[n].cpu())
        return got


def prepare(impl: Impl, case: Case, inputs: Inputs, rank: int, device: torch.device | str = "cpu", *,
            grad: bool = True, layout: str = "contiguous") -> Prepared:
    """This rank's shards of `inputs`, arranged as `layout` says, ready for `.call(group)`:
    `.q`, `.k`, `.v`, `.dout`, the `.leaves` a backward reaches (and `.sinks`). For callers that
    measure a call (ringcheck.measure) rather than judge its results."""
    return Prepared(impl, case, inputs, rank, torch.device(device), grad=grad, layout=layout)


def require_graph(impl: Impl, out: torch.Tensor) -> None:
    if not out.requires_grad:
        raise ContractError(f"--impl {impl.name} returned an out with no autograd graph (it does not require grad), "
                            f"so no gradient can reach q, k, v; an inference ring without a backward: pass "
                            f"--forward-only")


def _grads(impl: Impl, outs, preps: list[Prepared]):
    """Every call's leaves' gradients, one backward over all the calls (autograd's order)."""
    leaves = [leaf for p in preps for leaf in p.leaves]
    grads = torch.autograd.grad(outs, leaves, [p.dout for p in preps], allow_unused=True)
    names = [n for p in preps for n in p.names]
    for name, g in zip(names, grads):
        if g is None:
            sinks = " and sinks" if any(p.sinks is not None for p in preps) else ""
            raise ContractError(f"--impl {impl.name}: no gradient flows to {name} (it must be differentiable in "
                                f"q, k, v{sinks}; an inference ring without a backward: pass --forward-only)")
    per, at = [], 0
    for p in preps:
        per.append(grads[at:at + len(p.leaves)])
        at += len(p.leaves)
    return per


def run_shards(impl: Impl, case: Case, inputs: Inputs, rank: int, group, device: torch.device | str = "cpu", *,
               forward_only: bool = False, input_layout: str = "contiguous") -> dict[str, torch.Tensor | None]:
    """This rank's shards of `inputs` through `impl` (and the backward with its shard of dout
    unless `forward_only`), arranged as `input_layout` says: its shards of out, lse, dq, dk, dv
    and the dsinks it holds, on the CPU (None: not returned, or not run)."""
    grad = not forward_only
    prep = Prepared(impl, case, inputs, rank, torch.device(device), grad=grad, layout=input_layout)
    with torch.set_grad_enabled(grad):
        out, lse = prep.call(group)
    if forward_only:
        return prep.results(out, lse)
    require_graph(impl, out)
    return prep.results(out, lse, _grads(impl, [out], [prep])[0])


def run_two_calls(impl: Impl, case: Case, first: Inputs, second: Inputs, rank: int, group,
                  device: torch.device | str = "cpu", *, forward_only: bool = False,
                  layouts: tuple[str, str] = ("contiguous", "contiguous")) -> tuple[dict, dict]:
    """Two calls before any backward: forward of `first`, forward of `second` (same shapes, other
    data), then one backward of both (autograd runs the later call's first); each call's shards
    of out, lse, dq, dk, dv, dsinks, as `run_shards` returns them. `layouts`: each call's input
    layout (`INPUT_LAYOUTS`)."""
    grad = not forward_only
    preps = [Prepared(impl, case, x, rank, torch.device(device), grad=grad, layout=layout)
             for x, layout in zip((first, second), layouts)]
    with torch.set_grad_enabled(grad):
        calls = [p.call(group) for p in preps]
    if forward_only:
        return tuple(p.results(out, lse) for p, (out, lse) in zip(preps, calls))
    for out, _ in calls:
        require_graph(impl, out)
    grads = _grads(impl, [out for out, _ in calls], preps)
    return tuple(p.results(out, lse, g) for p, (out, lse), g in zip(preps, calls, grads))
