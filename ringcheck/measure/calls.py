"""One rank's measured calls of an implementation under the `--impl` contract: the one
measurement that validate's promise rows, `ringcheck bench` and the pytest plugin share.

- `measured_call`: one forward and backward on this rank's shards under both instruments at
  once: the peak bytes of tensor storage (`memory.peak_bytes`, plus the shards it was handed)
  and the traffic per phase (`comm.CommCounter`).
- `overlap_run`: the same call timed without a delay, then with each transfer held for a
  fraction of one ring step's compute (the pass's time outside its waits, over P), forward and
  backward apart;
  per delay the seconds each pass took and the injected and exposed seconds (`CommCounter`).
- `promise_task`: both, as a task of `ringcheck.harness.Runner.submit_task`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..adapters import Impl
from ..harness.call import prepare
from ..harness.runner import ImplOptions, loaded
from ..judge.check import Case
from ..judge.inputs import Inputs
from .comm import PHASES, CommCounter, nbytes
from .memory import instrument, peak_bytes

MIN_STEP_S = 1e-4  # a pass's compute below this is timer noise: its step is taken as this


def device_clock(device: torch.device | str, synchronize: Callable[[], None] | None = None) -> Callable[[], float]:
    """`time.perf_counter` for calls on `device`: on a GPU the clock first waits for the work
    queued on it (`synchronize`, by default `torch.cuda.synchronize(device)`), since CUDA runs
    kernels asynchronously and a pass's time would otherwise be the time to launch it."""
    device = torch.device(device)
    if synchronize is None and device.type == "cuda":
        def synchronize():
            torch.cuda.synchronize(device)
    if synchronize is None:
        return time.perf_counter

    def now() -> float:
        synchronize()
        return time.perf_counter()
    return now


def _forward_backward(prep, group, counter: CommCounter, forward_only: bool):
    counter.phase = "forward"
    with torch.set_grad_enabled(not forward_only):
        out, lse = prep.call(group)
    if forward_only:
        return out, lse
    counter.phase = "backward"
    grads = torch.autograd.grad([out], list(prep.leaves), [prep.dout], allow_unused=True)
    return out, lse, grads


def measured_call(impl: Impl, case: Case, inputs: Inputs, rank: int, group, device: torch.device | str = "cpu", *,
                  forward_only: bool = False) -> dict[str, Any]:
    """One forward (and backward) of this rank's contiguous shards: {"peak_bytes": the shards
    handed in plus the peak of what the call allocated, "input_bytes": the shards, "traffic":
    {phase: `Traffic` as JSON}}."""
    prep = prepare(impl, case, inputs, rank, device, grad=not forward_only)
    held = [prep.q, prep.k, prep.v, *([] if forward_only else [prep.dout]), *([prep.sinks] if prep.sinks is not None
                                                                               else [])]
    counter = CommCounter()
    with counter:
        peak, _ = peak_bytes(lambda: _forward_backward(prep, group, counter, forward_only), device=device)
    phases = PHASES[:1] if forward_only else PHASES
    return {"peak_bytes": nbytes(held) + peak, "input_bytes": nbytes(held), "instrument": instrument(device),
            "traffic": {p: counter.traffic[p].to_json() for p in phases}}


