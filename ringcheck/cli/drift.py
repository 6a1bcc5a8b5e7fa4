"""`ringcheck drift` and `ringcheck report diff|render`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import torch

from ..adapters import load_impl, require_variant_keywords
from ..commands.drift import (
    AS_IMPLEMENTED,
    DEFAULT_ACCUMULATIONS,
    DEFAULT_BACKENDS,
    DEFAULT_DISTRIBUTIONS,
    DEFAULT_DTYPES,
    DEFAULT_MODES,
    DEFAULT_RING_SIZES,
    DRIFT_MODES,
    IMPLEMENTATIONS,
    DriftSpec,
    Implementation,
    count_runs,
    ring_implementation,
    run_drift,
    seeds_for_fit,
)
from ..commands.drift.model import MIN_FIT_SAMPLES
from ..documents import DRIFT_SCHEMA, diff_documents, exact_differences, load, require_same_spec
from ..flash_stand_in import install as install_flash_stand_in
from ..harness import Mesh
from ..harness.embedding import EmbeddingFailure
from ..judge.distributions import DISTRIBUTIONS
from ..launch import RingError, from_torchrun_env
from ..render.files import write_drift_reports
from ..render.terminal import (
    drift_progress,
    make_console,
    print_drift_diff,
    print_drift_summary,
)
from ..spec import DEFAULT_TIMEOUT, Budget
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_device,
    add_log_dir,
    add_quiet,
    add_variant_flags,
    command_meta,
    list_of,
    open_rings,
    shows_progress,
    variant_options,
)
from .validate import incomplete_run


def _drift_spec(args: argparse.Namespace):
    distributions = tuple(DISTRIBUTIONS) if args.distributions == ("all",) else args.distributions
    accumulations = args.accumulate
    if args.impl != "simulated":  # an --impl has no accumulation switch: it runs as it is built
        if accumulations is not None:
            raise UsageError(f"--accumulate switches our simulated ring's merge; --impl {args.impl} runs as it is "
                             "built: drop --accumulate")
        accumulations = (AS_IMPLEMENTED,)
    elif args.forward_only or args.flash_attn_stand_in:
        flag = "--forward-only" if args.forward_only else "--flash-attn-stand-in"
        raise UsageError(f"{flag} is for an --impl; the simulated ring runs forward and backward on our own kernels")
    return DriftSpec(dtypes=args.dtypes, ring_sizes=args.ring_sizes, distributions=distributions,
                     modes=args.modes, backends=args.backends, accumulations=accumulations or DEFAULT_ACCUMULATIONS,
                     seeds=args.seeds, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, tokens_per_rank=args.tokens_per_rank, seq_len=args.seq_len,
                     softmax_scale=args.softmax_scale, variants=variant_options(args),
                     budget=Budget(k_forward=args.k_forward, k_backward=args.k_backward))


def _cmd_drift(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # fixed, so a rerun gives the same bits
    spec = _drift_spec(args)
    if args.impl == "simulated":
        env = from_torchrun_env(os.environ)
        if env is not None and env.rank != 0:  # one process simulates every ring: rank 0 runs and reports it
            return EXIT_OK
        return _sweep(args, spec, IMPLEMENTATIONS["simulated"], make_console())
    if args.forward_only and args.sinks:
        raise UsageError("--forward-only runs no backward, and sinks are judged by their gradient dsinks: drop one")
    notes = [f"--flash-attn-stand-in: {install_flash_stand_in().describe()}"] if args.flash_attn_stand_in else []
    try:  # fail fast, before any process starts, on an unknown or malformed --impl or a layout it cannot run
        impl = load_impl(args.impl, layout=DRIFT_MODES[spec.modes[0]][1], backend=spec.backends[0])
        for mode in spec.modes:
            causal, layout = DRIFT_MODES[mode]
            try:
                impl.check_layout(layout, causal)
            except ValueError as exc:  # drift names layouts by mode
                modes = ", ".join(f"{m} = {'causal' if c else 'bidirectional'} on {lay}"
                                  for m, (c, lay) in DRIFT_MODES.items())
                raise ValueError(f"{exc} (drift --modes {mode}: {modes})") from exc
        att = spec.attention_spec(spec.modes[0], spec.dtypes[0], spec.ring_sizes[-1])
        require_variant_keywords(impl.fn, impl.name, att)  # never judge a variant the implementation was not given
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    mesh = _mesh(args, spec)
    cuda_only = [b for b in spec.backends if b in ("triton", "flash_attn")]  # refused on ranks on the CPU with GPUs
    ring = open_rings(args, args.timeout, EXIT_USAGE, backend=(cuda_only or [None])[0], impl=args.impl)
    try:
        if mesh is not None and ring.is_torchrun and mesh.size != ring.size:
            raise UsageError(f"--mesh {mesh.text} has {mesh.size} ranks but the torchrun world has {ring.size}: "
                             f"launch with --nproc-per-node={mesh.size}")
        implementation = ring_implementation(args.impl, ring, forward_only=args.forward_only,
                                             stand_in=args.flash_attn_stand_in, max_ring_size=ring.size, mesh=mesh,
                                             sinks_grad=args.sinks_grad)
        left_out = [p for p in spec.ring_sizes if ring.size is not None and p > ring.size]
        if left_out:
            notes.append(f"ring sizes {left_out} left out: the torchrun world has {ring.size} ranks")
        notes.append(f"every ring inside mesh {mesh.text} (its cp dim set to the ring size)" if mesh is not None else
                     "every ring beside a second one (mesh cp=P,tp=2) where the processes hold it; the sweep "
                     "measures the first, the second must pass the budget rule")
        try:
            return _sweep(args, spec, implementation, make_console(), notes=notes, main=ring.is_main)
        except RingError as exc:
            raise incomplete_run(exc, args.log_dir) from exc
        except EmbeddingFailure as exc:
            if ring.is_main:
                print(f"FAILED: {exc}", file=sys.stderr)
            return EXIT_FAILED
    finally:
        ring.close()


def _mesh(args: argparse.Namespace, spec: DriftSpec) -> Mesh | None:
    """--mesh, checked against the sweep before any rank starts: its cp dim holds the largest ring."""
    if args.mesh is None:
        return None
    try:
        mesh = Mesh.parse(args.mesh)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if max(spec.ring_sizes) > mesh.cp:
        raise UsageError(f"--mesh {mesh.text}: its cp dim is the largest ring of the sweep, but --ring-sizes asks for "
                         f"{max(spec.ring_sizes)}; pass cp={max(spec.ring_sizes)} or smaller ring sizes")
    return mesh


def _sweep(args: argparse.Namespace, spec: DriftSpec, implementation: Implementation, console, *,
           notes: list[str] | None = None, main: bool = True) -> int:
    """Run the sweep (seeds raised for the fits, said aloud); on the main process, write and
    print the report. The exit code (`_exit_code`): 1 when the ring under test is flagged, 2
    when no verdict could be reached (every group too weak to judge), with what would judge it."""
    notes = list(notes or [])
    seeds = seeds_for_fit(spec, implementation)
    if seeds > spec.seeds:  # too few points for a slope's confidence bounds: more seeds, said aloud
        notes.append(f"seeds raised from {spec.seeds} to {seeds}: a slope fit needs {MIN_FIT_SAMPLES} points "
                     f"(ring sizes P >= 2 x seeds) for bounds that can decide a flag")
        spec = replace(spec, seeds=seeds)  # the summary prints the note
    start = time.perf_counter()
    shows = main and shows_progress(args, console)
    with drift_progress(count_runs(spec, implementation), console, enabled=shows) as progress:
        doc = run_drift(spec, implementation=implementation, progress=progress)
    if not main:  # another rank of the torchrun world: the same verdict, rank 0 reports it
        return _exit_code(doc["summary"])
    doc["summary"]["notes"] = notes
    doc["meta"] = command_meta(args, start, threads=args.threads)
    paths = write_drift_reports(doc, args.out)
    print_drift_summary(doc, console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())} in {doc['meta']['elapsed_s']:.0f} s",
                  highlight=False)
    to_judge = doc["summary"]["to_judge"]
    if doc["summary"]["verdict"] == "no verdict":  # the last line a CI log shows
        console.print(f"no verdict (exit {EXIT_USAGE}): {to_judge['why']}; run again with {to_judge['flags']}",
                      style="bold yellow", markup=False, highlight=False)
    return _exit_code(doc["summary"])


def _exit_code(summary: dict) -> int:
    """0 pass, 1 the ring under test is flagged, 2 no verdict could be reached."""
    return {"pass": EXIT_OK, "flagged": EXIT_FAILED}.get(summary["verdict"], EXIT_USAGE)


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


def add_drift_command(sub) -> None:
    def join(xs) -> str:
        return ",".join(map(str, xs))

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
    p.add_argument("--accumulate", type=list_of(str), default=None,
                   help="running output of our ring: float32 (the default merge, under test) and/or input "
                        "(rounded to the input dtype at every hop: the control) "
                        f"(default {join(DEFAULT_ACCUMULATIONS)})")
    p.add_argument("--seeds", type=int, default=2,
                   help="seeds 0..N-1 per case (default 2; raised, with a note, to give every slope fit "
                        f"{MIN_FIT_SAMPLES} points)")
    p.add_argument("--mesh", default=None, metavar="DIM=N,...",
                   help="with --impl: the mesh every ring runs inside (outermost dim first, one dim named cp; its cp "
                        "dim set to each ring size), each CP group on its own data, the others judged by the budget "
                        "rule (default: cp=P,tp=2 where the processes hold it); under torchrun the world must be it")
    p.add_argument("--sinks-grad", dest="sinks_grad", default="partial", choices=["partial", "reduced"],
                   help="with --impl and --sinks: what each rank's sinks.grad holds (default partial: its own rows' "
                        "share, summed over the group here; reduced: the whole sequence's)")
    p.add_argument("--impl", default="simulated",
                   help="the ring under test: simulated (default: our ring, simulated in one process, with the "
                        "per-step drift and the --accumulate control), or any implementation under the --impl "
                        "contract of validate (MOD:FN or a built-in adapter: ringcheck, torch_cp, ...), run on "
                        "real process groups of each ring size: local gloo rings, or the torchrun world's "
                        "sub-groups under torchrun")
    p.add_argument("--forward-only", dest="forward_only", action="store_true",
                   help="with --impl: forward only (out, lse); dq, dk, dv say 'not run', never pass")
    p.add_argument("--flash-attn-stand-in", dest="flash_attn_stand_in", action="store_true",
                   help="with --impl: 'import flash_attn' gives ringcheck's CPU stand-in in every rank when the real "
                        "flash-attn is absent (the report says so)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"with --impl: seconds any rank may wait on another (default {DEFAULT_TIMEOUT:g})")
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
    add_device(p)
    add_log_dir(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_drift)


def add_report_command(sub) -> None:
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


