"""The `ringcheck` command line. The environment is read here and nowhere deeper.

Exit codes: 0 every check passed; 1 a check failed (a verdict); 2 no verdict could be reached
(bad flags or config, an implementation that breaks the contract, raises, hangs or dies).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..launch import launched_rank
from ..launch.start import environ_as_started
from .bench import add_bench_command, our_ring_failures
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, SILENT_RANK_GRACE_S, UsageError, where_to_rerun
from .drift import add_drift_command, add_report_command
from .plan import add_plan_command
from .step import add_step_command
from .test import add_test_command
from .train import add_train_command
from .validate import add_validate_command, rerun_command

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "UsageError", "build_parser", "main", "our_ring_failures",
           "rerun_command"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringcheck", description="Verify ring attention against exact references.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_validate_command(sub)
    add_drift_command(sub)
    add_report_command(sub)
    add_bench_command(sub)
    add_test_command(sub)
    add_train_command(sub)
    add_step_command(sub)
    add_plan_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_on_unknown", False):
        parser.parse_args(argv)  # argparse's own error (exit 2): only `ringcheck test` passes arguments on (to pytest)
    args.passed_on = unknown
    args.argv = argv
    args.where = where_to_rerun(environ_as_started(os.environ))  # the user's PYTHONPATH, not the workers' pin
    # under torchrun every rank runs this: one of them (rank 0) says what went wrong
    # (a subprocess of a rank inherits the launcher's variables but is no rank: it speaks for itself)
    speaks = not launched_rank(os.environ) or os.environ.get("RANK", "0") == "0"
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

