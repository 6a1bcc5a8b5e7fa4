"""What every command of the CLI shares: exit codes, the usage error, the document meta, list flags."""

from __future__ import annotations

import argparse
import shlex
import time

from ..documents import meta

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SILENT_RANK_GRACE_S = 2.0  # under torchrun, how long a rank that failed quietly waits for rank 0 to speak


class UsageError(Exception):
    """Something the user must fix; printed without a traceback, exit code 2."""


def command_meta(args: argparse.Namespace, start: float, **extra) -> dict:
    """The `meta` of this command's document (`ringcheck.documents.meta`), `start` its
    `time.perf_counter()` when the work began."""
    return meta("ringcheck " + shlex.join(args.argv), elapsed_s=time.perf_counter() - start, **extra)


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress display (it is off anyway when stdout is not a terminal)")


def shows_progress(args: argparse.Namespace, console) -> bool:
    """Whether this run shows progress: not --quiet, and stdout a terminal (read here, at the edge)."""
    return not args.quiet and console.is_terminal


def list_of(kind):
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
