"""The one service that runs an implementation under the `--impl` contract on process groups.

validate, drift, bench, train and the pytest plugin all run implementations through here: a
`Runner` binds the implementation (`ImplOptions`) to the processes (`ringcheck.launch`: local
gloo rings, or the torchrun world) and runs a case on a `Mesh`: every CP group at the same
time, each on its own inputs, each rank calling the implementation on its shards with its CP
group (`impl_task`, `ringcheck.harness.call`). What comes back is every group's results, whole
(`GroupRun`: unsharded, the sinks gradient combined under the declared convention).

A run may hold several *calls* of the same case (`CALLS`): the contiguous shards, the input
layouts of `ringcheck.harness.call` (views of fused projections), two calls before one
backward, and the calls as training wraps them (`ringcheck.harness.wrappers`: two layers inside
activation checkpointing, the function under torch.compile). ringcheck's own traffic never shares a group with the implementation: results travel
through the launcher (pipes to the parent, or the torchrun world's control group), never
through the CP group the implementation was given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..adapters import Impl, load_impl
from ..judge.check import Case, Results
from ..judge.inputs import Inputs
from ..judge.sinks import combine
from ..launch.audit import device_audit
from ..ring.layouts import unshard
from ..ring.loops import check_sinks_grad
from .call import INPUT_LAYOUTS, run_shards, run_two_calls
from .mesh import Mesh
from .wrappers import WRAPPED_CALLS

TWO_CALLS = "two_calls"
# two calls before one backward, the first on views of a fused projection, the second with k
# and v of other strides: every embedding of the inputs in one dispatch (validate's common path)
TWO_CALLS_ON_VIEWS = "two_calls_on_views"
SECOND = "second"  # the second call's inputs alone, contiguous: the single-call run beside TWO_CALLS
AUDITED = "audited"  # the contiguous call under the device audit, on the rank's audited device
CALLS = (*INPUT_LAYOUTS, TWO_CALLS, TWO_CALLS_ON_VIEWS, SECOND, *WRAPPED_CALLS, AUDITED)
PAIRS = {TWO_CALLS: ("contiguous", "contiguous"), TWO_CALLS_ON_VIEWS: ("fused_qkv", "kv_strides")}
PAIRED = (*PAIRS, *WRAPPED_CALLS)  # the calls whose results are a pair: (the first call's, the second's)
TENSOR_NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class ImplOptions:
    """The implementation under test and how every rank loads and calls it (picklable: it
    travels to the ranks with each task). `layout` and `backend` configure the adapter (a run
    loads it for each case's layout and backend); `stand_in` installs the flash-attn stand-in
    on every rank first."""

    spec: str
    layout: str = "zigzag"
    backend: str = "torch"
    forward_only: bool = False
    stand_in: bool = False
    sinks_grad: str = "partial"

    def __post_init__(self) -> None:
        check_sinks_grad(self.sinks_grad)

    def load(self) -> Impl:
        return load_impl(self.spec, layout=self.layout, backend=self.backend, sinks_grad=self.sinks_grad)


_LOADED: dict[ImplOptions, Impl] = {}  # per process: a rank loads an implementation once


def loaded(options: ImplOptions) -> Impl:
    """`options.load()`, once per process (with the stand-in installed first where asked)."""
    if options not in _LOADED:
        if options.stand_in:
            # start-up time: the stand-in is imported only when asked for
            from ..flash_stand_in import install

            install()
        _LOADED[options] = options.load()
    return _LOADED[options]


def impl_task(member, options: ImplOptions, case: Case, inputs: list[Inputs], calls: tuple[str, ...],
              second: Inputs | None = None) -> dict[str, Any]:
    """One rank: its CP group's inputs (`inputs[member.group_index]`) through the implementation
    in each of `calls` (`CALLS`); per call its shards of out, lse, dq, dk, dv and dsinks (two
    calls: a pair).
    The second call of `TWO_CALLS` (and `SECOND`, that input alone) takes `second`, else the
    next group's inputs (other data, same shapes)."""
    impl = loaded(options)
    mine = inputs[member.group_index]
    done: dict[str, Any] = {}
    other = second if second is not None else inputs[(member.group_index + 1) % len(inputs)]
    for call in calls:
        if call in PAIRS:
            done[call] = run_two_calls(impl, case, mine, other, member.rank, member.group, member.device,
                                       forward_only=options.forward_only, layouts=PAIRS[call])
        elif call == SECOND:
            done[call] = run_shards(impl, case, other, member.rank, member.group, member.device,
                                    forward_only=options.forward_only)
        elif call == AUDITED:  # a CPU tensor where a GPU run would have one raises here (launch.audit)
            with device_audit(member.device):
                done[call] = run_shards(impl, case, mine, member.rank, member.group, member.device,
                                        forward_only=options.forward_only)
        elif call in WRAPPED_CALLS:  # checkpointed, compiled (`ringcheck.harness.wrappers`)
            done[call] = WRAPPED_CALLS[call](impl, case, mine, other, member.rank, member.group, member.device,
                                             forward_only=options.forward_only)
        else:
            done[call] = run_shards(impl, case, mine, member.rank, member.group, member.device,
                                    forward_only=options.forward_only, input_layout=call)
    return done


def whole_results(parts: list[dict], case: Case, sinks_grad: str = "partial") -> Results:
    """Every rank's shards (ring-rank order) unsharded; a tensor no rank returned is None; the
    sinks gradient is the ranks' combination under `sinks_grad` (`ringcheck.judge.sinks`), each
    rank's kept beside it."""
    layout, cu = case.ring.layout, case.spec.variant.cu_seqlens

    def whole(name: str):
        if parts[0][name] is None:
            return None
        return unshard([p[name] for p in parts], layout=layout, dim=2 if name == "lse" else 1, cu_seqlens=cu)

    sinks = None if parts[0].get("dsinks") is None else tuple(p["dsinks"] for p in parts)
    return Results(*(whole(n) for n in TENSOR_NAMES), None if sinks is None else combine(sinks, sinks_grad),
                   sinks, sinks_grad)


@dataclass
class GroupRun:
    """One CP group's part of a run: its place in the mesh and its whole results per call
    (`TWO_CALLS`: a pair, the first call's and the second's)."""

    index: int
    ranks: tuple[int, ...]
    mesh: Mesh
    calls: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, Any] = field(default_factory=dict)  # per call, every rank's shards as returned

    @property
    def name(self) -> str:
        """'cp group 1 (global ranks 1,3,5,7) of mesh cp=4,tp=2', or the ring's ranks alone."""
        ranks = ",".join(map(str, self.ranks))
        if self.mesh.rings == 1:
            return f"one ring (global ranks {ranks}, mesh {self.mesh.text})"
        return f"cp group {self.index} (global ranks {ranks}) of mesh {self.mesh.text}"


