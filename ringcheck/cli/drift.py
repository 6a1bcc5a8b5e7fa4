"""`ringcheck drift` and `ringcheck report diff|render`."""

from __future__ import annotations

import argparse
import time

import torch

from ..commands.drift import (
    DEFAULT_ACCUMULATIONS,
    DEFAULT_BACKENDS,
    DEFAULT_DISTRIBUTIONS,
    DEFAULT_DTYPES,
    DEFAULT_MODES,
    DEFAULT_RING_SIZES,
    IMPLEMENTATIONS,
    DriftSpec,
    count_runs,
    run_drift,
)
from ..documents import DRIFT_SCHEMA, diff_documents, exact_differences, load, require_same_spec
from ..judge.distributions import DISTRIBUTIONS
from ..render.files import write_drift_reports
from ..render.terminal import (
    drift_progress,
    make_console,
    print_drift_diff,
    print_drift_summary,
)
from ..spec import Budget
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_quiet,
    add_variant_flags,
    command_meta,
    list_of,
    shows_progress,
    variant_options,
)


def _drift_spec(args: argparse.Namespace):
    distributions = tuple(DISTRIBUTIONS) if args.distributions == ("all",) else args.distributions
    return DriftSpec(dtypes=args.dtypes, ring_sizes=args.ring_sizes, distributions=distributions,
                     modes=args.modes, backends=args.backends, accumulations=args.accumulate,
                     seeds=args.seeds, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, tokens_per_rank=args.tokens_per_rank, seq_len=args.seq_len,
                     softmax_scale=args.softmax_scale, variants=variant_options(args),
                     budget=Budget(k_forward=args.k_forward, k_backward=args.k_backward))


def _cmd_drift(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # fixed, so a rerun gives the same bits
    spec = _drift_spec(args)
    implementation = IMPLEMENTATIONS[args.impl]
    console = make_console()
    start = time.perf_counter()
    with drift_progress(count_runs(spec, implementation), console, enabled=shows_progress(args, console)) as progress:
        doc = run_drift(spec, implementation=implementation, progress=progress)
    doc["meta"] = command_meta(args, start, threads=args.threads)
    paths = write_drift_reports(doc, args.out)
    print_drift_summary(doc, console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())} in {doc['meta']['elapsed_s']:.0f} s",
                  highlight=False)
    return EXIT_OK if doc["summary"]["passed"] else EXIT_FAILED


def _cmd_report_diff(args: argparse.Namespace) -> int:
    a, b = load(args.a, schema=DRIFT_SCHEMA), load(args.b, schema=DRIFT_SCHEMA)
    console = make_console()
    if args.exact:
        try:  # two runs of different settings cannot reproduce each other
            require_same_spec(a, b)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        found = exact_differences(a, b)
        if not found:
            console.print("[bold green]identical[/]: the two reports agree bit for bit on everything but meta")
            return EXIT_OK
        console.print(f"[bold red]different[/]: first {len(found)} differences", highlight=False)
        for line in found:
            console.print("  " + line, markup=False, highlight=False)
        return EXIT_FAILED
    diff = diff_documents(a, b, threshold=args.threshold, slope_rise=args.slope_rise)
    print_drift_diff(diff, console)
    return EXIT_FAILED if diff.got_worse else EXIT_OK


def _cmd_report_render(args: argparse.Namespace) -> int:
    doc = load(args.json, schema=DRIFT_SCHEMA)
    paths = write_drift_reports(doc, args.out)
    console = make_console()
    print_drift_summary(doc, console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}", highlight=False)
    return EXIT_OK


