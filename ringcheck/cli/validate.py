"""`ringcheck validate`: its flags and config file, the re-run command, the run."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import time
import tomllib
from pathlib import Path

from ..adapters import load_impl
from ..commands.validate import (
    DeviceDefect,
    Target,
    check_variant_keywords,
    placement,
    report_dict,
    validate,
    validate_steps,
)
from ..commands.validate.promises import DEFAULT_PROMISES, OVERLAP, parse_require
from ..commands.validate.rows import stand_in_row
from ..commands.validate.target import ONLY, check_keys, check_types
from ..harness import Mesh
from ..launch import RingError
from ..render.files import write_validate_reports
from ..render.terminal import (
    make_console,
    print_check_rows,
    progress,
)
from ..spec import check_timeout
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
    log_files_note,
    open_rings,
    shows_progress,
    where_to_rerun,  # noqa: F401 - train and other commands take it from here too
)

# ---------------------------------------------------------------------------- validate

# validate's flags that name a field of the target (the TOML config takes the same keys)
_VARIANT_FLAGS = ("documents", "pad", "window", "softcap", "sinks", "head_dim_v")  # `VariantOptions`
_TARGET_FLAGS = ("seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "layout",
                 "softmax_scale", "world_size", "impl", "backend", "seed", "sample_rows", "local_lengths",
                 "ragged_lengths", "distributions", *_VARIANT_FLAGS, "flash_attn_stand_in", "forward_only", "mesh", "sinks_grad",
                 "compile", "only")
QUICK_LENGTHS = (2, 6)           # --quick: the ring-local lengths checked
DEFAULT_TIMEOUT_S = 60.0         # --timeout when neither the flag nor the config sets it
_RUN_KEYS = ("quick", "timeout")  # config keys that are flags of the run, not fields of the target


def ragged_lengths_flag(text: str) -> tuple[int, ...]:
    """--ragged-lengths: a comma-separated list of tokens per rank, or none."""
    return () if text.strip().lower() == "none" else list_of(int)(text)


def read_config(path_text: str) -> dict:
    """The config's keys: top-level keys and a [validate] table, merged (a key in both with two
    values is refused); every key known (a "did you mean" otherwise) and of its type, named."""
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--config {path_text}: no such file")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path_text} is not valid TOML: {exc}") from exc
    table = values.pop("validate", {})
    if not isinstance(table, dict):
        raise UsageError(f"--config {path_text}: validate must be a [validate] table, got {table!r}")
    top = {key.replace("-", "_"): value for key, value in values.items()}
    table = {key.replace("-", "_"): value for key, value in table.items()}
    clash = sorted(k for k in set(top) & set(table) if top[k] != table[k])
    if clash:
        said = ", ".join(f"{k} = {top[k]!r} at the top level and {table[k]!r} in [validate]" for k in clash)
        raise UsageError(f"--config {path_text}: {said}; keep one of them")
    merged = {**top, **table}
    try:
        check_keys(merged, [*(f.name for f in dataclasses.fields(Target)), *_RUN_KEYS], f"--config {path_text}")
        check_types(merged, source=f"--config {path_text}")
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    if not isinstance(merged.get("quick", False), bool):
        raise UsageError(f"--config {path_text}: quick must be true or false, got {merged['quick']!r}")
    timeout = merged.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise UsageError(f"--config {path_text}: timeout must be a number of seconds, got {timeout!r}")
    return merged


def _validate_settings(args: argparse.Namespace) -> tuple[Target, float]:
    """The target and the timeout: the config file's keys, then the flags over them."""
    values = read_config(args.config) if args.config else {}
    quick = values.pop("quick", False)
    timeout = values.pop("timeout", None)
    for name in _TARGET_FLAGS:
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.quick or quick:
        values.setdefault("local_lengths", QUICK_LENGTHS)
    if values.get("mesh") is not None and "world_size" not in values:  # the mesh's cp dim is the ring
        try:
            values["world_size"] = Mesh.parse(values["mesh"]).cp
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    timeout = args.timeout if args.timeout is not None else timeout if timeout is not None else DEFAULT_TIMEOUT_S
    try:
        return Target.from_mapping(values, source=args.config or "flags"), check_timeout(timeout)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(target: Target, timeout: float, *, torchrun: bool = False, world: int | None = None,
                  prefix: str = "", promise_flags: tuple[str, ...] = ()) -> str:
    """The command that repeats this validate run exactly: every setting of the target as a
    flag (config values expanded, defaults spelled out, so a change of defaults cannot change
    what it runs) and the timeout; under torchrun, the torchrun launch of it on `world` ranks;
    after `prefix` (`where_to_rerun`: the directory and PYTHONPATH of the run); `promise_flags`
    (`promise_settings`: --overlap, --require) last."""
    flags: list[str] = []
    for name in _TARGET_FLAGS:
        value = getattr(target, name)
        flag = "--" + name.replace("_", "-")
        if value is None or name in _VARIANT_FLAGS:
            continue
        if name == "causal":
            flags.append("--causal" if value else "--no-causal")
        elif name in ("flash_attn_stand_in", "forward_only", "compile"):
            flags += [flag] if value else []
        elif name == "local_lengths":
            flags += ["--quick"] if tuple(value) == QUICK_LENGTHS else [flag, ",".join(map(str, value))]
        elif name == "distributions":
            flags += [flag, ",".join(value)]
        elif name == "ragged_lengths":
            flags += [flag, ",".join(map(str, value)) or "none"]
        elif name == "sinks_grad" and not target.sinks:
            continue
        else:
            flags += [flag, str(value)]
    flags += target.variants.flags()
    flags += ["--timeout", f"{timeout:g}", *promise_flags]
    head = (f"torchrun --nproc-per-node={world or target.world_size} -m ringcheck validate" if torchrun
            else "ringcheck validate")
    return prefix + head + " " + shlex.join(flags)


