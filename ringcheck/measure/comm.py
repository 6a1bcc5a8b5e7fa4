"""The communication one call makes, counted where it happens, and a delay injected into it:
`CommCounter`.

Where it counts. Every torch.distributed operation reaches the dispatcher as an op: the
point-to-point calls (`dist.isend`, `dist.irecv`, `dist.batch_isend_irecv`, `send`, `recv`:
``c10d::send``, ``c10d::recv_``), the collectives (``c10d::allgather_``, ``allreduce_``,
``reduce_scatter_``, ``alltoall_base_``, ...) and the functional collectives that PyTorch's
context parallel and compiled code use (``_c10d_functional::all_gather_into_tensor``,
``all_to_all_single``, ...). `CommCounter` is a ``TorchDispatchMode``, so it sees each of them
once, whichever Python API the implementation called and however it imported it, with the
tensors and the process group (its size and this rank's place in it).

What it counts, per phase (the caller says "forward" or "backward"): the bytes this rank sends
and receives, the point-to-point messages it sends and receives, and the collectives it joins.
A collective is counted as the bytes a ring algorithm moves per rank (NCCL's bus-bandwidth
convention): an all-gather of P parts of x bytes sends and receives (P - 1) x, a reduce-scatter
to x bytes (P - 1) x, an all-reduce of x bytes 2 (P - 1) / P x, an all-to-all the parts that
leave this rank and the parts that arrive (its own part stays); a broadcast x for the root to
send and x for every other rank to receive.

The delay (`delay`: seconds per phase). Each transfer is held: its completion is reported no
earlier than `delay` after its post returned, as over a link with that latency. A `Work` (what
``dist.isend``, ``batch_isend_irecv`` and an ``async_op=True`` collective return, and what the
blocking calls wait on inside torch) is held in its ``wait``: while the counter is active,
``Work.wait`` sleeps after the real wait until the deadline (NCCL's coalesced batch answers
with one `Work` no dispatched op returned: `batch_isend_irecv` is wrapped while the counter is
active, and that work is held with its ops). A functional collective is held
in its ``wait_tensor``. A ring that computes between posting a transfer and waiting for it does
not feel the delay; one that waits at once sleeps through it. The counter books both:
`injected` (the time during which at least one transfer was held: the union of the intervals
[post, post + delay]) and `exposed` (the union of the times a wait was blocked by a held
transfer: from the wait's call to the deadline), so
`exposed / injected` is the share of the injected time the ring did not hide. Booked from the
call, not from the real transfer's end: a wait that a lagging peer kept blocked past the
deadline was blocked by the hold as well, and a ring that waits at once exposes the whole
delay however its peers are scheduled.
Not held: a transfer never waited on, and a ring that polls ``Work.is_completed()`` instead of
waiting (it sees the real completion).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..thirdparty.torch_private import ProcessGroup, TorchDispatchMode, Work, resolve_process_group

PHASES = ("forward", "backward")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Traffic:
    """What one rank sent and received in one phase."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0       # point-to-point sends
    messages_received: int = 0   # point-to-point receives
    collectives: int = 0         # collectives joined (any kind)
    ops: dict[str, int] = field(default_factory=dict)  # op name -> calls

    def add(self, name: str, sent: float, received: float, *, messages: tuple[int, int] = (0, 0),
            collective: bool = False) -> None:
        self.bytes_sent += int(round(sent))
        self.bytes_received += int(round(received))
        self.messages_sent += messages[0]
        self.messages_received += messages[1]
        self.collectives += int(collective)
        self.ops[name] = self.ops.get(name, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nbytes(x: Any) -> int:
    """The bytes of a tensor (its elements, not its storage) or of nested lists of them."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    return 0


def _place(group: Any) -> tuple[int, int]:
    """(this rank's place, the group's size) of a c10d op's process group or a functional
    collective's group name."""
    if isinstance(group, str):
        pg = resolve_process_group(group)  # torch's own resolver of functional collectives' group names
        return pg.rank(), pg.size()
    pg = ProcessGroup.unbox(group) if not isinstance(group, ProcessGroup) else group
    return pg.rank(), pg.size()


def _split_bytes(x: torch.Tensor, splits, rank: int, size: int) -> float:
    """Bytes of the parts of an all-to-all of `x`'s rows (`splits` rows each; none: even) that
    are not this rank's own."""
    if not splits:
        return nbytes(x) * (size - 1) / size
    row = nbytes(x) / max(1, x.shape[0])
    return row * (sum(splits) - splits[rank])


# the functional collectives (and DTensor's all-to-all) that move data; their other ops (wait_tensor,
# the autograd wrapping) move none
FUNCTIONAL = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out",
              "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out", "all_to_all_single", "broadcast",
              "broadcast_", "isend", "irecv", "batch_p2p_ops", "shard_dim_alltoall")


def count(traffic: Traffic, name: str, args: tuple) -> bool:
    """Book one op's traffic; False for an op that is no communication."""
    op = name.split(".")[0]  # "c10d::allgather_" (the overload dropped)
    ns, _, base = op.partition("::")
    if ns == "c10d" and base != "check_for_nan":
        return _count_c10d(traffic, base, args)
    if ns in ("_c10d_functional", "_c10d_functional_autograd", "_dtensor") and base in FUNCTIONAL:
        return _count_functional(traffic, base, args)
    return False


