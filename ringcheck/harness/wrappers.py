"""One rank's calls of an implementation as training wraps them: inside activation checkpointing
and under `torch.compile`.

- `CHECKPOINT`, `CHECKPOINT_REENTRANT`: two layers' worth, each call inside
  `torch.utils.checkpoint` (``use_reentrant=False``, then ``True``): the forward of one input,
  the forward of another (same shapes, other data), one backward of both. The backward
  recomputes each call's forward first (the later call's first), so a ring that keeps
  state between its forward and its backward outside the autograd context (a module-level or
  per-group slot) reads what the recompute overwrote. `run_two_calls` is the same two layers
  without checkpointing: the run these equal bit for bit when the ring keeps no such state.
- `COMPILED`: the implementation's function under `torch.compile` (backend ``aot_eager`` on the
  CPU, ``inductor`` on CUDA), called on one input and then on another, each with its backward;
  what dynamo made of it rides along on the first call's results (`compile_info`): the error if
  it did not compile, the graph breaks with their reasons, the graphs. dynamo's caches are
  reset before and after, so each run counts its own breaks.

Each call's shards come back as `run_shards` returns them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..adapters import ContractError, Impl
from ..judge.check import Case
from ..judge.inputs import Inputs
from ..thirdparty.torch_private import dynamo_counters, dynamo_reset
from .call import Prepared, require_graph, run_shards

CHECKPOINT = "checkpoint"                      # torch.utils.checkpoint(use_reentrant=False)
CHECKPOINT_REENTRANT = "checkpoint_reentrant"  # torch.utils.checkpoint(use_reentrant=True)
COMPILED = "compiled"
COMPILE_INFO = "compile"  # the key of the first call's results that holds `compile_info`
REASON_CHARS = 160        # a graph break's reason: its first line, cut to this
MODES = {CHECKPOINT: "use_reentrant=False", CHECKPOINT_REENTRANT: "use_reentrant=True"}  # the checkpoints, in words
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def differing(a, b) -> list[str]:
    """The tensors whose bits differ between the results `a` and `b` (one of them missing counts)."""
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and x.equal(y))
    return [t for t in TENSORS if not same(a.get(t), b.get(t))]


def run_checkpointed(impl: Impl, case: Case, first: Inputs, second: Inputs, rank: int, group,
                     device: torch.device | str = "cpu", *, reentrant: bool,
                     forward_only: bool = False) -> tuple[dict, dict]:
    """Two calls, each inside `torch.utils.checkpoint(use_reentrant=reentrant)`, then one
    backward of both (`torch.autograd.backward`: the reentrant checkpoint refuses
    `torch.autograd.grad`); each call's shards of out, lse, dq, dk, dv, dsinks."""
    if forward_only:
        raise ValueError("checkpointing recomputes the forward inside the backward: it has nothing to check without "
                         "a backward (--forward-only)")
    preps = [Prepared(impl, case, x, rank, torch.device(device), grad=True, layout="contiguous")
             for x in (first, second)]
    calls = []
    for prep in preps:
        def layer(*tensors, prep=prep):
            out, lse = prep.call(group, *tensors)
            return (out,) if lse is None else (out, lse)
        calls.append(checkpoint(layer, *prep.leaves, use_reentrant=reentrant))
    for got in calls:
        require_graph(impl, got[0])
    torch.autograd.backward([got[0] for got in calls], [p.dout for p in preps])
    results = []
    for prep, got in zip(preps, calls):
        grads = tuple(leaf.grad for leaf in prep.leaves)
        missing = [name for name, g in zip(prep.names, grads) if g is None]
        if missing:
            raise ContractError(f"--impl {impl.name}: under torch.utils.checkpoint(use_reentrant={reentrant}) no "
                                f"gradient flows to {', '.join(missing)}")
        results.append(prep.results(got[0], got[1] if len(got) > 1 else None, grads))
    return tuple(results)


def compile_backend(device: torch.device) -> str:
    """torch.compile's backend for `device`: inductor on CUDA (its kernels: the budget rule
    judges them), aot_eager elsewhere (the same ATen kernels as eager, traced)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def _first_line(text: Any) -> str:
    return (str(text).strip().splitlines() or [""])[0][:REASON_CHARS]


def compile_info(counters, backend: str, error: str | None, said=()) -> dict[str, Any]:
    """What dynamo made of the function: {backend, error (None: it compiled and ran), graph_breaks
    (how many), reasons (each break's first line -> how often), graphs (the FX graphs it
    compiled), fullgraph (whether it compiled whole: no break and no error, what
    `fullgraph=True` would have accepted), warnings (the first line of each warning it gave,
    once: kept here, not printed by every rank)}."""
    reasons = Counter()
    for reason, count in counters["graph_break"].items():
        reasons[_first_line(reason)] += count
    breaks = sum(reasons.values())
    return {"backend": backend, "error": error, "graph_breaks": breaks, "reasons": dict(reasons.most_common()),
            "graphs": int(counters["stats"].get("unique_graphs", 0)), "fullgraph": error is None and breaks == 0,
            "warnings": list(dict.fromkeys(_first_line(w.message) for w in said))}


def run_compiled(impl: Impl, case: Case, first: Inputs, second: Inputs, rank: int, group,
                 device: torch.device | str = "cpu", *, forward_only: bool = False) -> tuple[dict, dict]:
    """The implementation's function under `torch.compile`, called on `first` and then on
    `second`, each with its backward (unless `forward_only`); `compile_info` under
    `COMPILE_INFO` in the first call's results. A function that does not compile or raises
    compiled gives no tensors (None) and the error: not compiling is information, not a
    wrong result."""
    counters = dynamo_counters()  # torch._dynamo (about a second to import), only where a compile row runs

    device = torch.device(device)
    backend = compile_backend(device)
    dynamo_reset()
    counters.clear()
    compiled = dataclasses.replace(impl, fn=torch.compile(impl.fn, backend=backend))
    error, results = None, []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            for x in (first, second):
                results.append(run_shards(compiled, case, x, rank, group, device, forward_only=forward_only))
        except Exception as exc:  # whatever the compiled function raised: the row reports it, never a verdict
            error = f"{type(exc).__name__}: {_first_line(exc)}"
            results = [dict.fromkeys(TENSORS) for _ in (first, second)]
    results[0][COMPILE_INFO] = compile_info(counters, backend, error, said)
    dynamo_reset()  # the worker keeps no compiled code of this run
    counters.clear()
    return tuple(results)


# call name -> how a rank makes it: (impl, case, first, second, rank, group, device, *, forward_only)
WRAPPED_CALLS: dict[str, Callable[..., tuple[dict, dict]]] = {
    CHECKPOINT: partial(run_checkpointed, reentrant=False),
    CHECKPOINT_REENTRANT: partial(run_checkpointed, reentrant=True),
    COMPILED: run_compiled,
}
