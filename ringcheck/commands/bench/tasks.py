"""What `ringcheck bench` measures, case by case: the inputs and float64 reference of a case,
the systems (our ring, peer rings, SDPA), and the tasks each rank of a local ring runs
(speed, overlap, memory), plus the runs made in the parent process. `bench.py` plans the
sections and builds the document from these. Overlap and memory are measured with the
instruments validate uses (`ringcheck.measure`): no second copy of either."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...adapters import load_impl
from ...judge.check import Case, Results, row_results
from ...judge.inputs import Inputs, make_inputs, sample_rows, with_sampled_rows
from ...measure.calls import overlap_run
from ...measure.memory import peak_bytes
from ...ring import simulate_ring
from ...ring.comm import timed_waits
from ...ring.layouts import positions, shard
from ...spec import AttentionSpec, RingSpec

OURS = "ringcheck"
SIMULATED = "ringcheck:simulated"
SDPA = "sdpa"
SDPA_1T = "sdpa:1thread"
PEERS = ("torch_cp", "ring_attention_pytorch")
LOCAL = (SIMULATED, SDPA, SDPA_1T)     # run in the parent process, not in the ring

# per system: the layout of each mode (None: the system cannot run that mode)
_LAYOUTS = {
    OURS: {"bidirectional": "contiguous", "causal": "contiguous", "causal_balanced": "zigzag"},
    SIMULATED: {"bidirectional": "contiguous", "causal": "contiguous", "causal_balanced": "zigzag"},
    "torch_cp": {"bidirectional": "contiguous", "causal": "contiguous", "causal_balanced": "zigzag"},
    "ring_attention_pytorch": {"bidirectional": "contiguous", "causal": "contiguous",
                               "causal_balanced": "striped"},
}
# any other --impl: the first layout of the mode's list that it says it runs (`Impl.check_layout`)
_PREFERRED = {"bidirectional": ("contiguous", "zigzag", "striped"), "causal": ("contiguous",),
              "causal_balanced": ("zigzag", "striped")}


# ---------------------------------------------------------------------------------- inputs

def case_inputs(case: BenchCase) -> tuple[Inputs, torch.Tensor]:
    """The case's seeded inputs (normal distribution; the same on every rank) with dout zero
    except on `case.sample_rows` sampled rows, and those rows."""
    rows = sample_rows(case.tokens, case.sample_rows, case.seed)
    return with_sampled_rows(make_inputs(case.spec(), seed=case.seed, distribution="normal"), rows), rows


def case_reference(case: BenchCase, inputs: Inputs, rows: torch.Tensor) -> Results:
    """float64 out, dq on `rows`; dk, dv on every key (exact: dout is zero elsewhere)."""
    return row_results(case.spec(), inputs, rows)


def errors(ref: Results, out, dq=None, dk=None, dv=None, *, rows, positions=None) -> dict[str, float]:
    """Max abs errors against `ref`. Tensors are whole (positions None) or one rank's shard, whose
    global token positions are `positions`; only the sampled rows of out and dq are compared."""
    n_total = ref.dk.shape[1]
    if positions is None:
        positions = torch.arange(n_total)
    where = torch.full((n_total,), -1, dtype=torch.int64)
    where[positions] = torch.arange(len(positions))
    local = where[rows]
    mine = local >= 0
    found: dict[str, float] = {}
    for name, got in (("out", out), ("dq", dq)):
        if got is not None and bool(mine.any()):
            diff = got.detach()[:, local[mine]].double() - ref.get(name)[:, mine.nonzero().flatten()]
            found[name] = float(diff.abs().max())
    for name, got in (("dk", dk), ("dv", dv)):
        if got is not None:
            found[name] = float((got.detach().double() - ref.get(name)[:, positions]).abs().max())
    return found


def merge_errors(parts: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


# ------------------------------------------------------------------------------- systems

def system_layout(system: str, mode: str) -> tuple[str | None, str]:
    """(layout, reason if n/a) of `system` in `mode`: the known systems' own; any other --impl
    the first of the mode's layouts it runs (a peer adapter says which: ring_flash_attn:zigzag
    runs zigzag only, so it has no plain causal cell)."""
    if system in _LAYOUTS:
        return _LAYOUTS[system][mode], ""
    causal = mode != "bidirectional"
    reasons = []
    for layout in _PREFERRED[mode]:
        try:
            load_impl(system, layout=layout).check_layout(layout, causal)
            return layout, ""
        except (ValueError, RuntimeError) as exc:
            reasons.append(str(exc).splitlines()[0])
    return None, f"{system} cannot run {mode}: {reasons[-1]}"


def call(fn: Callable, passes: str, inputs: tuple, dout):
    """One measured call: forward, and backward when timing fwd+bwd. Returns (out, grads)."""
    q, k, v = inputs
    if passes == "fwd":
        with torch.no_grad():
            res = fn(q, k, v)
        return (res[0] if isinstance(res, tuple) else res), None
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    res = fn(q, k, v)
    out = res[0] if isinstance(res, tuple) else res
    out.backward(dout)
    return out, (q.grad, k.grad, v.grad)


def times_of(fn: Callable, warmup: int, repeats: int, barrier: Callable = lambda: None):
    """Per-repeat seconds of fn() after `warmup` calls, each between barriers; last result.
    Ring waits block directly here (`timed_waits`): no fail-fast helper thread in the timing."""
    result = None
    with timed_waits():
        for _ in range(warmup):
            barrier()
            result = fn()
        times = []
        for _ in range(repeats):
            barrier()
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        barrier()
    return times, result


@dataclass(frozen=True)
class BenchCase:
    """One cell of the speed grid (not a `judge.check.Case`: no ring spec, a bench mode)."""

    dtype: str
    ring_size: int
    tokens: int
    mode: str
    passes: str
    heads: int
    head_dim: int
    sample_rows: int
    seed: int

    @property
    def causal(self) -> bool:
        return self.mode != "bidirectional"

    def key(self) -> str:
        return f"{self.dtype}/P{self.ring_size}/N{self.tokens}/{self.mode}/{self.passes}"

    def spec(self) -> AttentionSpec:
        return AttentionSpec(batch=1, heads=self.heads, kv_heads=self.heads, seq_len=self.tokens,
                             head_dim=self.head_dim, dtype=self.dtype, causal=self.causal)


def ring_fn(system: str, layout: str, causal: bool, scale: float, group):
    """A callable (q, k, v) -> out for a distributed system on this rank."""
    impl = load_impl(system, layout=layout)
    return lambda q, k, v: impl.call(q, k, v, causal=causal, softmax_scale=scale, group=group, layout=layout)


def speed_task(member, case: BenchCase, systems: tuple[str, ...], warmup: int, repeats: int) -> dict:
    """Ring task: time every distributed system on this rank for one case; errors per system."""
    torch.set_num_threads(1)
    inputs, rows = case_inputs(case)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    ref = case_reference(case, inputs, rows)
    scale = 1.0 / math.sqrt(case.head_dim)
    barrier = lambda: dist.barrier(group=member.group)  # noqa: E731
    found: dict[str, Any] = {}
    for system in systems:
        layout, _ = system_layout(system, case.mode)
        try:
            fn = ring_fn(system, layout, case.causal, scale, member.group)
            parts = [shard(t, layout=layout, rank=member.rank, world_size=member.world_size, dim=1)
                     for t in (q, k, v, dout)]
            times, (out, grads) = times_of(lambda: call(fn, case.passes, tuple(parts[:3]), parts[3]),
                                         warmup, repeats, barrier)
            pos = positions(layout=layout, rank=member.rank, world_size=member.world_size, seq_len=case.tokens)
            found[system] = {"times": times, "errors": errors(ref, out, *(grads or ()), rows=rows, positions=pos)}
        except Exception as exc:  # recorded as n/a; the other ranks fail (or time out) alike
            found[system] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return found


def overlap_task(member, case: BenchCase, systems: tuple[str, ...], repeats: int) -> dict:
    """Ring task: per system, its call timed without a delay and with every transfer held 0.5
    and 2 times a ring step's compute (`ringcheck.measure.overlap_run`, as validate --overlap)."""
    torch.set_num_threads(1)
    inputs, _ = case_inputs(case)
    found = {}
    for system in systems:
        layout, _ = system_layout(system, case.mode)
        try:
            ring_case = Case(case.spec(), RingSpec(member.world_size, layout))
            found[system] = overlap_run(load_impl(system, layout=layout), ring_case, inputs, member.rank,
                                        member.group, member.device, forward_only=case.passes == "fwd",
                                        repeats=max(1, repeats))
        except Exception as exc:  # recorded as n/a; the other ranks fail (or time out) alike
            found[system] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return found


