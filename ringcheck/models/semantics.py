"""Diagnosis by semantics: which attention semantic a glue lost, and on which layers.

When a model's step at CP=P and the native truth (`native.py`) differ, the figures are compared
with the native model recomputed under each known loss of semantics (`LOSSES`), applied to every
layer having the feature and to each such layer alone. The one the figures match is named with
its distance: "your logits and gradients equal the model with the sliding windows removed on
layers 0 and 2 (to 2e-15)".

The recomputation is the model's own code with one change: its attention is `SEMANTIC`, a
function registered with transformers' `AttentionInterface` that computes each layer's attention
in float64 from explicit semantics (`LayerSemantics`: scaling, sliding window in transformers'
convention, chunk, sinks, softcap, whether packed documents are kept apart), through ringcheck's
dense reference (`reference.dense_attention`). With no override it equals the native truth to
~1e-16 (`diagnose` measures this every time and says so when it does not hold); each override
is one candidate.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface

from reference import dense_attention

from .native import attention_implementation, native_step, segments, step_with

SEMANTIC = "ringcheck_semantics"
LOSSES = ("window_dropped", "window_wider", "window_narrower", "window_dropped_short_shard",
          "sinks_dropped", "softcap_dropped", "scale_default", "documents_crossed", "mask_plain_causal")


@dataclass(frozen=True)
class LayerSemantics:
    """What one layer's attention computes. `window`: transformers' W (key j visible to query i
    iff i - W < j <= i); `chunk`: keys visible only within the query's chunk of that size
    (counted from the document's start); `sinks`: the layer's learned sink logits join every
    softmax; `documents`: packed documents are kept apart (False: attention crosses them)."""

    scaling: float
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    softcap: float | None = None
    documents: bool = True


def layer_semantics(tiny) -> dict[int, LayerSemantics]:
    """The native semantics of every layer of a `TinyModel` (its `layers`, `LayerAttention`)."""
    return {layer.index: LayerSemantics(scaling=float(layer.scaling), window=layer.window, chunk=layer.chunk,
                                        sinks=bool(layer.sinks), softcap=layer.softcap) for layer in tiny.layers}


@dataclass(frozen=True)
class _Forward:
    """What the attention function of one recomputation reads: every layer's semantics and the
    spans (documents, then the padding tail) of the sequence being computed."""

    layers: dict[int, LayerSemantics]
    spans: tuple[tuple[int, int], ...]


_CURRENT: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("ringcheck_semantics", default=None)


def _boundaries(n: int, spans, sem: LayerSemantics) -> tuple[int, ...]:
    """The cu_seqlens the dense reference is given for a layer: the documents (one span when they
    are crossed), each cut into its chunks when the layer is chunked."""
    spans = spans if sem.documents else ((0, n),)
    cuts = set()
    for a, b in spans:
        cuts.update(range(a, b, sem.chunk) if sem.chunk else (a,))
    return tuple(sorted(cuts)) + (n,)


def semantic_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature ((batch, heads, seq, dim) in, (batch, seq, heads, dv)
    out) computing the layer's `LayerSemantics` in float64; transformers' own mask is not used
    (the semantics say everything it would). Outside `recomputed` it refuses to guess."""
    plan = _CURRENT.get()
    if plan is None:
        raise RuntimeError(f"attention {SEMANTIC!r} computes a layer from explicit semantics and runs only inside "
                           f"ringcheck.models.semantics.recomputed(...)")
    index = getattr(module, "layer_idx", None)
    if index not in plan.layers:
        raise RuntimeError(f"attention {SEMANTIC!r}: no semantics for layer {index!r} ({type(module).__name__}); "
                           f"the layers known are {sorted(plan.layers)}")
    sem = plan.layers[index]
    sinks = kwargs.get("s_aux", getattr(module, "sinks", None)) if sem.sinks else None
    if sem.sinks and sinks is None:
        raise RuntimeError(f"layer {index} has sinks but transformers passed no s_aux and the module has no `sinks`")
    q, k, v = (t.transpose(1, 2).to(torch.float64) for t in (query, key, value))
    n = q.shape[1]
    out = dense_attention(q, k, v, causal=True, softmax_scale=sem.scaling, cu_seqlens=_boundaries(n, plan.spans, sem),
                          window=None if sem.window is None else (sem.window - 1, -1), softcap=sem.softcap,
                          sinks=None if sinks is None else sinks.to(torch.float64))
    return out.to(query.dtype), None


AttentionInterface.register(SEMANTIC, semantic_attention)


@contextlib.contextmanager
def recomputed(layers: dict[int, LayerSemantics]) -> Iterator[None]:
    """Within the block, `semantic_logits` computes with these layers' semantics."""
    token = _CURRENT.set(_Forward(dict(layers), ()))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def semantic_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """The model's logits on whole sequences, one forward, every layer's attention computed from
    the semantics `recomputed` holds (documents kept apart by the reference's own boundaries)."""
    plan = _CURRENT.get()
    if plan is None:
        raise RuntimeError("semantic_logits runs inside ringcheck.models.semantics.recomputed(layers)")
    token = _CURRENT.set(replace(plan, spans=tuple(segments(input_ids.shape[1], cu_seqlens))))
    try:
        with attention_implementation(model, SEMANTIC):
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    finally:
        _CURRENT.reset(token)


def semantic_step(model, layers: dict[int, LayerSemantics], micro_batches: list[dict]):
    """`native_step`'s (loss, gradients, logits), each layer's attention from `layers`."""
    with recomputed(layers):
        return step_with(model, micro_batches, semantic_logits)


__all__ = ["LOSSES", "SEMANTIC", "LayerSemantics", "layer_semantics", "native_step", "recomputed",
           "semantic_attention", "semantic_logits", "semantic_step"]
