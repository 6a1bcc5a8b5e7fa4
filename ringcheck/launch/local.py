"""Local gloo rings of worker processes on 127.0.0.1, fed tasks, kept per ring size."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ..spec import DEFAULT_TIMEOUT, check_timeout
from ..thirdparty.torch_private import bound_new_groups
from . import wire
from .common import (
    GRACE,
    START_TIMEOUT,
    GroupPlan,
    PlanGroups,
    Submitted,
    Task,
    as_timedelta,
    control_timeout,
    describe_task,
    raised_text,
    ring_error,
)
from .rank_task import STOP_PREFIX, StopFlag, log_path, rank_task
from .start import worker_context

# -------------------------------------------------------------------------------- local rings

def _loopback_interface() -> str | None:
    try:
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    except OSError:
        return None


LAST_WORDS = 40  # lines of a dead worker's stderr its failure message quotes
IDLE_CLOSE = 30.0  # seconds a local ring may sit unused before `LocalRings` closes it


def _worker_main(rank: int, world_size: int, port: int, timeout: float, conn, log_dir: str | None = None,
                 stderr_path: str | None = None, audit: bool = False) -> None:
    """One rank of a local ring: join the group, then run tasks until told to stop (each in
    `rank_task`: the ring's stop flag in the pool's store, the rank's log in `log_dir`).

    With `stderr_path` the process's stderr (file descriptor 2: Python's, and what C++ code
    writes as it aborts) goes to that file, which the pool relays and quotes when the worker
    dies; faulthandler adds the Python stack of every thread on a fatal signal."""
    if stderr_path is not None:
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        faulthandler.enable(file=sys.stderr, all_threads=True)
    # this process is the edge of its own environment: keep gloo on the loopback interface
    lo = _loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    torch.set_num_threads(1)
    gc.freeze()  # what the fork server imported (torch and all) stays put: the collector no longer walks it
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=as_timedelta(control_timeout(timeout)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=as_timedelta(control_timeout(timeout)))
        bound_new_groups(timeout)  # a trainer's own groups (its ring, its mesh) wait no longer than ours
        conn.send_bytes(pickle.dumps(("ready", None)))
    except Exception:
        conn.send_bytes(pickle.dumps(("error", f"could not join the ring: {raised_text()}")))
        return
    plans = PlanGroups(rank, timeout)
    index = 0
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone: leave, never linger
            break
        try:
            kind, plan, task, args = pickle.loads(message)
        except Exception:
            conn.send_bytes(pickle.dumps(("error", f"could not unpickle the task: {raised_text()}")))
            continue
        if kind == "stop":
            break
        index += 1  # every worker counts every task: the same stop flag key on every rank
        flag = StopFlag(store, f"{STOP_PREFIX}/{index}")
        try:
            member = plans.member(plan)  # every worker gets every task: all make the groups together
            if member is None:
                reply = pickle.dumps(("idle", None))
            else:
                with rank_task(member, describe_task(task), index, flag=flag, log_dir=log_dir, audit=audit) as failed:
                    try:
                        reply = wire.dumps(("ok", task(member, *args)))
                    except BaseException:
                        text = raised_text()
                        failed(text)
                        reply = pickle.dumps(("error", text))
        except BaseException:
            reply = pickle.dumps(("error", raised_text()))
        try:
            conn.send_bytes(reply)
        except OSError:  # the parent is gone
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _context():
    """The workers' start method (`ringcheck.launch.start.worker_context`: forkserver where there is
    one, with the package pinned on the PYTHONPATH they inherit)."""
    return worker_context()


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
                 start_timeout: float = START_TIMEOUT, grace: float = GRACE, log_dir: str | None = None,
                 audit: bool = False):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"a local ring needs world_size >= 1 processes, got {world_size!r}")
        self.size = world_size
        self.timeout = check_timeout(timeout)
        self.grace = grace
        self._closed = False
        ctx = _context()
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=as_timedelta(control_timeout(self.timeout)))
        self._conns, self._procs = [], []
        # each worker's stderr in a file: relayed here after each task, quoted when it dies
        self._stderr_dir = tempfile.mkdtemp(prefix="ringcheck-ring-")
        self._stderr_read = [0] * world_size
        self._log_dir = log_dir
        self._in_flight: Submitted | None = None
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"ringcheck-rank{rank}-of-{world_size}",
                                   args=(rank, world_size, self._store.port, self.timeout, child_end, log_dir,
                                         self._stderr_path(rank), audit),
                                   daemon=True)
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
            replies = self._collect(range(world_size), time.monotonic() + check_timeout(start_timeout),
                                    what="start")
            self._relay_stderr()
            errors = {r: text or "did not join in time" for r, (kind, text) in replies.items() if kind != "ready"}
            if errors:
                raise ring_error(_worker_main, "local gloo ring, start-up", GroupPlan.ring(world_size, world_size),
                                 errors)
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _stderr_path(self, rank: int) -> str:
        return os.path.join(self._stderr_dir, f"rank{rank}.stderr")

    def _relay_stderr(self) -> None:
        """What each worker wrote to stderr since the last relay (whole lines), onto this
        process's stderr, each line marked with its rank."""
        for rank in range(len(self._procs)):
            try:
                with open(self._stderr_path(rank), "rb") as f:
                    f.seek(self._stderr_read[rank])
                    new = f.read()
            except OSError:
                continue
            whole = new[:new.rfind(b"\n") + 1]
            self._stderr_read[rank] += len(whole)
            if whole:
                text = whole.decode("utf-8", errors="replace")
                try:
                    sys.stderr.write("".join(f"[ringcheck rank {rank}] {line}\n" for line in text.splitlines()))
                    sys.stderr.flush()
                except (OSError, ValueError):
                    return

    def _death(self, rank: int, what: str) -> str:
        """How a worker died, with its last words; also appended to its log (a dead rank
        cannot write the end of its own story)."""
        words = self._last_words(rank)
        text = (f"died during the {what}: {_exit_words(self._procs[rank].exitcode)}"
                + (f"\nthe last it wrote to stderr:\n{words}" if words else ""))
        if self._log_dir is not None:
            try:
                with open(log_path(self._log_dir, rank), "a", encoding="utf-8") as log:
                    log.write(f"=== {text}\n\n")
            except OSError:
                pass
        return text

    def _last_words(self, rank: int) -> str:
        """The last LAST_WORDS lines a worker wrote to stderr (an abort message, a C++ error,
        faulthandler's Python stacks), or ""."""
        try:
            with open(self._stderr_path(rank), "rb") as f:
                f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
                lines = f.read().decode("utf-8", errors="replace").rstrip().splitlines()[-LAST_WORDS:]
        except OSError:
            return ""
        return "\n".join(lines)

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
                    replies[r] = ("error", self._death(r, what))
                except Exception:
                    replies[r] = ("error", f"sent a reply that cannot be read:\n{traceback.format_exc()}")
                waiting.discard(r)
                if replies[r][0] == "error":
                    deadline = min(deadline, time.monotonic() + self.grace)
        for r in sorted(waiting):
            replies[r] = ("silent", None)
        return replies

    def run(self, ring_size: int, task: Task, *args: Any, deadline: float | None = None) -> list[Any]:
        """`task(member, *args)` on every rank of a ring of `ring_size` (<= size) processes: the
        pool's last ranks, so ring ranks differ from global ranks.

        `deadline` (seconds, default 10 x timeout) bounds the whole task; ring waits inside
        are bounded by the timeout already, so it only catches work that never ends.
        """
        __tracebackhide__ = True
        if not 1 <= ring_size <= self.size:
            raise ValueError(f"a ring of {ring_size} ranks does not fit in a local ring of {self.size} processes")
        return self.run_groups(GroupPlan.ring(self.size, ring_size), task, *args, deadline=deadline)[0]

    def run_groups(self, plan: GroupPlan, task: Task, *args: Any, deadline: float | None = None) -> list[list[Any]]:
        """`task(member, *args)` on every rank of every ring of `plan` (global ranks of this
        pool), all rings at once; the results per ring, in ring-rank order."""
        __tracebackhide__ = True
        return self.submit_groups(plan, task, *args, deadline=deadline).result()

    def submit_groups(self, plan: GroupPlan, task: Task, *args: Any, deadline: float | None = None) -> Submitted:
        """`run_groups` without waiting: the task is sent to every worker, and `result()` of what
        this returns collects it (this process meanwhile is free: a command judges the last
        task's results while the workers compute the next). One task at a time per pool: a
        second submit first collects the one in flight."""
        if self._closed:
            raise RuntimeError(f"this local ring of {self.size} was closed after a failure; start a new one")
        if plan.size > self.size:
            raise ValueError(f"the groups {[list(g) for g in plan.groups]} need {plan.size} processes; this local "
                             f"ring has {self.size}")
        if self._in_flight is not None:
            self._in_flight.settle()
        limit = 10 * self.timeout if deadline is None else check_timeout(deadline)
        message = wire.dumps(("task", plan, task, args))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except (OSError, ValueError):
                pass  # a dead worker shows up in _collect
        deadline = time.monotonic() + limit
        self._in_flight = Submitted(lambda: self._finish(plan, task, deadline, limit))
        return self._in_flight

    def _finish(self, plan: GroupPlan, task: Task, deadline: float, limit: float) -> list[list[Any]]:
        self._in_flight = None
        replies = self._collect(range(self.size), deadline, what="task")
        self._relay_stderr()
        errors = {r: text for r, (kind, text) in replies.items() if kind == "error"}
        silent = [r for r, (kind, _) in replies.items() if kind == "silent"]
        if errors or silent:
            self.close(graceful=False)
            why = (f"did not answer within the grace of {self.grace:g} s after the first failure" if errors
                   else f"did not answer within the task deadline of {limit:g} s")
            errors.update({r: f"{why}; stopped with the ring" for r in silent})
            raise ring_error(task, f"local gloo ring of {self.size} processes", plan, errors, silent=silent)
        return plan.split([replies[r][1] for r in range(self.size)])

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
        self._relay_stderr()
        shutil.rmtree(self._stderr_dir, ignore_errors=True)
        self._store = None


