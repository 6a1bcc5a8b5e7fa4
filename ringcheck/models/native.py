"""The truth of `ringcheck step --model`: the model as its authors wrote it, on one device.

The reference of every `--model` case is the same weights with transformers' own attention
(`attn_implementation="eager"`, `NATIVE`) at CP=1 on whole sequences. Three measured facts of
transformers 5.23 shape how it is run (docs/explanation/native-truth.md has the numbers):

- eager computes its softmax in float32 even in a float64 model
  (`nn.functional.softmax(scores, dim=-1, dtype=torch.float32)`): against it a correct float64
  glue sits near 5e-8 on a tiny model's logits, a budget of float32 in a float64 check. The
  reference therefore runs under `float64_softmax()`, which hands a float64 input asked for a
  float32 softmax a float64 one; the authors' code is otherwise unchanged (their norms and rope
  keep their own float32 steps, which the run under test takes identically). With it the truth
  equals a float64 attention computed from the layers' semantics (`semantics.py`) exactly on
  the logits of the issue's eleven proof models (0.0 measured; gradients 0 .. 3e-16).
- its packing mask is built only with `use_cache=False`, and gpt_oss's mask ignores
  `position_ids` altogether. So packed documents are kept apart by construction: each document
  is its own forward (its slice of `position_ids`, so the rope sees the positions the batch
  gives), and the logits are concatenated. No model's mask quirk can then join two documents.
  Tokens after the last boundary (padding) are one more sequence of their own.
- `ForCausalLMLoss` casts the logits to float32. The truth's loss is computed here, in float64,
  from the logits: labels shifted on the whole sequence (`shift_labels`), -100 ignored, summed
  and divided once by the global count of every micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..step.contract import IGNORE, shift_labels
from ..thirdparty.transformers_private import attn_implementation

NATIVE = "eager"


@contextlib.contextmanager
def float64_softmax() -> Iterator[None]:
    """Within the block, `torch.nn.functional.softmax(x, ..., dtype=torch.float32)` on a float64
    `x` computes in float64 (transformers' eager calls it through the module attribute, as
    `nn.functional.softmax` or `F.softmax`, so the patch reaches it); every other call is passed
    through unchanged. Autograd records the float64 op, so the backward is float64 too."""
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and input.dtype == torch.float64:
            dtype = torch.float64
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """The model runs its attention as `name` (a transformers implementation or a function
    registered with `AttentionInterface`) within the block, and as before after it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"the native truth needs a transformers model (a PreTrainedModel with a config); got "
                        f"{type(model).__name__}: build it with TinyModel.build or from_config")
    before = attn_implementation(config)
    if before != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if attn_implementation(model.config) != before:
            model.set_attn_implementation(before)


def segments(seq_len: int, cu_seqlens) -> list[tuple[int, int]]:
    """The [start, end) spans run as sequences of their own: the documents of `cu_seqlens`
    (None: the whole sequence), then the tail after the last boundary, if any (padding)."""
    if cu_seqlens is None:
        return [(0, seq_len)]
    cu = [int(x) for x in torch.as_tensor(cu_seqlens).tolist()]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])) or cu[-1] > seq_len:
        raise ValueError(f"cu_seqlens {cu}: expected strictly increasing document boundaries from 0 to at most the "
                         f"sequence length {seq_len}, e.g. (0, 21, 45, {seq_len})")
    spans = list(zip(cu, cu[1:]))
    return spans + [(cu[-1], seq_len)] if cu[-1] < seq_len else spans


def run_documents(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """The model's logits (batch, seq, vocab), each span of `segments` its own forward (no cache:
    transformers would otherwise build one and skip its packing mask)."""
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(f"input_ids and position_ids must both be (batch, seq); got {tuple(input_ids.shape)} and "
                         f"{tuple(position_ids.shape)}")
    parts = [model(input_ids=input_ids[:, a:b], position_ids=position_ids[:, a:b], use_cache=False).logits
             for a, b in segments(input_ids.shape[1], cu_seqlens)]
    return torch.cat(parts, dim=1)


def native_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """The truth's logits (batch, seq, vocab): transformers' eager attention at CP=1 on whole
    sequences, each document its own forward, the softmax in float64 for a float64 model (see
    the module's docstring). Differentiable: `native_step` takes gradients through it."""
    with attention_implementation(model, NATIVE), float64_softmax():
        return run_documents(model, input_ids, position_ids, cu_seqlens)


def causal_lm_loss(logits: list[torch.Tensor], labels: list[torch.Tensor], targets=None) -> torch.Tensor:
    """The correct step's loss in float64: each micro-batch's labels shifted on its whole
    sequence, -100 not counted, the summed cross-entropy divided once by the global count.
    `targets` (one per micro-batch, already shifted): the targets a step under test gave the
    tokens instead (a diagnosis's candidate), still divided by the correct global count."""
    total = sum(int((shift_labels(y) != IGNORE).sum()) for y in labels)
    if total == 0:
        raise ValueError("the micro-batches count no target (every shifted label is -100): a step over them has no "
                         "loss to compare; give at least one label that is not -100")
    targets = [shift_labels(y) for y in labels] if targets is None else targets
    ce = sum(F.cross_entropy(z.to(torch.float64).flatten(0, 1), t.to(z.device).flatten(),
                             ignore_index=IGNORE, reduction="sum") for z, t in zip(logits, targets))
    return ce / total


def step_with(model, micro_batches: list[dict], logits_of, targets=None):
    """(loss, {parameter name: gradient}, [logits per micro-batch]) of the correct step, the
    logits of each micro-batch being `logits_of(model, input_ids, position_ids, cu_seqlens)`.

    The loss is `causal_lm_loss` (the common convention of `ringcheck.step.contract`); the
    gradients are those of that loss for every parameter that requires one (zeros where the loss
    does not reach it), taken with `torch.autograd.grad`, so the model's own `.grad` is left as
    it was. Under `torch.no_grad()` (an evaluation) the gradients are {}. `targets`: see
    `causal_lm_loss`."""
    if not micro_batches:
        raise ValueError("a step needs at least one micro-batch")
    logits = [logits_of(model, mb["input_ids"], mb["position_ids"], mb.get("cu_seqlens")) for mb in micro_batches]
    loss = causal_lm_loss(logits, [mb["labels"] for mb in micro_batches], targets)
    if not loss.requires_grad:
        return loss.detach(), {}, [z.detach() for z in logits]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    out = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}
    return loss.detach(), out, [z.detach() for z in logits]


def native_step(model, micro_batches: list[dict]):
    """The correct step's truth: (loss, {parameter name: gradient}, [logits per micro-batch]),
    the logits `native_logits` (see `step_with`)."""
    return step_with(model, micro_batches, native_logits)
