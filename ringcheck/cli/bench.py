"""`ringcheck bench`."""

from __future__ import annotations

import argparse
import os
import time

from ..adapters.flash import stand_in_task
from ..commands.bench import (
    BENCH_MODES,
    DEFAULT_IMPLS,
    DEFAULT_SECTIONS,
    FULL,
    OURS,
    QUICK,
    SECTIONS,
    SIMULATED,
    BenchSpec,
    load_average,
    machine,
    run_bench,
)
from ..documents import save
from ..flash_stand_in import install as install_flash_stand_in
from ..launch import LocalRings, audit_requested
from ..render.terminal import (
    make_console,
    print_bench,
    progress,
)
from .common import EXIT_OK, UsageError, add_log_dir, add_quiet, command_meta, list_of, shows_progress

# ------------------------------------------------------------------------------- bench

def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks side by side (ringcheck.commands.bench); never fails on speed: exit 0 once measured."""
    values: dict = {}
    if args.quick and args.full:
        raise UsageError("--quick and --full exclude each other")
    values.update(QUICK if args.quick else FULL if args.full else {})
    impls = tuple(x for group in (args.impl or [DEFAULT_IMPLS]) for x in group)
    values["impls"] = impls
    for name in ("dtypes", "ring_sizes", "tokens", "heads", "head_dim", "modes", "repeats", "warmup", "sections",
                 "mesh"):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    try:
        spec = BenchSpec(**values)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    console = make_console()
    stand_in = {}
    if args.flash_attn_stand_in:  # here (loading an impl imports flash_attn) and on every rank, below
        stand_in = {"flash_attn_stand_in": install_flash_stand_in().describe()}
        console.print(f"flash-attn stand-in: {stand_in['flash_attn_stand_in']}", highlight=False, markup=False)
    before = machine()
    start = time.perf_counter()
    # every pool the bench starts (also after a failure) installs the stand-in first
    with (LocalRings(timeout=args.timeout, log_dir=args.log_dir, setup=stand_in_task if stand_in else None,
                     audit=audit_requested(os.environ)) as rings,
          progress(None, console, enabled=shows_progress(args, console), label="benchmarking") as advance):
        doc = run_bench(spec, rings, progress=advance)
    doc["meta"] = command_meta(args, start, threads=before["parent_threads"], **before, load_after=load_average(),
                               **stand_in)
    print_bench(doc, console)
    if args.json:
        console.print(f"wrote {save(doc, args.json)}", highlight=False)
    failed = our_ring_failures(doc)
    if failed:  # measured, but not our ring: that is no benchmark of it
        raise UsageError("our ring could not run: " + "; ".join(failed[:3]))
    return EXIT_OK


def our_ring_failures(doc: dict) -> list[str]:
    """The speed cells where our ring (distributed or simulated) has no time, with why."""
    return [f"{r['system']} {r['key']}: {r.get('na')}" for r in doc.get("speed", [])
            if r["system"] in (OURS, SIMULATED) and r.get("median_s") is None]


def add_bench_command(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks: our ring against peer rings and single-device attention",
        description="Speed of our ring (simulated and distributed) against PyTorch's context-parallel ring, "
                    "ring_attention_pytorch and single-device SDPA, as ratios to the fastest peer ring, with "
                    "errors against float64 beside the times; overlap efficiency, load balance, peak memory "
                    "and harness speed. Local gloo rings on CPU. Never fails on speed (exit 0).")
    p.add_argument("--impl", type=list_of(str), action="append",
                   help=f"systems, repeatable or comma list (default {','.join(DEFAULT_IMPLS)}); any --impl "
                        "of validate (package.module:function) runs with our ring's layouts")
    p.add_argument("--mesh", metavar="DIM=N,...",
                   help="the distributed systems' rings inside this mesh (outermost dim first, one dim named cp, set "
                        "to each ring size; e.g. cp=4,tp=2): every CP group times at once, a repeat lasts as long as "
                        "the slowest rank of any group (default: each ring alone)")
    p.add_argument("--dtypes", type=list_of(str), help="default float32,bfloat16")
    p.add_argument("--ring-sizes", dest="ring_sizes", type=list_of(int), help="default 2,4")
    p.add_argument("--tokens", type=list_of(int), help="total tokens (default 1024,4096)")
    p.add_argument("--heads", type=int, help="default 4 (--full: 8)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="default 64")
    p.add_argument("--modes", type=list_of(str), help=f"default {','.join(BENCH_MODES)}")
    p.add_argument("--repeats", type=int, help="timed repeats, median reported (default 3)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 1)")
    p.add_argument("--sections", type=list_of(str),
                   help=f"of {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)}; harness runs the "
                        "test suites and validate as subprocesses: minutes)")
    p.add_argument("--quick", action="store_true", help="a tiny grid (float32, P=2, 512 tokens): a smoke run")
    p.add_argument("--full", action="store_true", help="the issue's whole grid (P 2,4,8; 1K,4K,16K tokens; 8 heads): long")
    p.add_argument("--flash-attn-stand-in", dest="flash_attn_stand_in", action="store_true",
                   help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in in "
                        "every ring worker (for --impl ring_flash_attn:* and yunchang:*); the JSON's meta says so")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank may wait on another (default 300)")
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON to FILE")
    add_log_dir(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_bench)


