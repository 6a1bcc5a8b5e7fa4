"""The truth's own rounding: how far the gradients of a correct step move when only the order of
their sums changes.

The truth (`native_step`) is exact to float64 in its attention, but a model's own code may compute
other parts in float32 whatever the model's dtype: Gemma's RMSNorm computes `(1 + weight.float())`,
so its weights' gradients are float32 sums over the tokens. A CP run sums them per rank and then
over the ranks: a correct glue then sits ~1e-8 from the truth on those parameters (3.5e-8 to
8.4e-8 measured on gemma2, P=2), a million float64 budgets out, though nothing is wrong.

So the budget of every gradient is floored by a measurement, as `ringcheck.step.noise` does for a
narrowed attention: the truth's gradients taken once more with the targets split into the P parts
the ranks hold (one forward, one backward per part, the parts' gradients summed in float64), the
same loss summed in another order. `K_NOISE` x the change, per parameter (relative as the
parameter is judged: `ringcheck.models.budgets.judged_scale`), floors that parameter's budget. Where the model computes in float64 throughout the change is ~1e-16 and the
derived budget stands (2 n K_COND u is larger); where a parameter's gradient passes through
float32, its floor says so in the report.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from ..ring.layouts import positions
from ..spec import RingSpec
from ..step.contract import IGNORE, shift_labels
from ..step.noise import K_NOISE
from ..step.scales import distance
from ..step.verdict import relative

__all__ = ["K_NOISE", "float64_throughout", "split_gradients", "truth_noise"]


def _part_targets(labels: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The targets (shifted on the whole sequence) of the positions `held`, IGNORE elsewhere."""
    targets = shift_labels(labels)
    out = torch.full_like(targets, IGNORE)
    keep = held[held < targets.shape[1]]
    out[:, keep] = targets[:, keep]
    return out


