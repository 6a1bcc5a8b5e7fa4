"""What every command of the CLI shares: exit codes, the usage error, the document meta, list flags."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..documents import meta
from ..judge.variant_options import VariantOptions, parse_documents, parse_window
from ..launch import from_torchrun_env, open_ring
from ..launch.environment import DEVICE_VARIABLE, DEVICES
from ..render.terminal import make_console
from ..spec import check_timeout

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SILENT_RANK_GRACE_S = 2.0  # under torchrun, how long a rank that failed quietly waits for rank 0 to speak


class UsageError(Exception):
    """Something the user must fix; printed without a traceback, exit code 2."""


def command_meta(args: argparse.Namespace, start: float, **extra) -> dict:
    """The `meta` of this command's document (`ringcheck.documents.meta`), `start` its
    `time.perf_counter()` when the work began; its command reproduces the run from anywhere
    (`where_to_rerun`, read by `cli.main` into ``args.where``)."""
    return meta(getattr(args, "where", "") + "ringcheck " + shlex.join(args.argv),
                elapsed_s=time.perf_counter() - start, **extra)


def where_to_rerun(environ, sys_path: list[str] | None = None) -> str:
    """The part of a re-run command before `ringcheck` that makes it reproduce this run from
    anywhere: the working directory, and the PYTHONPATH that let the ranks import the user's
    modules (made absolute; with the working directory in it where this process imports from
    there, as `python -m ringcheck` does), read once here at the edge."""
    cwd = os.getcwd()
    paths = [str(Path(cwd, p).resolve()) for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if {"", cwd} & set(sys.path if sys_path is None else sys_path) and cwd not in paths:
        paths.insert(0, cwd)  # this process imports from its working directory (python -m ringcheck)
    return f"cd {shlex.quote(cwd)} && " + (f"PYTHONPATH={shlex.quote(os.pathsep.join(paths))} " if paths else "")


def timeout_of(args: argparse.Namespace, default: float) -> float:
    """--timeout (seconds any rank may wait on another; `default` when unset), checked."""
    try:
        return check_timeout(default if args.timeout is None else args.timeout)
    except ValueError as exc:
        raise UsageError(f"--timeout: {exc}") from exc


def present(report: dict, console, out_dir: str | None, summary, write) -> None:
    """A command's summary on the console, and with `out_dir` its report files (`write(report,
    out_dir)` -> their paths), named in one line."""
    summary(report, console)
    if out_dir:
        paths = [str(p) for p in write(report, out_dir).values()]
        named = paths[0] if len(paths) == 1 else ", ".join(paths[:-1]) + " and " + paths[-1]
        console.print(f"report written to {named}")


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress display (it is off anyway when stdout is not a terminal)")


def add_log_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-dir", dest="log_dir", metavar="DIR", default=None,
                        help="write each rank's full output, traceback and ring-step trace (step, source rank, "
                             "bytes sent and received, time per step) to DIR/rank<G>.log, G its global rank")


def add_world_size(parser: argparse.ArgumentParser) -> None:
    """--world-size of the commands whose ring is the cp dim of a mesh (train, step)."""
    parser.add_argument("--world-size", dest="world_size", type=int, default=None,
                        help="ranks of the ring, the mesh's cp dim (default 4; under torchrun without --mesh: the world)")


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help=f"where each rank computes: auto (under torchrun the rank's GPU where CUDA is available, "
                             f"else the CPU), cpu (a gloo world, also on a machine with GPUs), cuda (the rank's GPU, "
                             f"NCCL; torchrun only). Local rings are gloo processes on the CPU (default: "
                             f"${DEVICE_VARIABLE}, else auto)")


def add_run_flags(parser: argparse.ArgumentParser, report: str, default_timeout: float) -> None:
    """The flags every command that runs rings ends with: --report (`report`: what it writes),
    --timeout, --device, --log-dir, -q."""
    parser.add_argument("--report", metavar="DIR", help=report)
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds any rank may wait on another (default {default_timeout:g})")
    add_device(parser)
    add_log_dir(parser)
    add_quiet(parser)


def open_rings(args: argparse.Namespace, timeout: float | None, stuck_exit_code: int, *, backend: str | None = None,
               impl: str | None = None):
    """`open_ring` for a command: --device (else $RINGCHECK_DEVICE, read here at the edge), and
    what ranks on the CPU cannot run refused first, in one line (`cpu_ranks_refusal`: a CUDA-only
    `backend` or `impl` on local rings, or under --device cpu, where the machine has GPUs)."""
    # start-up time: the device choice imports torch, and only a command that runs rings gets here
    from ..flash_stand_in import active
    from ..launch.devices import DeviceError, cpu_ranks_refusal, probe

    device = getattr(args, "device", None) or os.environ.get(DEVICE_VARIABLE, "auto")
    if device not in DEVICES:
        raise UsageError(f"{DEVICE_VARIABLE}={device!r} is not a device choice; set one of {', '.join(DEVICES)}")
    torchrun = from_torchrun_env(os.environ) is not None
    gpus = probe(os.environ)
    if not torchrun or device == "cpu":
        flash_based = (impl or "").split(":")[0] in ("ring_flash_attn", "yunchang") and not active()
        refused = cpu_ranks_refusal(gpus, torchrun=torchrun, backend=backend, impl=impl, impl_needs_cuda=flash_based,
                                    interpreted=os.environ.get("TRITON_INTERPRET") == "1")
        if refused:
            raise UsageError(refused)
    try:
        return open_ring(timeout=timeout, environ=os.environ, log_dir=args.log_dir, stuck_exit_code=stuck_exit_code,
                         device=device, accelerators=gpus)
    except (DeviceError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


def torchrun_ring(world: int, ring: int | None) -> tuple[int, str | None]:
    """Under torchrun without --mesh: the ring (--world-size `ring`, default the whole `world`)
    and the mesh of a world of k rings, dp=k,cp=P (None for one ring)."""
    ring = ring or world
    if world % ring:
        k = max(world // ring, 1)
        raise UsageError(f"the torchrun world has {world} ranks, not a multiple of --world-size {ring}: pass --mesh "
                         f"(e.g. --mesh dp={k},cp={ring} on {k * ring} ranks)")
    return ring, (f"dp={world // ring},cp={ring}" if world != ring else None)


def rerun_line(command: str, flags: list[str], timeout: float, *, torchrun: bool, ranks: int, prefix: str = "") -> str:
    """The command that repeats a run exactly: every setting as a flag and the timeout; under
    torchrun, its launch on `ranks` ranks."""
    head = f"torchrun --nproc-per-node={ranks} -m ringcheck {command}" if torchrun else f"ringcheck {command}"
    return prefix + head + " " + shlex.join([*flags, "--timeout", f"{timeout:g}"])


def judged_on(run, incomplete):
    """`run()`'s verdict, its failures as the user's: a run that did not complete on every rank
    (a `RingError`) as `incomplete(error)`, a setting it refused as a `UsageError`."""
    # start-up time: the launchers import torch, and only a command that runs rings gets here
    from ..launch import RingError
    from ..launch.audit import DeviceDefect

    try:
        return run()
    except RingError as exc:
        raise incomplete(exc) from exc
    except DeviceDefect as exc:  # the device audit found ringcheck's own code at fault
        raise UsageError(f"ringcheck's own code would fail on a GPU: {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


@dataclass
class RingRun:
    """A command's run on rings (`ring_command`): the re-run prefix, the timeout, the console,
    when the work began, the rings (local or the torchrun world) and the settled config."""

    prefix: str
    timeout: float
    console: Any
    start: float
    ring: Any
    config: Any


@contextlib.contextmanager
def ring_command(args: argparse.Namespace, default_timeout: float, exit_of: dict[str, int], settle):
    """The frame of a command that runs rings (train, step): the re-run prefix (read before the
    launcher pins its package on the PYTHONPATH), --timeout, the config `settle(None)` makes and
    checks before any rank starts, the rings opened, under torchrun the config settled again
    for the world (`settle(size)`), and the rings closed after the block (also on an error)."""
    prefix = where_to_rerun(os.environ)
    timeout = timeout_of(args, default_timeout)
    config = settle(None)
    console = make_console()
    start = time.perf_counter()
    ring = open_rings(args, timeout, exit_of["no verdict"], backend=getattr(args, "backend", None),
                      impl=getattr(args, "impl", None))
    try:
        if ring.is_torchrun:
            config = settle(ring.size)
        yield RingRun(prefix, timeout, console, start, ring, config)
    finally:
        ring.close()


def conclude(args: argparse.Namespace, run: RingRun, judged: dict, report_of, summary, write,
             exit_of: dict[str, int]) -> int:
    """The end of a command on rings: a rank other than rank 0 returns its exit code alone; rank
    0 makes the document (`report_of(meta)`), prints its summary, writes its report files."""
    if not run.ring.is_main:
        return exit_of[judged["verdict"]]
    report = report_of(command_meta(args, run.start))
    present(report, run.console, args.report, summary, write)
    return exit_of[report["verdict"]]


def log_files_note(log_dir: str | None, error: Exception | None = None) -> str:
    """The line that names the per-rank logs (of the failing ranks, from a `RingError`), or ""."""
    if not log_dir:
        return ""
    ranks = sorted(getattr(error, "global_ranks", {}).values())
    which = ", ".join(f"{Path(log_dir) / f'rank{r}.log'}" for r in ranks) if ranks else f"{log_dir}/rank<G>.log"
    return f"the whole story of each rank (output, traceback, ring-step trace): {which}"


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
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from exc
    return parse


def _checked(parse):
    """An argparse type from a parser that raises ValueError with the message to show."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    check.__name__ = parse.__name__
    return check


def add_variant_flags(parser: argparse.ArgumentParser, *, unset=False) -> None:
    """The attention-variant flags (`ringcheck.judge.variant_options`), one meaning everywhere.
    With `unset`, --pad and --sinks default to None (so a config file's values stand)."""
    g = parser.add_argument_group("attention variants (default: plain attention)")
    g.add_argument("--documents", type=_checked(parse_documents), default=None, metavar="LEN,LEN,...|random:K",
                   help="packed documents: explicit lengths (with --pad they add up to the sequence length) or K "
                        "seeded random ones that include boundaries on a rank and a chunk boundary")
    g.add_argument("--pad", type=int, default=None if unset else 0, metavar="N",
                   help="padding tokens after the last document")
    g.add_argument("--window", type=_checked(parse_window), default=None, metavar="LEFT,RIGHT",
                   help="sliding window: query i sees keys i-LEFT..i+RIGHT (-1: unbounded)")
    g.add_argument("--softcap", type=float, default=None, metavar="X", help="logit softcap X tanh(s / X)")
    g.add_argument("--sinks", action="store_true", default=None if unset else False,
                   help="seeded per-head sink logits around ln(seq_len)")
    g.add_argument("--head-dim-v", type=int, default=None, metavar="D", help="value head dim (default: head dim)")


def variant_options(args: argparse.Namespace) -> VariantOptions:
    """The `VariantOptions` of parsed variant flags."""
    return VariantOptions(documents=args.documents, pad=args.pad, window=args.window, softcap=args.softcap,
                          sinks=args.sinks, head_dim_v=args.head_dim_v)
