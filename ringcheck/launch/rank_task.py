"""One task on one rank, as both launchers run it: fail fast, and (with a log dir) the rank's log.

Fail fast. A rank whose task raises sets its ring's stop flag (`StopFlag`, one key per task in
a store every rank of the ring reaches: the local ring's TCPStore, the torchrun world's); the
other ranks' ring waits (`ring.comm.watched`) see it within `STOP_POLL_S` and give up with
"stopped waiting ... rank R (global rank G) raised T: first line" instead of running out the
timeout. A rank blocked in an implementation's own communication (not `RingComm`) cannot be
interrupted: in a local ring its process is killed after the launcher's grace, under torchrun a
watchdog (`StuckWatchdog`) ends it `grace` seconds after the flag, saying why. The timeout stays
the bound for a rank that hangs or dies without raising.

Per-rank logs (`--log-dir DIR`). Each rank appends to `DIR/rank<G>.log` (G: global rank), per
task: a header, everything the task printed (stdout and stderr, still shown where they went),
the outcome (or the whole traceback) and its ring-step trace: one line per exchange of
`RingComm` (channel, step, source rank, bytes sent and received, seconds from post to arrival,
seconds waited).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..ring.comm import STOPPED, watched
from .audit import device_audit

STOP_PREFIX = "ringcheck/stop"


class StopFlag:
    """The stop flag of one task on one ring: set once by the first rank that fails."""

    def __init__(self, store: Any, key: str):
        self.store, self.key = store, key

    def set(self, reason: str) -> None:
        if not self.store.check([self.key]):
            self.store.set(self.key, reason)

    def reason(self) -> str | None:
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode(errors="replace")
        except Exception:
            return None
        return None


def failure_reason(member: Any, text: str) -> str | None:
    """What the others are told when this rank's task failed with `text` (its first line);
    None when it failed only because it was itself told to stop."""
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    if STOPPED in first:
        return None
    return f"rank {member.rank} (global rank {member.global_rank}) {first}"


class _Tee(io.TextIOBase):
    """Writes to the stream it replaces and to the rank's log."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()


def _trace_lines(records: list[dict]) -> list[str]:
    if not records:
        return [("ring-step trace: no RingComm exchange in this task (an implementation's own "
                 "communication is not traced)")]
    head = f"{'channel':>7} {'step':>4} {'from':>4} {'to':>4} {'sent B':>10} {'recv B':>10} {'step s':>9} {'wait s':>9}"
    lines = [f"ring-step trace ({len(records)} exchanges):", head]
    for r in records:
        lines.append(f"{r['channel']:>7} {r['step']:>4} {r['source_rank']:>4} {r['dest_rank']:>4} "
                     f"{r['bytes_sent']:>10} {r['bytes_received']:>10} {r['step_s']:>9.4f} {r['waited_s']:>9.4f}")
    return lines


def log_path(log_dir: str | os.PathLike, global_rank: int) -> Path:
    return Path(log_dir) / f"rank{global_rank}.log"


@contextlib.contextmanager
def _rank_log(log_dir, member: Any, task_name: str, index: int) -> Iterator[tuple[Callable | None, Callable]]:
    """(trace recorder, finish(outcome_text)) for the task; writes nothing without a log dir."""
    if log_dir is None:
        yield None, lambda text: None
        return
    path = log_path(log_dir, member.global_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    with open(path, "a", encoding="utf-8") as log:
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        place = f"; {member.place}" if getattr(member, "place", "") else ""
        log.write(f"=== task {index}: {task_name} on a ring of {member.world_size}, ring rank {member.rank} "
                  f"(global rank {member.global_rank}{place}, pid {os.getpid()}, {member.device}) at {stamp}\n")
        log.flush()
        outcome: list[str] = []
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield records.append, outcome.append
        finally:
            sys.stdout, sys.stderr = out, err
            log.write("\n".join([*outcome, *_trace_lines(records)]) + "\n\n")


@contextlib.contextmanager
def rank_task(member: Any, task_name: str, index: int, *, flag: StopFlag | None,
              log_dir: str | os.PathLike | None, audit: bool = False) -> Iterator[Callable[[str], None]]:
    """The scope a launcher runs one task in on this rank. Yields `failed(text)`, which the
    launcher calls with the task's error text: it sets the stop flag and logs the text.
    `audit`: the task runs under the device audit (`ringcheck.launch.audit`) for `member.device`."""
    stop = flag.reason if flag is not None else None
    with _rank_log(log_dir, member, task_name, index) as (trace, finish):
        said: list[str] = []

        def failed(text: str) -> None:
            said.append(text)
            reason = failure_reason(member, text)
            if flag is not None and reason is not None:
                flag.set(reason)

        start = time.monotonic()
        try:
            with watched(stop=stop, trace=trace), device_audit(member.device, enabled=audit, judge_impl=False):
                yield failed
        finally:
            took = time.monotonic() - start
            finish(f"outcome after {took:.2f} s: " + ("failed:\n" + said[0].rstrip() if said else "ok"))


class StuckWatchdog:
    """Under torchrun: after another rank's failure, end this rank if its task is still running
    `grace` seconds later (blocked in an implementation's own communication, which nothing can
    interrupt), with a message naming the failure, rather than wait out the ring timeout."""

    def __init__(self, flag: StopFlag, grace: float, exit_code: int, where: str, log_dir=None):
        self.flag, self.grace, self.exit_code, self.where = flag, grace, exit_code, where
        self.note = "" if log_dir is None else f"; every rank's whole story: {Path(log_dir) / 'rank<G>.log'}"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ringcheck-stuck-watchdog", daemon=True)

    def __enter__(self) -> StuckWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            reason = self.flag.reason()
            if reason is None:
                continue
            if self._done.wait(self.grace):
                return
            sys.stderr.write(f"ringcheck: {self.where}: {reason}; this rank was still blocked in the "
                             f"implementation {self.grace:g} s later (its own communication cannot be "
                             f"interrupted), so it exits with code {self.exit_code} instead of waiting out "
                             f"the ring timeout{self.note}\n")
            sys.stderr.flush()
            os._exit(self.exit_code)
