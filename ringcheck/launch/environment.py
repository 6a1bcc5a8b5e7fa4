"""Whether this process is a launcher's rank, read from its environment: standard library only,
so the pytest plugin and the command ask it without importing torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunEnv:
    """The launcher's environment, read once (`from_torchrun_env`)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None  # ranks on this machine (torchrun's LOCAL_WORLD_SIZE; None: not said)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

DEVICES = ("auto", "cpu", "cuda")  # where ranks compute (`devices.rank_device`): what --device accepts
DEVICE_VARIABLE = "RINGCHECK_DEVICE"  # the same, for the plugin and any command without --device

# set by the process that joins the world with these variables: its subprocesses inherit them
# but are not ranks (a rank that runs `ringcheck validate` in a subprocess must not make that
# subprocess join the world as a second copy of itself, which would hang)
CLAIMED_BY = "RINGCHECK_TORCHRUN_RANK_PID"


def launched_rank(environ: Mapping[str, str]) -> bool:
    """Whether `environ` makes this process a launcher's rank: some of the launcher's variables are
    set, and no other process (the rank whose subprocess this is) has claimed them."""
    return (any(name in environ for name in TORCHRUN_VARS)
            and environ.get(CLAIMED_BY, str(os.getpid())) == str(os.getpid()))


def from_torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun environment, or None when this process was not started by a launcher
    (or inherited the variables from a process that is the rank)."""
    environ = os.environ if environ is None else environ
    if not launched_rank(environ):
        return None
    present = [name for name in TORCHRUN_VARS if name in environ]
    missing = [name for name in TORCHRUN_VARS if name not in environ]
    if missing:
        raise RuntimeError(f"the launcher environment is incomplete: {present} are set but {missing} are not; "
                           f"launch with `torchrun --nproc-per-node=<P> ...`, or unset {present}")
    try:
        local = environ.get("LOCAL_WORLD_SIZE")
        env = TorchrunEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]),
                          environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), None if local is None else int(local))
    except ValueError as exc:
        shown = {n: environ[n] for n in (*TORCHRUN_VARS, "LOCAL_WORLD_SIZE") if n in environ}
        raise RuntimeError(f"the launcher environment has a non-integer value: {shown}") from exc
    if not 0 <= env.rank < env.world_size:
        raise RuntimeError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
    return env


# the device audit (`ringcheck.launch.audit`): set for any command or test session, every rank's
# task runs under it; read here, at the edge, and passed on as `audit=`
AUDIT_ENV = "RINGCHECK_DEVICE_AUDIT"


def audit_requested(environ: Mapping[str, str] | None) -> bool:
    """Whether `RINGCHECK_DEVICE_AUDIT` in `environ` asks for the device audit (1, true, yes, on)."""
    return environ is not None and environ.get(AUDIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")
