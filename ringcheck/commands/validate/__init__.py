"""`ringcheck validate`: is this ring attention exact, on this ring, at this configuration, as
training embeds it?

The target (`Target`) names the implementation (`--impl`), the attention shape at its full
length, the dtype, the layout, the ring size and the mesh. `validate` drives the run from one
process (the CLI, or every rank of a torchrun world in step) and runs the implementation
through `ringcheck.harness.Runner` on process groups (`ringcheck.launch`):

- the scaled-down cases (same heads, kv_heads, head_dim, dtype, layout, causal; batch 2 at
  least) for every named logit distribution and several ring-local lengths, on a mesh of CP
  groups at once (by default two interleaved rings, cp=P,tp=2, each on its own data), each
  case also as two calls before one backward on views of fused projections: forward and
  backward of every group against float64 and the same-dtype peer, and the precision class
  (`steps`);
- the ragged shards (`ragged`): every distribution at tokens per rank
  longer than the tiles block kernels walk and a multiple of none (66, 130), on sampled query
  rows (every ragged tail among them) and every key, the lengths in turn in one process (long,
  short, long again: the calls that change length);
- at the full target length (on the target world: a ring that is the whole world, or the
  mesh), sampled query rows against the row-sampled reference (never an N x N matrix);
- NaN/Inf anywhere; determinism (two runs, same bits: measured, a FLAG where a second run
  changes bits within rounding, a gate under ``--require determinism`` or where
  ``torch.use_deterministic_algorithms(True)`` is on); output shape and dtype; what the mesh
  found (a ring that passes alone and fails inside the mesh); the layout's per-rank work
  balance (information, not a gate);
- the ring as training wraps it (`wrapped`): two layers under activation checkpointing
  against the same without (recompute), and, with `compile`, torch.compile against eager.
- the ring's other promises, measured (`promises`): memory O(N/P) and communication
  at the ring's minimum by default, overlap with ``--overlap``; a FLAG there gates only the
  promises named by ``--require``.

With ``only="ragged"`` (``--only ragged``) the ragged shards' rows run alone, with the rows that
judge any run (no NaN/Inf, output shape and dtype): seconds, for a check of the ragged tails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...documents import VALIDATE_SCHEMA, header
from ...harness import ImplOptions, Mesh, Runner
from ...harness.mesh import REPLICA
from ...harness.settings import torch_threads
from ...launch.audit import OWN_CODE, DeviceDefect
from ...spec import Budget
from .device import device_row
from .promises import promise_rows, promise_steps
from .ragged import ragged_rows
from .rows import FLAG, NOT_RUN, CheckRow, balance_row, finite_row, shape_row, stand_in_row
from .steps import DETERMINISM, Run, full_length_rows, mesh_row, scaled_rows
from .target import SCALED_MIN_BATCH, Target, check_variant_keywords, ragged_cases, scaled_cases
from .wrapped import RECOMPUTE_ROW, compile_row, recompute_row

__all__ = ["SCALED_MIN_BATCH", "CheckRow", "DeviceDefect", "Placement", "Target", "check_variant_keywords", "placement",
           "report_dict", "scaled_cases", "validate", "validate_steps"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the cases run: the scaled-down cases on `scaled`, the full length on `full`;
    `alone` is why they run on one ring only (the row that says so), "" inside a mesh."""

    scaled: Mesh
    full: Mesh
    alone: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**self.scaled.to_json(), "full_length": self.full.to_json(), "one_ring_only": self.alone or None}


def placement(target: Target, world: int | None, world_only: str | None = None) -> Placement:
    """The meshes of a run on local rings (`world` None: any size) or a torchrun world of
    `world` ranks; ValueError where the target's mesh and the world disagree."""
    p, given = target.world_size, target.mesh_spec
    if world_only is not None:
        if world is not None and world != p:
            raise ValueError(f"--impl {target.impl}: {world_only}, so its ring must be the whole world: launch "
                             f"torchrun --nproc-per-node={p}")
        return Placement(Mesh.ring(p), Mesh.ring(p), f"{world_only}: it runs alone, group handling is not checked")
    if given is not None:
        if world is not None and world != given.size:
            raise ValueError(f"--mesh {given.text} has {given.size} ranks but the torchrun world has {world}: launch "
                             f"torchrun --nproc-per-node={given.size}, or pass a mesh of {world} ranks")
        return Placement(given, given)
    if world is None:
        return Placement(Mesh.embedded(p), Mesh.ring(p))
    if world == p:
        return Placement(Mesh.ring(p), Mesh.ring(p),
                         f"one ring only (launch 2P = {2 * p} ranks or pass --mesh to check group handling)")
    if world % p:
        sizes = [d for d in range(2, world + 1) if world % d == 0]
        raise ValueError(f"the torchrun world has {world} ranks, not a multiple of the ring size --world-size {p}: "
                         f"launch torchrun --nproc-per-node={p} (or {2 * p}: two rings), or pass --world-size "
                         f"{' or '.join(map(str, sizes))} (a ring size that divides {world})")
    mesh = Mesh.parse(f"cp={p},{REPLICA}={world // p}")
    return Placement(mesh, mesh)


