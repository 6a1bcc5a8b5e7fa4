"""`ringcheck step --model NAME [--glue GLUE]`: the flags' settings, the run, the report.

`ringcheck step` hands its arguments here when --model is given (`cmd_step_model`); the frame
(local rings or the torchrun world, --timeout, --report, exit codes) is step's."""

from __future__ import annotations

import argparse

from ..commands.step_model import (
    EXIT_OF,
    check_model_before_start,
    default_model_cases,
    model_report_dict,
    run_model_step,
)
from ..glues.loader import BUILT_IN
from ..harness import Mesh
from ..models.step import DEFAULT_GLUE, ModelStepConfig
from ..render.model_report import print_model_summary, write_model_reports
from ..trainers import TRAINER_GLUES
from .common import UsageError, conclude, judged_on, rerun_line, ring_command, torchrun_ring
from .validate import short_failures

DEFAULT_TIMEOUT_S = 60.0
# step's flags that belong to the recipe path: with --model they would be silently ignored
RECIPE_ONLY = {"recipe": "plain", "impl": "ringcheck", "backend": "torch", "attention_dtype": None,
               "flash_attn_stand_in": False}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="NAME",
                   help="judge a transformers decoder instead of a recipe: a model_type (llama, qwen3, gpt_oss, ...) "
                        "or a path to a config.json; a tiny model of it runs through --glue at CP=P against its own "
                        "eager attention at CP=1")
    others = [g for g in (*BUILT_IN, *TRAINER_GLUES) if g != DEFAULT_GLUE]
    p.add_argument("--glue", default=None, metavar="GLUE",
                   help=f"with --model, the glue between the model's attention and the ring: {DEFAULT_GLUE} "
                        f"(default), {', '.join(others)} (the trainers' glues as they ship: "
                        f"docs/how-to/trainer-glue.md), or PKG.MOD:OBJ (see docs/reference/glue-contract.md)")


def model_config(args: argparse.Namespace, world: int | None = None) -> ModelStepConfig:
    """The settings of a --model run from the flags (step's meaning of --world-size, --mesh and
    torchrun's world); the recipe path's flags are refused, not ignored."""
    stray = [f"--{k.replace('_', '-')}" for k, v in RECIPE_ONLY.items() if getattr(args, k, v) != v]
    if stray:
        raise UsageError(f"--model runs ringcheck's own step around the model, through --glue: {', '.join(stray)} "
                         f"belong to a recipe's step; drop them (a recipe around a transformers model: see "
                         f"docs/how-to/model-glue.md)")
    try:
        mesh, ring = args.mesh, args.world_size
        if mesh is not None and ring is None:
            ring = Mesh.parse(mesh).cp
        if world is not None and mesh is None:
            ring, mesh = torchrun_ring(world, ring)
        return ModelStepConfig(model=args.model, glue=args.glue or DEFAULT_GLUE, world_size=ring or 4, mesh=mesh,
                               layout=args.layout, dtype=args.dtype, seed=args.seed,
                               cases=default_model_cases(args.cases))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


def _settled(args: argparse.Namespace, world: int | None):
    config = model_config(args, world)
    try:
        checked = check_model_before_start(config)
    except (ValueError, TypeError, RuntimeError, ImportError) as exc:
        raise UsageError(str(exc)) from exc
    if world is not None and config.mesh_spec.size != world:
        raise UsageError(f"mesh {config.mesh_spec.text} has {config.mesh_spec.size} ranks but the torchrun world has "
                         f"{world}: launch torchrun --nproc-per-node={config.mesh_spec.size}")
    return config, checked


def cmd_step_model(args: argparse.Namespace) -> int:
    with ring_command(args, DEFAULT_TIMEOUT_S, EXIT_OF, lambda world: _settled(args, world)) as run:
        (config, checked), ring = run.config, run.ring
        command = rerun_line("step", config.flags(), run.timeout, torchrun=ring.is_torchrun,
                             ranks=ring.size or config.mesh_spec.size, prefix=run.prefix)
        if ring.is_main and not args.quiet:
            run.console.print(command, markup=False, highlight=False, soft_wrap=True)
        judged = judged_on(lambda: run_model_step(config, ring, checked), lambda exc: UsageError(
            "the model's step did not complete on every rank:\n" + short_failures(exc)))
    return conclude(args, run, judged, lambda meta: model_report_dict(config, judged, command, meta=meta),
                    print_model_summary, write_model_reports, EXIT_OF)
