"""An implementation under the `--impl` contract, run on real process groups, as the `impl` of
the property bodies (`ringcheck.testing.properties`, `variant_properties`).

The property bodies take a factory ``Case -> WholeImpl``. A ring of processes cannot be
differentiated from the process that judges it, so `RingImpl(case)` returns a `CaseRun`
whose ``results(inputs)`` runs forward and backward on every rank (`ringcheck.harness.Runner`)
and unshards the ranks' results into whole tensors; the bodies' `_run` uses ``results`` where
an implementation offers it. With ``forward_only`` the backward is not run: dq, dk and dv are
None, and the bodies compare only the tensors that are present (so is lse, when the
implementation returns out alone: the contract allows it).

Each case runs as training embeds it: on a mesh of CP groups at once (the default embedding
cp=P,tp=2 where the processes hold it, or the `--ring-mesh` given), the body's inputs on group
0 and the other groups on their own data, judged by the budget rule; a group that fails while
the same case passes alone makes the property fail with what that means (a ring wrong alone
too is left to the property's own verdict). Nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adapters import accepted_keywords
from ..harness import TWO_CALLS, GroupRun, ImplOptions, Mesh, Runner
from ..harness.embedding import alone_words, check_witnesses, default_mesh, embedding_message, group_inputs
from ..judge.check import Case, Results
from ..judge.inputs import Inputs
from ..launch import RingError

# the contract's variant keywords, and what in a case asks for each
VARIANT_KEYWORDS = ("cu_seqlens", "window", "softcap", "sinks")


def case_keywords(case: Case) -> tuple[str, ...]:
    """The variant keywords a case passes (documents, a window, a softcap, sinks)."""
    return (*case.spec.variant_kwargs(), *(("sinks",) if case.spec.sinks else ()))


class Refused(ValueError):
    """The implementation's own rules refuse this case (a built-in adapter's `check_target`:
    what validate refuses before any rank starts), so the case is not run."""


@dataclass(frozen=True)
class CaseTarget:
    """What an adapter's `check_target` reads of a validate target, from a case."""

    case: Case

    dtype = property(lambda self: self.case.spec.dtype)
    causal = property(lambda self: self.case.spec.causal)
    heads = property(lambda self: self.case.spec.heads)
    layout = property(lambda self: self.case.ring.layout)
    world_size = property(lambda self: self.case.ring.world_size)

    def full_spec(self):
        return self.case.spec


@dataclass(frozen=True)
class RingImpl:
    """The `impl` of a property body for an implementation under the `--impl` contract: a
    factory ``Case -> CaseRun``, running through `runner` on meshes (`mesh_for`)."""

    spec: str
    runner: Runner = field(compare=False)
    forward_only: bool = False
    fn: object = field(default=None, compare=False)  # the loaded function, for its signature
    check_target: object = field(default=None, compare=False)  # a built-in adapter's rules
    mesh: Mesh | None = None       # --ring-mesh: its other dims replicate every ring size
    world_only: str | None = None  # the adapter rings over the whole world only: always alone

    def __call__(self, case: Case) -> CaseRun:
        return CaseRun(self, case)

    @property
    def is_ours(self) -> bool:
        """Whether this is our own ring (the built-in adapter `ringcheck`)."""
        return self.spec == "ringcheck"

    @property
    def device(self) -> torch.device:
        """Where the ranks compute: the torchrun world's device (`TorchrunWorld.device`, a GPU's
        under NCCL), else the CPU (local rings)."""
        return torch.device(getattr(self.runner.processes, "device", None) or "cpu")

    def accepts(self, names) -> tuple[str, ...]:
        """Of the keywords `names`, those the implementation takes (`accepted_keywords`)."""
        return tuple(names) if self.fn is None else accepted_keywords(self.fn, names)

    def mesh_for(self, world_size: int) -> Mesh:
        """Where a ring of `world_size` runs (`ringcheck.harness.embedding.default_mesh`)."""
        return default_mesh(world_size, room=self.runner.processes.size, world_only=self.world_only is not None,
                            template=self.mesh)


@dataclass(frozen=True)
class CaseRun:
    """One case of a `RingImpl`: ``results(inputs)`` runs it on the case's mesh."""

    impl: RingImpl
    case: Case

    def _refuse(self) -> None:
        if self.impl.check_target is not None:
            try:
                self.impl.check_target(CaseTarget(self.case))
            except ValueError as exc:
                raise Refused(f"--impl {self.impl.spec} refuses {self.case.describe()}: {exc}") from None

    def _run(self, first: Inputs, call: str, second: Inputs | None = None):
        self._refuse()
        mesh = self.impl.mesh_for(self.case.ring.world_size)
        inputs = group_inputs(self.case, first, mesh.rings)
        try:
            runs = self.impl.runner.run(self.case, inputs, mesh, (call,), second=second)
        except RingError as exc:
            if mesh.rings == 1 or not self.impl.runner.alone(mesh.cp):
                raise
            self.impl.runner.run(self.case, inputs[:1], Mesh.ring(mesh.cp), (call,), second=second)  # alone?
            raise AssertionError(embedding_message(mesh, [f"raises: {str(exc).splitlines()[0]}"], True,
                                                   alone_words(mesh.cp))) from None
        if call != TWO_CALLS:  # a ring that does not keep to its group fails here, naming the group
            check_witnesses(self.impl.runner, self.case, runs, inputs, call)
        return runs[0].calls[call]

    def results(self, inputs: Inputs, call: str = "contiguous") -> Results:
        """The case's whole results for `inputs` (group 0 of its mesh), with the inputs as
        `call` hands them over (`ringcheck.harness.call.INPUT_LAYOUTS`)."""
        return self._run(inputs, call)

    def two_calls(self, first: Inputs, second: Inputs) -> tuple[Results, Results]:
        """Forward of `first`, forward of `second`, one backward of both: each call's results."""
        return self._run(first, TWO_CALLS, second)

    def wrapped(self, first: Inputs, second: Inputs, calls: tuple[str, ...]) -> GroupRun:
        """The first group's run of `calls` in one dispatch (`ringcheck.harness.wrappers`:
        checkpointed, compiled; beside them the plain calls they are compared with), the first
        of two calls on `first`, the second on `second`."""
        self._refuse()
        mesh = self.impl.mesh_for(self.case.ring.world_size)
        inputs = group_inputs(self.case, first, mesh.rings)
        return self.impl.runner.run(self.case, inputs, mesh, calls, second=second)[0]

    def __call__(self, *tensors):
        raise TypeError(f"--impl {self.impl.spec} runs on a ring of processes: call results(inputs), not a "
                        f"whole-tensor function")


def ring_impl(spec: str, processes, *, forward_only: bool = False, stand_in: bool = False,
              sinks_grad: str = "partial", mesh: Mesh | None = None) -> RingImpl:
    """The `RingImpl` of `spec` on `processes` (local gloo rings or the torchrun world), with
    the adapter's own rules; a wrong spelling raises here, before any ring runs."""
    options = ImplOptions(spec, forward_only=forward_only, stand_in=stand_in, sinks_grad=sinks_grad)
    adapter = options.load()
    return RingImpl(spec, Runner(processes, options), forward_only, adapter.fn, adapter.check_target, mesh,
                    adapter.world_only)