def short_failures(exc) -> str:
    """One line per failing rank, not whole tracebacks: the first line of what the rank said,
    which names the exception's type and the first line of its message (a multi-line
    message's last line is often a detail, e.g. a dispatcher registration)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return str(exc)
    lines = []
    for rank, text in sorted(failures.items()):
        said = [ln for ln in str(text).strip().splitlines() if ln.strip()]
        lines.append(f"  rank {rank}: {said[0].strip() if said else text}")
    head = str(exc).strip().splitlines()[0]
    return head + "\n" + "\n".join(lines)


def incomplete_run(exc, log_dir: str | None) -> UsageError:
    """The usage error of a run that did not complete on every rank: a line per failing rank
    (`short_failures`), and the per-rank logs that hold the whole story (with --log-dir)."""
    note = log_files_note(log_dir, exc)
    return UsageError("the implementation did not complete on every rank:\n" + short_failures(exc)
                      + (f"\n{note}" if note else ""))


def promise_settings(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(the promises measured, those required, their flags for the re-run command)."""
    try:
        require = parse_require(args.require)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    promises = (*DEFAULT_PROMISES, *((OVERLAP,) if args.overlap else ()))
    flags = (*(("--overlap",) if args.overlap else ()), *(("--require", ",".join(require)) if require else ()))
    return promises, require, flags


