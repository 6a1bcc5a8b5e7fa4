"""The ring as training embeds it: where each case runs, what the other CP groups get, and what a
failure inside a mesh means.

A case runs on a mesh of CP groups at once (`Mesh`): group 0 gets the inputs the caller chose
(so a run inside a mesh judges the same data as one alone), every other group its own seeded
inputs of the same shapes (`group_inputs`: different data in each, so a ring that mixes the
groups' data is wrong, never lucky). Commands whose question is not the embedding (the property
bodies, drift, bench) use group 0's results and judge the others' with the budget rule
(`witness_failures`); validate judges every group in every row.

A ring that passes alone (a world that is just its ring) and fails inside a mesh has one of a
few bugs, the likely causes that `LIKELY_CAUSES` names.
"""

from __future__ import annotations

from ..judge.check import Case, Results, judge_results, peer, truth
from ..judge.inputs import Inputs, make_inputs
from ..judge.verdict import TENSORS, Verdict
from ..spec import Budget
from .mesh import REPLICA, Mesh
from .runner import GroupRun

GROUP_SEED = 1_000_003  # group g of a mesh draws its inputs from seed + g x this

LIKELY_CAUSES = ("collectives on another group than the one given (the default world group, or a group of "
                 "another mesh axis), a ring position taken from the wrong axis (dist.get_rank() % world_size "
                 "instead of dist.get_rank(group)), peers computed as group ranks where a P2P op wants global "
                 "ranks (or the reverse)")


def alone_words(world_size: int) -> str:
    return f"a ring of {world_size} rank{'s' if world_size != 1 else ''} alone"


def group_inputs(case: Case, first: Inputs, rings: int) -> list[Inputs]:
    """Inputs of every CP group: `first` for group 0, the case's spec drawn from its own seed for
    each other group (the same shapes and variant, other data)."""
    return [first] + [make_inputs(case.spec, seed=case.seed + GROUP_SEED * g, distribution=case.distribution,
                                  ring=case.ring) for g in range(1, rings)]


def default_mesh(world_size: int, *, room: int | None, world_only: bool = False,
                 template: Mesh | None = None) -> Mesh:
    """Where a ring of `world_size` runs: `template` with that ring (a `--mesh`), else the
    default embedding: on local rings (`room` None) two interleaved rings, cp=P,tp=2; in a
    torchrun world of `room` ranks that P divides, as many interleaved rings as fill it
    (cp=P,tp=room/P: no rank idle, so a ring that talks over the default group meets the other
    rings, never a rank that waits elsewhere); else one ring. An implementation that rings over
    the whole world only (`world_only`) always alone."""
    if world_only:
        return Mesh.ring(world_size)
    if template is not None:
        return template.with_cp(world_size)
    if room is None:
        return Mesh.embedded(world_size)
    if room % world_size == 0 and room // world_size >= 2:
        return Mesh.parse(f"cp={world_size},{REPLICA}={room // world_size}")
    return Mesh.ring(world_size)


def present(got: Results, tensors=TENSORS) -> tuple[str, ...]:
    """Of `tensors`, those the results hold (lse may be missing; forward only: no gradients)."""
    return tuple(t for t in tensors if got.get(t) is not None)


def judge_group(case: Case, got: Results, inputs: Inputs, *, budget: Budget = Budget(), label: str = "") -> Verdict:
    """One group's results against float64 and the peer (the budget rule), named by `label`."""
    verdict = judge_results(case, got, truth(case.spec, inputs), peer(case.spec, inputs), budget=budget,
                            tensors=present(got), inputs=inputs)
    if label:
        verdict.case = f"{verdict.case} [{label}]"
    return verdict


def witness_failures(case: Case, runs: list[GroupRun], inputs: list[Inputs], call: str = "contiguous", *,
                     budget: Budget = Budget()) -> list[tuple[int, Verdict]]:
    """(group index, verdict) of every CP group but the first (whose results the caller judges
    its own way) that fails the budget rule."""
    failed = []
    for run, x in zip(runs[1:], inputs[1:]):
        verdict = judge_group(case, run.calls[call], x, budget=budget, label=run.name)
        if not verdict.passed:
            failed.append((run.index, verdict))
    return failed


def embedding_message(mesh: Mesh, failures: list[str], alone: bool | None, world: str) -> str:
    """What a failure inside `mesh` means: the groups that failed (`failures`, in words) and,
    where the same case was run alone (`alone`: it passed there; False: it failed there too;
    None: not run), whether the mesh is the cause."""
    head = f"inside {mesh.describe()}: " + "; ".join(failures)
    if alone is None:
        return head
    if alone:
        return (f"passes alone ({world}) and fails inside mesh {mesh.text}: the ring does not keep to the group "
                f"it is given. {head}. Likely causes: {LIKELY_CAUSES}")
    return f"{head}. It fails alone ({world}) too: not (only) the mesh"


class EmbeddingFailure(AssertionError):
    """Groups of a mesh other than the one a command measures failed the budget rule, and the
    same case passes alone: a verdict (exit 1), with the groups named (`verdicts`)."""

    def __init__(self, mesh: Mesh, verdicts: list[Verdict], alone: str):
        super().__init__(embedding_message(mesh, [v.message() for v in verdicts], True, alone))
        self.mesh, self.verdicts = mesh, verdicts


def check_witnesses(runner, case: Case, runs: list[GroupRun], inputs: list[Inputs], call: str = "contiguous", *,
                    budget: Budget = Budget()) -> None:
    """Raise `EmbeddingFailure` when a group other than the first fails the budget rule and its
    case passes alone (a ring of the same size that is the whole world, where local rings can
    make one): a ring that does not keep to its group. A ring wrong alone too is left to the
    caller's own verdict on the first group."""
    failed = witness_failures(case, runs, inputs, call, budget=budget)
    if not failed:
        return
    mesh, witness = runs[0].mesh, inputs[failed[0][0]]
    if not runner.alone(mesh.cp):  # no clean room here: the first group's own verdict decides
        return
    alone = runner.run(case, [witness], Mesh.ring(mesh.cp), (call,))[0].calls[call]
    if judge_group(case, alone, witness, budget=budget).passed:
        raise EmbeddingFailure(mesh, [v for _, v in failed], alone_words(mesh.cp))