def overlap_run(impl: Impl, case: Case, inputs: Inputs, rank: int, group, device: torch.device | str = "cpu", *,
                fractions: tuple[float, ...] = (0.5, 2.0), repeats: int = 3, held_repeats: int = 2,
                forward_only: bool = False, barrier: Callable[[], None] | None = None,
                clock: Callable[[], float] | None = None) -> dict[str, Any]:
    """This rank's call timed `repeats` times without a delay (after one warm-up), then
    `held_repeats` times at each delay: `fraction` x one ring step's compute per phase. A step's
    compute is what a pass spent outside its waits (its time less the time its waits on
    transfers were blocked), median over the calls, over P; the smallest rank's, agreed over
    `group` outside the timed calls, so that every rank holds its transfers alike and a rank
    descheduled while it waited does not stretch the delay past what the ring computes.
    `clock`: the timer (`device_clock(device)` by default: synchronised on a GPU)."""
    prep = prepare(impl, case, inputs, rank, device, grad=not forward_only)
    phases = PHASES[:1] if forward_only else PHASES
    barrier = barrier or (lambda: dist.barrier(group=group))
    clock = clock or device_clock(device)

    def once(delay: dict[str, float] | float) -> tuple[list[float], CommCounter]:
        counter = CommCounter(delay, time_waits=True)
        barrier()
        with counter:
            t0 = clock()
            _forward_backward(prep, group, _Marks(counter, marks := [], clock), forward_only)
            marks.append(clock())
        return [marks[0] - t0, *([] if forward_only else [marks[1] - marks[0]])], counter

    once(0.0)
    base = [once(0.0) for _ in range(repeats)]
    compute = [statistics.median(max(t[i] - c.waited(p), 0.0) for t, c in base) for i, p in enumerate(phases)]
    step = torch.tensor(compute, dtype=torch.float64).clamp_min(MIN_STEP_S) / case.ring.world_size
    dist.all_reduce(step, op=dist.ReduceOp.MIN, group=group)  # every rank holds its transfers alike
    found: dict[str, Any] = {"base_s": [t for t, _ in base], "step_s": step.tolist(), "held": [],
                             "device": str(device)}
    for fraction in fractions:
        delay = {p: fraction * float(s) for p, s in zip(phases, step)}
        runs = [once(delay) for _ in range(held_repeats)]
        found["held"].append({"fraction": fraction, "delay_s": delay, "times_s": [t for t, _ in runs],
                              "injected_s": {p: [c.injected(p) for _, c in runs] for p in phases},
                              "exposed_s": {p: [c.exposed(p) for _, c in runs] for p in phases}})
    return found


def overlap_figures(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's `overlap_run` summed up, per delay: its `fraction` and `delay_s`, the share of
    the injected time `hidden` (over every rank and held call; None when nothing was held), the
    `injected_s` per rank and call, and how much slower the call was (`grew_s`: the slowest
    rank's, median over the calls, against the calls without a delay)."""
    def median_call(times: list[list[list[float]]]) -> float:
        return statistics.median(max(sum(rank[k]) for rank in times) for k in range(len(times[0])))

    base = median_call([r["base_s"] for r in runs])
    figures = []
    for i, held in enumerate(runs[0]["held"]):
        injected = sum(sum(v) for r in runs for v in r["held"][i]["injected_s"].values())
        exposed = sum(sum(v) for r in runs for v in r["held"][i]["exposed_s"].values())
        figures.append({"fraction": held["fraction"], "delay_s": held["delay_s"],
                        "hidden": 1.0 - exposed / injected if injected else None,
                        "injected_s": injected / (len(runs) * len(held["times_s"])),
                        "grew_s": median_call([r["held"][i]["times_s"] for r in runs]) - base})
    return figures


class _Marks:
    """A `CommCounter` seen by `_forward_backward`: setting the phase to "backward" also marks
    the time the forward ended (the split of a timed call into its passes)."""

    def __init__(self, counter: CommCounter, marks: list[float], clock: Callable[[], float] = time.perf_counter):
        self.counter, self.marks, self.clock = counter, marks, clock

    @property
    def phase(self) -> str:
        return self.counter.phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value == "backward":
            self.marks.append(self.clock())
        self.counter.phase = value


def promise_task(member, options: ImplOptions, case: Case, inputs: list[Inputs], call: bool = True,
                 overlap: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of a `Runner.submit_task`: its group's inputs through `measured_call` (with
    `call`) and `overlap_run` (with `overlap`: its keyword arguments)."""
    impl = loaded(options)
    mine = inputs[member.group_index]
    found: dict[str, Any] = {}
    if call:
        found["call"] = measured_call(impl, case, mine, member.rank, member.group, member.device,
                                      forward_only=options.forward_only)
    if overlap is not None:
        found["overlap"] = overlap_run(impl, case, mine, member.rank, member.group, member.device,
                                       forward_only=options.forward_only, **overlap)
    return found
