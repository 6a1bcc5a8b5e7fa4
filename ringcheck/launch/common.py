"""What both launchers share: a ring member, the ring error and its message, timeouts."""

from __future__ import annotations

import datetime
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..ring.comm import STOPPED
from ..thirdparty.torch_private import abort_process_group, process_group_count

Task = Callable[..., Any]

START_TIMEOUT = 120.0  # seconds for a local ring's processes to import torch and join the group
GRACE = 2.0            # seconds the other workers get to report after a first failure


def control_timeout(timeout: float) -> float:
    """Collectives outside the ring wait out a rank that is itself timing out in the ring."""
    return 2 * timeout + 30.0


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class RingMember:
    """What a task gets to know about its place: ring rank and size, group, timeout, device;
    inside a mesh of groups (`GroupPlan`) also which group of the plan it is in (`group_index`,
    its global ranks `group_ranks`), the plan's words (`place`), and the handles of the other
    families of groups it belongs to (`groups`, by family name: e.g. "mesh", every rank of it)."""

    rank: int
    world_size: int
    group: Any
    timeout: float
    global_rank: int
    device: str = "cpu"
    group_index: int = 0
    group_ranks: tuple[int, ...] = ()
    place: str = ""
    groups: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupPlan:
    """Which process groups a task runs on, in global ranks of the world: `groups` are the
    rings (the task runs once on every rank of each, every ring at the same time), and `also`
    names further families of groups that members get handles to (family -> groups; e.g. the
    whole mesh, for a gradient all-reduce). Ranks in no ring are idle for the task. `label`
    names the plan in messages and logs (e.g. "mesh cp=4,tp=2")."""

    groups: tuple[tuple[int, ...], ...]
    also: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    label: str = ""

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(r) for r in g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "also", tuple((str(n), tuple(tuple(int(r) for r in g) for g in gs))
                                               for n, gs in self.also))
        seen = [r for g in groups for r in g]
        if not groups or any(not g for g in groups) or len(seen) != len(set(seen)) or min(seen) < 0:
            raise ValueError(f"a group plan needs disjoint, non-empty rings of ranks >= 0, got {groups}")

    @classmethod
    def ring(cls, world_size: int, ring_size: int) -> GroupPlan:
        """One ring of the world's last `ring_size` ranks (ring ranks differ from global ones)."""
        return cls((tuple(range(world_size - ring_size, world_size)),))

    @property
    def size(self) -> int:
        """The smallest world that holds the plan."""
        return 1 + max(r for g in (*self.groups, *(g for _, gs in self.also for g in gs)) for r in g)

    def place_of(self, global_rank: int) -> tuple[int, int] | None:
        """(ring index, rank in that ring) of a global rank, None when it is in no ring."""
        for i, g in enumerate(self.groups):
            if global_rank in g:
                return i, g.index(global_rank)
        return None

    def ring_words(self, index: int) -> str:
        ranks = ",".join(map(str, self.groups[index]))
        return f"group {index} (global ranks {ranks})" if len(self.groups) > 1 else f"global ranks {ranks}"

    def rank_name(self, global_rank: int) -> str:
        """'rank r (global rank g)', with its group inside a plan of several rings."""
        place = self.place_of(global_rank)
        if place is None:
            return f"global rank {global_rank} (outside the ring)"
        index, rank = place
        if len(self.groups) == 1:
            return f"rank {rank} (global rank {global_rank})"
        return f"rank {rank} of group {index} (global rank {global_rank})"

    def short_name(self, global_rank: int) -> str:
        place = self.place_of(global_rank)
        if place is None:
            return f"global {global_rank}"
        return str(place[1]) if len(self.groups) == 1 else f"{place[1]} (group {place[0]}, global {global_rank})"

    def describe(self, index: int) -> str:
        """A member's place, for its log: the plan's label and its ring's global ranks."""
        return " ".join(x for x in (self.label, self.ring_words(index)) if x)

    def keyed(self, errors: Mapping[int, Any]) -> tuple[dict[int, Any], dict[int, int]]:
        """`errors` keyed by global rank -> (keyed by ring rank for a plan of one ring, by global
        rank otherwise: the keys of `RingError.failures`; key -> global rank)."""
        if len(self.groups) == 1:
            mine = {g: self.place_of(g) for g in errors}
            out = {mine[g][1]: text for g, text in errors.items() if mine[g] is not None}
            return out, {mine[g][1]: g for g in errors if mine[g] is not None}
        return dict(errors), {g: g for g in errors}

    def split(self, values: Sequence[Any]) -> list[list[Any]]:
        """Values indexed by global rank -> one list per ring, in ring-rank order."""
        return [[values[r] for r in g] for g in self.groups]


