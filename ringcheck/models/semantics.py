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

from ..spec import REFERENCE_DTYPES
from ..step.contract import IGNORE, shift_labels
from ..step.verdict import K_COND, budgets, relative
from .native import attention_implementation, native_step, run_documents, segments, step_with

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
    spans (documents, then the padding tail) of the sequence being computed (none: one forward
    per document, the whole forward one span)."""

    layers: dict[int, LayerSemantics]
    spans: tuple[tuple[int, int], ...]
    whole: bool = False


_CURRENT: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("ringcheck_semantics", default=None)


def _boundaries(n: int, spans, sem: LayerSemantics) -> tuple[int, ...]:
    """The cu_seqlens the dense reference is given for a layer: the documents (one span when they
    are crossed), each cut into its chunks when the layer is chunked."""
    spans = spans if sem.documents and spans else ((0, n),)
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
def recomputed(layers: dict[int, LayerSemantics], *, whole: bool = False) -> Iterator[None]:
    """Within the block, `semantic_logits` computes with these layers' semantics (`whole`: one
    forward over each packed sequence even where every layer keeps the documents apart)."""
    token = _CURRENT.set(_Forward(dict(layers), (), whole))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def semantic_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """The model's logits on whole sequences, every layer's attention computed from the semantics
    `recomputed` holds. Where every layer keeps documents apart, each document is its own forward,
    exactly as the native truth runs (the same shapes through the model's float32 steps, e.g.
    Llama 4's rope: one forward over a packed batch rounds them differently, ~1e-9); otherwise one
    forward, the documents handed to the attention."""
    plan = _CURRENT.get()
    if plan is None:
        raise RuntimeError("semantic_logits runs inside ringcheck.models.semantics.recomputed(layers)")
    with attention_implementation(model, SEMANTIC):
        if not plan.whole and all(sem.documents for sem in plan.layers.values()):
            return run_documents(model, input_ids, position_ids, cu_seqlens)
        token = _CURRENT.set(replace(plan, spans=tuple(segments(input_ids.shape[1], cu_seqlens))))
        try:
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        finally:
            _CURRENT.reset(token)


def semantic_step(model, layers: dict[int, LayerSemantics], micro_batches: list[dict], *, whole: bool = False):
    """`native_step`'s (loss, gradients, logits), each layer's attention from `layers`."""
    with recomputed(layers, whole=whole):
        return step_with(model, micro_batches, semantic_logits)


# ---- the candidates: each known loss of semantics, on every layer having the feature and on each alone


def _has(loss: str, sem: LayerSemantics, short: int) -> bool:
    """Whether `loss` changes a layer (`short`: the local key length of the shard-short rule)."""
    return {"window_dropped": sem.window is not None, "window_wider": sem.window is not None,
            "window_narrower": sem.window is not None and sem.window >= 2,
            "window_dropped_short_shard": sem.window is not None and short <= sem.window,
            "sinks_dropped": sem.sinks, "softcap_dropped": sem.softcap is not None,
            "scale_default": False, "documents_crossed": True,
            "mask_plain_causal": sem.window is not None or sem.chunk is not None}[loss]


def _lose(loss: str, sem: LayerSemantics, head_dim: int) -> LayerSemantics:
    """The layer's semantics with `loss` applied."""
    if loss in ("window_dropped", "window_dropped_short_shard"):
        return replace(sem, window=None)
    if loss in ("window_wider", "window_narrower"):
        return replace(sem, window=sem.window + (1 if loss == "window_wider" else -1))
    return {"sinks_dropped": lambda: replace(sem, sinks=False), "softcap_dropped": lambda: replace(sem, softcap=None),
            "scale_default": lambda: replace(sem, scaling=head_dim ** -0.5),
            "documents_crossed": lambda: replace(sem, documents=False),
            "mask_plain_causal": lambda: replace(sem, window=None, chunk=None)}[loss]()


def _words(loss: str, native: dict[int, LayerSemantics], layers, head_dims, short: int, world_size: int) -> str:
    w = sorted({native[i].window for i in layers if native[i].window is not None})
    return {
        "window_dropped": "the sliding windows removed",
        "window_wider": "the sliding windows one token wider (W + 1, W = " + ", ".join(map(str, w)) + ")",
        "window_narrower": "the sliding windows one token narrower (W - 1, W = " + ", ".join(map(str, w)) + ")",
        "window_dropped_short_shard": f"the sliding windows removed where the shard is not longer than the window "
                                      f"({short} keys per rank at P={world_size}, W = {', '.join(map(str, w))}), as "
                                      f"a glue does that passes the window only when its local key length exceeds it",
        "sinks_dropped": "the attention sinks (s_aux) dropped",
        "softcap_dropped": "the attention logit softcap dropped",
        "scale_default": "the scale head_dim^-0.5 (" + ", ".join(
            f"{head_dims[i] ** -0.5:.4g}" for i in sorted(set(layers))[:1]) + ") instead of the layers' own (" + ", ".join(
            sorted({f"{native[i].scaling:.4g}" for i in layers})) + ")",
        "documents_crossed": "attention across the packed documents' boundaries",
        "mask_plain_causal": "the sliding/chunked masks replaced by plain causal",
    }[loss]


def on_layers(layers) -> str:
    """'on layer 3', 'on layers 0 and 2', 'on layers 0, 2 and 4'."""
    xs = [str(i) for i in sorted(layers)]
    return f"on layer {xs[0]}" if len(xs) == 1 else f"on layers {', '.join(xs[:-1])} and {xs[-1]}"


@dataclass(frozen=True)
class Candidate:
    """One recomputation: the native semantics with `losses` applied on `layers` (several losses
    that come to the same computation are one candidate, e.g. a sliding window dropped and a
    sliding mask replaced by plain causal)."""

    losses: tuple[str, ...]
    layers: tuple[int, ...]
    semantics: tuple[tuple[int, LayerSemantics], ...]
    words: tuple[str, ...]

    @property
    def loss(self) -> str:
        return self.losses[0]

    def describe(self) -> str:
        also = "".join(f" (equally: {w})" for w in self.words[1:])
        return f"the model with {self.words[0]} {on_layers(self.layers)}{also}"


def local_key_length(seq_len: int, world_size: int, layout: str) -> int:
    """The keys a rank holds of a global sequence padded to the layout's multiple (P for
    contiguous, 2P for zigzag): what a glue's attention sees as its key length."""
    multiple = world_size * (2 if layout == "zigzag" else 1)
    return -(-seq_len // multiple) * multiple // world_size


def candidates(native: dict[int, LayerSemantics], head_dims: dict[int, int], *, seq_len: int, world_size: int,
               layout: str, packed: bool) -> list[Candidate]:
    """Every known loss (`LOSSES`) on all the layers having its feature and on each such layer
    alone; documents_crossed only where a micro-batch is packed; scale_default only on layers whose
    scaling is not head_dim^-0.5. Candidates with the same computation are merged."""
    short = local_key_length(seq_len, world_size, layout)
    merged: dict[tuple, Candidate] = {}
    for loss in LOSSES:
        if loss == "documents_crossed" and not packed:
            continue
        having = [i for i, sem in sorted(native.items())
                  if (abs(sem.scaling - head_dims[i] ** -0.5) > 1e-12 * sem.scaling if loss == "scale_default"
                      else _has(loss, sem, short))]
        subsets = [tuple(having)] + ([(i,) for i in having] if len(having) > 1 else [])
        for layers in subsets if having else ():
            sem = dict(native)
            sem.update({i: _lose(loss, native[i], head_dims[i]) for i in layers})
            key = tuple(sorted(sem.items(), key=lambda kv: kv[0]))
            words = _words(loss, native, layers, head_dims, short, world_size)
            if key in merged:
                c = merged[key]
                merged[key] = replace(c, losses=c.losses + (loss,), words=c.words + (words,))
            else:
                merged[key] = Candidate((loss,), layers, key, (words,))
    return list(merged.values())


# ---- the diagnosis


@dataclass(frozen=True)
class Match:
    """A computation's distance to the observed figures: normwise relative, the worst micro-batch's
    logits and the worst parameter's gradient (None: no gradients observed); `within`: every
    quantity within its tolerance."""

    candidate: Candidate | None   # None: the native model itself
    logits: float
    grads: float | None
    within: bool

    def distance(self, word: str = "to ") -> str:
        grads = "" if self.grads is None else f", gradients {word}{self.grads:.1e}"
        return f"logits {word}{self.logits:.1e}{grads}"


@dataclass(frozen=True)
class Diagnosis:
    """What the observed CP=P figures equal. `matches`: the candidates within tolerance, nearest
    first (empty: none); `truth`: the native model's own distance; `reproduced`: the distance
    between the native truth and the recomputation with no loss (the check that the layers'
    semantics say everything the model computes; when it fails nothing is diagnosed)."""

    matches: tuple[Match, ...]
    truth: Match
    nearest: Match | None
    tried: tuple[Match, ...]
    reproduced: float
    reproducible: bool
    tolerance: float
    shape_dependence: float = 0.0

    @property
    def matched(self) -> str | None:
        """The loss the figures equal ("none" for the native model), or None."""
        if self.truth.within:
            return "none"
        return self.matches[0].candidate.loss if self.matches else None

    @property
    def layers(self) -> tuple[int, ...]:
        return self.matches[0].candidate.layers if self.matches and not self.truth.within else ()

    def summary(self) -> str:
        what = "your logits" if self.truth.grads is None else "your logits and gradients"
        if not self.reproducible:
            return (f"no diagnosis by semantics: the layers' semantics do not reproduce the native model (the "
                    f"recomputation is {self.reproduced:.1e} off it, over the budget of an exact recomputation)")
        if self.truth.within:
            return f"{what} equal the native model ({self.truth.distance()}): no semantic is lost"
        if self.matches:
            return "; ".join(f"{what} equal {m.candidate.describe()} ({m.distance()})" for m in self.matches)
        near = "" if self.nearest is None else (f"; the nearest is {self.nearest.candidate.describe()} "
                                                f"({self.nearest.distance()})")
        note = "" if not self.shape_dependence else (
            f"; note: this model's figures change when a packed batch is one forward instead of one per document "
            f"({self.shape_dependence:.1e} on the logits): it computes something from the token's index in the "
            f"forward, not from position_ids (llama4's attention temperature does), which no glue can carry")
        return (f"{what} match none of the known losses of semantics ({len(self.tried)} tried; off the native model "
                f"by {self.truth.distance('')}){near}{note}")

    def to_dict(self) -> dict:
        def row(m: Match) -> dict:
            c = m.candidate
            return {"losses": list(c.losses) if c else ["none"], "layers": list(c.layers) if c else [],
                    "logits": m.logits, "grads": m.grads, "within": m.within}
        return {"matched": self.matched, "layers": list(self.layers), "summary": self.summary(),
                "reproduced": self.reproduced, "tolerance": self.tolerance, "truth": row(self.truth),
                "shape_dependence": self.shape_dependence,
                "tried": [row(m) for m in self.tried]}


def _as_list(logits) -> list[torch.Tensor]:
    return [logits] if isinstance(logits, torch.Tensor) else list(logits)


def _distances(a, b) -> tuple[list[float], dict[str, float] | None]:
    """Per micro-batch logits and per parameter gradient distances of figures a to figures b
    (each (logits list, grads dict or None))."""
    (za, ga), (zb, gb) = a, b
    if len(za) != len(zb) or any(x.shape != y.shape for x, y in zip(za, zb)):
        raise ValueError(f"observed logits of shapes {[tuple(x.shape) for x in za]} cannot be compared with the "
                         f"model's {[tuple(y.shape) for y in zb]}: give one (batch, seq, vocab) per micro-batch")
    logits = [relative(x.detach().cpu(), y.cpu()) for x, y in zip(za, zb)]
    if ga is None:
        return logits, None
    missing = sorted(set(gb) - set(ga))
    if missing:
        raise ValueError(f"observed gradients lack {len(missing)} parameters of the model, e.g. {missing[:3]}")
    return logits, {k: relative(ga[k].detach().cpu(), gb[k].cpu()) for k in gb}


class Diagnoser:
    """The recomputations of one model and batch, made once: the native truth, the exact
    recomputation (its distance to the truth is the noise of every quantity) and every
    candidate's figures; `diagnose` then compares any observed figures with them.

    `gradients=False` for an evaluation (no gradients observed). `tolerance`: the relative
    distance that counts as equal (default the float64 step budget of the micro-batches,
    `ringcheck.step.verdict.budgets`; a glue that runs bf16 passes its measured noise budget).
    Every quantity's tolerance is at least 16 times its noise: the distances to the truth of the
    exact recomputation, per document and (packed batches) in one forward, whose other shapes
    round the model's own float32 steps otherwise (Gemma's norms compute their weights'
    gradients in float32: ~1e-7; `noise`, (logits, gradients))."""

    def __init__(self, model, tiny, micro_batches: list[dict], *, world_size: int, layout: str = "contiguous",
                 gradients: bool = True, tolerance: float | None = None):
        native = layer_semantics(tiny)
        head_dims = {layer.index: int(layer.head_dim) for layer in tiny.layers}
        n = sum(int((shift_labels(mb["labels"]) != IGNORE).sum()) for mb in micro_batches)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        exact = budgets(max(n, 1), dtype if dtype in REFERENCE_DTYPES else "float32", None)[1]
        self.tolerance = exact if tolerance is None else float(tolerance)
        self.gradients = gradients

        def figures(step, *args, **kwargs):
            with torch.enable_grad() if gradients else torch.no_grad():
                _, g, z = step(model, *args, micro_batches, **kwargs)
            return z, g if gradients else None

        self.truth = figures(native_step)
        noise_z, noise_g = _distances(figures(semantic_step, native), self.truth)
        self.reproduced = max(noise_z)
        self.reproducible = self.reproduced <= exact
        packed = any(len(segments(mb["input_ids"].shape[1], mb.get("cu_seqlens"))) > 1 for mb in micro_batches)
        self.shape_dependence = 0.0
        if packed:  # other shapes through the model's own float32 steps (a CP run's shards are other shapes too)
            shaped_z, shaped_g = _distances(figures(semantic_step, native, whole=True), self.truth)
            rounding = budgets(max(n, 1), "float32", None)[1] / K_COND  # 2 n u of float32
            if max([*shaped_z, *(shaped_g or {}).values()]) <= rounding:
                noise_z = [max(a, b) for a, b in zip(noise_z, shaped_z)]
                noise_g = None if noise_g is None else {k: max(v, shaped_g[k]) for k, v in noise_g.items()}
            else:  # not rounding: the model computes something from the forward's own token index
                self.shape_dependence = max(shaped_z)
        self.noise = max(noise_z), max((noise_g or {0: 0.0}).values())
        self.tol_z = max(self.tolerance, 16 * max(noise_z))
        self.tol_g = {k: max(self.tolerance, 16 * v) for k, v in (noise_g or {}).items()}
        seq_len = max(mb["input_ids"].shape[1] for mb in micro_batches)
        found = candidates(native, head_dims, seq_len=seq_len, world_size=world_size, layout=layout, packed=packed)
        self.candidates = [(c, figures(semantic_step, dict(c.semantics))) for c in found] if self.reproducible else []

    def _match(self, candidate, observed, figures) -> Match:
        dz, dg = _distances(observed, figures)
        within = max(dz) <= self.tol_z and (dg is None or all(v <= self.tol_g[k] for k, v in dg.items()))
        return Match(candidate, max(dz), None if dg is None else max(dg.values(), default=0.0), within)

    def diagnose(self, observed_logits, observed_grads) -> Diagnosis:
        if (observed_grads is not None) != self.gradients:
            raise ValueError(f"observed gradients {'given' if observed_grads is not None else 'absent'}, but the "
                             f"diagnoser was made with gradients={self.gradients}: make it to match the figures")
        observed = (_as_list(observed_logits), observed_grads)
        truth = self._match(None, observed, self.truth)
        if not self.reproducible or truth.within:
            return Diagnosis((), truth, None, (), self.reproduced, self.reproducible, self.tolerance,
                             self.shape_dependence)
        tried = sorted((self._match(c, observed, f) for c, f in self.candidates),
                       key=lambda m: (max(m.logits, m.grads or 0.0), len(m.candidate.layers)))
        matches = tuple(m for m in tried if m.within)
        return Diagnosis(matches, truth, tried[0] if tried else None, tuple(tried), self.reproduced,
                         self.reproducible, self.tolerance, self.shape_dependence)


def diagnose(model, tiny, micro_batches: list[dict], observed_logits, observed_grads, *, world_size: int,
             layout: str = "contiguous", tolerance: float | None = None) -> Diagnosis:
    """The lost semantic (and on which layers) the observed CP=P figures match (`Diagnoser`).

    `observed_logits`: the gathered global logits, one (batch, seq, vocab) per micro-batch (or
    one tensor, for one micro-batch); `observed_grads`: {parameter name: gradient}, summed over
    the CP group (None for an evaluation); `layout`: the sharding of the glue's ring."""
    return Diagnoser(model, tiny, micro_batches, world_size=world_size, layout=layout,
                     gradients=observed_grads is not None, tolerance=tolerance).diagnose(observed_logits, observed_grads)


__all__ = ["LOSSES", "SEMANTIC", "Candidate", "Diagnoser", "Diagnosis", "LayerSemantics", "Match", "candidates", "diagnose",
           "layer_semantics", "local_key_length", "on_layers", "recomputed", "semantic_attention", "semantic_logits",
           "semantic_step"]