def validate_steps(target: Target, promises=(), recompute: bool = True) -> int:
    """The progress notes of a run: each scaled case, the full length, its reference, determinism,
    recompute (asked for, and not under --forward-only), compile (with it) and the promises measured."""
    if target.only == "ragged":
        return len(ragged_cases(target))
    return (len(scaled_cases(target)) + len(ragged_cases(target)) + 4 + (recompute and not target.forward_only) + target.compile
            + promise_steps(promises))


def validate(target: Target, processes, *, budget: Budget = Budget(),
             progress: Callable[[str], None] | None = None, promises=(), require=(),
             recompute: bool = True) -> list[CheckRow]:
    """Every check of `target`, run on `processes` (`ringcheck.launch.LocalRings`, or the
    `TorchrunWorld` whose every rank calls this in step and gets the same rows); the promises
    measured are `promises` and every one in `require` (whose FLAG then fails the run). The
    command measures `DEFAULT_PROMISES` (memory, communication) unless told otherwise; this
    function none unless asked, so that callers that judge exactness alone (the suites) do not
    pay for the measurements. `recompute` False leaves out the recompute row's runs (the row says
    it was not run): the suites that judge other rows do, the command never. Determinism is
    required where `require` names it, or where `torch.use_deterministic_algorithms(True)` is on
    when this starts (read once here, after the implementation's module is imported)."""
    stand_in = stand_in_row(target.flash_attn_stand_in)  # before the implementation is imported
    options = ImplOptions(target.impl, target.layout, target.backend, target.forward_only,
                          target.flash_attn_stand_in, target.sinks_grad)
    impl = options.load()
    required = determinism_required(require, torch.are_deterministic_algorithms_enabled())  # read once, here
    impl.check_layout(target.layout, target.causal)
    check_variant_keywords(impl, target)
    where = placement(target, processes.size, impl.world_only)
    with torch_threads(1):  # small tensors: a second thread only spins against the ranks' processes
        return _rows(target, processes, options, where, budget, progress, stand_in, promises, require, recompute,
                     required)


def _rows(target, processes, options, where, budget, progress, stand_in, promises, require,
          recompute, required: str) -> list[CheckRow]:
    run = Run(target, Runner(processes, options), where.scaled, budget,
              progress if getattr(processes, "is_main", True) else None, determinism_required=required)
    if target.only == "ragged":  # these rows alone (--only ragged): no scaled case, full length or promise
        ragged, ragged_verdicts = ragged_rows(run, where.full)
        return _no_defect_of_ours([*([stand_in] if stand_in else []), *ragged, finite_row(ragged_verdicts),
                                   shape_row(run.returns_lse)])
    rows = scaled_rows(run)
    ragged, ragged_verdicts = ragged_rows(run, where.full)
    full, full_verdicts = full_length_rows(run, where.full)
    determinism = run.determinism_row()
    deterministic = determinism.status == "pass"
    wrapped = [recompute_row(run, deterministic) if recompute else not_asked(RECOMPUTE_ROW),
               compile_row(run, deterministic)]
    every = [*([stand_in] if stand_in else []), *rows, *ragged, *full,
             finite_row([*run.verdicts, *ragged_verdicts, *full_verdicts]),
             determinism, device_row(run), *wrapped, shape_row(run.returns_lse), mesh_row(run, where),
             balance_row(target, target.world_size), *promise_rows(target, run.runner, promises, require, run.note,
                                                                   cheap=True)]
    return _no_defect_of_ours(every)


def _no_defect_of_ours(rows: list[CheckRow]) -> list[CheckRow]:
    """`rows`, unless the device audit (RINGCHECK_DEVICE_AUDIT) put one on ringcheck's own code:
    then `DeviceDefect` (no verdict)."""
    ours = [r for r in rows if OWN_CODE in r.detail]
    if ours:
        raise DeviceDefect(f"{ours[0].check}: {ours[0].detail}")
    return rows


def determinism_required(require, deterministic_algorithms: bool) -> str:
    """Why the determinism row's FLAG fails the run, in words ("": it is reported only): `require`
    names it, or `deterministic_algorithms` (torch.are_deterministic_algorithms_enabled() where
    the run starts) is on."""
    if deterministic_algorithms:
        return "torch.use_deterministic_algorithms(True) is on"
    return f"--require {DETERMINISM}" if DETERMINISM in require else ""


def not_asked(check: str) -> CheckRow:
    return CheckRow(check, NOT_RUN, detail="not run: not asked for (validate(..., recompute=False)); the command "
                                           "runs it")


# ------------------------------------------------------------------------------- reports

def report_dict(target: Target, rows: list[CheckRow], meta: dict[str, Any] | None = None,
                where: Placement | None = None) -> dict[str, Any]:
    """The validate document (schema "ringcheck.validate", see `ringcheck.documents`); `meta`
    from `ringcheck.documents.meta`, `where` the meshes it ran on. `ringcheck.render.markdown`
    presents it."""
    return {
        **header(VALIDATE_SCHEMA),
        "passed": all(r.passed for r in rows),
        "flagged": [r.check for r in rows if r.status == FLAG],
        "target": target.to_dict(),
        "variants": target.variants.describe(),
        "command": f"ringcheck validate {target.describe()}",
        "mesh": None if where is None else where.to_json(),
        "checks": [dataclasses.asdict(r) for r in rows],
        "meta": meta or {},
    }
