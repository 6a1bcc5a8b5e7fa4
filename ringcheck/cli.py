"""The `ringcheck` command line. The environment is read here and nowhere deeper.

Exit codes: 0 every check passed; 1 a check failed (a verdict); 2 no verdict could be reached
(bad flags or config, an implementation that breaks the contract, raises, hangs or dies).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import tomllib
from contextlib import nullcontext
from pathlib import Path

import torch

from .commands.adapters import load_impl
from .commands.bench import (
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
from .commands.drift import (
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
from .commands.validate import Target, report_dict, validate_task
from .documents import DRIFT_SCHEMA, diff_documents, exact_differences, load, meta, save
from .judge.distributions import DISTRIBUTIONS
from .launch import LocalRings, RingError, open_ring
from .render.files import write_drift_reports, write_validate_reports
from .render.terminal import (
    drift_progress,
    make_console,
    print_bench,
    print_check_rows,
    print_drift_diff,
    print_drift_summary,
)
from .spec import Budget, check_timeout

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SILENT_RANK_GRACE_S = 2.0  # under torchrun, how long a rank that failed quietly waits for rank 0 to speak


class UsageError(Exception):
    """Something the user must fix; printed without a traceback, exit code 2."""


def _meta(args: argparse.Namespace, start: float, **extra) -> dict:
    """The `meta` of this command's document (`ringcheck.documents.meta`), `start` its
    `time.perf_counter()` when the work began."""
    return meta("ringcheck " + shlex.join(args.argv), elapsed_s=time.perf_counter() - start, **extra)


# ---------------------------------------------------------------------------- validate

# validate's flags that name a field of the target (the TOML config takes the same keys)
_TARGET_FLAGS = ("seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "layout",
                 "softmax_scale", "world_size", "impl", "backend", "seed", "sample_rows", "local_lengths",
                 "distributions")
QUICK_LENGTHS = (2, 6)           # --quick: the ring-local lengths checked
DEFAULT_TIMEOUT_S = 60.0         # --timeout when neither the flag nor the config sets it
_RUN_KEYS = ("quick", "timeout")  # config keys that are flags of the run, not fields of the target


def _read_config(path_text: str) -> dict:
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--config {path_text}: no such file")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path_text} is not valid TOML: {exc}") from exc
    values = values.get("validate", values)  # a [validate] table, or top-level keys
    return {key.replace("-", "_"): value for key, value in values.items()}


def _validate_settings(args: argparse.Namespace) -> tuple[Target, float]:
    """The target and the timeout: the config file's keys, then the flags over them."""
    values = _read_config(args.config) if args.config else {}
    quick = values.pop("quick", False)
    timeout = values.pop("timeout", None)
    if not isinstance(quick, bool):
        raise UsageError(f"--config {args.config}: quick must be true or false, got {quick!r}")
    for name in _TARGET_FLAGS:
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.quick or quick:
        values.setdefault("local_lengths", QUICK_LENGTHS)
    timeout = args.timeout if args.timeout is not None else timeout if timeout is not None else DEFAULT_TIMEOUT_S
    try:
        return Target.from_mapping(values, source=args.config or "flags"), check_timeout(timeout)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(target: Target, timeout: float, *, torchrun: bool = False) -> str:
    """The command that repeats this validate run exactly: every setting of the target as a
    flag (config values expanded, defaults spelled out, so a change of defaults cannot change
    what it runs) and the timeout; under torchrun, the torchrun launch of it."""
    flags: list[str] = []
    for name in _TARGET_FLAGS:
        value = getattr(target, name)
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if name == "causal":
            flags.append("--causal" if value else "--no-causal")
        elif name == "local_lengths":
            flags += ["--quick"] if tuple(value) == QUICK_LENGTHS else [flag, ",".join(map(str, value))]
        elif name == "distributions":
            flags += [flag, ",".join(value)]
        else:
            flags += [flag, str(value)]
    flags += ["--timeout", f"{timeout:g}"]
    head = (f"torchrun --nproc-per-node={target.world_size} -m ringcheck validate" if torchrun
            else "ringcheck validate")
    return head + " " + shlex.join(flags)


