"""Drivers: who answers the `Post`/`Wait` that the per-rank loops yield.

One protocol, three drivers, one dispatch (`answer`):

- `SimulatedDriver` runs all P virtual ranks in one process, in lockstep, each rank's
  messages answered by a `Mailbox` that hands it the payload its predecessor posted;
- `DistributedDriver` runs this process's one rank, its messages answered by a `RingComm`
  over `torch.distributed`;
- `NoCommDriver` runs one rank whose messages are answered with its own payload (the same
  compute with no transfer: what bench uses to measure overlap).

A transport is anything with ``post(channel, payload)`` and ``wait(channel) -> payload``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .comm import RingComm
from .loops import Post, RankLoop, Wait


class Transport(Protocol):
    def post(self, channel: str, payload: tuple) -> None: ...

    def wait(self, channel: str) -> tuple: ...


class Driver(Protocol):
    """Runs the loops of the ranks it holds locally (`local_ranks`) of a ring of `world_size`."""

    world_size: int
    local_ranks: list[int]

    def run(self, loops: list[RankLoop]) -> list[Any]: ...


def answer(message: Any, transport: Transport) -> Any:
    """The reply to one message of a ring loop: None after a Post, the payload after a Wait."""
    if isinstance(message, Post):
        transport.post(message.channel, message.payload)
        return None
    if isinstance(message, Wait):
        return transport.wait(message.channel)
    raise TypeError(f"a ring loop yielded {message!r}; expected Post or Wait")


def run_one(loop: RankLoop, transport: Transport) -> Any:
    """Run one rank's loop to its end against `transport`; returns the loop's result."""
    reply = None
    while True:
        try:
            message = loop.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = answer(message, transport)


class Mailbox:
    """The simulated ring's transport for one rank: what rank r posts on a channel, rank
    r + 1 receives by waiting on it. Shared by all ranks of one `SimulatedDriver`."""

    def __init__(self, world_size: int, rank: int, boxes: dict):
        self.world_size, self.rank, self._boxes = world_size, rank, boxes

    def post(self, channel: str, payload: tuple) -> None:
        box = self._boxes.setdefault(channel, {})
        if self.rank in box:
            raise RuntimeError(f"two sends in flight on channel {channel!r}: wait before posting again")
        box[self.rank] = payload

    def wait(self, channel: str) -> tuple:
        box = self._boxes.get(channel, {})
        prev = (self.rank - 1) % self.world_size
        if prev not in box:
            raise RuntimeError(f"wait on channel {channel!r} before anything was sent on it")
        return box.pop(prev)


class SimulatedDriver:
    """Runs the per-rank loops of all P virtual ranks in one process, in lockstep: every rank
    takes one message per round, and all ranks must agree on it (same kind, same channel)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.local_ranks = list(range(world_size))

    def run(self, loops: list[RankLoop]) -> list[Any]:
        p = self.world_size
        if len(loops) != p:
            raise ValueError(f"the simulated ring has {p} ranks, got {len(loops)} loops")
        boxes: dict = {}
        mailboxes = [Mailbox(p, r, boxes) for r in range(p)]
        results: list[Any] = [None] * p
        done = [False] * p
        messages: list[Any] = [None] * p
        replies: list[Any] = [None] * p
        while True:
            for r, loop in enumerate(loops):
                if done[r]:
                    continue
                try:
                    messages[r] = loop.send(replies[r])
                except StopIteration as stop:
                    done[r], results[r], messages[r] = True, stop.value, None
            if all(done):
                return results
            if any(done):
                raise RuntimeError(
                    f"ranks {[r for r in range(p) if done[r]]} finished while ranks "
                    f"{[r for r in range(p) if not done[r]]} still expect ring steps")
            kinds = {(type(m).__name__, getattr(m, "channel", None)) for m in messages}
            if len(kinds) != 1:
                raise RuntimeError("ranks disagree on the next ring operation: "
                                   + ", ".join(f"rank {r}: {m}" for r, m in enumerate(messages)))
            # all posts of a round land before any rank of a later round waits
            replies = [answer(m, box) for m, box in zip(messages, mailboxes)]


class DistributedDriver:
    """Runs this process's one per-rank loop, answering its Post/Wait through a `RingComm`.

    The comm knows its rank and ring size, so they are not passed again (one source of truth).
    """

    def __init__(self, comm: RingComm):
        self.comm = comm
        self.world_size = comm.world_size
        self.local_ranks = [comm.rank]

    def run(self, loops: list[RankLoop]) -> list[Any]:
        if len(loops) != 1:
            raise ValueError(f"a distributed driver runs this rank's one loop, got {len(loops)} loops")
        loop, comm = loops[0], self.comm
        try:
            result = run_one(loop, comm)
        except BaseException:
            comm.abandon()
            loop.close()
            raise
        if comm.in_flight:
            left = comm.in_flight
            comm.abandon()
            raise RuntimeError(f"{comm.where()} finished with exchanges still in flight on "
                               f"channels {left}: every post needs its wait")
        return [result]


class Loopback:
    """The no-comm transport: a wait returns what this rank itself posted. The dK/dV origin
    tag is set to the one the ring loop expects, so its bookkeeping check passes."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._posted: dict[str, tuple] = {}
        self._grad_waits = 0

    def post(self, channel: str, payload: tuple) -> None:
        self._posted[channel] = payload

    def wait(self, channel: str) -> tuple:
        reply = self._posted.pop(channel)
        if channel == "grad":
            origin = (self.rank - 1 - self._grad_waits) % self.world_size
            reply = (*reply[:2], torch.tensor([origin]))
            self._grad_waits += 1
        return reply


class NoCommDriver:
    """Answers one rank's `Post`/`Wait` with the rank's own payload: the same compute as the
    distributed ring, with no transfer. The numbers it produces are not attention (every step
    sees this rank's own K/V); only its time means something."""

    def __init__(self, rank: int, world_size: int):
        self.world_size = world_size
        self.local_ranks = [rank]

    def run(self, loops: list[RankLoop]) -> list[Any]:
        if len(loops) != 1:
            raise ValueError(f"a no-comm driver runs one rank's loop, got {len(loops)} loops")
        return [run_one(loops[0], Loopback(self.local_ranks[0], self.world_size))]