def _add_drift(sub) -> None:
    join = lambda xs: ",".join(map(str, xs))  # noqa: E731
    p = sub.add_parser(
        "drift", help="sweep dtypes x ring sizes x distributions x modes: error against ring size",
        description="Precision drift: error of every tensor against ring size, per dtype, logit distribution, "
                    "mode, backend and accumulation, with a fitted slope per group and flags. Writes "
                    "drift.json, drift.md and drift.html to --out. Exit code 1 when the ring under test "
                    "(the float32 merge) is flagged.")
    p.add_argument("--dtypes", type=list_of(str), default=DEFAULT_DTYPES, help=f"default {join(DEFAULT_DTYPES)}")
    p.add_argument("--ring-sizes", type=list_of(int), default=DEFAULT_RING_SIZES,
                   help=f"simulated ring sizes P (default {join(DEFAULT_RING_SIZES)})")
    p.add_argument("--distributions", type=list_of(str), default=DEFAULT_DISTRIBUTIONS,
                   help="logit distributions, or 'all' for every registered one "
                        f"(default {join(DEFAULT_DISTRIBUTIONS)})")
    p.add_argument("--modes", type=list_of(str), default=DEFAULT_MODES, help=f"default {join(DEFAULT_MODES)}")
    p.add_argument("--backends", type=list_of(str), default=DEFAULT_BACKENDS,
                   help=f"block backends (default {join(DEFAULT_BACKENDS)})")
    p.add_argument("--accumulate", type=list_of(str), default=DEFAULT_ACCUMULATIONS,
                   help="running output of our ring: float32 (the default merge, under test) and/or input "
                        "(rounded to the input dtype at every hop: the control) "
                        f"(default {join(DEFAULT_ACCUMULATIONS)})")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per case (default 2)")
    p.add_argument("--impl", choices=sorted(IMPLEMENTATIONS), default="simulated",
                   help="ring implementation driven by the sweep (default simulated)")
    shape = p.add_argument_group("shape")
    shape.add_argument("--batch", type=int, default=1, help="default 1")
    shape.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    shape.add_argument("--kv-heads", type=int, default=2, help="K/V heads (default 2: grouped-query)")
    shape.add_argument("--head-dim", type=int, default=32, help="default 32")
    length = shape.add_mutually_exclusive_group()
    length.add_argument("--tokens-per-rank", type=int, default=None,
                        help="weak scaling: seq_len = P x this for every ring size P (default 8; even for zigzag)")
    length.add_argument("--seq-len", type=int, default=None,
                        help="strong scaling instead: this total length for every P "
                             "(a multiple of P, of 2P for zigzag)")
    shape.add_argument("--softmax-scale", type=float, default=None, help="default 1/sqrt(head_dim)")
    add_variant_flags(p)
    p.add_argument("--k-forward", type=float, default=2.0, help="budget factor for out, lse (default 2)")
    p.add_argument("--k-backward", type=float, default=3.0, help="budget factor for dq, dk, dv (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: reproducible bits)")
    p.add_argument("--out", default="drift-report", help="output directory (default ./drift-report)")
    add_quiet(p)
    p.set_defaults(func=_cmd_drift)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="work with saved reports: diff two drift reports, render one again")
    rsub = p.add_subparsers(dest="report_command", required=True)
    d = rsub.add_parser("diff", help="what got worse from drift report A to B (exit 1 if anything did)",
                        description="Compare two drift.json files by their stable keys (meta is ignored). "
                                    "Exit 0: nothing got worse; 1: something did; 2: bad input.")
    d.add_argument("a", help="the earlier drift.json (the baseline)")
    d.add_argument("b", help="the later drift.json")
    d.add_argument("--threshold", type=float, default=1.5,
                   help="an error (max abs or normwise relative) larger by this factor is worse (default 1.5)")
    d.add_argument("--slope-rise", type=float, default=0.25,
                   help="a fitted slope up by more than this is worse (default 0.25)")
    d.add_argument("--exact", action="store_true", help="reproducibility check: any difference but meta counts")
    d.set_defaults(func=_cmd_report_diff)
    r = rsub.add_parser("render", help="write drift.md and drift.html again from a drift.json")
    r.add_argument("json", help="a drift.json")
    r.add_argument("--out", required=True, help="output directory")
    r.set_defaults(func=_cmd_report_render)