def _short_failures(exc) -> str:
    """One line per failing rank (the exception's last line), not whole tracebacks."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return str(exc)
    lines = []
    for rank, text in sorted(failures.items()):
        last = [ln for ln in str(text).strip().splitlines() if ln.strip()]
        lines.append(f"  rank {rank}: {last[-1].strip() if last else text}")
    head = str(exc).strip().splitlines()[0]
    return head + "\n" + "\n".join(lines)


def _cmd_validate(args: argparse.Namespace) -> int:
    target, timeout = _validate_settings(args)
    try:  # fail fast, before any process starts, on an unknown or malformed --impl
        load_impl(target.impl, layout=target.layout, backend=target.backend).check_layout(target.layout, target.causal)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    console = make_console()
    start = time.perf_counter()
    ring = open_ring(timeout=timeout, environ=os.environ)
    try:
        if ring.is_torchrun and ring.size != target.world_size:
            if args.world_size is not None or args.config:
                raise UsageError(f"the torchrun world has {ring.size} ranks but the target says world_size="
                                 f"{target.world_size}; launch with torchrun --nproc-per-node={target.world_size}")
            target = type(target).from_mapping({**target.to_dict(), "world_size": ring.size})
        main = ring.is_main
        command = rerun_command(target, timeout, torchrun=ring.is_torchrun)
        if main:
            console.print(command, markup=False, highlight=False, soft_wrap=True)
        with console.status("validating", spinner="dots") if main else nullcontext():
            try:
                rows = ring.run(target.world_size, validate_task, target)[0]
            except RingError as exc:
                raise UsageError("the implementation did not complete on every rank:\n" + _short_failures(exc)) from exc
    finally:
        ring.close()
    if not main:
        return EXIT_OK if all(r.passed for r in rows) else EXIT_FAILED
    report = report_dict(target, rows, meta=_meta(args, start))
    report["command"] = command  # the run exactly, config values expanded
    print_check_rows(rows, report["passed"], console)
    if args.report:
        paths = write_validate_reports(report, args.report)
        console.print(f"report written to {paths['json']} and {paths['md']}")
    return EXIT_OK if report["passed"] else EXIT_FAILED


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="judge a ring attention implementation against the references",
                       description="Judge a ring attention (ours by default, or --impl) against float64 and "
                                   "the same-dtype peer; exit 0 if every check passes, 1 if one fails, 2 if no "
                                   "verdict could be reached.")
    p.add_argument("--impl", help="implementation: ringcheck (default), ring_attention_pytorch, torch_cp, "
                                  "ring_flash_attn:zigzag, or package.module:function")
    p.add_argument("--config", help="TOML file with the target: the flags' names as keys (e.g. seq_len = 4096, "
                                    "causal = false, quick = true, timeout = 30), flags override it")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="full target sequence length (default 2048)")
    p.add_argument("--batch", type=int, help="batch (default 1)")
    p.add_argument("--heads", type=int, help="query heads (default 4)")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="K/V heads (default 2)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="head dim (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="input dtype (default bfloat16)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal attention (default: causal)")
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], help="sequence layout (default zigzag)")
    p.add_argument("--softmax-scale", dest="softmax_scale", type=float, help="default 1/sqrt(head_dim)")
    p.add_argument("--world-size", dest="world_size", type=int,
                   help="ranks of the local gloo ring (default 4; under torchrun: the world)")
    p.add_argument("--backend", help="block backend of our ring: torch (default), triton, flash_attn")
    p.add_argument("--seed", type=int, help="seed of every input (default 0)")
    p.add_argument("--sample-rows", dest="sample_rows", type=int, help="query rows checked at full length (default 16)")
    p.add_argument("--local-lengths", dest="local_lengths", type=_list(int),
                   help="ring-local lengths of the scaled-down cases, tokens per rank (default 2,6,16)")
    p.add_argument("--distributions", type=_list(str),
                   help="logit distributions of the scaled-down cases (default: every registered one)")
    p.add_argument("--quick", action="store_true",
                   help="fewer ring-local lengths (2 and 6 tokens per rank; config key quick = true)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds any rank may wait on another (default {DEFAULT_TIMEOUT_S:g}; config key timeout)")
    p.add_argument("--report", metavar="DIR", help="write validate.json and validate.md to DIR")
    p.set_defaults(func=_cmd_validate)


def _list(kind):
    """An argparse type: a comma-separated list of `kind` (str or int)."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return tuple(kind(x) for x in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def _drift_spec(args: argparse.Namespace):
    distributions = tuple(DISTRIBUTIONS) if args.distributions == ("all",) else args.distributions
    return DriftSpec(dtypes=args.dtypes, ring_sizes=args.ring_sizes, distributions=distributions,
                     modes=args.modes, backends=args.backends, accumulations=args.accumulate,
                     seeds=args.seeds, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, tokens_per_rank=args.tokens_per_rank, seq_len=args.seq_len,
                     softmax_scale=args.softmax_scale,
                     budget=Budget(k_forward=args.k_forward, k_backward=args.k_backward))


def _cmd_drift(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # fixed, so a rerun gives the same bits
    spec = _drift_spec(args)
    implementation = IMPLEMENTATIONS[args.impl]
    console = make_console()
    start = time.perf_counter()
    with drift_progress(count_runs(spec, implementation), console) as progress:
        doc = run_drift(spec, implementation=implementation, progress=progress)
    doc["meta"] = _meta(args, start, threads=args.threads)
    paths = write_drift_reports(doc, args.out)
    print_drift_summary(doc, console)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())} in {doc['meta']['elapsed_s']:.0f} s",
                  highlight=False)
    return EXIT_OK if doc["summary"]["passed"] else EXIT_FAILED


