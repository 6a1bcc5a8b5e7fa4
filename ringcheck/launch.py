"""Process groups: the one place that creates them, so a dead rank is an error, never a hang.

Two ways to get ranks, one interface (`run(ring_size, task, *args)`, `size`, `close()`):

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
exercised. `run` returns the tasks' results in ring-rank order, or raises `RingError` naming
every rank that raised, died or did not answer, with what each said — on every rank in
torchrun mode (a collective verdict), in the parent with local rings.

Timeouts: `timeout` (default 60 s) bounds every ring wait (see `comm.RingComm`); collectives
of the control plane get twice that plus a margin (a rank that failed fast must outwait a rank
still timing out in the ring); a local ring reports a worker death at once and stops the other
workers `grace` seconds after the first failure.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .spec import DEFAULT_TIMEOUT, check_timeout

Task = Callable[..., Any]

START_TIMEOUT = 120.0  # seconds for a local ring's processes to import torch and join the group
GRACE = 2.0            # seconds the other workers get to report after a first failure


def control_timeout(timeout: float) -> float:
    """Collectives outside the ring wait out a rank that is itself timing out in the ring."""
    return 2 * timeout + 30.0


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class RingMember:
    """What a task gets to know about its place: ring rank and size, group, timeout, device."""

    rank: int
    world_size: int
    group: Any
    timeout: float
    global_rank: int
    device: str = "cpu"


class RingError(RuntimeError):
    """A task failed on some rank of a ring; `failures` maps ring rank -> what happened there
    (a process outside the ring that failed is named in the message only)."""

    def __init__(self, message: str, failures: dict):
        super().__init__(message)
        self.failures = failures


def _describe_task(task: Task) -> str:
    return f"{getattr(task, '__module__', '?')}.{getattr(task, '__qualname__', repr(task))}"


def _failure_message(task: Task, where: str, world_size: int, ring_size: int, errors: dict[int, str]) -> str:
    """One message for every process of the world (keyed by global rank) that failed: a line
    each (the first line of its text), then what each said in full. A ring is
    the world's last `ring_size` ranks, so ring rank = global rank - (world_size - ring_size)."""
    first = world_size - ring_size

    def name(g: int) -> str:
        return f"rank {g - first} (global rank {g})" if g >= first else f"global rank {g} (outside the ring)"

    ranks = sorted(errors)
    lines = [f"{_describe_task(task)} failed on a ring of {ring_size} ({where}); failing ranks: "
             + ", ".join(str(g - first) for g in ranks if g >= first)]
    for g in ranks:  # every error text starts with a one-line summary
        text = errors[g].strip() or "(no message)"
        lines.append(f"  {name(g)}: {text.splitlines()[0]}")
    for g in ranks:
        if "\n" in errors[g].strip():
            lines.append(f"{name(g)} in full:\n    " + errors[g].strip().replace("\n", "\n    "))
    return "\n".join(lines)


def _raised() -> str:
    """The exception being handled: a one-line summary, then its traceback."""
    exc = sys.exc_info()[1]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}: {first}\n{traceback.format_exc()}"


def _ring_failures(world_size: int, ring_size: int, errors: dict[int, str]) -> dict[int, str]:
    first = world_size - ring_size
    return {g - first: text for g, text in errors.items() if g >= first}


# ----------------------------------------------------------------------------------- torchrun

