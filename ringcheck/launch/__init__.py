"""Process groups: the one place that creates them, so a dead rank is an error, never a hang.

Two ways to get ranks, one interface (`run(ring_size, task, *args)`, `run_groups(plan, task,
*args)`, `size`, `close()`):

- `TorchrunWorld`: this process is one rank of a world launched by torchrun (or any launcher
  that sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT); `from_torchrun_env` reads that
  environment once. Every rank calls `run` in the same order; the task runs in-process.
- `LocalRings`: no launcher; it starts local gloo rings of worker processes on 127.0.0.1 and
  feeds them tasks, so process start-up (a torch import per process) is paid once per ring
  size, not per task. A failed task stops its ring's processes; the next task starts fresh ones.

A *task* is a module-level function `task(member, *args)` (picklable by reference) run on every
rank of a ring of `ring_size` ranks; `member` is a `RingMember` (ring rank, ring size, the
ring's process group, the timeout, the device). A ring smaller than the world is a sub-group
of the world's *last* ranks, so ring ranks differ from global ranks and the conversion is
exercised. `run_groups` runs a task on several rings at once (a `GroupPlan`: the rings of a
mesh, in global ranks, e.g. the strided CP groups of cp=4,tp=2), each rank with its ring's
group, and returns the results per ring. `run` returns the tasks' results in ring-rank order,
or raises `RingError` naming every rank that raised, died or did not answer, with what each
said — on every rank in torchrun mode (a collective verdict), in the parent with local rings.

Timeouts: `timeout` (default 60 s) bounds every ring wait (see `comm.RingComm`); collectives
of the control plane get twice that plus a margin (a rank that failed fast must outwait a rank
still timing out in the ring); a local ring reports a worker death at once and stops the other
workers `grace` seconds after the first failure.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .environment import AUDIT_ENV, CLAIMED_BY, TorchrunEnv, audit_requested, from_torchrun_env, launched_rank

__all__ = ["AUDIT_ENV", "CLAIMED_BY", "GRACE", "START_TIMEOUT", "GroupPlan", "LocalRingPool", "LocalRings", "ProgressFile",
           "RingError", "RingMember", "Submitted", "Task", "TorchrunEnv", "TorchrunWorld", "audit_requested", "control_timeout",
           "from_torchrun_env", "launched_rank", "open_ring", "relay"]

# the rest loads on first use (they import torch): whether this process is a launcher's rank is
# asked at start-up by the pytest plugin of every pytest run, and by the command, without it
_LAZY = {"ProgressFile": "channel", "relay": "channel", "GRACE": "common", "START_TIMEOUT": "common",
         "GroupPlan": "common", "RingError": "common", "RingMember": "common", "Submitted": "common", "Task": "common",
         "control_timeout": "common", "LocalRingPool": "local", "LocalRings": "local", "TorchrunWorld": "torchrun"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_ring(*, timeout: float | None = None, environ: Mapping[str, str] | None = None,
              log_dir: str | None = None, stuck_exit_code: int | None = None, setup=None, device: str = "auto",
              accelerators=None, audit: bool | None = None):
    """The torchrun world when launched by torchrun, else local gloo rings (the CLI's entry).
    `timeout`: every ring wait's bound (default `ringcheck.spec.DEFAULT_TIMEOUT`); `log_dir`: one
    log per rank (`rank_task`); `stuck_exit_code`: see `TorchrunWorld`; `setup`: a task every
    local ring's processes run first (under torchrun each rank is the calling process, which
    does its own setup); `device`: where each rank computes (`devices.rank_device`: "auto",
    "cpu", "cuda"; local rings are always on the CPU, and refuse "cuda"); `accelerators`: the
    GPUs the ranks see (`devices.Accelerators`; probed when None); `audit`: every rank's task under
    the device audit, None: as `RINGCHECK_DEVICE_AUDIT` in `environ` says (`ringcheck.launch.audit`)."""
    # start-up time: the launchers (and the device choice) import torch, and are needed only here
    from ..spec import DEFAULT_TIMEOUT
    from .devices import check_device_request
    from .local import LocalRings
    from .torchrun import TorchrunWorld

    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    check_device_request(device)
    if audit is None:
        audit = audit_requested(environ)
    env = from_torchrun_env(environ)
    if env is not None:
        return TorchrunWorld(env, timeout=timeout, log_dir=log_dir, stuck_exit_code=stuck_exit_code, device=device,
                             accelerators=accelerators, audit=audit)
    if device == "cuda":
        raise ValueError("--device cuda puts each rank on its own GPU, and local rings are gloo processes on the "
                         "CPU: launch with torchrun --nproc-per-node=<P> -m ringcheck ..., or drop --device cuda")
    return LocalRings(timeout=timeout, log_dir=log_dir, setup=setup, audit=audit)