def _count_c10d(traffic: Traffic, op: str, args: tuple) -> bool:
    if op == "send":
        traffic.add(op, nbytes(args[0]), 0, messages=(1, 0))
        return True
    if op in ("recv_", "recv_any_source_"):
        traffic.add(op, 0, nbytes(args[0]), messages=(0, 1))
        return True
    group = {"allgather_": 2, "_allgather_base_": 2, "allgather_coalesced_": 2, "allgather_into_tensor_coalesced_": 2,
             "reduce_scatter_": 2, "_reduce_scatter_base_": 2, "reduce_scatter_tensor_coalesced_": 2,
             "alltoall_": 2, "alltoall_base_": 2, "gather_": 2, "scatter_": 2}.get(op, 1)
    rank, size = _place(args[group])
    if op in ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        x = (size - 1) * nbytes(args[1])
        traffic.add(op, x, x, collective=True)
    elif op in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        x = (size - 1) * nbytes(args[0])
        traffic.add(op, x, x, collective=True)
    elif op in ("allreduce_", "allreduce_coalesced_"):
        x = 2 * (size - 1) / size * nbytes(args[0])
        traffic.add(op, x, x, collective=True)
    elif op == "alltoall_":
        traffic.add(op, nbytes(args[1]) - nbytes(args[1][rank]), nbytes(args[0]) - nbytes(args[0][rank]),
                    collective=True)
    elif op == "alltoall_base_":
        traffic.add(op, _split_bytes(args[1], args[4], rank, size), _split_bytes(args[0], args[3], rank, size),
                    collective=True)
    elif op in ("broadcast_", "reduce_"):
        root = args[2] if op == "broadcast_" else args[3]
        x = nbytes(args[0])
        traffic.add(op, x if (rank == root) == (op == "broadcast_") else 0,
                    x if (rank == root) != (op == "broadcast_") else 0, collective=True)
    elif op == "gather_":
        x = nbytes(args[1])
        traffic.add(op, 0 if rank == args[3] else x, (size - 1) * x if rank == args[3] else 0, collective=True)
    elif op == "scatter_":
        x = nbytes(args[0])
        traffic.add(op, (size - 1) * x if rank == args[3] else 0, 0 if rank == args[3] else x, collective=True)
    else:  # barrier, monitored_barrier_ and any newer collective: joined, its bytes not known here
        traffic.add(op, 0, 0, collective=True)
    return True


def _count_functional(traffic: Traffic, op: str, args: tuple) -> bool:
    if op == "isend":
        traffic.add(op, nbytes(args[0]), 0, messages=(1, 0))
        return True
    if op == "irecv":
        traffic.add(op, 0, nbytes(args[0]), messages=(0, 1))
        return True
    if op == "batch_p2p_ops":
        for kind, tensor in zip(args[0], args[3]):
            sent = "send" in kind
            traffic.add(op, nbytes(tensor) if sent else 0, 0 if sent else nbytes(tensor),
                        messages=(1, 0) if sent else (0, 1))
        return True
    rank, size = _place(args[-1])  # a functional collective's group name comes last
    x = nbytes(args[0])
    if op.startswith("all_gather_into_tensor"):
        traffic.add(op, (size - 1) * x, (size - 1) * x, collective=True)
    elif op.startswith("reduce_scatter_tensor"):
        traffic.add(op, (size - 1) / size * x, (size - 1) / size * x, collective=True)
    elif op.startswith("all_reduce"):
        traffic.add(op, 2 * (size - 1) / size * x, 2 * (size - 1) / size * x, collective=True)
    elif op == "all_to_all_single":
        traffic.add(op, _split_bytes(args[0], list(args[2]), rank, size),
                    _split_bytes(args[0], list(args[1]), rank, size), collective=True)
    elif op == "shard_dim_alltoall":
        traffic.add(op, (size - 1) / size * x, (size - 1) / size * x, collective=True)
    elif op.startswith("broadcast"):
        traffic.add(op, x if rank == args[1] else 0, 0 if rank == args[1] else x, collective=True)
    return True


def union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of closed intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)


_ACTIVE: list[CommCounter] = []   # the counter whose delays `Work.wait` applies (one at a time)
_WORK_WAIT = Work.wait
_BATCH: list = []  # the (dist's, c10d's) `batch_isend_irecv` the active counter replaced (one at a time)


def _held_batch(p2p_op_list):
    """`dist.batch_isend_irecv` while a counter that holds or times transfers is active. NCCL
    answers a batch with one coalesced `Work` that no dispatched op returned (the ops inside
    give placeholders), so the counter would never see the wait the ring makes: the works the
    batch returns are held with the burst its ops just posted."""
    works = _BATCH[-1][0](p2p_op_list)
    if _ACTIVE:
        _ACTIVE[-1].adopt(works)
    return works


