"""How the property bodies (`ringcheck.testing.properties`, `variant_properties`) compare runs:
bit for bit, within the two runs' budgets, and bit for bit unless the ring is not deterministic
(`Exact`).

Several properties hold exactly in the arithmetic of a deterministic ring (V -> -V, causal
prefix, batch and head independence, lse and dV independent of V, sinks of -inf): the same
operations on the same values give the same bits. A correct ring need not be deterministic: on
GPUs flash-attn's and SDPA's backward accumulate dq with atomic adds whose order changes from run
to run, so its float32 roundings do too. Demanding the same bits of such a ring would test its
kernels' determinism, not the masking or independence the property is about. So `Exact` measures
determinism first where bits differ: the property's first call is made again (a second plain
run of the same inputs, up to `RERUNS` times), unless this process has seen the implementation
change bits before (`SEEN_NOT_DETERMINISTIC`: the plugin's determinism test runs first). Where
those give the same bits, the ring is deterministic on the case and the difference fails, as
it always has. Where it does not, the comparison is judged by the
budget rule instead: within the sum of the two runs' budgets against float64 (each within its
own of the truth). A ring whose run-to-run difference is beyond rounding fails there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..judge.check import Case, Results, judge_results, peer, truth
from ..judge.inputs import Inputs
from ..judge.verdict import TENSORS, Verdict


def repro(check: str, case: Case, **params) -> str:
    """A one-line shell command (from the repository root) that re-runs one property."""
    args = ", ".join([repr(case)] + [f"{k}={v!r}" for k, v in params.items()])
    return (f"python -c \"from ringcheck.testing.properties import {check}; "
            f"from ringcheck.judge.check import Case; from ringcheck.spec import AttentionSpec, RingSpec, Variant; "
            f"{check}({args})\"")


def failure(check: str, case: Case, what: str, *, subject: str | None = None, **params) -> AssertionError:
    """The error of a failed property: what failed, for `subject` (default: the case's words),
    and the command that replays it."""
    return AssertionError(f"{check} failed for {case.describe() if subject is None else subject}: {what}\n"
                          f"  reproduce: {repro(check, case, **params)}")


def present(results: Results, names) -> tuple[str, ...]:
    """Of `names`, the tensors `results` holds: an implementation run forward only has no dq,
    dk and dv, one that returns out alone no lse (`ringcheck.testing.impl_runner`); the
    properties compare what is there."""
    return tuple(name for name in names if results.get(name) is not None)


def verdict_of(case: Case, inputs: Inputs, got: Results, tensors=TENSORS) -> Verdict:
    """`got`'s budget verdict against the float64 truth and the same-dtype peer of `inputs`."""
    return judge_results(case, got, truth(case.spec, inputs), peer(case.spec, inputs), tensors=present(got, tensors),
                         inputs=inputs)


def worst(diff: torch.Tensor, allowed: torch.Tensor | float) -> str:
    """How many elements of `diff` are over `allowed`, and the worst of them, in words."""
    over = diff - allowed
    i = tuple(int(j) for j in torch.unravel_index(over.argmax(), over.shape))
    a = allowed[i] if isinstance(allowed, torch.Tensor) else allowed
    return (f"{int((over > 0).sum())} of {diff.numel()} elements over; worst at index {list(i)}: "
            f"|difference| {float(diff[i]):.3e} > allowed {float(a):.3e}")


def first_unequal(a: torch.Tensor, b: torch.Tensor) -> str:
    """How many elements of `a` and `b` differ in bits (NaN equals NaN), and the first, in words."""
    ne = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    i = [int(j) for j in torch.nonzero(ne)[0]]
    return f"{int(ne.sum())} of {a.numel()} elements differ, first at index {i}: {float(a[tuple(i)])!r} vs {float(b[tuple(i)])!r}"


def same_bits(a: Results, b: Results) -> bool:
    """Whether two runs' results are the same bits in every tensor either holds."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((a.get(t), b.get(t)) for t in (*TENSORS, "dsinks")))


Run = tuple[Case, Inputs, Results]  # a run of a property: its case, inputs and results
RERUNS = 3  # the first call made again at most this many times, until its bits change
# the implementations (the bodies' `impl`) this process has seen change bits on a second run: on
# tiny tensors a few reruns may repeat the bits by chance, so once seen, it is not deterministic
SEEN_NOT_DETERMINISTIC: set = set()


def not_deterministic(impl) -> None:
    """Note that `impl` changed bits on a second run of the same inputs (`SEEN_NOT_DETERMINISTIC`)."""
    if impl is not None:
        SEEN_NOT_DETERMINISTIC.add(impl)


class Exact:
    """The bit-for-bit comparisons of one property body, for a ring that may not be deterministic
    (see the module). `first` is the body's first run, and `again` makes its call once more; it is
    called only where two results' bits differ, at most `RERUNS` times per body."""

    def __init__(self, check: str, case: Case, first: Results, again: Callable[[], Results], *, impl=None,
                 fail: Callable[..., AssertionError] = failure, **params):
        self.check, self.case, self.first, self.again, self.params = check, case, first, again, params
        self.impl = impl  # the implementation, as `SEEN_NOT_DETERMINISTIC` knows it (None: not noted)
        self.fail = fail  # the failure of the property's module (its replay line names that module)
        self._deterministic: bool | None = None
        self._verdicts: dict[int, Verdict] = {}

    def deterministic(self) -> bool:
        """Whether the first call, made again, gives its bits (`RERUNS` times at most, when first
        asked: a ring whose roundings change at a few elements may repeat them once by chance)."""
        if self._deterministic is None:
            self._deterministic = self.impl not in SEEN_NOT_DETERMINISTIC and all(
                same_bits(self.first, self.again()) for _ in range(RERUNS))
            if not self._deterministic:
                not_deterministic(self.impl)
        return self._deterministic

    def _verdict(self, run: Run) -> Verdict:
        case, inputs, got = run
        if id(got) not in self._verdicts:
            self._verdicts[id(got)] = verdict_of(case, inputs, got, (*TENSORS, "dsinks"))
        return self._verdicts[id(got)]

    def equal(self, what: str, name: str, x: torch.Tensor | None, y: torch.Tensor | None, runs: tuple[Run, Run]):
        """`x` and `y` (parts of tensor `name` of the two `runs`) the same bits; where they are not
        and the ring is not deterministic, within the sum of the two runs' budgets."""
        if (x is None and y is None) or torch.equal(x, y):
            return
        if self.deterministic():
            raise self.fail(self.check, self.case, f"{what} is not bit-identical: {first_unequal(x, y)}", **self.params)
        va, vb = (self._verdict(run) for run in runs)
        allowed = va[name].max_allowed + vb[name].max_allowed
        diff = (x.double() - y.double()).abs()
        if not (diff <= allowed).all():  # NaN compares False: it never passes
            raise self.fail(self.check, self.case, f"{what} differ by more than the two runs' budgets "
                          f"({va[name].max_allowed:.3e} + {vb[name].max_allowed:.3e}; the ring is not deterministic, "
                          f"a second run of the same inputs changed bits, so judged within them): "
                          + worst(diff, allowed), **self.params)