def _cmd_report_diff(args: argparse.Namespace) -> int:
    a, b = load(args.a, schema=DRIFT_SCHEMA), load(args.b, schema=DRIFT_SCHEMA)
    console = make_console()
    if args.exact:
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
    p.add_argument("--dtypes", type=_list(str), default=DEFAULT_DTYPES, help=f"default {join(DEFAULT_DTYPES)}")
    p.add_argument("--ring-sizes", type=_list(int), default=DEFAULT_RING_SIZES,
                   help=f"simulated ring sizes P (default {join(DEFAULT_RING_SIZES)})")
    p.add_argument("--distributions", type=_list(str), default=DEFAULT_DISTRIBUTIONS,
                   help="logit distributions, or 'all' for every registered one "
                        f"(default {join(DEFAULT_DISTRIBUTIONS)})")
    p.add_argument("--modes", type=_list(str), default=DEFAULT_MODES, help=f"default {join(DEFAULT_MODES)}")
    p.add_argument("--backends", type=_list(str), default=DEFAULT_BACKENDS,
                   help=f"block backends (default {join(DEFAULT_BACKENDS)})")
    p.add_argument("--accumulate", type=_list(str), default=DEFAULT_ACCUMULATIONS,
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
    p.add_argument("--k-forward", type=float, default=2.0, help="budget factor for out, lse (default 2)")
    p.add_argument("--k-backward", type=float, default=3.0, help="budget factor for dq, dk, dv (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: reproducible bits)")
    p.add_argument("--out", default="drift-report", help="output directory (default ./drift-report)")
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


# ------------------------------------------------------------------------------- bench

def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks side by side (ringcheck.commands.bench); never fails on speed: exit 0 once measured."""
    values: dict = {}
    if args.quick and args.full:
        raise UsageError("--quick and --full exclude each other")
    values.update(QUICK if args.quick else FULL if args.full else {})
    impls = tuple(x for group in (args.impl or [DEFAULT_IMPLS]) for x in group)
    values["impls"] = impls
    for name in ("dtypes", "ring_sizes", "tokens", "heads", "head_dim", "modes", "repeats", "warmup", "sections"):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    try:
        spec = BenchSpec(**values)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    console = make_console()
    before = machine()
    start = time.perf_counter()
    with LocalRings(timeout=args.timeout) as rings, console.status("benchmarking", spinner="dots") as status:
        doc = run_bench(spec, rings, progress=lambda what: status.update(f"benchmarking {what}"))
    doc["meta"] = _meta(args, start, threads=before["parent_threads"], **before, load_after=load_average())
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


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks: our ring against peer rings and single-device attention",
        description="Speed of our ring (simulated and distributed) against PyTorch's context-parallel ring, "
                    "ring_attention_pytorch and single-device SDPA, as ratios to the fastest peer ring, with "
                    "errors against float64 beside the times; overlap efficiency, load balance, peak memory "
                    "and harness speed. Local gloo rings on CPU. Never fails on speed (exit 0).")
    p.add_argument("--impl", type=_list(str), action="append",
                   help=f"systems, repeatable or comma list (default {','.join(DEFAULT_IMPLS)}); any --impl "
                        "of validate (package.module:function) runs with our ring's layouts")
    p.add_argument("--dtypes", type=_list(str), help="default float32,bfloat16")
    p.add_argument("--ring-sizes", dest="ring_sizes", type=_list(int), help="default 2,4")
    p.add_argument("--tokens", type=_list(int), help="total tokens (default 1024,4096)")
    p.add_argument("--heads", type=int, help="default 4 (--full: 8)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="default 64")
    p.add_argument("--modes", type=_list(str), help=f"default {','.join(BENCH_MODES)}")
    p.add_argument("--repeats", type=int, help="timed repeats, median reported (default 3)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 1)")
    p.add_argument("--sections", type=_list(str),
                   help=f"of {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)}; harness runs the "
                        "test suites and validate as subprocesses: minutes)")
    p.add_argument("--quick", action="store_true", help="a tiny grid (float32, P=2, 512 tokens): a smoke run")
    p.add_argument("--full", action="store_true", help="the issue's whole grid (P 2,4,8; 1K,4K,16K tokens; 8 heads): long")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank may wait on another (default 300)")
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON to FILE")
    p.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringcheck", description="Verify ring attention against exact references.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_validate(sub)
    _add_drift(sub)
    _add_report(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    # under torchrun every rank runs this: one of them (rank 0) says what went wrong
    speaks = os.environ.get("RANK", "0") == "0" or "WORLD_SIZE" not in os.environ
    try:
        return args.func(args)
    except UsageError as exc:
        message = f"ringcheck {args.command}: error: {exc}"
    except (ValueError, TypeError, RuntimeError) as exc:
        message = f"ringcheck {args.command}: error: {type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        message = f"ringcheck {args.command}: interrupted"
    if speaks:
        print(message, file=sys.stderr)
    else:  # torchrun stops every rank when the first one exits: let rank 0 say it first
        time.sleep(SILENT_RANK_GRACE_S)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
