"""The ring's point-to-point exchange over `torch.distributed`.

`RingComm` is the transport that `DistributedDriver` (drivers.py) answers one rank's loop with:

- ``post(channel, payload)`` starts, in one `batch_isend_irecv`, sending the payload (a tuple
  of tensors) to the next rank and receiving the previous rank's payload into freshly
  allocated buffers of the same shapes and dtypes; it returns at once, so the transfer is in
  flight while the loop computes on what it holds (double buffering: the block in use and the
  block on the wire);
- ``wait(channel)`` waits for that exchange, with a timeout, and returns what arrived.

At most one exchange is in flight per channel; a second post, or a wait with nothing posted,
raises RuntimeError naming the channel. Peers are addressed by *global* rank (converted from
group ranks with `get_global_rank`), so any sub-group can be a ring.

Tensors travel as their raw bytes (a uint8 view of a contiguous copy) and are viewed back to
their dtype on arrival: bit-exact by construction, and independent of which dtypes a backend
supports for point-to-point (gloo in older torch did not take every dtype). The same code runs
on gloo (CPU tensors) and NCCL (CUDA tensors); the device comes from the tensors.

A launcher can watch the ring's waits (`watched`): `stop` is asked every `STOP_POLL_S` while a
wait is blocked and, when it returns a reason (another rank of the ring failed), the wait gives
up at once with a RuntimeError that says "stopped waiting" and why, instead of running out the
timeout; `trace` is handed one record per completed exchange (the per-rank ring-step trace of
`--log-dir`).

Timeouts: every wait has one. gloo honours `Work.wait(timeout)`; a transfer of GPU tensors
(NCCL) is polled from the waiting thread until it completes or the timeout passes
(`wait_work`), and its group's own timeout (NCCL's watchdog, which aborts the process) must be
longer: the launchers make ring groups with `launch.common.group_timeout`. A peer that died,
raised or never sent becomes a RuntimeError naming that peer's rank (ring rank and global rank).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..spec import DEFAULT_TIMEOUT, check_timeout, require_distributed

# one tag per channel keeps the "kv" and "grad" streams apart on backends that match by tag
# (gloo); NCCL ignores tags and matches in posting order, which every rank keeps identical
# exchanges abandoned after a failure, kept referenced until the backend is done with them
_ABANDONED: deque = deque(maxlen=64)
_CHANNEL_TAGS = {"kv": 1, "grad": 2, "sum": 3}  # "sum": small per-rank partials (dsinks)

STOPPED = "stopped waiting"  # how a wait cut short by `watched`'s stop begins its reason
STOP_POLL_S = 0.05           # how often a blocked wait asks `stop`
# what the launcher watching this process's ring waits asked for (`watched`); one task at a time
_WATCH: dict[str, Callable | None] = {"stop": None, "trace": None}


@contextmanager
def watched(*, stop: Callable[[], str | None] | None = None,
            trace: Callable[[dict], None] | None = None) -> Iterator[None]:
    """While inside: every ring wait of this process asks `stop()` (None: keep waiting; a
    reason: give up now) and hands `trace` a record of each completed exchange."""
    before = dict(_WATCH)
    _WATCH.update(stop=stop, trace=trace)
    try:
        yield
    finally:
        _WATCH.update(before)


@contextmanager
def timed_waits() -> Iterator[None]:
    """While inside: waits block directly, without the helper thread that asking `stop` needs
    (timed regions of a benchmark; the trace stays). A failing peer then costs the timeout, or
    the launcher's grace in a local ring."""
    with watched(stop=None, trace=_WATCH["trace"]):
        yield


class _Stopped(Exception):
    """`stop` gave a reason while a wait was blocked."""


