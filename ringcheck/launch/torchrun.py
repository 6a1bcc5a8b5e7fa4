"""The torchrun world: this process is one rank of a world a launcher started."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ..spec import DEFAULT_TIMEOUT, check_timeout
from ..thirdparty.torch_private import bound_new_groups, default_store
from . import wire
from .common import (
    GroupPlan,
    PlanGroups,
    Submitted,
    Task,
    as_timedelta,
    control_timeout,
    describe_task,
    raised_text,
    ring_backend,
    ring_error,
)
from .devices import Accelerators, probe, rank_device
from .environment import CLAIMED_BY, TorchrunEnv
from .rank_task import STOP_PREFIX, StopFlag, StuckWatchdog, rank_task

# ----------------------------------------------------------------------------------- torchrun

def _default_store():
    """The store the default process group was made with, for the stop flags; None where this
    torch does not say (then a failing rank's peers wait out the ring timeout, as before)."""
    return default_store()  # private (torch's door): nothing else reaches the launcher's store


class TorchrunWorld:
    """This process as one rank of a launcher-started world; tasks run in-process.

    Initializes the default group from the environment (gloo for CPU tensors, and NCCL for
    CUDA tensors where the rank has a GPU: the device of the tensors picks the backend), a gloo
    control group for verdicts, and the groups of each `GroupPlan` (one ring per ring size, or
    the rings of a mesh), made on first use and destroyed on every rank after a failure in
    them (a ring that timed out may hold stale transfers; kept, they would pile up). The rank's
    device is `rank_device`'s choice: `device` ("auto", "cpu", "cuda") against the GPUs this
    process sees (`accelerators`, probed when None).
    """

    is_torchrun = True

    def __init__(self, env: TorchrunEnv, *, timeout: float = DEFAULT_TIMEOUT, device: str = "auto",
                 accelerators: Accelerators | None = None, log_dir: str | os.PathLike | None = None,
                 stuck_exit_code: int | None = None, stuck_grace: float = 5.0, audit: bool = False):
        """`log_dir`: each rank's log (`rank_task`). `stuck_exit_code`: a command's code for a
        rank still blocked in the implementation `stuck_grace` seconds after another rank
        failed (`StuckWatchdog`); None (a test session): such a rank waits out the timeout."""
        self.env = env
        self.log_dir = None if log_dir is None else str(log_dir)
        self.stuck_exit_code, self.stuck_grace = stuck_exit_code, stuck_grace
        self.timeout = check_timeout(timeout)
        self.rank, self.size = env.rank, env.world_size
        accelerators = probe() if accelerators is None else accelerators
        device = rank_device(env.local_rank, env.local_world_size, accelerators, device)
        self.device = str(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._owns_world = not dist.is_initialized()
        if self._owns_world:
            dist.init_process_group(ring_backend(self.device), rank=env.rank, world_size=env.world_size,
                                    timeout=as_timedelta(control_timeout(self.timeout)))
        elif (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(f"torch.distributed is initialized as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.world_size}")
        bound_new_groups(self.timeout)  # a trainer's own groups (its ring, its mesh) wait no longer than ours
        # a world someone else made (NCCL alone, say) is fine: the rings' groups name their backends
        self.control = dist.new_group(backend="gloo", timeout=as_timedelta(control_timeout(self.timeout)))
        self.audit = audit  # every task under the device audit (ringcheck.launch.audit)
        self._plans = PlanGroups(self.rank, self.timeout, self.device)  # members per plan, made on first use
        os.environ[CLAIMED_BY] = str(os.getpid())  # this process is the rank (see CLAIMED_BY)
        # the stop flags live in the store every rank joined through; keys unique to this world
        # object (rank 0's pid and clock), since one process may open several in turn
        self._store = _default_store()
        self._stop_prefix = f"{STOP_PREFIX}/{self.all_gather(f'{os.getpid()}-{time.time_ns()}')[0]}"
        self._tasks = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank of the world, in rank order (on every rank)."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.control)
        return gathered

    def _member(self, plan: GroupPlan):
        return self._plans.member(plan)  # collective: every rank gets here in the same order

    def run(self, ring_size: int, task: Task, *args: Any) -> list[Any]:
        """`task(member, *args)` on a ring of the world's last `ring_size` ranks; every rank gets
        every ring rank's result (or the same `RingError`)."""
        __tracebackhide__ = True  # pytest shows the failure, not this frame
        if not 1 <= ring_size <= self.size:
            raise ValueError(f"a ring of {ring_size} ranks does not fit in the torchrun world of {self.size}; "
                             f"launch with `torchrun --nproc-per-node={ring_size} ...` or more")
        return self.run_groups(GroupPlan.ring(self.size, ring_size), task, *args)[0]

    def submit_groups(self, plan: GroupPlan, task: Task, *args: Any) -> Submitted:
        """`run_groups`, run now (every rank computes in-process: there is nothing to overlap)."""
        done = Submitted(lambda: self.run_groups(plan, task, *args))
        done.settle()
        return done

    def run_groups(self, plan: GroupPlan, task: Task, *args: Any) -> list[list[Any]]:
        """`task(member, *args)` on every ring of `plan` (global ranks of this world) at once;
        every rank gets every ring's results, per ring in ring-rank order (or the same
        `RingError`). Ranks in no ring of the plan wait for the others."""
        __tracebackhide__ = True
        if plan.size > self.size:
            raise ValueError(f"the groups {[list(g) for g in plan.groups]} need a world of {plan.size} ranks; the "
                             f"torchrun world has {self.size}: launch with `torchrun --nproc-per-node={plan.size} ...`")
        member = self._member(plan)
        self._tasks += 1
        flag = None if self._store is None else StopFlag(self._store, f"{self._stop_prefix}/{self._tasks}")
        if member is not None:
            watchdog = (StuckWatchdog(flag, self.stuck_grace, self.stuck_exit_code, f"rank {self.rank}", self.log_dir)
                        if flag is not None and self.stuck_exit_code is not None else contextlib.nullcontext())
            with rank_task(member, describe_task(task), self._tasks, flag=flag, log_dir=self.log_dir,
                           audit=self.audit) as failed, \
                    watchdog:
                try:
                    outcome = ("ok", task(member, *args))
                except Exception:
                    outcome = ("error", raised_text())
                    failed(outcome[1])
        else:
            outcome = ("idle", None)
        try:  # a result's tensors leave the rank on the CPU (wire.dumps), wherever they were
            payload = wire.dumps(outcome)
        except Exception:
            payload = wire.dumps(("error", "returned a result that cannot be sent to the other ranks:\n"
                                           + traceback.format_exc()))
        outcomes = [wire.loads(sent) for sent in self.all_gather(payload)]
        errors = {g: text for g, (kind, text) in enumerate(outcomes) if kind == "error"}
        if errors:
            self._plans.discard(plan)  # every rank destroys the plan's groups (they all see the failure)
            raise ring_error(task, f"torchrun world of {self.size}", plan, errors)
        return plan.split([value for _, value in outcomes])

    def close(self) -> None:
        self._plans.clear()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> TorchrunWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