def group_timeout(timeout: float, device: str) -> float:
    """The timeout a plan's process groups are made with, for rings whose waits `timeout` bounds.
    On the CPU (gloo) it is `timeout`: every ring wait passes its own, and an implementation's own
    collective gets the same bound. On a GPU it is also NCCL's watchdog timeout, which aborts the
    process (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, on by default) when it fires: it must outlast
    `RingComm`'s own deadline (`timeout`) and the control plane that reports it, so that a rank
    that waited too long becomes a `RingError` naming the culprit, never an aborted process."""
    return timeout if torch.device(device).type == "cpu" else control_timeout(timeout)


def ring_backend(device: str) -> str:
    """The backend of the process groups of ranks that compute on `device`: gloo on the CPU; on
    a GPU, NCCL for CUDA tensors and gloo for CPU ones (a timing all-reduce, a barrier, an object
    collective). Named on every group a plan makes, so a world someone else initialised with
    NCCL alone still gets rings that take CPU tensors."""
    return "gloo" if torch.device(device).type == "cpu" else "cpu:gloo,cuda:nccl"


def _make_groups(plan: GroupPlan, rank: int, timeout: float, device: str) -> tuple[RingMember | None, list]:
    """Make every process group of `plan` (collective: every rank of the world calls it with the
    same plan, in the same order); this rank's `RingMember` (None where the rank is in no ring
    of the plan) and the handles of every group made (to destroy them with)."""
    bound, backend = as_timedelta(group_timeout(timeout, device)), ring_backend(device)
    handles = [dist.new_group(ranks=list(g), timeout=bound, backend=backend) for g in plan.groups]
    made = list(handles)
    families: dict[str, Any] = {}
    for name, groups in plan.also:
        for g in groups:
            handle = dist.new_group(ranks=list(g), timeout=bound, backend=backend)
            made.append(handle)
            if rank in g:
                families[name] = handle
    place = plan.place_of(rank)
    if place is None:
        return None, made
    index, ring_rank = place
    ring = plan.groups[index]
    return RingMember(ring_rank, len(ring), handles[index], timeout, rank, device, index, ring,
                      plan.describe(index), families), made


KEEP_PLANS = 4  # the groups of this many plans a rank keeps (the most recently used)


class PlanGroups:
    """A rank's process groups per `GroupPlan`, made on a plan's first use (collectively: every
    rank of the world asks for the same plans in the same order) and kept for the `keep` most
    recently used plans. The groups of an older plan are destroyed: each gloo group holds a
    polling thread of its own, and a long-lived rank that kept every group it ever made (a
    session of tests: every ring size, every mesh) spent a tenth of a core on idle polling.
    Every rank evicts the same plan at the same time, since each sees the same sequence."""

    def __init__(self, rank: int, timeout: float, device: str = "cpu", keep: int = KEEP_PLANS):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 plan, got {keep!r}")
        self.rank, self.timeout, self.device, self.keep = rank, timeout, device, keep
        self._plans: dict[GroupPlan, tuple[RingMember | None, list]] = {}

    def member(self, plan: GroupPlan) -> RingMember | None:
        """This rank's member of `plan` (None: in no ring of it), its groups made if needed."""
        if plan in self._plans:
            self._plans[plan] = self._plans.pop(plan)  # the most recently used goes last
        else:
            while len(self._plans) >= self.keep:
                _destroy(self._plans.pop(next(iter(self._plans)))[1])
            self._plans[plan] = _make_groups(plan, self.rank, self.timeout, self.device)
        return self._plans[plan][0]

    def discard(self, plan: GroupPlan) -> None:
        """Destroy a plan's groups after a task failed in them (every rank calls it: each has
        seen the failure). On NCCL they are aborted: a communicator may hold work that a rank gave
        up on, which a plain destroy would wait for. The next use of the plan makes new groups.
        Kept instead, every failure left its groups alive (on NCCL: communicators, GPU buffers,
        proxy threads) until the process ran out of them."""
        entry = self._plans.pop(plan, None)
        if entry is not None:
            _destroy(entry[1], abort=torch.device(self.device).type == "cuda")

    def clear(self) -> None:
        """Destroy every plan's groups (the world is being closed)."""
        while self._plans:
            _destroy(self._plans.pop(next(iter(self._plans)))[1], abort=torch.device(self.device).type == "cuda")

    def __len__(self) -> int:
        return len(self._plans)


def _destroy(handles: list, *, abort: bool = False) -> None:
    """Destroy process groups (with `abort`, NCCL's abort where this torch has it: it does not wait
    for work in flight)."""
    # private (torch's door), but the only way to abort one group's NCCL communicators
    end = abort_process_group() if abort else None
    for handle in handles:
        if handle is not None and handle is not dist.GroupMember.NON_GROUP_MEMBER:
            (end or dist.destroy_process_group)(handle)


