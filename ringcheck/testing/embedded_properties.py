"""Property bodies of the ring as training embeds it: inputs handed over as views of fused
projections, and two calls before one backward. Parametrised by the implementation like the
bodies of `ringcheck.testing.properties` (whose conventions they keep: ``check_*(case, ...,
impl=simulated_impl)`` raising AssertionError with the case and a reproduction).

An implementation on a ring of processes (`ringcheck.testing.impl_runner.CaseRun`) runs the
calls itself (``results(inputs, call)``, ``two_calls(first, second)``); a whole-tensor one is
given whole views and called here.
"""

from __future__ import annotations

import torch

from ..harness.call import INPUT_LAYOUTS, arrange
from ..judge.check import Case, Results, simulated_impl
from ..judge.inputs import Inputs
from .compare import verdict_of
from .properties import case_inputs, other_inputs

LAYOUT_WORDS = {"fused_qkv": "q, k, v views of one fused projection, dout a transposed view",
                "kv_strides": "k a view of a fused K/V buffer, v a transposed view (other strides), dout a view"}


def _views(layout: str, x: Inputs):
    """Whole-tensor inputs as `layout` hands them over, and how their buffers' grads map back."""
    q, k, v, dout, leaves, grads_of, _ = arrange(layout, x.q, x.k, x.v, x.dout, True)
    return Inputs(q, k, v, dout, x.sinks), leaves, grads_of


def _whole_views(fn, x: Inputs, layout: str) -> Results:
    arranged, leaves, grads_of = _views(layout, x)
    sinks = None if x.sinks is None else x.sinks.detach().clone().requires_grad_(True)
    out, lse = fn(arranged.q, arranged.k, arranged.v) if sinks is None else fn(arranged.q, arranged.k,
                                                                                arranged.v, sinks)
    every = (*leaves, *(() if sinks is None else (sinks,)))
    grads = torch.autograd.grad(out, every, arranged.dout)
    dq, dk, dv = grads_of(grads[:len(leaves)])
    return Results(out.detach(), lse.detach(), dq, dk, dv, None if sinks is None else grads[-1])


def check_input_layout(case: Case, layout: str, impl=simulated_impl) -> None:
    """With the inputs as views (`layout`, of `ringcheck.harness.call.INPUT_LAYOUTS`), every
    tensor within the budget against float64, as with contiguous inputs."""
    if layout not in INPUT_LAYOUTS:
        raise ValueError(f"input layout {layout!r} is unknown; choose from {list(INPUT_LAYOUTS)}")
    x = case_inputs(case)
    whole = impl(case)
    got = whole.results(x, call=layout) if hasattr(whole, "results") else _whole_views(whole, x, layout)
    verdict = verdict_of(case, x, got)
    if not verdict.passed:
        raise AssertionError(f"with {LAYOUT_WORDS.get(layout, layout)}: {verdict.message()}\n"
                             f"  reproduce: {case.repro()}")


def _two_whole_calls(fn, first: Inputs, second: Inputs) -> tuple[Results, Results]:
    leaves, outs = [], []
    for x in (first, second):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (x.q, x.k, x.v))
        sinks = None if x.sinks is None else x.sinks.detach().clone().requires_grad_(True)
        outs.append(fn(q, k, v) if sinks is None else fn(q, k, v, sinks))
        leaves.append((q, k, v) if sinks is None else (q, k, v, sinks))
    grads = torch.autograd.grad([o for o, _ in outs], [t for ls in leaves for t in ls], [first.dout, second.dout])
    n = len(leaves[0])
    return tuple(Results(o.detach(), lse.detach(), *g[:3], g[3] if len(g) > 3 else None)
                 for (o, lse), g in zip(outs, (grads[:n], grads[n:])))


def check_two_calls_before_backward(case: Case, impl=simulated_impl) -> None:
    """Two calls (the forward of one input, then of another of the same shapes) before one
    backward of both, as two attention layers of a model: each call within the budget against
    its float64 truth."""
    x, y = case_inputs(case), other_inputs(case)
    whole = impl(case)
    calls = whole.two_calls(x, y) if hasattr(whole, "two_calls") else _two_whole_calls(whole, x, y)
    for which, got, inputs in (("first", calls[0], x), ("second", calls[1], y)):
        verdict = verdict_of(case, inputs, got)
        if not verdict.passed:
            raise AssertionError(f"the {which} of two calls before one backward: {verdict.message()}\n"
                                 f"  reproduce: {case.repro()}")
