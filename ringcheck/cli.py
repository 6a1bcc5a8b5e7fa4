"""The `ringcheck` command line. The environment is read here and nowhere deeper."""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _console():
    from rich.console import Console

    # a pipe or a CI log gets a wide table instead of rich's 80-column default
    return Console() if sys.stdout.isatty() else Console(width=140)


def _cmd_validate(args: argparse.Namespace) -> int:
    from .report import print_verdicts
    from .validate import default_cases, validate

    console = _console()
    cases = default_cases(args.world_size, backend=args.backend)
    with console.status("validating") as status:
        verdicts = validate(cases, progress=lambda c: status.update(f"validating {c.describe()}"))
    print_verdicts(verdicts, console)
    return EXIT_OK if all(v.passed for v in verdicts) else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringcheck", description="Verify ring attention against exact references.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="judge a ring attention implementation against the references")
    p.add_argument("--world-size", type=int, default=4, help="ring size (default 4)")
    p.add_argument("--backend", default="torch", help="block backend of our ring: torch, triton, flash_attn")
    p.set_defaults(func=_cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"ringcheck {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