@dataclass(frozen=True)
class TorchrunEnv:
    """The launcher's environment, read once (`from_torchrun_env`)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# set by the process that joins the world with these variables: its subprocesses inherit them
# but are not ranks (a rank that runs `ringcheck validate` in a subprocess must not make that
# subprocess join the world as a second copy of itself, which would hang)
CLAIMED_BY = "RINGCHECK_TORCHRUN_RANK_PID"


def from_torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun environment, or None when this process was not started by a launcher
    (or inherited the variables from a process that is the rank)."""
    environ = os.environ if environ is None else environ
    present = [name for name in _TORCHRUN_VARS if name in environ]
    if not present or environ.get(CLAIMED_BY, str(os.getpid())) != str(os.getpid()):
        return None
    missing = [name for name in _TORCHRUN_VARS if name not in environ]
    if missing:
        raise RuntimeError(f"the launcher environment is incomplete: {present} are set but {missing} are not; "
                           f"launch with `torchrun --nproc-per-node=<P> ...`, or unset {present}")
    try:
        env = TorchrunEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]),
                          environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
    except ValueError as exc:
        raise RuntimeError(f"the launcher environment has a non-integer value: "
                           f"{ {n: environ[n] for n in _TORCHRUN_VARS} }") from exc
    if not 0 <= env.rank < env.world_size:
        raise RuntimeError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
    return env