class _Waiter:
    """One helper thread that blocks on the works handed to it, one after the other, so that a
    ring wait needs no thread of its own (starting one per wait cost as much CPU as a small
    ring's compute). A waiter left blocked on a wait that was given up on is replaced."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        threading.Thread(target=self._loop, name="ringcheck-ring-wait", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, seconds, done, failed = self.jobs.get()
            try:
                work.wait(datetime.timedelta(seconds=seconds))
            except Exception as exc:
                failed.append(exc)
            del work  # a send's work holds its buffer: keep none alive until the next job comes
            done.set()


_WAITERS: list[_Waiter] = []


def _waiter() -> _Waiter:
    if not _WAITERS or _WAITERS[-1].abandoned:
        _WAITERS[:] = [_Waiter()]
    return _WAITERS[-1]


def _wait_watched(work, seconds: float, stop: Callable[[], str | None] | None) -> None:
    """`work.wait`, bounded by `seconds`; with `stop`, the wait runs in a helper thread (a
    blocked gloo wait can neither be polled nor cut into slices) while this thread asks `stop`
    every STOP_POLL_S. A wait given up on is left to its thread, which ends at the timeout."""
    if stop is None:
        work.wait(datetime.timedelta(seconds=seconds))
        return
    waiter, done, failed = _waiter(), threading.Event(), []
    waiter.jobs.put((work, seconds, done, failed))
    while not done.wait(STOP_POLL_S):
        why = stop()
        if why:
            waiter.abandoned = True  # it stays blocked on this work; the next wait gets a new one
            raise _Stopped(why)
    if failed:
        raise failed[0]


POLL_MAX_S = 1e-3  # the longest pause between two polls of a GPU transfer


def wait_work(work, seconds: float, stop: Callable[[], str | None] | None, *, poll: bool) -> None:
    """Wait for a transfer's `work`, at most `seconds`, giving up when `stop()` gives a reason
    (asked every STOP_POLL_S). With `poll` (a transfer of GPU tensors, over NCCL) this thread
    polls `work.is_completed()` and calls `work.wait()` only once the work has completed:
    NCCL's `wait` makes the calling thread's current CUDA stream wait for the transfer, so a
    wait given up on in a helper thread would leave the device's default stream (the one the
    ring computes on) blocked behind a transfer that never ends, and the next task would hang
    at its first synchronising op. Without `poll` (gloo), `_wait_watched`: a blocked gloo wait
    can be neither polled cheaply nor cut into slices. Raises RuntimeError at the deadline."""
    if not poll:
        _wait_watched(work, seconds, stop)
        return
    start = asked = time.monotonic()
    pause = 1e-5
    while not work.is_completed():
        now = time.monotonic()
        if stop is not None and now - asked >= STOP_POLL_S:
            asked = now
            why = stop()
            if why:
                raise _Stopped(why)
        if now - start >= seconds:
            raise RuntimeError(f"the transfer did not complete within {seconds:g} s (polled; never waited on, so "
                               f"no CUDA stream waits for it)")
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    work.wait()


@dataclass
class _Exchange:
    """One posted exchange: the requests, the send buffers kept alive, the receive buffers."""

    works: list            # (work, "recv" | "send" | "both"), receives first
    sends: list            # kept referenced until the sends complete
    recvs: list            # one uint8 buffer: the payload packed (`_pack`)
    meta: list             # (dtype, shape, offset, bytes) per tensor, to view the bytes back
    step: int = 0          # the how-many-th exchange on its channel (for the trace)
    posted: float = 0.0    # time.monotonic() at the post
    polled: bool = False   # GPU tensors (NCCL): waited by polling (`wait_work`)


ALIGN = 16  # bytes: each tensor of a packed payload starts at a multiple of this (any dtype views back)


def _pack(payload: tuple) -> tuple[torch.Tensor, list]:
    """A payload's tensors as one byte buffer (one send and one receive per exchange, not one
    per tensor: each P2P op costs more than a small copy), and where each tensor lies in it."""
    pieces, meta, at = [], [], 0
    for t in payload:
        raw = _as_bytes(t)
        pad = -raw.numel() % ALIGN
        pieces += [raw, raw.new_zeros(pad)] if pad else [raw]
        meta.append((t.dtype, t.shape, at, raw.numel()))
        at += raw.numel() + pad
    return (torch.cat(pieces) if len(pieces) > 1 else pieces[0]), meta


def _unpack(buf: torch.Tensor, meta: list) -> tuple:
    return tuple(buf[at:at + n].view(dtype).view(shape) for dtype, shape, at, n in meta)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class RingComm:
    """Point-to-point exchange around the ring formed by the ranks of `group`, in group order.

    Ring rank r sends to ring rank r + 1 and receives from r - 1 (mod world size); `rank` and
    `world_size` are those of the group, peers are addressed by their global ranks.
    """

    def __init__(self, group=None, *, timeout: float = DEFAULT_TIMEOUT):
        require_distributed("building a ring")
        self.group = dist.group.WORLD if group is None else group
        self.timeout = check_timeout(timeout)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it "
                             f"was asked to form a ring with; call ring_attention only on the group's ranks")
        self.world_size = dist.get_world_size(self.group)
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self.next_rank = (self.rank + 1) % self.world_size
        self.prev_rank = (self.rank - 1) % self.world_size
        self._in_flight: dict[str, _Exchange | tuple] = {}
        self._steps: dict[str, int] = {}

    def _name(self, ring_rank: int) -> str:
        return f"rank {ring_rank} (global rank {self.global_ranks[ring_rank]})"

    def where(self) -> str:
        """This rank's place, for messages: "ring rank 1 (global rank 3) of 4"."""
        return f"ring {self._name(self.rank)} of {self.world_size}"

    @property
    def in_flight(self) -> list[str]:
        """Channels with an exchange posted and not yet waited for."""
        return list(self._in_flight)

    def post(self, channel: str, payload: tuple) -> None:
        """Start sending `payload` to the next rank and receiving the previous rank's."""
        if channel in self._in_flight:
            raise RuntimeError(f"{self.where()}: two sends in flight on channel {channel!r}: "
                               f"wait for the first before posting again")
        if not isinstance(payload, tuple) or not all(isinstance(t, torch.Tensor) for t in payload):
            raise TypeError(f"{self.where()}: a payload is a tuple of tensors, got {type(payload).__name__}")
        if self.world_size == 1:  # the ring of one: the payload comes straight back
            self._in_flight[channel] = payload
            return
        if channel not in _CHANNEL_TAGS:
            raise ValueError(f"channel={channel!r} is unknown; choose one of {list(_CHANNEL_TAGS)}")
        tag = _CHANNEL_TAGS[channel]
        nxt, prv = self.global_ranks[self.next_rank], self.global_ranks[self.prev_rank]
        packed, meta = _pack(payload)
        sends = [packed]
        recvs = [torch.empty_like(packed)]
        ops = [dist.P2POp(dist.isend, s, nxt, self.group, tag) for s in sends]
        ops += [dist.P2POp(dist.irecv, r, prv, self.group, tag) for r in recvs]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.where()}: could not start the {channel!r} exchange with "
                               f"{self._name(self.next_rank)} and {self._name(self.prev_rank)}: {exc}") from exc
        if len(works) == len(ops):  # one request per operation (gloo)
            roles = [(w, "send") for w in works[:len(sends)]]
            roles = [(w, "recv") for w in works[len(sends):]] + roles  # "nothing arrived" tells more
        else:  # a coalesced batch (NCCL) answers with one request for all of it
            roles = [(w, "both") for w in works]
        step = self._steps[channel] = self._steps.get(channel, -1) + 1
        self._in_flight[channel] = _Exchange(roles, sends, recvs, meta, step, time.monotonic(),
                                             packed.device.type != "cpu")

    def wait(self, channel: str) -> tuple:
        """The payload the previous rank posted on `channel`, once the exchange is complete."""
        exchange = self._in_flight.pop(channel, None)
        if exchange is None:
            raise RuntimeError(f"{self.where()}: wait on channel {channel!r} before anything was posted on it")
        if isinstance(exchange, tuple):
            return exchange
        start = time.monotonic()
        deadline = start + self.timeout
        stop, trace = _WATCH["stop"], _WATCH["trace"]
        for work, role in exchange.works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                wait_work(work, left, stop, poll=exchange.polled)
            except _Stopped as why:
                _ABANDONED.append(exchange)  # its thread still waits on it
                raise RuntimeError(f"{self.where()}: {STOPPED} for the {channel!r} payload from "
                                   f"{self._name(self.prev_rank)} after {time.monotonic() - start:.2f} s: "
                                   f"{why}") from None
            except RuntimeError as exc:
                what = {
                    "recv": f"no {channel!r} payload arrived from {self._name(self.prev_rank)}",
                    "send": f"{self._name(self.next_rank)} did not take the {channel!r} payload sent to it",
                    "both": f"the {channel!r} exchange (sending to {self._name(self.next_rank)}, receiving "
                            f"from {self._name(self.prev_rank)}) did not complete",
                }[role]
                who = "one of them" if role == "both" else "that rank"
                waited = time.monotonic() - start
                when = (f"within the timeout of {self.timeout:g} s" if waited >= self.timeout - 0.01 else
                        f"(the wait failed after {waited:.2f} s of at most {self.timeout:g} s)")
                raise RuntimeError(
                    f"{self.where()}: {what} {when}: {who} raised, died, or never reached this ring "
                    f"step ({type(exc).__name__}: {exc})") from exc
        if trace is not None:
            done = time.monotonic()
            size = sum(buf.numel() for buf in exchange.recvs)
            trace({"channel": channel, "step": exchange.step, "source_rank": self.prev_rank,
                   "source_global_rank": self.global_ranks[self.prev_rank],
                   "dest_rank": self.next_rank, "bytes_sent": size, "bytes_received": size,
                   "step_s": round(done - exchange.posted, 6), "waited_s": round(done - start, 6)})
        return _unpack(exchange.recvs[0], exchange.meta)

    def abandon(self) -> None:
        """Forget exchanges still in flight (after a failure; their peers will time out). Their
        requests and buffers stay referenced (`_ABANDONED`, the last few), never freed under a
        transfer the backend may still complete: a later exchange on the same group (a process
        group lives longer than one ring call) then finds it clean."""
        _ABANDONED.extend(self._in_flight.values())
        self._in_flight.clear()