def _cmd_validate(args: argparse.Namespace) -> int:
    prefix = getattr(args, "where", "")  # the directory and PYTHONPATH of this run, read at the edge (cli.main)
    target, timeout = _validate_settings(args)
    promises, require, promise_flags = promise_settings(args)
    stand_in = stand_in_row(target.flash_attn_stand_in)  # here too: loading the impl below imports it
    try:  # fail fast, before any process starts, on an unknown or malformed --impl
        impl = load_impl(target.impl, layout=target.layout, backend=target.backend, sinks_grad=target.sinks_grad)
        impl.check_layout(target.layout, target.causal)
        check_variant_keywords(impl, target)
        placement(target, None, impl.world_only)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    console = make_console()
    start = time.perf_counter()
    ring = open_rings(args, timeout, EXIT_USAGE, backend=target.backend, impl=target.impl)
    try:
        if ring.is_torchrun and target.mesh is None and args.world_size is None and not args.config:
            target = type(target).from_mapping({**target.to_dict(), "world_size": ring.size})
        try:
            where = placement(target, ring.size, impl.world_only)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        main = ring.is_main
        command = rerun_command(target, timeout, torchrun=ring.is_torchrun, world=ring.size, prefix=prefix,
                                promise_flags=promise_flags)
        if main:
            console.print(command, markup=False, highlight=False, soft_wrap=True)
            console.print(f"variants: {target.variants.describe()}", markup=False, highlight=False)
            console.print(f"--only {target.only}: the ragged shards' rows alone, on {where.full.describe()}"
                          if target.only else
                          f"scaled-down cases: {where.scaled.describe()}; full length: {where.full.describe()}"
                          + (f" ({where.alone})" if where.alone else ""), markup=False, highlight=False)
            if stand_in is not None:
                console.print(f"flash-attn stand-in: {stand_in.detail}", markup=False, highlight=False)
        shows = main and shows_progress(args, console)
        with progress(validate_steps(target, (*promises, *require)), console, enabled=shows,
                      label="validating") as advance:
            try:  # the run is driven from here: progress notes need no channel
                rows = validate(target, ring, progress=advance if shows else None, promises=promises, require=require)
            except RingError as exc:
                raise incomplete_run(exc, args.log_dir) from exc
            except (ValueError, TypeError) as exc:  # the implementation's contract, judged on the ranks' results
                raise UsageError(str(exc)) from exc
            except DeviceDefect as exc:  # the device audit found ringcheck's own code at fault: no verdict
                raise UsageError(str(exc)) from exc
    finally:
        ring.close()
    if not main:
        return EXIT_OK if all(r.passed for r in rows) else EXIT_FAILED
    report = report_dict(target, rows, meta=command_meta(args, start), where=where)
    report["command"] = command  # the run exactly, config values expanded
    print_check_rows(rows, report["passed"], console, compact=not args.full_table)
    if args.report:
        paths = write_validate_reports(report, args.report)
        console.print(f"report written to {paths['json']}, {paths['md']} and {paths['html']}")
    return EXIT_OK if report["passed"] else EXIT_FAILED


