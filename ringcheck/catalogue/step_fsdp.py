"""Recipes whose parameters are DTensors: the `plain` step with its model sharded by FSDP2
(`torch.distributed.fsdp.fully_shard`) over the CP group, as torchtitan shards over the
CP dim ("dp_shard_cp"). Every parameter and its `.grad` is then a DTensor, Shard(0) over the
CP ranks: ringcheck gathers each gradient to the full tensor (`DTensor.full_tensor`) before it
compares it with the reference's (at CP=1, a mesh of one rank: the whole tensor).

- `fsdp_over_cp`: correct. FSDP's reduce-scatter is the gradient sum over the CP group (its
  divide factor set to 1: the loss is already the global token mean), the replicas' shards are
  summed over `cp.dp_group`;
- `fsdp_averaged_over_cp`: FSDP's default, the gradients averaged over the CP ranks it shards
  over (torchtitan #685): every gradient 1/P of the reference's, named `grads_over_p`.

On CPU FSDP2 runs over gloo; no activation checkpointing here (the plain recipe's runs inside
FSDP's hooks, which this template does not try).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..recipes.plain import PlainRecipe
from ..step.contract import CP


class FSDPOverCP(PlainRecipe):
    """The plain step on a model sharded over the CP group (the docstring's first recipe)."""

    checkpointing = ()

    def divide_factor(self, cp: CP) -> float:
        return 1.0

    def shard_model(self, model, cp: CP) -> None:
        """fully_shard over a mesh of the CP group (once per model); every parameter a DTensor."""
        if isinstance(next(model.parameters()), DTensor):
            return
        fully_shard(model, mesh=DeviceMesh.from_group(cp.group, device_type=cp.device.split(":")[0]))
        model.set_gradient_divide_factor(self.divide_factor(cp))

    def step(self, model, micro_batches, cp: CP, *, backward: bool = True) -> torch.Tensor:
        self.shard_model(model, cp)
        return super().step(model, micro_batches, cp, backward=backward)

    def reduce_gradients(self, model, cp: CP) -> None:
        """FSDP reduce-scattered over the CP group in backward; the replicas' shards summed here."""
        for p in model.parameters():
            if p.grad is None:
                continue
            if not isinstance(p.grad, DTensor) or p.grad.placements != (Shard(0),):
                raise TypeError(f"fully_shard left a {type(p.grad).__name__} gradient; this recipe is here to hand "
                                f"ringcheck Shard(0) DTensor gradients")
            if cp.dp_size > 1:
                local = p.grad.to_local()
                dist.all_reduce(local, group=cp.dp_group)


class FSDPAveragedOverCP(FSDPOverCP):
    """FSDP's default gradient division by the size of the group it shards over, here the CP
    group: the gradients averaged over CP instead of summed (torchtitan #685)."""

    def divide_factor(self, cp: CP) -> float:
        return float(cp.size)


fsdp_over_cp = FSDPOverCP()
fsdp_averaged_over_cp = FSDPAveragedOverCP()