def live_groups() -> int:
    """How many process groups this process holds (the default group included): what a long-lived
    rank must not let grow with every failed task."""
    if not dist.is_initialized():
        return 0
    return process_group_count()  # private: torch's door


class Submitted:
    """A task sent to the ranks: `result()` gives its results per ring (or raises its
    `RingError`), collected once by `finish`; `settle()` collects it now and keeps the outcome
    for `result()` (a launcher settles the task in flight before it sends another)."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish = finish
        self._outcome: tuple[bool, Any] | None = None

    def settle(self) -> None:
        if self._outcome is None:
            try:
                self._outcome = (True, self._finish())
            except BaseException as exc:
                self._outcome = (False, exc)

    def result(self) -> Any:
        __tracebackhide__ = True
        self.settle()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class RingError(RuntimeError):
    """A task failed on some rank; `failures` maps ring rank -> what happened there for a task
    on one ring, global rank -> what happened there for a task on several rings at once (a
    process outside every ring that failed is named in the message only); `global_ranks` maps
    those keys to global ranks."""

    def __init__(self, message: str, failures: dict, offset: int | dict = 0):
        super().__init__(message)
        self.failures = failures
        # key -> global rank
        self.global_ranks = dict(offset) if isinstance(offset, dict) else {r: r + offset for r in failures}


def describe_task(task: Task) -> str:
    return f"{getattr(task, '__module__', '?')}.{getattr(task, '__qualname__', repr(task))}"


_TIMED_OUT = re.compile(r"timed? ?out|timeout|did not complete|no .* payload arrived", re.IGNORECASE)


def failure_kinds(errors: dict[int, str], silent: Iterable[int] = ()) -> dict[int, str]:
    """What each failing process did: "died" (killed by a signal, or exited: a native crash
    takes its connections with it, so its peers raise next); "raised"; "timed out waiting"
    (on a peer that never came); "never answered" (it hung: the likely culprit, when nobody
    raised); or "stopped after the failure" (told to stop by the rank that failed, or silent
    after another rank raised or died: it was waiting on that rank)."""
    silent = set(silent)
    kinds = {g: "died" if text.startswith("died during")
             else "stopped after the failure" if STOPPED in text.split("\n", 1)[0]
             else "timed out waiting" if _TIMED_OUT.search(text) else "raised"
             for g, text in errors.items() if g not in silent}
    someone_raised = bool({"raised", "died"} & set(kinds.values()))
    kinds.update({g: "stopped after the failure" if someone_raised else "never answered"
                  for g in errors if g in silent})
    return kinds


def failure_message(task: Task, where: str, plan: GroupPlan, errors: dict[int, str], *,
                    silent: Iterable[int] = ()) -> str:
    """One message for every process of the world (keyed by global rank) that failed: a
    headline naming the culprits apart from the ranks that only timed out waiting for them,
    a line each (the first line of its text), then what each said in full. `silent`: the
    processes that never answered. Ranks are named by their place in `plan` (ring rank and
    global rank; the group too when the plan has several rings)."""
    ranks = sorted(errors)
    kinds = failure_kinds(errors, silent)
    groups = [(kind, [plan.short_name(g) for g in ranks if kinds[g] == kind])
              for kind in ("died", "raised", "never answered", "timed out waiting", "stopped after the failure")]
    groups = [(kind, who) for kind, who in groups if who]
    headline = "; ".join(f"{kind}: {', '.join(who)}" for kind, who in groups)
    rings = len(plan.groups)
    on = f"a ring of {len(plan.groups[0])}" if rings == 1 else f"{rings} rings of {plan.label or 'a mesh'}"
    lines = [f"{describe_task(task)} failed on {on} ({where}); failing ranks: "
             + ", ".join(plan.short_name(g) for g in ranks if plan.place_of(g) is not None) + f" — {headline}"]
    for g in ranks:  # every error text starts with a one-line summary
        text = errors[g].strip() or "(no message)"
        lines.append(f"  {plan.rank_name(g)} [{kinds[g]}]: {text.splitlines()[0]}")
    for g in ranks:
        if "\n" in errors[g].strip():
            lines.append(f"{plan.rank_name(g)} in full:\n    " + errors[g].strip().replace("\n", "\n    "))
    return "\n".join(lines)


def raised_text() -> str:
    """The exception being handled: a one-line summary, then its traceback."""
    exc = sys.exc_info()[1]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}: {first}\n{traceback.format_exc()}"


def ring_error(task: Task, where: str, plan: GroupPlan, errors: dict[int, str], *,
               silent: Iterable[int] = ()) -> RingError:
    """The `RingError` of a task that failed on the ranks `errors` names (by global rank)."""
    failures, global_ranks = plan.keyed(errors)
    return RingError(failure_message(task, where, plan, errors, silent=silent), failures, global_ranks)


