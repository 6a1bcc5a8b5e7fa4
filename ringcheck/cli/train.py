"""`ringcheck train`: its flags, the re-run command, the run, the report."""

from __future__ import annotations

import argparse
import os
import shlex
import time

from ..commands.train import EXIT_OF, check_impl, impl_options, placement, report_dict, run_steps_total, run_train
from ..harness import Mesh
from ..launch import RingError, open_ring
from ..render.files import write_train_reports
from ..render.terminal import make_console, progress
from ..render.train_terminal import print_train_summary
from ..train.config import PRESETS, TrainConfig
from .common import (
    UsageError,
    add_log_dir,
    add_quiet,
    add_variant_flags,
    command_meta,
    present,
    shows_progress,
    timeout_of,
)
from .validate import incomplete_run, where_to_rerun

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
            ring = values.setdefault("world_size", world)
            if world != ring:
                if world % ring:
                    raise UsageError(f"the torchrun world has {world} ranks, not a multiple of --world-size {ring}: "
                                     f"pass --mesh (e.g. --mesh dp={max(world // ring, 1)},cp={ring} on "
                                     f"{max(world // ring, 1) * ring} ranks)")
                values["mesh"] = f"dp={world // ring},cp={ring}"
        return TrainConfig(**values)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def rerun_command(config: TrainConfig, timeout: float, *, torchrun: bool = False, world: int | None = None,
                  prefix: str = "") -> str:
    """The command that repeats this run exactly: every setting as a flag (the preset's shape
    spelled out) and the timeout; under torchrun, its launch on `world` ranks."""
    head = (f"torchrun --nproc-per-node={world or config.mesh_spec.size} -m ringcheck train" if torchrun
            else "ringcheck train")
    return prefix + head + " " + shlex.join([*config.flags(), "--timeout", f"{timeout:g}"])


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


def _cmd_train(args: argparse.Namespace) -> int:
    prefix = where_to_rerun(os.environ)  # before the launcher pins its package on the PYTHONPATH
    timeout = timeout_of(args, DEFAULT_TIMEOUT_S)
    config = train_config(args)
    _check_before_start(config)
    console = make_console()
    start = time.perf_counter()
    ring = open_ring(timeout=timeout, environ=os.environ, log_dir=args.log_dir, stuck_exit_code=EXIT_OF["no verdict"])
    try:
        if ring.is_torchrun:
            config = train_config(args, ring.size)
            _check_before_start(config)
            try:
                placement(config, ring.size, None)
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
        main = ring.is_main
        command = rerun_command(config, timeout, torchrun=ring.is_torchrun, world=ring.size, prefix=prefix)
        if main:
            console.print(command, markup=False, highlight=False, soft_wrap=True)
            console.print(f"{config.describe()}; {config.mesh_spec.describe()}", markup=False, highlight=False)
        shows = main and shows_progress(args, console)
        with progress(run_steps_total(config), console, enabled=shows, label="training", announce=False) as advance:
            try:
                judged = run_train(config, ring, progress=advance if shows else None)
            except RingError as exc:
                raise incomplete_run(exc, args.log_dir) from exc
            except (ValueError, TypeError) as exc:
                raise UsageError(str(exc)) from exc
    finally:
        ring.close()
    if not main:
        return EXIT_OF[judged["verdict"]]
    report = report_dict(config, judged, command, meta=command_meta(args, start))
    present(report, console, args.report, print_train_summary, write_train_reports)
    return EXIT_OF[report["verdict"]]


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="does training under this ring match training without it?",
                       description="Train a small Llama-style model with the ring (ours by default, or --impl) on "
                                   "every rank of a mesh and on one device, and judge the ring's step-0 gradients "
                                   "and loss trajectory against the measured noise floor of legitimate single-device "
                                   "runs; exit 0 if indistinguishable, 1 if not, 2 if no verdict could be reached.")
    p.add_argument("--impl", help="implementation: ringcheck (default), ring_attention_pytorch, torch_cp, "
                                  "ring_flash_attn:zigzag|basic|stripe|llama3, yunchang:..., or package.module:function")
    p.add_argument("--layout", metavar="LAYOUT", help="sequence layout: contiguous, zigzag (default), striped, "
                                                      "zigzag_docs (needs --documents), or a custom package.module:FN")
    p.add_argument("--world-size", dest="world_size", type=int,
                   help="ranks of the ring, the mesh's cp dim (default 4; under torchrun without --mesh: the world)")
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
    p.add_argument("--report", metavar="DIR", help="write train.json, train.md and train.html (with plots) to DIR")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds any rank may wait on another (default {DEFAULT_TIMEOUT_S:g})")
    add_log_dir(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_train)