def split_gradients(model, batches: list[dict], logits_of, *, layout: str, world_size: int,
                    total: torch.Tensor) -> dict[str, torch.Tensor]:
    """The correct step's gradients, the loss split into the targets each of `world_size` ranks
    holds in `layout` (the sequence padded to the layout's multiple), summed part by part."""
    logits = [logits_of(model, mb["input_ids"], mb["position_ids"], mb.get("cu_seqlens")) for mb in batches]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    multiple = RingSpec(world_size, layout).chunks
    for rank in range(world_size):
        loss = 0.0
        for z, mb in zip(logits, batches):
            n = mb["input_ids"].shape[1]
            held = positions(layout=layout, rank=rank, world_size=world_size, seq_len=-(-n // multiple) * multiple)
            loss = loss + F.cross_entropy(z.to(torch.float64).flatten(0, 1),
                                          _part_targets(mb["labels"], held).flatten(), ignore_index=IGNORE,
                                          reduction="sum")
        grads = torch.autograd.grad(loss / total, [p for _, p in named], retain_graph=rank < world_size - 1,
                                    allow_unused=True)
        for (name, _), g in zip(named, grads):
            if g is not None:
                sums[name] += g.to(torch.float64)
    return sums


def truth_noise(split: dict[str, torch.Tensor], truth: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter, the distance ||split - truth|| of its gradient (the judge scales it as it
    judges the parameter, `ringcheck.models.budgets.judged_scale`: relative to its true gradient,
    or to the whole gradient where the true one cancels to rounding, as a key bias's does)."""
    return {n: distance(split[n], g) for n, g in truth.items() if g is not None and n in split}


# the legitimate attentions of a narrowed glue's noise runs: the model built in the glue's dtype, at CP=1, with
# transformers' eager attention (the truth's, its softmax in float32) and with its sdpa
NARROW_RUNS = ("eager", "sdpa")


def token_change(logits: list[torch.Tensor], truth: list[torch.Tensor], batches: list[dict]) -> float:
    """sum_t |CE_t - CE_t(truth)| / sum_t CE_t(truth) over every counted target: a bound on the
    loss's relative change that no cancellation between tokens makes small by chance (a noise
    run's loss alone may land near the truth's while its tokens' losses do not)."""
    diff = total = 0.0
    for z, w, mb in zip(logits, truth, batches):
        target = shift_labels(mb["labels"]).flatten()
        ce = [F.cross_entropy(x.double().flatten(0, 1), target, ignore_index=IGNORE, reduction="none") for x in (z, w)]
        diff += float((ce[0] - ce[1]).abs().sum())
        total += float(ce[1].sum())
    return diff / total if total > 0 else diff


def narrow_noise(tiny, config, batches: list[dict], truth: dict, dtype) -> dict[str, Any]:
    """How far a correct step moves from the truth when the whole model runs in `dtype` (the
    glue's, e.g. bfloat16), at CP=1 with each attention of `NARROW_RUNS`: the relative change of
    the loss and of the logits (the worst micro-batch), and per parameter the distance of its
    gradient ||g - g_truth|| (`diffs`: `ringcheck.models.budgets.narrow_unit` scales each as the
    parameter is judged), per run; a run that raises (gemma2's sdpa refuses a softcap) is left out
    and said."""
    # start-up time: the truth imports transformers, only for a --model run
    from .native import native_step, run_documents, step_with

    rows, skipped = [], {}
    for attn in NARROW_RUNS:
        try:
            model = tiny.build(attn, dtype=dtype, seed=config.seed)
            loss, grads, logits = (native_step(model, batches) if attn == "eager" else
                                   step_with(model, batches, run_documents))
        except Exception as exc:  # a legitimate attention that cannot run this model: said
            skipped[attn] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            continue
        diffs = {n: distance(grads[n], g) for n, g in truth["grads"].items()
                 if g is not None and grads.get(n) is not None}
        rows.append({"run": attn, "loss": token_change(logits, truth["logits"], batches),
                     "logits": max(relative(z.double(), w) for z, w in zip(logits, truth["logits"])),
                     "diffs": diffs})
    return {"rows": rows, "skipped": skipped}


def own_rounding(tiny, config, batches: list[dict], grads: dict, built: dict | None = None) -> dict[str, float]:
    """Per parameter, the truth's distance to the same code run with no float32 step of its own
    (`float64_throughout`; `config`: the step's dtype and seed); {} where that run cannot be made
    (a model whose float32 step another dtype breaks): the split sums' floor then stands alone.
    `built`: a dict the caller keeps across its cases, where the model built under
    `float64_throughout` is kept (each case a copy: the same build, made once a task instead of
    once a case)."""
    # start-up time: the truth imports transformers, only for a --model run
    from .native import NATIVE, native_step

    try:
        if built is not None and "own" in built:
            model = copy.deepcopy(built["own"])
        else:
            with float64_throughout():  # the build under it too: the mode may change what it makes
                model = tiny.build(NATIVE, dtype=config.torch_dtype, seed=config.seed)
            if built is not None:
                built["own"] = copy.deepcopy(model)
        with float64_throughout():
            exact = native_step(model, batches)[1]
    except Exception:  # the measurement is a floor, never a verdict: without it the derived budget stands
        return {}
    return truth_noise({n: g.double() for n, g in exact.items() if g is not None}, grads)


def float32_steps(model, batch: dict, logits_of) -> int:
    """How many times the model's forward, run as the truth runs it (`logits_of`: eager's softmax
    already float64), casts a float64 tensor to float32: Llama's RMSNorm (`.to(torch.float32)`),
    Gemma's `weight.float()`, a MoE router's. Where it does, the model's own arithmetic is float32
    there: two correct attentions that differ by a float64 rounding flip its float32 roundings
    (deepseek_v3's logits: 1.3e-8 apart at P=2 on 61 tokens), and the budgets take float32's unit
    roundoff, as `ringcheck step` does for a ring not known to compute float64 throughout."""
    # start-up time: torch's dispatch mode is needed only for a --model run
    from ..thirdparty.torch_private import TorchDispatchMode, to_copy_op

    count, to_copy = 0, to_copy_op()

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            out = func(*args, **(kwargs or {}))
            if (func is to_copy and isinstance(out, torch.Tensor)
                    and out.dtype == torch.float32 and args[0].dtype == torch.float64):
                count += 1
            return out

    ids, pos = batch["input_ids"][:1, :8], batch["position_ids"][:1, :8]
    with torch.no_grad(), Casts():
        logits_of(model, ids, pos, None)
    return count


def _narrowing(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to` / `Tensor.type` call asks for float32 (by dtype, positional or keyword)."""
    return kwargs.get("dtype") is torch.float32 or any(a is torch.float32 or a == "torch.FloatTensor" for a in args)


def float64_throughout():
    """A context in which the model's own casts of a float64 tensor to float32 (`x.float()`,
    `x.to(torch.float32)`, `x.type(torch.float32)`) leave it float64: the authors' code run with no
    float32 step of its own. The truth's distance to that run is its own float32 rounding, measured
    per parameter (granite_swa forces its sinks' scaling to float32 inside the attention: a correct
    glue's sinks gradient sat at 1.0x the derived float32 budget on it, off the truth by the truth's
    rounding, not the glue's); `K_NOISE` x it floors that parameter's budget as the split sums' does."""
    # start-up time: torch's function mode is needed only for a --model run
    from torch.overrides import TorchFunctionMode

    class Float64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            this = args[0] if args else None
            if isinstance(this, torch.Tensor) and this.dtype == torch.float64:
                if func is torch.Tensor.float or (func in (torch.Tensor.to, torch.Tensor.type)
                                                  and _narrowing(args[1:], kwargs)):
                    return this
            return func(*args, **kwargs)

    return Float64()

