"""`ringcheck step`: its flags, the re-run command, the run, the report."""

from __future__ import annotations

import argparse
import dataclasses

from ..commands.step import EXIT_OF, check_before_start, default_cases, narrowed_for, report_dict, run_step
from ..harness import ImplOptions, Mesh
from ..harness.runner import loaded
from ..render.step_report import print_step_summary, write_step_reports
from ..step.cases import CASES, case_names
from ..step.contract import BUILTIN_RECIPES, load_recipe
from ..step.run import ATTENTION_DTYPES, StepConfig
from .common import (
    UsageError,
    add_run_flags,
    add_world_size,
    conclude,
    judged_on,
    rerun_line,
    ring_command,
    torchrun_ring,
)
from .step_model import add_model_flags, cmd_step_model
from .validate import short_failures

DEFAULT_TIMEOUT_S = 60.0
DESCRIPTION = ("Run a recipe's training step (its sharding, labels, loss reduction and gradient sync) at CP=P and at "
               "CP=1 on every case, in float64, and judge the loss and every parameter's gradient within a float64 "
               "budget; a failure is diagnosed as the bug class its figures match. Exit 0 if consistent, 1 if not, 2 "
               "if no verdict.")


def step_config(args: argparse.Namespace, world: int | None = None) -> StepConfig:
    """The run's settings from the flags; under torchrun (`world`) without --mesh the ring is
    --world-size ranks (default: the whole world), k rings of it the mesh dp=k,cp=P. A ring that
    cannot run the step's dtype (flash-attn's: bf16 and fp16) is called in the first dtype it
    runs unless --attention-dtype says which (the report says so)."""
    try:
        recipe = load_recipe(args.recipe)
        options = ImplOptions(args.impl, args.layout or "zigzag", args.backend, stand_in=args.flash_attn_stand_in)
        impl = loaded(options)
        narrow = args.attention_dtype or narrowed_for(impl, args.dtype)
        values = {"recipe": args.recipe, "impl": args.impl, "layout": args.layout or "zigzag", "dtype": args.dtype,
                  "seed": args.seed, "backend": args.backend, "attention_dtype": narrow,
                  "flash_attn_stand_in": args.flash_attn_stand_in}
        mesh, ring = args.mesh, args.world_size
        if mesh is not None and ring is None:
            ring = Mesh.parse(mesh).cp
        if world is not None and mesh is None:
            ring, mesh = torchrun_ring(world, ring)
        config = StepConfig(world_size=ring or 4, mesh=mesh, **values)
        cases = default_cases(recipe, impl, config) if args.cases is None else case_names(args.cases)
        return dataclasses.replace(config, cases=cases)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(config: StepConfig, timeout: float, *, torchrun: bool = False, world: int | None = None,
                  prefix: str = "") -> str:
    return rerun_line("step", config.flags(), timeout, torchrun=torchrun, ranks=world or config.mesh_spec.size,
                      prefix=prefix)


def add_step_command(sub) -> None:
    p = sub.add_parser("step", help="is your own training step the same at CP=P as at CP=1?", description=DESCRIPTION)
    p.add_argument("--recipe", default="plain",
                   help=f"the recipe: {', '.join(BUILTIN_RECIPES)} (built in) or package.module:object (default plain)")
    p.add_argument("--impl", default="ringcheck", help="the ring the recipe's attention goes through (default "
                                                       "ringcheck; the names of validate --impl)")
    add_world_size(p)
    p.add_argument("--mesh", metavar="DIM=N,...", help="the device mesh, one dim named cp (e.g. dp=2,cp=2); the "
                                                       "reference is the same mesh with cp=1")
    p.add_argument("--layout", default=None, help="sequence layout of the shards (default zigzag; with --model the "
                                                  "glue's own: ringcheck's glue contiguous, or zigzag, ...)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                   help="default dtype of the model and the step (default float64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the cases (default 0)")
    p.add_argument("--cases", metavar="NAME,...", default=None,
                   help=f"cases to run (default every one the recipe offers): {', '.join(CASES)}")
    p.add_argument("--backend", default="torch", help="block backend of our ring (--impl ringcheck): torch (default)")
    p.add_argument("--attention-dtype", dest="attention_dtype", choices=list(ATTENTION_DTYPES), default=None,
                   help="call the ring in this narrower dtype (q, k, v cast in, out cast back; the model and the step "
                        "stay in --dtype), judged within a budget measured from noise runs (default: the step's dtype, "
                        "or the first dtype the ring runs when it cannot run that: bfloat16 for flash-attn's rings)")
    p.add_argument("--flash-attn-stand-in", dest="flash_attn_stand_in", action="store_true",
                   help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in on "
                        "every rank (for ring_flash_attn:* and yunchang:* on CPU)")
    add_model_flags(p)
    add_run_flags(p, "write step.json and step.md to DIR", DEFAULT_TIMEOUT_S)
    p.set_defaults(func=_cmd_step)


def _checked(config: StepConfig) -> None:
    try:
        check_before_start(config)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


def _settled(args: argparse.Namespace, world: int | None) -> StepConfig:
    """The config, checked before any rank starts; under torchrun (`world`) the world's."""
    config = step_config(args, world)
    _checked(config)
    if world is not None and config.mesh_spec.size != world:
        raise UsageError(f"mesh {config.mesh_spec.text} has {config.mesh_spec.size} ranks but the torchrun world has "
                         f"{world}: launch torchrun --nproc-per-node={config.mesh_spec.size}")
    return config


def _cmd_step(args: argparse.Namespace) -> int:
    if args.model is not None:  # a transformers model through a glue, against its own attention
        return cmd_step_model(args)
    if args.glue is not None:
        raise UsageError("--glue is the glue of a --model; a recipe's attention goes through --impl")
    with ring_command(args, DEFAULT_TIMEOUT_S, EXIT_OF, lambda world: _settled(args, world)) as run:
        config, ring = run.config, run.ring
        command = rerun_command(config, run.timeout, torchrun=ring.is_torchrun, world=ring.size, prefix=run.prefix)
        if ring.is_main and not args.quiet:
            run.console.print(command, markup=False, highlight=False, soft_wrap=True)
        judged = judged_on(lambda: run_step(config, ring), lambda exc: UsageError(
            "the recipe's step did not complete on every rank:\n" + short_failures(exc)))
    return conclude(args, run, judged, lambda meta: report_dict(config, judged, command, meta=meta),
                    print_step_summary, write_step_reports, EXIT_OF)