class Runner:
    """An implementation bound to processes: `run(case, inputs, mesh)` runs it on every CP group
    of `mesh` at once (a local pool of exactly the mesh's size, or the torchrun world, whose
    last ranks hold a mesh smaller than it)."""

    def __init__(self, processes, options: ImplOptions):
        self.processes, self.options = processes, options

    def alone(self, world_size: int) -> bool:
        """Whether a ring of `world_size` can run alone, as the whole world (local rings start a
        pool of that size; a torchrun world only if it is that size): the clean room that tells
        a ring that does not keep to its group from one that is wrong anyway. A ring beside
        idle ranks is no clean room: one that talks over the default group would wait on them."""
        return self.processes.size is None or self.processes.size == world_size

    def fits(self, mesh: Mesh) -> bool:
        """Whether the processes can hold `mesh` (a torchrun world holds meshes up to its size)."""
        return self.processes.size is None or mesh.size <= self.processes.size

    def run(self, case: Case, inputs: list[Inputs], mesh: Mesh, calls: tuple[str, ...] = ("contiguous",), *,
            second: Inputs | None = None) -> list[GroupRun]:
        """`case` on every CP group of `mesh` (group g on `inputs[g]`), each of `calls`; every
        group's results, whole. Raises `ringcheck.launch.RingError` when a rank fails."""
        return self.submit(case, inputs, mesh, calls, second=second)()

    def submit(self, case: Case, inputs: list[Inputs], mesh: Mesh, calls: tuple[str, ...] = ("contiguous",), *,
               second: Inputs | None = None) -> Callable[[], list[GroupRun]]:
        """`run` without waiting where the processes allow it (local rings: this process judges
        while the ranks compute the next case): call what it returns for the results."""
        if len(inputs) != mesh.rings:
            raise ValueError(f"mesh {mesh.text} runs {mesh.rings} CP groups, given inputs for {len(inputs)}")
        if case.ring.world_size != mesh.cp:
            raise ValueError(f"the case has a ring of {case.ring.world_size} but mesh {mesh.text} has cp={mesh.cp}")
        plan, sent = self.submit_task(impl_task, case, inputs, mesh, tuple(calls), second)
        return lambda: self._whole(case, mesh, plan, calls, sent.result())

    def submit_task(self, task, case: Case, inputs: list[Inputs], mesh: Mesh, *args):
        """`task(member, options, case, inputs, *args)` on every rank of every CP group of `mesh`
        (the options of this case's layout and backend): (the group plan, what `result()` of
        gives, per group, every rank's return)."""
        first = 0 if self.processes.size is None else self.processes.size - mesh.size
        plan = mesh.plan(first, families=False)  # the CP groups are all a call needs
        options = replace(self.options, layout=case.ring.layout, backend=case.backend)  # the adapter of this case
        return plan, self.processes.submit_groups(plan, task, options, case, inputs, *args)

    def _whole(self, case: Case, mesh: Mesh, plan, calls, per_group) -> list[GroupRun]:
        runs = []
        for index, (ranks, parts) in enumerate(zip(plan.groups, per_group)):
            run = GroupRun(index, ranks, mesh)
            for call in calls:
                got = [p[call] for p in parts]
                run.parts[call] = got
                if call in PAIRED:
                    run.calls[call] = tuple(whole_results([g[i] for g in got], case, self.options.sinks_grad)
                                            for i in (0, 1))
                else:
                    run.calls[call] = whole_results(got, case, self.options.sinks_grad)
            runs.append(run)
        return runs
