"""An implementation under the `--impl` contract, run on real process groups, as the `impl` of
the property bodies (`ringcheck.testing.properties`, `variant_properties`).

The property bodies take a factory ``Case -> WholeImpl``. A ring of processes cannot be
differentiated from the process that judges it, so `RingImpl(case)` returns a `CaseRun`
whose ``results(inputs)`` runs forward and backward on every rank of a ring of the case's
size (one ring task: shard, call the implementation, backward with the case's dout) and
unshards the ranks' results into whole tensors; the bodies' `_run` uses ``results`` where an
implementation offers it. With ``forward_only`` the backward is not run: dq, dk and dv are
None, and the bodies compare only the tensors that are present (so is lse, when the
implementation returns out alone: the contract allows it).

`run` is ``run(ring_size, task, *args) -> [result of every ring rank]``: local gloo rings
(`ringcheck.launch.LocalRings.run`) under plain pytest, the torchrun world
(`TorchrunWorld.run`, every rank calls it in the same order and gets every rank's results)
under torchrun. Nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..commands.adapters import Impl, accepted_keywords, load_impl
from ..commands.impl_shards import run_shards
from ..judge.check import Case, Results
from ..judge.inputs import Inputs
from ..ring.layouts import unshard

# the contract's variant keywords, and what in a case asks for each
VARIANT_KEYWORDS = ("cu_seqlens", "window", "softcap", "sinks")

_LOADED: dict[tuple[str, str, str], Impl] = {}  # per process (a rank loads an implementation once)


def loaded(spec: str, layout: str, backend: str = "torch") -> Impl:
    """`load_impl(spec, layout=...)`, once per process."""
    key = (spec, layout, backend)
    if key not in _LOADED:
        _LOADED[key] = load_impl(spec, layout=layout, backend=backend)
    return _LOADED[key]


def case_keywords(case: Case) -> tuple[str, ...]:
    """The variant keywords a case passes (documents, a window, a softcap, sinks)."""
    return (*case.spec.variant_kwargs(), *(("sinks",) if case.spec.sinks else ()))


def impl_shards_task(member, spec: str, case: Case, inputs: Inputs, forward_only: bool) -> dict:
    """One rank: its shards of the case's inputs through the implementation (and the backward
    with its shard of dout unless `forward_only`); returns its shards of out, lse, dq, dk, dv
    and the dsinks it holds, on the CPU (`ringcheck.commands.impl_shards.run_shards`, the way
    validate calls it too)."""
    impl = loaded(spec, case.ring.layout, case.backend)
    return run_shards(impl, case, inputs, member.rank, member.group, member.device, forward_only=forward_only)


def whole_results(parts: list[dict], case: Case) -> Results:
    """Every rank's shards (ring-rank order) unsharded; a tensor no rank returned is None;
    dsinks is ring rank 0's (every rank holds the whole sequence's: the contract)."""
    layout, cu = case.ring.layout, case.spec.variant.cu_seqlens

    def whole(name: str) -> torch.Tensor | None:
        if parts[0][name] is None:
            return None
        return unshard([p[name] for p in parts], layout=layout, dim=2 if name == "lse" else 1, cu_seqlens=cu)

    return Results(whole("out"), whole("lse"), whole("dq"), whole("dk"), whole("dv"), parts[0]["dsinks"])


RingRun = Callable[..., list]  # run(ring_size, task, *args) -> every ring rank's result


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
    factory ``Case -> CaseRun``, running on `run`'s process groups."""

    spec: str
    run: RingRun = field(compare=False)
    forward_only: bool = False
    fn: Callable | None = field(default=None, compare=False)  # the loaded function, for its signature
    check_target: Callable | None = field(default=None, compare=False)  # a built-in adapter's rules

    def __call__(self, case: Case) -> CaseRun:
        return CaseRun(self, case)

    @property
    def is_ours(self) -> bool:
        """Whether this is our own ring (the built-in adapter `ringcheck`)."""
        return self.spec == "ringcheck"

    def accepts(self, names) -> tuple[str, ...]:
        """Of the keywords `names`, those the implementation takes (`accepted_keywords`)."""
        return tuple(names) if self.fn is None else accepted_keywords(self.fn, names)


@dataclass(frozen=True)
class CaseRun:
    """One case of a `RingImpl`: ``results(inputs)`` runs it on a ring of the case's size."""

    impl: RingImpl
    case: Case

    def results(self, inputs: Inputs) -> Results:
        if self.impl.check_target is not None:
            try:
                self.impl.check_target(CaseTarget(self.case))
            except ValueError as exc:
                raise Refused(f"--impl {self.impl.spec} refuses {self.case.describe()}: {exc}") from None
        parts = self.impl.run(self.case.ring.world_size, impl_shards_task, self.impl.spec, self.case, inputs,
                              self.impl.forward_only)
        return whole_results(parts, self.case)

    def __call__(self, *tensors):
        raise TypeError(f"--impl {self.impl.spec} runs on a ring of processes: call results(inputs), not a "
                        f"whole-tensor function")
