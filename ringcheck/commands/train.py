"""`ringcheck train`: does training under this ring match training without it?

`run_train` drives one run from one process (the CLI, or every rank of a torchrun world in
step) on process groups of `ringcheck.launch`:

1. the implementation is loaded and its rules checked (layouts, dtypes, variants, whether it
   runs inside a mesh) before any rank starts (`check_impl`), and the mesh placed on the
   processes (`placement`);
2. the ring's run: every rank of every CP group of the mesh trains the model on its shards,
   the attention through the implementation under test (`ringcheck.train.loop.ring_task`);
3. the single-device runs, one per process at a time: the reference and the noise runs
   (`ringcheck.train.loop.single_task`);
4. the verdict (`ringcheck.train.verdict.judge`) and the document (`report_dict`, schema
   "ringcheck.train" of `ringcheck.documents`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..adapters import Impl, require_variant_keywords
from ..documents import TRAIN_SCHEMA, header
from ..harness import ImplOptions, Mesh
from ..launch import GroupPlan, relay
from ..train.config import TrainConfig
from ..train.data import counted_tokens
from ..train.loop import REFERENCE, noise_runs, ring_task, run_words, single_key, single_task
from ..train.verdict import K_GRAD, K_LOSS, judge

EXIT_OF = {"pass": 0, "fail": 1, "no verdict": 2}


def impl_options(config: TrainConfig) -> ImplOptions:
    return ImplOptions(config.impl, config.layout, config.backend, False, config.flash_attn_stand_in,
                       config.sinks_grad)


def check_impl(impl: Impl, config: TrainConfig) -> None:
    """The implementation's own rules for this run (ValueError naming the value and the fix):
    its layouts and masks, its dtypes, a built-in adapter's target rules, the variant keywords
    it must accept; and a run that could judge nothing (no counted target)."""
    impl.check_layout(config.layout, True)
    if impl.dtypes is not None and config.dtype not in impl.dtypes:
        raise ValueError(f"--impl {impl.name} runs the dtypes {list(impl.dtypes)}, not {config.dtype}; pass --dtype "
                         f"{impl.dtypes[0]}")
    if impl.check_target is not None:
        impl.check_target(config)
    require_variant_keywords(impl.fn, impl.name, config.full_spec())
    if counted_tokens(config, config.mesh_spec.rings) == 0:
        raise ValueError(f"no token of the batch is a counted target (documents {config.documents!r}, --pad "
                         f"{config.pad}): the loss would be empty and nothing could be judged; use longer documents "
                         f"(4 tokens at least) or less padding")


def placement(config: TrainConfig, world: int | None, world_only: str | None) -> Mesh:
    """The mesh the ring trains on, on local rings (`world` None) or a torchrun world of
    `world` ranks; ValueError where they disagree."""
    mesh = config.mesh_spec
    if world_only is not None and mesh.rings > 1:
        raise ValueError(f"--impl {config.impl}: {world_only}, so it trains alone: drop --mesh {mesh.text} (or pass "
                         f"--mesh cp={mesh.cp})")
    if world is not None and world != mesh.size:
        raise ValueError(f"mesh {mesh.text} has {mesh.size} ranks but the torchrun world has {world}: launch torchrun "
                         f"--nproc-per-node={mesh.size}, or pass a mesh of {world} ranks (e.g. --mesh "
                         f"dp={max(world // mesh.cp, 1)},cp={mesh.cp})")
    return mesh


def singles_plan(processes, mesh: Mesh) -> GroupPlan:
    """One group of one rank per process: the single-device runs go side by side."""
    slots = mesh.size if processes.size is None else processes.size
    return GroupPlan(tuple((r,) for r in range(slots)), label="single-device runs")


@contextlib.contextmanager
def _channel(processes, advance: Callable[[str], None] | None):
    """What the ranks' progress goes through: a relayed file for local rings, the callback
    itself on the torchrun rank that reports (its tasks run in-process), None elsewhere."""
    if advance is None:
        yield None
    elif getattr(processes, "is_torchrun", False):
        yield advance if processes.is_main else None
    else:
        with relay(advance) as channel:
            yield channel


def run_steps_total(config: TrainConfig) -> int:
    """The progress notes of a run: one per ring step, one per single-device run."""
    return config.steps + 1 + len(noise_runs(config))


def run_train(config: TrainConfig, processes, *, progress: Callable[[str], None] | None = None,
              cache: dict | None = None) -> dict[str, Any]:
    """The ring's run and the single-device runs on `processes` (`LocalRings` or the
    `TorchrunWorld` whose every rank calls this in step), judged. Raises `RingError` when a
    rank fails, ValueError for settings the implementation cannot run. `cache` (a sweep's):
    single-device runs by `single_key`, taken from it where the settings ran before."""
    options = impl_options(config)
    impl = options.load()
    check_impl(impl, config)
    mesh = placement(config, processes.size, impl.world_only)
    first = 0 if processes.size is None else processes.size - mesh.size
    kw = {} if getattr(processes, "is_torchrun", False) else {"deadline": processes.timeout * (10 + config.steps)}
    names = (REFERENCE, *noise_runs(config))
    plan = singles_plan(processes, mesh)
    with _channel(processes, progress) as channel:
        ring = processes.run_groups(mesh.plan(first, families=True), ring_task, options, config, channel, **kw)[0][0]
        singles: dict[str, Any] = {} if cache is None else cache.get(single_key(config), {})
        if not singles:
            for part in processes.run_groups(plan, single_task, config, names, len(plan.groups), channel, **kw):
                singles.update(part[0])
        if cache is not None:
            cache[single_key(config)] = singles
    judged = judge(config.dtype, ring, singles[REFERENCE], {n: singles[n] for n in names[1:]})
    judged["timing"] = {"ring_s": ring["seconds"], **{f"{n}_s": singles[n]["seconds"] for n in names}}
    judged["mesh"] = mesh
    return judged


def rule_words(config: TrainConfig) -> dict[str, Any]:
    """The verdict's rule as the report states it."""
    noise = noise_runs(config)
    return {
        "k_grad": K_GRAD, "k_loss": K_LOSS,
        "reference": run_words(REFERENCE),
        "noise_runs": {n: run_words(n) for n in noise},
        "gradients": (f"step 0, per parameter: ||g_ring - g_ref|| <= {K_GRAD:g} x max(spread, floor), spread = "
                      f"max over the noise runs of ||g_noise - g_ref||, floor = u(dtype) x ||g_ref||"),
        "loss": (f"every step t: |L_ring - L_ref| <= {K_LOSS:g} x E(t), E(t) = the largest noise spread "
                 f"max |L_noise - L_ref| of the steps up to t (at least float32's rounding of the loss)"),
    }


def report_dict(config: TrainConfig, judged: dict[str, Any], command: str, meta: dict | None = None) -> dict[str, Any]:
    """The train document (schema "ringcheck.train", see `ringcheck.documents`)."""
    return {
        **header(TRAIN_SCHEMA),
        "verdict": judged["verdict"],
        "passed": judged["verdict"] == "pass",
        "why": judged["why"],
        "command": command,
        "model": config.describe(),
        "mesh": judged["mesh"].to_json(),
        "config": config.to_dict(),
        "rule": rule_words(config),
        "summary": judged["summary"],
        "timing": {k: round(v, 2) for k, v in judged["timing"].items()},
        "gradients": judged["gradients"],
        "steps": judged["steps"],
        "meta": meta or {},
    }
