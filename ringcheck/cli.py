"""The `ringcheck` command line. The environment is read here and nowhere deeper.

Exit codes: 0 every check passed; 1 a check failed (a verdict); 2 no verdict could be reached
(bad flags or config, an implementation that breaks the contract, raises, hangs or dies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Something the user must fix; printed without a traceback, exit code 2."""


def _console():
    from rich.console import Console

    # a pipe or a CI log gets a wide table instead of rich's 80-column default
    return Console() if sys.stdout.isatty() else Console(width=160)


# ---------------------------------------------------------------------------- validate

_TARGET_FLAGS = ("seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "layout",
                 "softmax_scale", "world_size", "impl", "backend", "seed", "sample_rows")


def _target_from_args(args: argparse.Namespace):
    from .validate import Target

    values: dict = {}
    if args.config:
        import tomllib

        path = Path(args.config)
        if not path.is_file():
            raise UsageError(f"--config {args.config}: no such file")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"--config {args.config} is not valid TOML: {exc}") from exc
        values = values.get("validate", values)  # a [validate] table, or top-level keys
    for name in _TARGET_FLAGS:
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.quick:
        values.setdefault("local_lengths", [2, 6])
    try:
        return Target.from_mapping(values, source=args.config or "flags")
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


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
    from . import __version__
    from .adapters import load_impl
    from .launch import RingError, open_ring
    from .report import print_check_rows
    from .validate import markdown, report_dict, validate_task

    target = _target_from_args(args)
    try:  # fail fast, before any process starts, on an unknown or malformed --impl
        load_impl(target.impl, layout=target.layout, backend=target.backend).check_layout(target.layout, target.causal)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc
    console = _console()
    ring = open_ring(timeout=args.timeout, environ=os.environ)
    try:
        if ring.size is not None and getattr(ring, "is_torchrun", False) and ring.size != target.world_size:
            if args.world_size is not None or args.config:
                raise UsageError(f"the torchrun world has {ring.size} ranks but the target says world_size="
                                 f"{target.world_size}; launch with torchrun --nproc-per-node={target.world_size}")
            target = type(target).from_mapping({**target.to_dict(), "world_size": ring.size})
        main = getattr(ring, "is_main", True)
        if main:
            console.print(f"ringcheck validate {target.describe()}")
        with console.status("validating", spinner="dots") if main else _nullcontext():
            try:
                rows = ring.run(target.world_size, validate_task, target)[0]
            except RingError as exc:
                raise UsageError("the implementation did not complete on every rank:\n" + _short_failures(exc)) from exc
    finally:
        ring.close()
    if not main:
        return EXIT_OK if all(r.passed for r in rows) else EXIT_FAILED
    import platform
    import torch

    report = report_dict(target, rows, meta={"ringcheck": __version__, "torch": torch.__version__,
                                             "python": platform.python_version(), "host": platform.node()})
    print_check_rows(rows, report["passed"], console)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validate.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "validate.md").write_text(markdown(report))
        console.print(f"report written to {out / 'validate.json'} and {out / 'validate.md'}")
    return EXIT_OK if report["passed"] else EXIT_FAILED


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="judge a ring attention implementation against the references",
                       description="Judge a ring attention (ours by default, or --impl) against float64 and "
                                   "the same-dtype peer; exit 0 if every check passes, 1 if one fails, 2 if no "
                                   "verdict could be reached.")
    p.add_argument("--impl", help="implementation: ringcheck (default), ring_attention_pytorch, torch_cp, "
                                  "ring_flash_attn:zigzag, or package.module:function")
    p.add_argument("--config", help="TOML file with the target (keys as the flags, e.g. seq_len = 4096)")
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
    p.add_argument("--quick", action="store_true", help="fewer ring-local lengths (2 and 6 tokens per rank)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any rank may wait on another (default 60)")
    p.add_argument("--report", metavar="DIR", help="write validate.json and validate.md to DIR")
    p.set_defaults(func=_cmd_validate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringcheck", description="Verify ring attention against exact references.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_validate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"ringcheck {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"ringcheck {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"ringcheck {args.command}: interrupted", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
