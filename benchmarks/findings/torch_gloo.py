"""PyTorch 2.13's `torch.distributed.nn` all-to-all over gloo takes a group rank for a global rank:
on any group that does not start at global rank 0, its backward (and `all_gather`'s backward,
which is an all-to-all) raises "Global rank 0 is not part of group".

`_AlltoAll.forward` (`torch/distributed/nn/functional.py` L455-478) implements gloo's all-to-all
with one `dist.scatter` per member, `dist.scatter(out_tensor_list[i], to_send, i, group=group)`:
`i` runs over the group's ranks (0 .. size-1), but scatter's third argument is `src`, a global
rank. On the group of global ranks [2, 3] the first scatter asks for global rank 0 as the source,
which is not in the group, and raises. NCCL's branch calls `dist.all_to_all` and is right.

Where ringcheck meets it: a glue whose loss gathers with `torch.distributed.nn.all_gather` (LLaMA-
Factory's `sequence_parallel_loss`, L194) on a CPU ring that is not the first of the world: under
`torchrun -m pytest` (the plugin runs a ring on the world's last ranks), or a mesh with replicas
(`--mesh dp=2,cp=2`: the second CP group is [2, 3]). The glue is not at fault; on GPUs (NCCL) the
path is not taken.

The patched copy (`patched_forward`): the same loop with `group_src=i`, as scatter takes a group rank.

    python -m benchmarks.findings.torch_gloo            # as shipped, then patched: 4 processes, group [2, 3]
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def patched_forward(ctx, group, out_tensor_list, *tensors):
    """`_AlltoAll.forward` with scatter's source named as a group rank (`group_src`)."""
    ctx.group = group
    ctx.input_tensor_size_list = [tensors[i].size() for i in range(dist.get_world_size(group=group))]
    my_rank = dist.get_rank(group=group)
    tensors = tuple(t.contiguous() for t in tensors)
    if dist.get_backend(group=group) is dist.Backend.GLOO:
        for i in range(dist.get_world_size(group=group)):
            dist.scatter(out_tensor_list[i], list(tensors) if i == my_rank else None, group=group, group_src=i)
    else:
        dist.all_to_all(out_tensor_list, list(tensors), group=group)
    return tuple(out_tensor_list)


def _rank(rank: int, world: int, port: int, patched: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore", FutureWarning)  # all_gather's deprecation: LLaMA-Factory calls it all the same
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.nn import functional

        if patched:
            functional._AlltoAll.forward = staticmethod(patched_forward)
        group = dist.new_group([2, 3])  # every rank makes it; ranks 2 and 3 use it
        if rank not in (2, 3):
            return
        x = torch.full((2,), float(rank), dtype=torch.float64, requires_grad=True)
        try:
            gathered = functional.all_gather(x, group=group)
            torch.stack(gathered).sum().backward()
            out.put((rank, "ok", x.grad.tolist()))
        except Exception as exc:  # the shipped path: what it raises
            out.put((rank, "raised", f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run(patched: bool) -> list[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, patched, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=120)
    return results


def main() -> int:
    print(f"torch {torch.__version__}, gloo, world of 4, torch.distributed.nn.all_gather on the group [2, 3], "
          f"backward of the sum (each rank's gradient must be the group's size, 2)")
    for patched in (False, True):
        for rank, what, detail in run(patched):
            print(f"  {'patched' if patched else 'shipped'} rank {rank}: {what}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