def _held_wait(work, *args, **kwargs):
    """`Work.wait` while a counter that holds or times transfers is active: the real wait, then
    the rest of the transfer's delay."""
    called = time.monotonic()
    result = _WORK_WAIT(work, *args, **kwargs)
    if _ACTIVE:
        _ACTIVE[-1].hold(id(work), called)
    return result


class CommCounter(TorchDispatchMode):
    """While inside: `traffic[phase]` of every torch.distributed op this thread (and autograd's
    backward) runs, and with `delay` (seconds, or {phase: seconds}) each transfer held that long
    after its post; `injected` and `exposed` seconds per phase. With `delay` or `time_waits`,
    `waited` seconds per phase: the union of the times the waits on its transfers were blocked
    (the real waits: what a pass spent not computing). See the module's docstring."""

    def __init__(self, delay: float | dict[str, float] = 0.0, *, time_waits: bool = False) -> None:
        super().__init__()
        self.watching = bool(time_waits)
        self.delay = {p: float(delay.get(p, 0.0) if isinstance(delay, dict) else delay) for p in PHASES}
        if any(not d >= 0 for d in self.delay.values()):
            raise ValueError(f"CommCounter: delay must be >= 0 seconds, got {delay!r}")
        self.phase = PHASES[0]
        self.traffic = {p: Traffic() for p in PHASES}
        self._holds: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
        self._sleeps: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
        self._waits: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
        self.watching = self.watching or any(self.delay.values())
        self._pending: dict[Any, tuple[Any, list[float], str]] = {}  # key -> (work or tensor, [deadline], phase)
        self._burst: list[float] | None = None  # the deadline of the transfers posted back to back just now
        self._lock = threading.Lock()  # a wait may run on a helper thread (RingComm's waiter)

    def injected(self, phase: str) -> float:
        return union(self._holds[phase])

    def exposed(self, phase: str) -> float:
        return union(self._sleeps[phase])

    def waited(self, phase: str) -> float:
        return union(self._waits[phase])

    def __enter__(self):
        if self.watching:
            if _ACTIVE:
                raise RuntimeError("CommCounter: a counter with a delay is already active; nest none")
            _ACTIVE.append(self)
            Work.wait = _held_wait
            # each module's own, restored as it was: a caller may have replaced one and not the other
            _BATCH.append((dist.batch_isend_irecv, dist.distributed_c10d.batch_isend_irecv))
            dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = _held_batch
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()
                Work.wait = _WORK_WAIT
                dist.batch_isend_irecv, dist.distributed_c10d.batch_isend_irecv = _BATCH.pop()
            self._pending.clear()

    def adopt(self, works: Any) -> None:
        """Hold `works` (what a batch of transfers returned) with the burst just posted, where no
        dispatched op returned them (a coalesced batch)."""
        with self._lock:
            if self._burst is None:
                return
            for work in works or ():
                self._pending.setdefault(id(work), (work, self._burst, self.phase))

    def hold(self, key: int | torch.Tensor, called: float) -> None:
        """A transfer's wait, called at `called`, returned: sleep until its deadline (if it was
        held), and book the time the wait was blocked by the hold: from the call to the deadline
        (a real wait that returned later, on a peer that lagged, was blocked by the hold too)."""
        with self._lock:
            self._burst = None  # a wait ends a burst: what is posted after it is held on its own
            entry = self._pending.pop(key if isinstance(key, int) else ("tensor", id(key.untyped_storage())), None)
        if entry is None:
            return
        _, (deadline,), phase = entry
        now = time.monotonic()
        with self._lock:
            self._waits[phase].append((called, now))
        if deadline > now:
            time.sleep(deadline - now)
        if deadline > called:
            with self._lock:
                self._sleeps[phase].append((called, deadline))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            return NotImplemented  # a wrapper subclass unwraps first (an AsyncCollectiveTensor waits)
        name = func.name()
        if name.startswith("_c10d_functional::wait_tensor"):
            called = time.monotonic()
            result = func(*args, **(kwargs or {}))
            self.hold(args[0], called)
            return result
        result = func(*args, **(kwargs or {}))
        posted = time.monotonic()  # in flight from here: the ring may compute, or wait
        if not count(self.traffic[self.phase], name, tuple(args)):
            self._burst = None
            return result
        if self.watching:
            with self._lock:
                self._post(result, name, posted + self.delay[self.phase])
        return result

    def _post(self, result: Any, name: str, deadline: float) -> None:
        """Hold a transfer until `deadline`. Transfers posted back to back (a send and its receive,
        a batch) are one burst: all held until the last one's deadline, booked once."""
        held = (deadline - self.delay[self.phase], deadline)
        if self._burst is None:
            self._burst = [deadline]
            self._holds[self.phase].append(held)
        else:
            self._burst[0] = deadline
            self._holds[self.phase][-1] = held
        works = [r for r in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(r, torch.ScriptObject)]
        for work in works:
            unboxed = Work.unbox(work)  # the object the caller gets: its wait is held
            self._pending[id(unboxed)] = (unboxed, self._burst, self.phase)
        if name.startswith("_c10d_functional"):
            for t in _tensors(result):
                self._pending[("tensor", id(t.untyped_storage()))] = (t, self._burst, self.phase)
