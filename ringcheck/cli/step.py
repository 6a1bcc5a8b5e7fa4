"""`ringcheck step`: its flags, the re-run command, the run, the report."""

from __future__ import annotations

import argparse
import os
import shlex
import time

from ..commands.step import EXIT_OF, check_before_start, default_cases, report_dict, run_step
from ..harness import ImplOptions, Mesh
from ..launch import RingError, open_ring
from ..render.step_report import print_step_summary, write_step_reports
from ..render.terminal import make_console
from ..step.cases import CASES, case_names
from ..step.contract import BUILTIN_RECIPES, load_recipe
from ..step.run import StepConfig
from .common import UsageError, add_log_dir, add_quiet, command_meta, present, timeout_of
from .validate import short_failures, where_to_rerun

DEFAULT_TIMEOUT_S = 60.0


def step_config(args: argparse.Namespace, world: int | None = None) -> StepConfig:
    """The run's settings from the flags; under torchrun (`world`) without --mesh the ring is
    --world-size ranks (default: the whole world), k rings of it the mesh dp=k,cp=P."""
    try:
        recipe = load_recipe(args.recipe)
        impl = ImplOptions(args.impl, args.layout, args.backend).load()
        cases = default_cases(recipe, impl) if args.cases is None else case_names(args.cases)
        values = {"recipe": args.recipe, "impl": args.impl, "layout": args.layout, "dtype": args.dtype,
                  "seed": args.seed, "cases": cases, "backend": args.backend}
        mesh, ring = args.mesh, args.world_size
        if mesh is not None and ring is None:
            ring = Mesh.parse(mesh).cp
        if world is not None and mesh is None:
            ring = ring or world
            if world % ring:
                raise UsageError(f"the torchrun world has {world} ranks, not a multiple of --world-size {ring}: pass "
                                 f"--mesh (e.g. --mesh dp={max(world // ring, 1)},cp={ring})")
            mesh = f"dp={world // ring},cp={ring}" if world != ring else None
        return StepConfig(world_size=ring or 4, mesh=mesh, **values)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(config: StepConfig, timeout: float, *, torchrun: bool = False, world: int | None = None,
                  prefix: str = "") -> str:
    head = (f"torchrun --nproc-per-node={world or config.mesh_spec.size} -m ringcheck step" if torchrun
            else "ringcheck step")
    return prefix + head + " " + shlex.join([*config.flags(), "--timeout", f"{timeout:g}"])


def _checked(config: StepConfig) -> None:
    try:
        check_before_start(config)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


def _cmd_step(args: argparse.Namespace) -> int:
    prefix = where_to_rerun(os.environ)
    timeout = timeout_of(args, DEFAULT_TIMEOUT_S)
    config = step_config(args)
    _checked(config)
    console = make_console()
    start = time.perf_counter()
    ring = open_ring(timeout=timeout, environ=os.environ, log_dir=args.log_dir, stuck_exit_code=EXIT_OF["no verdict"])
    try:
        if ring.is_torchrun:
            config = step_config(args, ring.size)
            _checked(config)
            if config.mesh_spec.size != ring.size:
                raise UsageError(f"mesh {config.mesh_spec.text} has {config.mesh_spec.size} ranks but the torchrun "
                                 f"world has {ring.size}: launch torchrun --nproc-per-node={config.mesh_spec.size}")
        command = rerun_command(config, timeout, torchrun=ring.is_torchrun, world=ring.size, prefix=prefix)
        if ring.is_main and not args.quiet:
            console.print(command, markup=False, highlight=False, soft_wrap=True)
        try:
            judged = run_step(config, ring)
        except RingError as exc:
            raise UsageError("the recipe's step did not complete on every rank:\n" + short_failures(exc)) from exc
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from exc
    finally:
        ring.close()
    if not ring.is_main:
        return EXIT_OF[judged["verdict"]]
    report = report_dict(config, judged, command, meta=command_meta(args, start))
    present(report, console, args.report, print_step_summary, write_step_reports)
    return EXIT_OF[report["verdict"]]


def _add_step(sub) -> None:
    p = sub.add_parser("step", help="is your own training step the same at CP=P as at CP=1?",
                       description="Run a recipe's training step (its sharding, labels, loss reduction and gradient "
                                   "sync) at CP=P and at CP=1 on every case, in float64, and judge the loss and every "
                                   "parameter's gradient within a float64 budget; a failure is diagnosed as the bug "
                                   "class its figures match. Exit 0 if consistent, 1 if not, 2 if no verdict.")
    p.add_argument("--recipe", default="plain",
                   help=f"the recipe: {', '.join(BUILTIN_RECIPES)} (built in) or package.module:object (default plain)")
    p.add_argument("--impl", default="ringcheck", help="the ring the recipe's attention goes through (default "
                                                       "ringcheck; the names of validate --impl)")
    p.add_argument("--world-size", dest="world_size", type=int, default=None,
                   help="ranks of the ring, the mesh's cp dim (default 4; under torchrun without --mesh: the world)")
    p.add_argument("--mesh", metavar="DIM=N,...", help="the device mesh, one dim named cp (e.g. dp=2,cp=2); the "
                                                       "reference is the same mesh with cp=1")
    p.add_argument("--layout", default="zigzag", help="sequence layout of the shards (default zigzag)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                   help="default dtype of the model and the step (default float64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the cases (default 0)")
    p.add_argument("--cases", metavar="NAME,...", default=None,
                   help=f"cases to run (default every one the recipe offers): {', '.join(CASES)}")
    p.add_argument("--backend", default="torch", help="block backend of our ring (--impl ringcheck): torch (default)")
    p.add_argument("--report", metavar="DIR", help="write step.json and step.md to DIR")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds any rank may wait on another (default {DEFAULT_TIMEOUT_S:g})")
    add_log_dir(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_step)