class TorchrunWorld:
    """This process as one rank of a launcher-started world; tasks run in-process.

    Initializes the default group from the environment (gloo for CPU tensors, and NCCL for
    CUDA tensors where CUDA is available: the device of the tensors picks the backend), a gloo
    control group for verdicts, and one sub-group per ring size, made on first use and
    replaced after a failure (a ring that timed out may hold stale transfers).
    """

    is_torchrun = True

    def __init__(self, env: TorchrunEnv, *, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None):
        self.env = env
        self.timeout = check_timeout(timeout)
        self.rank, self.size = env.rank, env.world_size
        use_cuda = torch.cuda.is_available() if backend is None else "nccl" in backend
        self.device = f"cuda:{env.local_rank}" if use_cuda else "cpu"
        if use_cuda:
            torch.cuda.set_device(env.local_rank)
        self._owns_world = not dist.is_initialized()
        if self._owns_world:
            dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if use_cuda else "gloo"),
                                    rank=env.rank, world_size=env.world_size,
                                    timeout=_td(control_timeout(self.timeout)))
        elif (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(f"torch.distributed is initialized as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.world_size}")
        self.control = dist.new_group(backend="gloo", timeout=_td(control_timeout(self.timeout)))
        self._rings: dict[int, Any] = {}
        os.environ[CLAIMED_BY] = str(os.getpid())  # this process is the rank (see CLAIMED_BY)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank of the world, in rank order (on every rank)."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.control)
        return gathered

    def _ring_group(self, ring_size: int):
        if ring_size not in self._rings:  # collective: every rank gets here in the same order
            ranks = list(range(self.size - ring_size, self.size))
            self._rings[ring_size] = dist.new_group(ranks=ranks, timeout=_td(self.timeout))
        return self._rings[ring_size]

    def run(self, ring_size: int, task: Task, *args: Any) -> list[Any]:
        __tracebackhide__ = True  # pytest shows the failure, not this frame
        if not 1 <= ring_size <= self.size:
            raise ValueError(f"a ring of {ring_size} ranks does not fit in the torchrun world of {self.size}; "
                             f"launch with `torchrun --nproc-per-node={ring_size} ...` or more")
        group = self._ring_group(ring_size)
        ring_rank = self.rank - (self.size - ring_size)
        if ring_rank >= 0:
            member = RingMember(ring_rank, ring_size, group, self.timeout, self.rank, self.device)
            try:
                outcome = ("ok", task(member, *args))
            except Exception:
                outcome = ("error", _raised())
        else:
            outcome = ("idle", None)
        try:
            pickle.dumps(outcome)
        except Exception:
            outcome = ("error", f"returned a result that cannot be sent to the other ranks:\n{traceback.format_exc()}")
        outcomes = self.all_gather(outcome)
        errors = {g: text for g, (kind, text) in enumerate(outcomes) if kind == "error"}
        if errors:
            self._rings.pop(ring_size, None)  # every rank drops it (they all see the failure)
            raise RingError(_failure_message(task, f"torchrun world of {self.size}", self.size, ring_size, errors),
                            _ring_failures(self.size, ring_size, errors))
        return [value for _, value in outcomes[self.size - ring_size:]]

    def close(self) -> None:
        self._rings.clear()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "TorchrunWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -------------------------------------------------------------------------------- local rings

def _loopback_interface() -> str | None:
    try:
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    except OSError:
        return None


def _worker_main(rank: int, world_size: int, port: int, timeout: float, conn) -> None:
    """One rank of a local ring: join the group, then run tasks until told to stop."""
    # this process is the edge of its own environment: keep gloo on the loopback interface
    lo = _loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_td(control_timeout(timeout)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=_td(control_timeout(timeout)))
        conn.send_bytes(pickle.dumps(("ready", None)))
    except Exception:
        conn.send_bytes(pickle.dumps(("error", f"could not join the ring: {_raised()}")))
        return
    rings: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone: leave, never linger
            break
        try:
            kind, ring_size, task, args = pickle.loads(message)
        except Exception:
            conn.send_bytes(pickle.dumps(("error", f"could not unpickle the task: {_raised()}")))
            continue
        if kind == "stop":
            break
        try:
            if ring_size not in rings:  # every worker gets every task, so all make the group together
                rings[ring_size] = dist.new_group(ranks=list(range(world_size - ring_size, world_size)),
                                                  timeout=_td(timeout))
            ring_rank = rank - (world_size - ring_size)
            if ring_rank < 0:
                outcome: tuple = ("idle", None)
            else:
                member = RingMember(ring_rank, ring_size, rings[ring_size], timeout, rank, "cpu")
                outcome = ("ok", task(member, *args))
            reply = pickle.dumps(outcome)
        except BaseException:
            reply = pickle.dumps(("error", _raised()))
        try:
            conn.send_bytes(reply)
        except OSError:  # the parent is gone
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _context():
    """forkserver where there is one: a server process imports torch once and forks every
    worker from that clean, single-threaded state, so a pool (re)starts in a fraction of a
    second instead of a torch import per process; spawn elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def _exit_words(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LocalRingPool:
    """`world_size` local gloo worker processes, started once, fed tasks until one fails.

    After a failure (a task raised, a worker died, or did not answer in time) every worker is
    killed and the pool is closed; `alive` is False from then on.
    """

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 start_timeout: float = START_TIMEOUT, grace: float = GRACE):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"a local ring needs world_size >= 1 processes, got {world_size!r}")
        self.size = world_size
        self.timeout = check_timeout(timeout)
        self.grace = grace
        self._closed = False
        ctx = _context()
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=_td(control_timeout(self.timeout)))
        self._conns, self._procs = [], []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"ringcheck-rank{rank}-of-{world_size}",
                                   args=(rank, world_size, self._store.port, self.timeout, child_end), daemon=True)
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
            replies = self._collect(range(world_size), time.monotonic() + check_timeout(start_timeout),
                                    what="start")
            errors = {r: text or "did not join in time" for r, (kind, text) in replies.items() if kind != "ready"}
            if errors:
                raise RingError(_failure_message(_worker_main, "local gloo ring, start-up", world_size, world_size,
                                                 errors), errors)
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _collect(self, ranks, deadline: float, *, what: str) -> dict[int, tuple]:
        """One reply per rank, until `deadline`; a death or an error reply starts the grace period."""
        waiting = set(ranks)
        replies: dict[int, tuple] = {}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                break
            by_handle = {}
            for r in waiting:
                by_handle[self._conns[r]] = r
                by_handle[self._procs[r].sentinel] = r
            for handle in multiprocessing.connection.wait(list(by_handle), timeout=deadline - now):
                r = by_handle[handle]
                if r not in waiting:
                    continue
                conn = self._conns[r]
                try:
                    if conn.poll():
                        replies[r] = pickle.loads(conn.recv_bytes())
                    else:
                        raise EOFError
                except (EOFError, OSError):
                    self._procs[r].join(1.0)
                    replies[r] = ("error", f"died during the {what}: {_exit_words(self._procs[r].exitcode)}")
                except Exception:
                    replies[r] = ("error", f"sent a reply that cannot be read:\n{traceback.format_exc()}")
                waiting.discard(r)
                if replies[r][0] == "error":
                    deadline = min(deadline, time.monotonic() + self.grace)
        for r in sorted(waiting):
            replies[r] = ("silent", None)
        return replies

    def run(self, ring_size: int, task: Task, *args: Any, deadline: float | None = None) -> list[Any]:
        """`task(member, *args)` on every rank of a ring of `ring_size` (<= size) processes.

        `deadline` (seconds, default 10 x timeout) bounds the whole task; ring waits inside
        are bounded by the timeout already, so it only catches work that never ends.
        """
        __tracebackhide__ = True
        if self._closed:
            raise RuntimeError(f"this local ring of {self.size} was closed after a failure; start a new one")
        if not 1 <= ring_size <= self.size:
            raise ValueError(f"a ring of {ring_size} ranks does not fit in a local ring of {self.size} processes")
        limit = 10 * self.timeout if deadline is None else check_timeout(deadline)
        message = pickle.dumps(("task", ring_size, task, args))
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except (OSError, ValueError):
                pass  # a dead worker shows up in _collect
        replies = self._collect(range(self.size), time.monotonic() + limit, what="task")
        first = self.size - ring_size
        errors = {r: text for r, (kind, text) in replies.items() if kind == "error"}
        silent = [r for r, (kind, _) in replies.items() if kind == "silent"]
        if errors or silent:
            self.close(graceful=False)
            why = (f"did not answer within the grace of {self.grace:g} s after the first failure" if errors
                   else f"did not answer within the task deadline of {limit:g} s")
            errors.update({r: f"{why}; stopped with the ring" for r in silent})
            raise RingError(_failure_message(task, f"local gloo ring of {self.size} processes", self.size, ring_size,
                                             errors), _ring_failures(self.size, ring_size, errors))
        return [replies[r][1] for r in range(first, self.size)]

    def close(self, *, graceful: bool = True) -> None:
        """Stop every worker and reap it: no process outlives the pool. `graceful` first asks
        idle workers to leave their group (after a failure they are killed at once)."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop", 0, None, ())))
                except (OSError, ValueError):
                    pass
            end = time.monotonic() + 2.0
            for proc in self._procs:
                proc.join(max(end - time.monotonic(), 0.0))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._store = None