def add_validate_command(sub) -> None:
    p = sub.add_parser("validate", help="judge a ring attention implementation against the references",
                       description="Judge a ring attention (ours by default, or --impl) against float64 and "
                                   "the same-dtype peer; exit 0 if every check passes, 1 if one fails, 2 if no "
                                   "verdict could be reached.")
    p.add_argument("--impl", help="implementation: ringcheck (default), ring_attention_pytorch, torch_cp, "
                                  "ring_flash_attn:zigzag|basic|stripe|llama3, yunchang:ulysses|usp[:ulysses=N]|"
                                  "ring:basic|zigzag|stripe, or package.module:function")
    p.add_argument("--config", help="TOML file with the target: the flags' names as keys, at the top level or in a "
                                    "[validate] table (e.g. seq_len = 4096, causal = false, quick = true, timeout = "
                                    "30), each key's type checked; flags override it")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="full target sequence length (default 2048)")
    p.add_argument("--batch", type=int, help="batch (default 1)")
    p.add_argument("--heads", type=int, help="query heads (default 4)")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="K/V heads (default 2)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="head dim (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="input dtype (default bfloat16)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal attention (default: causal)")
    p.add_argument("--layout", metavar="LAYOUT",
                   help="sequence layout: contiguous, zigzag (default), striped, zigzag_docs (balances each document, "
                        "needs --documents), or a custom package.module:FN, FN(rank, world_size, seq_len, "
                        "cu_seqlens=None) -> LongTensor of the global positions that rank holds")
    p.add_argument("--softmax-scale", dest="softmax_scale", type=float, help="default 1/sqrt(head_dim)")
    p.add_argument("--world-size", dest="world_size", type=int,
                   help="ranks of the ring, the mesh's cp dim (default 4; under torchrun without --mesh: the world)")
    p.add_argument("--mesh", metavar="DIM=N,...",
                   help="the device mesh the ring is embedded in, outermost dim first, exactly one dim named cp (the "
                        "ring), e.g. dp=2,cp=4 (CP groups 0-3, 4-7) or cp=4,tp=2 (strided 0,2,4,6 and 1,3,5,7): every "
                        "CP group runs at once on its own data and is judged (default: local rings run the scaled-down "
                        "cases on cp=P,tp=2 and the full length alone; under torchrun the world must be the mesh)")
    p.add_argument("--sinks-grad", dest="sinks_grad", choices=["partial", "reduced"],
                   help="with --sinks, what each rank's sinks.grad holds: partial (default: its own rows' share; the "
                        "framework sums it over the group, as Megatron-LM and torchtitan do) or reduced (the whole "
                        "sequence's on every rank: the ring all-reduces it)")
    p.add_argument("--backend", help="block backend of our ring: torch (default), triton, flash_attn")
    p.add_argument("--seed", type=int, help="seed of every input (default 0)")
    p.add_argument("--sample-rows", dest="sample_rows", type=int, help="query rows checked at full length (default 16)")
    p.add_argument("--local-lengths", dest="local_lengths", type=list_of(int),
                   help="ring-local lengths of the scaled-down cases, tokens per rank (default 2,6,16)")
    p.add_argument("--ragged-lengths", dest="ragged_lengths", type=ragged_lengths_flag,
                   help="tokens per rank of the ragged shards: longer than the tiles kernels walk (16-128) and a "
                        "multiple of none, run long, short, long in one process (default 130,66; none: leave them "
                        "out)")
    p.add_argument("--distributions", type=list_of(str),
                   help="logit distributions of the scaled-down cases (default: every registered one)")
    p.add_argument("--quick", action="store_true",
                   help="fewer ring-local lengths (2 and 6 tokens per rank; config key quick = true)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds any rank may wait on another (default {DEFAULT_TIMEOUT_S:g}; config key timeout)")
    add_variant_flags(p, unset=True)
    p.add_argument("--flash-attn-stand-in", dest="flash_attn_stand_in", action="store_true", default=None,
                   help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in on "
                        "every rank (for ring_flash_attn:* and yunchang:* on CPU); the report says so "
                        "(config key flash_attn_stand_in = true)")
    _add_run_flags(p)
    p.set_defaults(func=_cmd_validate)


def _add_run_flags(p) -> None:
    """validate's flags of the run rather than the target: promises, reports, which rows, where."""
    p.add_argument("--overlap", action="store_true",
                   help="also measure overlap: every transfer held for 0.5 and 2 times a ring step's compute, the share "
                        "of that time the ring hides (it times calls: a few seconds; memory and communication are "
                        "measured by default)")
    p.add_argument("--require", metavar="PROMISES",
                   help="promises whose FLAG fails the run (exit 1): any of memory, communication, overlap, "
                        "determinism (a second run gives the same bits; also required where the implementation "
                        "turns on torch.use_deterministic_algorithms), comma-separated (default: none; a FLAG is "
                        "reported, exactness alone gates)")
    p.add_argument("--report", metavar="DIR", help="write validate.json, validate.md and validate.html to DIR")
    p.add_argument("--full-table", dest="full_table", action="store_true",
                   help="the wide table with every row's located detail in it (default: one line per check, "
                        "the detail of failing rows after the table)")
    p.add_argument("--forward-only", dest="forward_only", action="store_true", default=None,
                   help="an inference ring without a backward: forward verdicts only, the backward rows say "
                        "'not run' (config key forward_only = true)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="the compile row: torch.compile of a function calling the ring (aot_eager on the CPU, inductor "
                        "on CUDA), its graph breaks, and its results against eager; dynamo takes seconds per rank, so "
                        "it runs only when asked (config key compile = true)")
    add_device(p)
    p.add_argument("--only", choices=ONLY, default=None,
                   help="run these rows alone: ragged (the ragged shards and the calls that change length, with no "
                        "NaN/Inf and the output's shape; seconds: a quick check of the ragged tails, e.g. under each "
                        "ATEN_CPU_CAPABILITY); default: every row (config key only = \"ragged\")")
    add_log_dir(p)
    add_quiet(p)


