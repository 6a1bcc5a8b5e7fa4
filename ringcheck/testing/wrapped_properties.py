"""Property bodies of the ring as training wraps it: inside activation checkpointing and under
torch.compile (`ringcheck.harness.wrappers` makes the calls on the ranks). For an implementation
on a ring of processes (`ringcheck.testing.impl_runner.CaseRun.wrapped`), with the conventions of
`ringcheck.testing.properties` (``check_*(case, ..., impl)`` raising AssertionError with the
case and a reproduction).

The claim is the same bits: checkpointing recomputes the same operations on the same inputs,
and aot_eager runs eager's kernels. A ring that is not deterministic (a second plain run of the
same calls differs) cannot keep it; it is judged by the budget rule against float64 instead.
"""

from __future__ import annotations

from typing import Any

from ..harness import TWO_CALLS
from ..harness.runner import SECOND
from ..harness.wrappers import COMPILE_INFO, COMPILED, MODES, differing
from .compare import RERUNS, SEEN_NOT_DETERMINISTIC, not_deterministic, verdict_of
from .properties import case_inputs, failure, other_inputs

CONTIGUOUS = "contiguous"
LAYERS = ("layer 1", "layer 2")


def _deterministic(impl, case, first, second, call: str, seen) -> bool:
    """Whether `call` run again gives the bits it gave (`seen`: its results, a pair or one), up
    to `RERUNS` times, unless `impl` was seen to change bits before (`SEEN_NOT_DETERMINISTIC`:
    on tiny tensors one rerun may repeat the bits by chance)."""
    if impl in SEEN_NOT_DETERMINISTIC:
        return False
    for _ in range(RERUNS):
        again = impl(case).wrapped(first, second, (call,)).calls[call]
        pairs = zip(again, seen) if isinstance(seen, tuple) else [(again, seen)]
        if any(differing(a, b) for a, b in pairs):
            not_deterministic(impl)
            return False
    return True


def check_recompute(case, impl) -> None:
    """Two layers' worth (the forward of one input, of another, one backward of both), each call
    inside `torch.utils.checkpoint` with use_reentrant False and True: out, lse and every
    gradient the same bits as the same two layers without checkpointing."""
    x, y = case_inputs(case), other_inputs(case)
    run = impl(case).wrapped(x, y, (TWO_CALLS, *MODES))
    without = run.calls[TWO_CALLS]
    for mode, words in MODES.items():
        for layer, got, plain, inputs in zip(LAYERS, run.calls[mode], without, (x, y)):
            names = differing(got, plain)
            if not names:
                continue
            if _deterministic(impl, case, x, y, TWO_CALLS, without):
                raise failure("check_recompute", case, f"under torch.utils.checkpoint({words}), {layer}'s "
                                                       f"{', '.join(names)} differ from the run without checkpointing "
                                                       f"(a deterministic ring gives the same bits; the likely cause: "
                                                       f"state kept outside the autograd context, overwritten by the "
                                                       f"recompute)")
            verdict = verdict_of(case, inputs, got)  # not deterministic: the budget rule
            if not verdict.passed:
                raise failure("check_recompute", case, f"under torch.utils.checkpoint({words}), {layer} (the ring is "
                                                       f"not deterministic, so judged by the budget rule): "
                                                       f"{verdict.message()}")


def check_compile(case, impl) -> dict[str, Any]:
    """`torch.compile` of a function calling the ring, called on two inputs with a backward
    each: the same bits as eager (aot_eager, a deterministic ring), else within the budget
    against float64. Returns what dynamo made of it (`ringcheck.harness.wrappers.compile_info`
    of the first rank); one that did not compile has its `error` and is not judged."""
    x, y = case_inputs(case), other_inputs(case)
    run = impl(case).wrapped(x, y, (CONTIGUOUS, SECOND, COMPILED))
    infos = [rank[0][COMPILE_INFO] for rank in run.parts[COMPILED]]
    info = next((i for i in infos if i["error"]), infos[0])
    if info["error"]:
        return info
    for call, got, eager, inputs in zip(("call 1", "call 2"), run.calls[COMPILED], (run.calls[CONTIGUOUS],
                                                                                      run.calls[SECOND]), (x, y)):
        names = differing(got, eager)
        if not names:
            continue
        if info["backend"] == "aot_eager" and _deterministic(impl, case, x, y, CONTIGUOUS, run.calls[CONTIGUOUS]):
            raise failure("check_compile", case, f"compiled with aot_eager, {call}'s {', '.join(names)} differ from "
                                                 f"eager, where aot_eager runs the same kernels")
        verdict = verdict_of(case, inputs, got)
        if not verdict.passed:
            raise failure("check_compile", case, f"compiled with {info['backend']}, {call}: {verdict.message()}")
    return info
