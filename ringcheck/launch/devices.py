"""Where a rank runs: its device, chosen from what the machine shows (`Accelerators`, read once
at the edge) and what the user asked for (`--device`), in one function that tests call with
any device count (`rank_device`); and the refusal of local rings that were asked for code that
runs on CUDA tensors only on ranks on the CPU (`cpu_ranks_refusal`).

Ranks on a GPU use NCCL for their CUDA tensors; ranks on the CPU use gloo. Local rings (no
launcher) are always gloo processes on the CPU, even on a machine with GPUs: the GPUs are for a
torchrun world.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .environment import DEVICE_VARIABLE, DEVICES

__all__ = ["DEVICES", "DEVICE_VARIABLE", "Accelerators", "DeviceError", "check_device_request", "cpu_ranks_refusal",
           "probe", "rank_device"]


class DeviceError(RuntimeError):
    """A rank cannot have the device asked for: what was asked, what it sees, and the fix."""


@dataclass(frozen=True)
class Accelerators:
    """What this process sees of the machine's GPUs: how many CUDA devices, and the
    CUDA_VISIBLE_DEVICES it was given (None: unset), for messages."""

    cuda_devices: int = 0
    visible: str | None = None

    @property
    def cuda(self) -> bool:
        return self.cuda_devices > 0


def probe(environ: Mapping[str, str] | None = None) -> Accelerators:
    """The GPUs this process sees (asked of torch once, at the edge: a launcher or a command)."""
    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Accelerators(count, environ.get("CUDA_VISIBLE_DEVICES"))


def check_device_request(request: str, where: str = "--device") -> str:
    """`request` if it is one of `DEVICES`, else ValueError naming it and the choices."""
    if request not in DEVICES:
        raise ValueError(f"{where} {request!r} is not a device choice; pass one of {', '.join(DEVICES)}")
    return request


def rank_device(local_rank: int, local_world_size: int | None, accelerators: Accelerators,
                request: str = "auto") -> torch.device:
    """The device of a launcher's rank `local_rank` of `local_world_size` ranks on this machine
    (None: the launcher did not say), given the GPUs it sees and the request (`DEVICES`).

    - `cpu`, or `auto` where no GPU is visible: the CPU (a gloo world);
    - one visible GPU and several ranks on the machine: `cuda:0` on every rank (the per-rank
      CUDA_VISIBLE_DEVICES of SLURM's --gpus-per-task=1 and some Kubernetes launchers: each rank
      sees its own GPU as device 0);
    - else `cuda:<local_rank>`, and an error naming CUDA_VISIBLE_DEVICES and the fix where the
      machine's ranks outnumber its GPUs (NCCL takes one rank per GPU: "Duplicate GPU detected").
    """
    check_device_request(request)
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be an integer >= 0, got {local_rank!r}")
    n = accelerators.cuda_devices
    if request == "cpu" or (request == "auto" and n == 0):
        return torch.device("cpu")
    visible = ("unset" if accelerators.visible is None else repr(accelerators.visible))
    cpu_fix = f"pass --device cpu (or set {DEVICE_VARIABLE}=cpu) for a gloo world on the CPU"
    if n == 0:
        raise DeviceError(f"--device cuda was asked for, but this rank sees no CUDA device (CUDA_VISIBLE_DEVICES "
                           f"{visible}, torch {torch.__version__} with CUDA {torch.version.cuda}); {cpu_fix}")
    ranks = local_world_size if local_world_size is not None else local_rank + 1
    if n == 1:
        return torch.device("cuda", 0)
    if local_rank >= n or ranks > n:
        raise DeviceError(f"{ranks} ranks on this machine (LOCAL_RANK {local_rank}) but {n} visible CUDA devices "
                           f"(CUDA_VISIBLE_DEVICES {visible}): NCCL runs one rank per GPU. Launch at most {n} ranks "
                           f"per machine (torchrun --nproc-per-node={n}), make every GPU visible to every rank, or "
                           f"{cpu_fix}")
    return torch.device("cuda", local_rank)


def cpu_ranks_refusal(accelerators: Accelerators, *, torchrun: bool, backend: str | None = None,
                      impl: str | None = None, impl_needs_cuda: bool = False, interpreted: bool = False) -> str | None:
    """Why ranks on the CPU (local rings: gloo processes; a torchrun world under --device cpu)
    cannot run what was asked on this machine, in one line that says what to do, or None. On a
    machine without GPUs nothing is refused (Triton's interpreter and flash-attn's CPU stand-in
    run there); on one with GPUs a CUDA-only block backend (`flash_attn`; `triton` unless
    `interpreted`) or implementation (`impl_needs_cuda`) would get CPU tensors and fail on every
    rank."""
    if not accelerators.cuda:
        return None
    if backend == "flash_attn" or (backend == "triton" and not interpreted):
        what = f"--backend {backend}"
    elif impl_needs_cuda:
        what = f"--impl {impl}"
    else:
        return None
    if torchrun:
        return f"{what} runs on CUDA tensors, and --device cpu puts the ranks on the CPU: drop --device cpu"
    return (f"{what} runs on CUDA tensors, and local rings are gloo processes on the CPU: launch with "
            f"torchrun --nproc-per-node=<P> -m ringcheck ... (this machine has {accelerators.cuda_devices} GPUs)")
