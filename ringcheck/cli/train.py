"""`ringcheck train`: its flags, the re-run command, the run, the report."""

from __future__ import annotations

import argparse

from ..commands.train import EXIT_OF, check_impl, impl_options, placement, report_dict, run_steps_total, run_train
from ..harness import Mesh
from ..render.files import write_train_reports
from ..render.terminal import progress
from ..render.train_terminal import print_train_summary
from ..train.config import PRESETS, TrainConfig
from .common import (
    UsageError,
    add_run_flags,
    add_variant_flags,
    add_world_size,
    conclude,
    judged_on,
    rerun_line,
    ring_command,
    shows_progress,
    torchrun_ring,
)
from .validate import incomplete_run

DEFAULT_TIMEOUT_S = 60.0
# the flags that name a field of `TrainConfig` (argparse dest = field name)
_CONFIG_FLAGS = ("impl", "layout", "world_size", "mesh", "dtype", "steps", "seed", "model", "layers", "heads",
                 "kv_heads", "head_dim", "seq_len", "batch", "documents", "pad", "window", "softcap", "sinks",
                 "sinks_grad", "backend", "flash_attn_stand_in")


def train_config(args: argparse.Namespace, world: int | None = None) -> TrainConfig:
    """The run's settings from the flags (unset ones: the defaults, the preset's shape). Under
    torchrun (`world`: its size) without --mesh the ring is --world-size ranks (default: the
    whole world), and a world of k rings is the data-parallel mesh dp=k,cp=P."""
    if getattr(args, "head_dim_v", None) is not None:
        raise UsageError(f"--head-dim-v {args.head_dim_v}: train's model has one head dim for q, k and v; drop it "
                         f"(validate judges a value head dim of its own)")
    values = {name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name) is not None}
    values["pad"] = values.get("pad") or 0
    values["sinks"] = bool(values.get("sinks"))
    values["flash_attn_stand_in"] = bool(values.get("flash_attn_stand_in"))
    try:
        if values.get("mesh") is not None and "world_size" not in values:  # the mesh's cp dim is the ring
            values["world_size"] = Mesh.parse(values["mesh"]).cp
        if world is not None and values.get("mesh") is None:
            values["world_size"], mesh = torchrun_ring(world, values.get("world_size"))
            if mesh is not None:
                values["mesh"] = mesh
        return TrainConfig(**values)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(config: TrainConfig, timeout: float, *, torchrun: bool = False, world: int | None = None,
                  prefix: str = "") -> str:
    """The command that repeats this run exactly: every setting as a flag (the preset's shape
    spelled out) and the timeout; under torchrun, its launch on `world` ranks."""
    return rerun_line("train", config.flags(), timeout, torchrun=torchrun, ranks=world or config.mesh_spec.size,
                      prefix=prefix)


def _check_before_start(config: TrainConfig) -> None:
    """An unknown or malformed --impl, or settings it cannot run: exit 2 before any rank starts."""
    if config.flash_attn_stand_in:
        # start-up time: the stand-in is imported only when asked for (before the implementation)
        from ..flash_stand_in import install

        install()
    try:
        options = impl_options(config)
        impl = options.load()
        check_impl(impl, config)
        placement(config, None, impl.world_only)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from exc


def _settled(args: argparse.Namespace, world: int | None) -> TrainConfig:
    """The config, checked before any rank starts; under torchrun (`world`) the world's."""
    config = train_config(args, world)
    _check_before_start(config)
    if world is not None:
        try:
            placement(config, world, None)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    return config


def _cmd_train(args: argparse.Namespace) -> int:
    with ring_command(args, DEFAULT_TIMEOUT_S, EXIT_OF, lambda world: _settled(args, world)) as run:
        config, ring, console = run.config, run.ring, run.console
        main = ring.is_main
        command = rerun_command(config, run.timeout, torchrun=ring.is_torchrun, world=ring.size, prefix=run.prefix)
        if main:
            console.print(command, markup=False, highlight=False, soft_wrap=True)
            console.print(f"{config.describe()}; {config.mesh_spec.describe()}", markup=False, highlight=False)
        shows = main and shows_progress(args, console)
        with progress(run_steps_total(config), console, enabled=shows, label="training", announce=False) as advance:
            judged = judged_on(lambda: run_train(config, ring, progress=advance if shows else None),
                               lambda exc: incomplete_run(exc, args.log_dir))
    return conclude(args, run, judged, lambda meta: report_dict(config, judged, command, meta=meta),
                    print_train_summary, write_train_reports, EXIT_OF)


def add_train_command(sub) -> None:
    p = sub.add_parser("train", help="does training under this ring match training without it?",
                       description="Train a small Llama-style model with the ring (ours by default, or --impl) on "
                                   "every rank of a mesh and on one device, and judge the ring's step-0 gradients "
                                   "and loss trajectory against the measured noise floor of legitimate single-device "
                                   "runs; exit 0 if indistinguishable, 1 if not, 2 if no verdict could be reached.")
    p.add_argument("--impl", help="implementation: ringcheck (default), ring_attention_pytorch, torch_cp, "
                                  "ring_flash_attn:zigzag|basic|stripe|llama3, yunchang:..., or package.module:function")
    p.add_argument("--layout", metavar="LAYOUT", help="sequence layout: contiguous, zigzag (default), striped, "
                                                      "zigzag_docs (needs --documents), or a custom package.module:FN")
    add_world_size(p)
    p.add_argument("--mesh", metavar="DIM=N,...",
                   help="the device mesh, outermost dim first, one dim named cp (the ring), e.g. dp=2,cp=4 or cp=4,tp=2: "
                        "every CP group trains on its own sequences of the global batch and every gradient is summed "
                        "over the whole mesh, as data parallelism does (default: one ring, cp=P)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="training dtype (default bfloat16; float32 master weights either way)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    p.add_argument("--seed", type=int, help="seed of the initialisation and the data (default 0)")
    p.add_argument("--model", choices=sorted(PRESETS), help="model and data preset (default tiny: CPU CI-sized)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--heads", type=int, help="query heads (default: the preset's)")
    p.add_argument("--kv-heads", dest="kv_heads", type=int,
                   help="K/V heads (default: the preset's; equal to --heads for an MHA-only ring)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="head dim, even (default: the preset's)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--batch", type=int, help="sequences per CP group and step (default: the preset's)")
    add_variant_flags(p, unset=True)
    p.add_argument("--sinks-grad", dest="sinks_grad", choices=["partial", "reduced"],
                   help="with --sinks, what each rank's sinks.grad holds: partial (default: its own rows' share; train "
                        "sums it over the mesh, as Megatron-LM and torchtitan do) or reduced (the ring already summed "
                        "it over its CP group; train sums it over the replicas only)")
    p.add_argument("--backend", help="block backend of our ring (--impl ringcheck): torch (default), triton, flash_attn")
    p.add_argument("--flash-attn-stand-in", dest="flash_attn_stand_in", action="store_true", default=None,
                   help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in on "
                        "every rank (for ring_flash_attn:* and yunchang:* on CPU)")
    add_run_flags(p, "write train.json, train.md and train.html (with plots) to DIR", DEFAULT_TIMEOUT_S)
    p.set_defaults(func=_cmd_train)