class LocalRings:
    """Local gloo rings kept alive for a session: `run(ring_size, ...)` uses the smallest live
    pool with at least `ring_size` processes, or starts one of exactly `ring_size`.

    A pool that failed is dropped, so the next task gets fresh processes; a pool left unused for
    `idle_close` seconds is closed when another is asked for (an idle gloo process still polls
    its groups: a session that kept a pool of every ring size it ever ran paid for all of them).
    Restarting one costs a fork per process (the fork server keeps torch imported). As with any
    multiprocessing start method but fork, a script that starts rings must guard its entry
    point with `if __name__ == "__main__":` (workers import the main module).
    """

    size = None         # no upper bound: a bigger ring just starts more processes
    is_main = True      # the one process that reports
    is_torchrun = False

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, start_timeout: float = START_TIMEOUT,
                 log_dir: str | os.PathLike | None = None, setup: Task | None = None,
                 idle_close: float = IDLE_CLOSE, audit: bool = False, grace: float = GRACE):
        self.timeout, self.grace = check_timeout(timeout), check_timeout(grace)  # grace: as LocalRingPool's
        self.audit = audit  # every rank's task under the device audit (ringcheck.launch.audit)
        self.start_timeout = check_timeout(start_timeout)
        self.log_dir = None if log_dir is None else str(log_dir)  # each rank's log: DIR/rank<G>.log
        self.setup = setup  # a task every new pool runs first on all its processes (e.g. a stand-in)
        if isinstance(idle_close, bool) or not isinstance(idle_close, (int, float)) or not idle_close > 0:
            raise ValueError(f"idle_close must be a positive number of seconds (or inf: never), got {idle_close!r}")
        self.idle_close = float(idle_close)
        self._pools: list[LocalRingPool] = []
        self._used: dict[int, float] = {}  # id(pool) -> when it was last handed out

    def pool(self, ring_size: int, *, exact: bool = False) -> LocalRingPool:
        """A live pool that holds a ring of `ring_size`: the smallest that fits, or with `exact`
        one of exactly that size (for rings that must span their whole world)."""
        now = time.monotonic()
        fitting = [p for p in self._pools if p.alive and (p.size == ring_size if exact else p.size >= ring_size)]
        chosen = min(fitting, key=lambda p: p.size) if fitting else None
        for old in [p for p in self._pools if p is not chosen and (not p.alive or p._in_flight is None and
                                                                   now - self._used[id(p)] > self.idle_close)]:
            old.close()  # died between tasks (a worker), or idle too long: reap it and drop the pool
            self._pools.remove(old)
            del self._used[id(old)]
        if chosen is None:
            chosen = LocalRingPool(ring_size, timeout=self.timeout, start_timeout=self.start_timeout,
                                   grace=self.grace, log_dir=self.log_dir, audit=self.audit)
            if self.setup is not None:  # before any task, and again in every pool started after a failure
                chosen.run(ring_size, self.setup)
            self._pools.append(chosen)
        self._used[id(chosen)] = time.monotonic()
        return chosen

    def run(self, ring_size: int, task: Task, *args: Any, deadline: float | None = None,
            exact: bool = False) -> list[Any]:
        __tracebackhide__ = True
        for other in self._pools:  # one task at a time
            if other._in_flight is not None:
                other._in_flight.settle()
        return self.pool(ring_size, exact=exact).run(ring_size, task, *args, deadline=deadline)

    def run_groups(self, plan: GroupPlan, task: Task, *args: Any, deadline: float | None = None) -> list[list[Any]]:
        """`task` on every ring of `plan` at once, in a pool of exactly `plan.size` processes (the
        plan is the whole world: an implementation that talks over the default group reaches
        the other rings' ranks, never idle ones); results per ring."""
        __tracebackhide__ = True
        return self.submit_groups(plan, task, *args, deadline=deadline).result()

    def submit_groups(self, plan: GroupPlan, task: Task, *args: Any, deadline: float | None = None) -> Submitted:
        """`run_groups` without waiting (`LocalRingPool.submit_groups`): `result()` collects it.
        Every task in flight in another pool is collected first (one task at a time)."""
        for other in self._pools:
            if other._in_flight is not None:
                other._in_flight.settle()
        return self.pool(plan.size, exact=True).submit_groups(plan, task, *args, deadline=deadline)

    def retire(self, size: int) -> None:
        """Close the pool of exactly `size` processes (the next task gets fresh ones): a run left
        messages in flight that never completed, and gloo closes a pair that timed out for good."""
        for pool in [p for p in self._pools if p.size == size]:
            pool.close()  # graceful: a task in flight is collected by the caller first (run_groups)
            self._pools.remove(pool)
            del self._used[id(pool)]

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        self._pools = []
        self._used = {}

    def __enter__(self) -> LocalRings:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


