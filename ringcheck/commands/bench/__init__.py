"""Benchmarks, side by side: our ring against peer rings and single-device attention.

A benchmark, not a test: it measures and prints, it never fails on speed. Five sections:

- ``speed``: forward and forward+backward time of every system on the same inputs, as a ratio
  to the fastest *peer ring* of the same configuration (median of `repeats` after `warmup`),
  with the max abs error of out (and dq, dk, dv) against float64 beside it. Distributed rings
  run inside one local ring per ring size (`LocalRings().run(P, task, ...)`); each rank times
  its call between barriers, the time of a repeat is the slowest rank's.
- ``overlap``: every distributed system's call with each transfer held 0.5 and 2 times a ring
  step's compute, as `ringcheck validate --overlap` measures it (`ringcheck.measure`): the share
  of the injected time the ring hides (1.0: all of it), and how much slower the call was.
- ``balance``: unmasked score entries per rank (`layouts.work_counts`) and measured per-rank
  forward compute time (each rank's loop run alone through `NoCommDriver`, 1 thread), as
  max / mean, for contiguous causal, zigzag and striped.
- ``memory``: the peak tensor storage per rank during one call beyond its shards
  (`ringcheck.measure.peak_bytes`, validate's memory instrument), as total tokens grow at a fixed
  ring size; a log-log slope per system.
- ``harness``: wall time of `pytest suites -q -x` (from a source checkout) and `ringcheck validate`
  (subprocesses), and
  the references' speed (float64 dense sampled rows/s, mpmath certified rows/s).

Errors are measured on `sample_rows` query rows: `dout` is zero except on those rows, so the
float64 reference of out, lse and dq for the rows, and of dk, dv for every key, is exact
(`reference.dense_grads(..., rows=...)`). Timings never include the reference.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ringcheck.reference import dense_grads
from ringcheck.reference.mp import mp_attention

from ...documents import BENCH_SCHEMA, header
from ...harness import Mesh
from ...measure.calls import overlap_figures
from ...ring import (
    NoCommDriver,
    RankShard,
    make_config,
)
from ...ring.backends import get_backend
from ...ring.layouts import shard, work_counts
from ...ring.loops import forward_loop
from .tasks import (
    LOCAL,
    OURS,
    PEERS,
    SDPA,
    SDPA_1T,
    SIMULATED,
    BenchCase,
    case_inputs,
    memory_task,
    merge_errors,
    overlap_task,
    parent_threads,
    run_local,
    speed_task,
    system_layout,
    times_of,
)

SECTIONS = ("speed", "overlap", "balance", "memory", "harness")
DEFAULT_SECTIONS = ("speed", "overlap", "balance", "memory")
BENCH_MODES = ("bidirectional", "causal", "causal_balanced")  # the speed grid's modes, not judge.check.MODES
PASSES = ("fwd", "fwd+bwd")
DEFAULT_IMPLS = (OURS, SIMULATED, *PEERS, SDPA, SDPA_1T)

@dataclass(frozen=True)
class BenchSpec:
    """What one `ringcheck bench` run measures."""

    impls: tuple[str, ...] = DEFAULT_IMPLS
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    ring_sizes: tuple[int, ...] = (2, 4)
    tokens: tuple[int, ...] = (1024, 4096)
    heads: int = 4
    head_dim: int = 64
    modes: tuple[str, ...] = BENCH_MODES
    passes: tuple[str, ...] = PASSES
    repeats: int = 3
    warmup: int = 1
    sample_rows: int = 16
    sections: tuple[str, ...] = DEFAULT_SECTIONS
    balance_ring_sizes: tuple[int, ...] = (2, 4, 8, 16)
    balance_tokens: int = 4096
    memory_ring_size: int = 2
    memory_tokens: tuple[int, ...] = (2048, 4096, 8192, 16384)
    seed: int = 0
    # the distributed systems' rings inside a mesh (`ringcheck.harness.Mesh`, its cp dim set to
    # each ring size): every CP group times at once, a repeat lasts as long as the slowest rank
    mesh: str | None = None

    def __post_init__(self) -> None:
        for name, allowed, got in (("--modes", BENCH_MODES, self.modes), ("--sections", SECTIONS, self.sections),
                                   ("--dtypes", ("float32", "bfloat16", "float16"), self.dtypes),
                                   ("passes", PASSES, self.passes)):
            bad = [x for x in got if x not in allowed]
            if bad:
                raise ValueError(f"{name}: {bad} unknown; choose from {list(allowed)}")
        for name, values in (("--ring-sizes", self.ring_sizes), ("--tokens", self.tokens),
                             ("memory tokens", self.memory_tokens), ("balance ring sizes", self.balance_ring_sizes)):
            if not values or any(not isinstance(x, int) or x < 1 for x in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
        if self.mesh is not None:
            Mesh.parse(self.mesh)

        for n in self.tokens:
            for p in self.ring_sizes:
                if n % (2 * p):
                    raise ValueError(f"--tokens {n} is not divisible by 2 x ring size {p} (zigzag layout)")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats}, {self.warmup}")
        if self.heads < 1 or self.head_dim < 1:
            raise ValueError(f"--heads and --head-dim must be positive, got {self.heads}, {self.head_dim}")

    def on_rings(self, rings, ring_size: int, task, *args) -> list:
        """`task` on a ring of `ring_size`, or on every CP group of the mesh with that ring at
        once: every rank's result (all groups', in group order)."""
        if self.mesh is None:
            return rings.run(ring_size, task, *args)
        return [r for group in rings.run_groups(Mesh.parse(self.mesh).with_cp(ring_size).plan(families=False), task,
                                                *args)
                for r in group]


QUICK = dict(dtypes=("float32",), ring_sizes=(2,), tokens=(512,), repeats=2, warmup=1,
             balance_ring_sizes=(2, 4, 8, 16), balance_tokens=1024, memory_tokens=(1024, 2048, 4096))
FULL = dict(dtypes=("float32", "bfloat16"), ring_sizes=(2, 4, 8), tokens=(1024, 4096, 16384), heads=8,
            repeats=5, warmup=1, memory_tokens=(2048, 4096, 8192, 16384, 32768))


# -------------------------------------------------------------------------------- sections

def _row(case: BenchCase, system: str, **extra) -> dict:
    layout, _ = system_layout(OURS if system in (SDPA, SDPA_1T) else system, case.mode)
    return {"key": case.key(), **asdict(case), "system": system,
            "layout": "whole" if system in (SDPA, SDPA_1T) else layout, **extra}


def add_ratios(rows: list[dict]) -> None:
    """Set `ratio` = median time / the fastest peer ring's median time of the same case (the
    fastest distributed system that is not ours when there is one, else the fastest system)."""
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["key"], []).append(r)
    for group in by_case.values():
        timed = [r for r in group if r.get("median_s") is not None]
        peers = [r for r in timed if r["system"] not in (OURS, *LOCAL)]
        basis = min(peers or timed, key=lambda r: r["median_s"], default=None)
        for r in group:
            r["fastest_peer"] = None if basis is None else basis["system"]
            r["ratio"] = (None if basis is None or r.get("median_s") is None
                          else r["median_s"] / basis["median_s"])


def run_speed(spec: BenchSpec, rings, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    rows: list[dict] = []
    threads = parent_threads()
    distributed = tuple(s for s in spec.impls if s not in LOCAL)
    local = tuple(s for s in spec.impls if s in LOCAL)
    for p in spec.ring_sizes:
        for dtype in spec.dtypes:
            for n in spec.tokens:
                for mode in spec.modes:
                    for passes in spec.passes:
                        case = BenchCase(dtype, p, n, mode, passes, spec.heads, spec.head_dim, spec.sample_rows, spec.seed)
                        progress(case.key())
                        runnable = []
                        for system in distributed:
                            layout, why = system_layout(system, mode)
                            if layout is None:
                                rows.append(_row(case, system, median_s=None, na=why, threads=1))
                            else:
                                runnable.append(system)
                        per_rank = spec.on_rings(rings, p, speed_task, case, tuple(runnable), spec.warmup,
                                                 spec.repeats) \
                            if runnable else []
                        for system in runnable:
                            got = [r[system] for r in per_rank]
                            failed = [g["error"] for g in got if "error" in g]
                            if failed:
                                rows.append(_row(case, system, median_s=None, na=failed[0], threads=1))
                                continue
                            # a repeat lasts as long as its slowest rank
                            times = [max(ts) for ts in zip(*(g["times"] for g in got))]
                            rows.append(_row(case, system, median_s=statistics.median(times), times=times,
                                             errors=merge_errors([g["errors"] for g in got]), threads=1))
                        for system in local:
                            try:
                                got = run_local(system, case, spec.warmup, spec.repeats)
                            except Exception as exc:
                                rows.append(_row(case, system, median_s=None, na=f"{type(exc).__name__}: {exc}",
                                                 threads=1))
                                continue
                            rows.append(_row(case, system, median_s=statistics.median(got["times"]),
                                             times=got["times"], errors=got["errors"], threads=got["threads"]))
    torch.set_num_threads(threads)
    add_ratios(rows)
    return rows


def run_overlap(spec: BenchSpec, rings, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    rows = []
    systems = tuple(s for s in spec.impls if s not in LOCAL)
    for p in spec.ring_sizes:
        for dtype in spec.dtypes[:1]:
            for n in spec.tokens:
                for mode in ("bidirectional", "causal_balanced"):
                    for passes in spec.passes:
                        case = BenchCase(dtype, p, n, mode, passes, spec.heads, spec.head_dim, spec.sample_rows, spec.seed)
                        runnable = tuple(s for s in systems if system_layout(s, mode)[0] is not None)
                        progress("overlap " + case.key())
                        got = spec.on_rings(rings, p, overlap_task, case, runnable, spec.repeats)
                        for system in runnable:
                            per = [g[system] for g in got]
                            failed = [x["error"] for x in per if "error" in x]
                            row = {"key": case.key(), "dtype": dtype, "ring_size": p, "tokens": n, "mode": mode,
                                   "passes": passes, "system": system, "bytes_per_step": _kv_bytes(case)}
                            if failed:
                                rows.append({**row, "na": failed[0]})
                                continue
                            rows.append({**row, "step_s": max(per, key=lambda x: sum(x["step_s"]))["step_s"],
                                         "held": overlap_figures(per)})
    return rows


def _kv_bytes(case: BenchCase) -> int:
    return 2 * (case.tokens // case.ring_size) * case.heads * case.head_dim * getattr(torch, case.dtype).itemsize


def run_balance(spec: BenchSpec, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Work counts and per-rank forward compute time (1 thread, `NoCommDriver`) per layout."""
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = spec.dtypes[0]
        n = spec.balance_tokens
        balance = BenchCase(dtype, 1, n, "causal", "fwd", spec.heads, spec.head_dim, 1, spec.seed)
        inputs, _ = case_inputs(balance)
        q, k, v = inputs.q, inputs.k, inputs.v
        backend = get_backend("torch")
        for p in spec.balance_ring_sizes:
            for layout in ("contiguous", "zigzag", "striped"):
                progress(f"balance P{p} {layout}")
                counts = work_counts(layout=layout, world_size=p, seq_len=n, causal=True)
                config = make_config(world_size=p, layout=layout, causal=True, softmax_scale=None,
                                     head_dim=spec.head_dim, backend="torch")
                per_rank = []
                for r in range(p):
                    qs, ks, vs = (shard(t, layout=layout, rank=r, world_size=p, dim=1).contiguous() for t in (q, k, v))
                    run = lambda: NoCommDriver(r, p).run([forward_loop(config, RankShard(r, p), qs, ks, vs, backend)])  # noqa: E731
                    with torch.no_grad():
                        per_rank.append(statistics.median(times_of(run, spec.warmup, spec.repeats)[0]))
                rows.append({"ring_size": p, "layout": layout, "tokens": n, "dtype": dtype, "work": counts,
                             "work_max_over_mean": max(counts) / statistics.fmean(counts),
                             "time_s": per_rank, "time_max_over_mean": max(per_rank) / statistics.fmean(per_rank)})
    finally:
        torch.set_num_threads(threads)
    return rows


