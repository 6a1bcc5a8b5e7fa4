"""What both launchers share: a ring member, the ring error and its message, timeouts."""

from __future__ import annotations

import datetime
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..ring.comm import STOPPED

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

    def __init__(self, message: str, failures: dict, offset: int = 0):
        super().__init__(message)
        self.failures = failures
        self.global_ranks = {r: r + offset for r in failures}  # ring rank -> global rank


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


def failure_message(task: Task, where: str, world_size: int, ring_size: int, errors: dict[int, str], *,
                    silent: Iterable[int] = ()) -> str:
    """One message for every process of the world (keyed by global rank) that failed: a
    headline naming the culprits apart from the ranks that only timed out waiting for them,
    a line each (the first line of its text), then what each said in full. `silent`: the
    processes that never answered. A ring is the world's last `ring_size` ranks, so ring
    rank = global rank - (world_size - ring_size)."""
    first = world_size - ring_size

    def name(g: int) -> str:
        return f"rank {g - first} (global rank {g})" if g >= first else f"global rank {g} (outside the ring)"

    def short(g: int) -> str:
        return str(g - first) if g >= first else f"global {g}"

    ranks = sorted(errors)
    kinds = failure_kinds(errors, silent)
    groups = [(kind, [short(g) for g in ranks if kinds[g] == kind])
              for kind in ("died", "raised", "never answered", "timed out waiting", "stopped after the failure")]
    groups = [(kind, who) for kind, who in groups if who]
    headline = "; ".join(f"{kind}: {', '.join(who)}" for kind, who in groups)
    lines = [f"{describe_task(task)} failed on a ring of {ring_size} ({where}); failing ranks: "
             + ", ".join(str(g - first) for g in ranks if g >= first) + f" — {headline}"]
    for g in ranks:  # every error text starts with a one-line summary
        text = errors[g].strip() or "(no message)"
        lines.append(f"  {name(g)} [{kinds[g]}]: {text.splitlines()[0]}")
    for g in ranks:
        if "\n" in errors[g].strip():
            lines.append(f"{name(g)} in full:\n    " + errors[g].strip().replace("\n", "\n    "))
    return "\n".join(lines)


def raised_text() -> str:
    """The exception being handled: a one-line summary, then its traceback."""
    exc = sys.exc_info()[1]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}: {first}\n{traceback.format_exc()}"


def ring_failures(world_size: int, ring_size: int, errors: dict[int, str]) -> dict[int, str]:
    first = world_size - ring_size
    return {g - first: text for g, text in errors.items() if g >= first}