class LocalRings:
    """Local gloo rings kept alive for a session: `run(ring_size, ...)` uses the smallest live
    pool with at least `ring_size` processes, or starts one of exactly `ring_size`.

    A pool that failed is dropped, so the next task gets fresh processes. As with any
    multiprocessing start method but fork, a script that starts rings must guard its entry
    point with `if __name__ == "__main__":` (workers import the main module).
    """

    size = None         # no upper bound: a bigger ring just starts more processes
    is_main = True      # the one process that reports
    is_torchrun = False

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, start_timeout: float = START_TIMEOUT):
        self.timeout = check_timeout(timeout)
        self.start_timeout = check_timeout(start_timeout)
        self._pools: list[LocalRingPool] = []

    def pool(self, ring_size: int) -> LocalRingPool:
        for dead in [p for p in self._pools if not p.alive]:
            dead.close()  # a worker may have died between tasks: reap it and drop the pool
            self._pools.remove(dead)
        fitting = [p for p in self._pools if p.size >= ring_size]
        if fitting:
            return min(fitting, key=lambda p: p.size)
        pool = LocalRingPool(ring_size, timeout=self.timeout, start_timeout=self.start_timeout)
        self._pools.append(pool)
        return pool

    def run(self, ring_size: int, task: Task, *args: Any, deadline: float | None = None) -> list[Any]:
        __tracebackhide__ = True
        return self.pool(ring_size).run(ring_size, task, *args, deadline=deadline)

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        self._pools = []

    def __enter__(self) -> "LocalRings":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_ring(*, timeout: float = DEFAULT_TIMEOUT, environ: Mapping[str, str] | None = None):
    """The torchrun world when launched by torchrun, else local gloo rings (the CLI's entry)."""
    env = from_torchrun_env(environ)
    return TorchrunWorld(env, timeout=timeout) if env is not None else LocalRings(timeout=timeout)