def memory_task(member, case: BenchCase, systems: tuple[str, ...]) -> dict:
    """Ring task: per system, the peak MiB of tensor storage one call holds on this rank beyond
    its shards (`ringcheck.measure.peak_bytes`), after one warm-up call."""
    torch.set_num_threads(1)
    inputs, _ = case_inputs(case)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    scale = 1.0 / math.sqrt(case.head_dim)
    found = {}
    for system in systems:
        layout, _ = system_layout(system, case.mode)
        try:
            fn = ring_fn(system, layout, case.causal, scale, member.group)
            parts = [shard(t, layout=layout, rank=member.rank, world_size=member.world_size, dim=1).contiguous()
                     for t in (q, k, v, dout)]
            call(fn, case.passes, tuple(parts[:3]), parts[3])  # warm-up: lazy imports, kernel set-up
            dist.barrier(group=member.group)
            peak, _ = peak_bytes(lambda: call(fn, case.passes, tuple(parts[:3]), parts[3]), device=member.device)
            found[system] = {"mib": peak / 2 ** 20}
            dist.barrier(group=member.group)
        except Exception as exc:
            found[system] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return found


# ----------------------------------------------------------------------- parent-side runs

def _local_fn(system: str, case: BenchCase):
    """(fn(q, k, v) -> out on whole tensors, torch threads) for a system run in the parent."""
    if system == SIMULATED:
        layout, _ = system_layout(OURS, case.mode)
        return (lambda q, k, v: simulate_ring(q, k, v, world_size=case.ring_size, causal=case.causal,
                                              layout=layout)), 1

    def sdpa(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=case.causal)
        return out.transpose(1, 2)
    return sdpa, (1 if system == SDPA_1T else parent_threads())


_PARENT_THREADS: list[int] = []


def parent_threads() -> int:
    if not _PARENT_THREADS:
        _PARENT_THREADS.append(torch.get_num_threads())
    return _PARENT_THREADS[0]


def run_local(system: str, case: BenchCase, warmup: int, repeats: int) -> dict:
    fn, threads = _local_fn(system, case)
    inputs, rows = case_inputs(case)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    ref = case_reference(case, inputs, rows)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times, (out, grads) = times_of(lambda: call(fn, case.passes, (q, k, v), dout), warmup, repeats)
    finally:
        torch.set_num_threads(old)
    return {"times": times, "errors": errors(ref, out, *(grads or ()), rows=rows), "threads": threads}