def loglog_slope(xs, ys) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def run_memory(spec: BenchSpec, rings, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    p = spec.memory_ring_size
    systems = tuple(s for s in spec.impls if s not in LOCAL)
    rows = []
    for mode in ("bidirectional", "causal_balanced"):
        for passes in spec.passes:
            for n in spec.memory_tokens:
                if n % (2 * p):
                    continue
                case = BenchCase("float32", p, n, mode, passes, spec.heads, spec.head_dim, spec.sample_rows, spec.seed)
                progress("memory " + case.key())
                runnable = [s for s in systems if system_layout(s, mode)[0] is not None]
                got = spec.on_rings(rings, p, memory_task, case, tuple(runnable))
                for system in runnable:
                    per = [g[system] for g in got]
                    failed = [x["error"] for x in per if "error" in x]
                    rows.append({"system": system, "mode": mode, "passes": passes, "ring_size": p, "tokens": n,
                                 "tokens_per_rank": n // p,
                                 "peak_mib": None if failed else max(x["mib"] for x in per),
                                 "na": failed[0] if failed else None,
                                 # the N_local x N_local float32 score matrix of every head, for scale
                                 "nxn_mib": (n // p) ** 2 * spec.heads * 4 / 2 ** 20})
    fits = []
    for system in systems:
        for mode in ("bidirectional", "causal_balanced"):
            for passes in spec.passes:
                pts = [r for r in rows if (r["system"], r["mode"], r["passes"]) == (system, mode, passes)]
                if pts:
                    fits.append({"system": system, "mode": mode, "passes": passes,
                                 "slope": loglog_slope([r["tokens_per_rank"] for r in pts], [r["peak_mib"] for r in pts]),
                                 # the upper half alone: constant overheads flatten the small sizes
                                 "slope_upper": loglog_slope([r["tokens_per_rank"] for r in pts[len(pts) // 2 - 1:]],
                                                             [r["peak_mib"] for r in pts[len(pts) // 2 - 1:]])})
    return {"rows": rows, "fits": fits}


def run_harness(spec: BenchSpec, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Wall time of the test suites of the current directory (a source checkout: `suites/`) and
    of `ringcheck validate`; the references' speed. The library knows no path of its own
    checkout: without `suites/` in the current directory the suites are reported as not run."""
    root = os.getcwd()
    found: dict[str, Any] = {}
    commands = [("ringcheck validate", [sys.executable, "-m", "ringcheck", "validate"])]
    if os.path.isdir(os.path.join(root, "suites")):
        commands.insert(0, ("pytest suites -q -x", [sys.executable, "-m", "pytest", "suites", "-q", "-x"]))
    else:
        found["pytest suites -q -x"] = {"wall_s": None, "exit": None, "failed": [],
                                        "last_line": f"not run: no suites/ in {root} (run from a source checkout)"}
    for name, cmd in commands:
        progress("harness " + name)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # the summary line, and what failed (pytest's FAILED lines, or the error a command printed)
        failed = [ln for ln in lines if ln.startswith("FAILED") or ": error:" in ln]
        found[name] = {"wall_s": time.perf_counter() - t0, "exit": proc.returncode,
                       "last_line": (proc.stdout.strip().splitlines() or [""])[-1][:200],
                       "failed": [ln[:300] for ln in failed[:5]]}
    progress("harness references")
    inputs, rows = case_inputs(BenchCase("float32", 1, 4096, "bidirectional", "fwd+bwd", 4, 64, 16, spec.seed))
    t, _ = times_of(lambda: dense_grads(inputs.q, inputs.k, inputs.v, inputs.dout, rows=rows), 1, 3)
    found["float64 dense rows/s (N=4096, 16 sampled rows, 4 heads, fwd+bwd)"] = {
        "rows_per_s": 16 * 4 / statistics.median(t), "median_s": statistics.median(t)}
    inputs, rows = case_inputs(BenchCase("float32", 1, 1024, "bidirectional", "fwd", 4, 64, 16, spec.seed))
    t, _ = times_of(lambda: mp_attention(inputs.q, inputs.k, inputs.v, rows=rows, cache=False), 0, 1)
    found["mpmath certified rows/s (N=1024, 16 sampled rows, 4 heads, fwd)"] = {
        "rows_per_s": 16 * 4 / statistics.median(t), "median_s": statistics.median(t)}
    return found


# ---------------------------------------------------------------------------------- driver

def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


RING_BACKEND = "gloo"  # bench runs on local rings: gloo processes on the CPU, GPUs or not


def machine() -> dict:
    """What bench adds to a document's `meta` (`ringcheck.documents.meta`), taken before the
    run: the CPU, its load, the thread counts, the ring's transport."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(), "load_1_5_15": load_average(),
            "parent_threads": parent_threads(), "worker_threads": 1,
            "ring_backend": RING_BACKEND}


def run_bench(spec: BenchSpec, rings, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Every requested section: the bench document (schema "ringcheck.bench", see
    `ringcheck.documents`) without `meta`, which the command adds (`machine`)."""
    parent_threads()
    doc: dict[str, Any] = {**header(BENCH_SCHEMA), "spec": asdict(spec)}
    if "speed" in spec.sections:
        doc["speed"] = run_speed(spec, rings, progress)
    if "overlap" in spec.sections:
        doc["overlap"] = run_overlap(spec, rings, progress)
    if "balance" in spec.sections:
        doc["balance"] = run_balance(spec, progress)
    if "memory" in spec.sections:
        doc["memory"] = run_memory(spec, rings, progress)
    if "harness" in spec.sections:
        doc["harness"] = run_harness(spec, progress)
    return doc
