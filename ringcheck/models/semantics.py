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
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface

from ringcheck.reference import dense_attention

from ..spec import REFERENCE_DTYPES
from ..step.contract import IGNORE, shift_labels
from ..step.scales import distance, judged_scale, scaled, whole_norm
from ..step.verdict import K_COND, budgets, relative
from .heads import shard_candidates, shard_inputs, ulysses_candidates
from .losses import LOSSES, Candidate, LayerSemantics, candidates, local_key_length, on_layers  # noqa: F401 (re-exported)
from .native import attention_implementation, native_step, run_documents, segments, step_with

SEMANTIC = "ringcheck_semantics"


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
    if sem.kv_map is not None:   # each query head meets the K/V head the map gives it (heads.py)
        k, v = k[:, :, list(sem.kv_map)], v[:, :, list(sem.kv_map)]
    if sinks is not None and sem.sinks_map is not None:
        sinks = sinks[list(sem.sinks_map)]
    n = q.shape[1]
    out = dense_attention(q, k, v, causal=True, softmax_scale=sem.scaling, cu_seqlens=_boundaries(n, plan.spans, sem),
                          window=None if sem.window is None else (sem.window - 1, -1), softcap=sem.softcap,
                          sinks=None if sinks is None else sinks.to(torch.float64))
    if sem.out_map is not None:
        out = out[:, :, list(sem.out_map)]
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


def semantic_step(model, layers: dict[int, LayerSemantics], micro_batches: list[dict], *, whole: bool = False,
                  targets=None):
    """`native_step`'s (loss, gradients, logits), each layer's attention from `layers` (`targets`:
    `native.causal_lm_loss`'s)."""
    with recomputed(layers, whole=whole):
        return step_with(model, micro_batches, semantic_logits, targets)


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
    error: str = ""

    @property
    def matched(self) -> str | None:
        """The loss the figures equal (two together joined by "+"; "none" for the native model), or None."""
        if self.truth.within:
            return "none"
        return self.matches[0].candidate.name if self.matches else None

    @property
    def layers(self) -> tuple[int, ...]:
        return self.matches[0].candidate.layers if self.matches and not self.truth.within else ()

    def summary(self) -> str:
        what = "your logits" if self.truth.grads is None else "your logits and gradients"
        if not self.reproducible:
            why = (f"the recomputation fails ({self.error})" if self.error else f"the recomputation is "
                   f"{self.reproduced:.1e} off it, over the budget of an exact recomputation")
            return f"no diagnosis by semantics: the layers' semantics do not reproduce the native model ({why})"
        if self.truth.within:
            return f"{what} equal the native model ({self.truth.distance()}): no semantic is lost"
        if self.matches:
            return "; ".join(f"{what} equal {m.candidate.describe()} ({m.distance()})" for m in self.matches)
        near = "" if self.nearest is None else (f"; the nearest is {self.nearest.candidate.describe()} "
                                                f"({self.nearest.distance()})")
        note = "" if not self.shape_dependence else (
            f"; note: this model's figures change when other tokens come before a sequence in its forward "
            f"({self.shape_dependence:.1e} on the logits): it computes something from the token's index in the "
            f"forward, not from position_ids (llama4's attention temperature does), which an attention function "
            f"alone cannot carry")
        return (f"{what} match none of the known losses of semantics ({len(self.tried)} tried; off the native model "
                f"by {self.truth.distance('')}){near}{note}")

    def to_dict(self) -> dict:
        def row(m: Match) -> dict:
            c = m.candidate
            return {"name": c.name if c else "none", "losses": list(c.losses) if c else ["none"],
                    "layers": list(c.layers) if c else [],
                    "logits": m.logits, "grads": m.grads, "within": m.within}
        return {"matched": self.matched, "layers": list(self.layers), "summary": self.summary(),
                "reproduced": self.reproduced, "tolerance": self.tolerance, "truth": row(self.truth),
                "shape_dependence": self.shape_dependence,
                "tried": [row(m) for m in self.tried]}


def _as_list(logits) -> list[torch.Tensor]:
    return [logits] if isinstance(logits, torch.Tensor) else list(logits)


def _distances(a, b, scale: tuple[int, str]) -> tuple[list[float], dict[str, float] | None]:
    """Per micro-batch logits and per parameter gradient distances of figures a to figures b
    (each (logits list, grads dict or None)); each gradient's relative to b's, or to b's whole
    gradient where b's cancels to rounding (`ringcheck.step.scales.judged_scale`, `scale`: the
    target positions and the dtype the figures are exact to): a key bias's gradient, analytically
    zero, read 1.1e+13 relative to its own float64 residue."""
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
    whole = whole_norm(gb)
    out = {}
    for k, want in gb.items():
        if want is None:
            continue
        norm, against = judged_scale(want.cpu(), whole, *scale)
        got = ga[k].detach().cpu()
        out[k] = scaled(distance(got, want.cpu()), norm) if against else relative(got, want.cpu())
    return logits, out


class Diagnoser:
    """The recomputations of one model and batch, made once: the native truth, the exact
    recomputation (its distance to the truth is the noise of every quantity) and every
    candidate's logits (a candidate's gradients are computed only when its logits match, then
    kept: `figures`); `diagnose` then compares any observed figures with them.

    `gradients=False` for an evaluation (no gradients observed). `tolerance`: the relative
    distance that counts as equal (default the float64 step budget of the micro-batches,
    `ringcheck.step.verdict.budgets`; a glue that runs bf16 passes its measured noise budget).
    Every quantity's tolerance is at least 16 times its noise: the distances to the truth of the
    exact recomputation per document, in one forward (packed batches) and with every row twice,
    whose other matrix shapes round the model's own float32 steps otherwise, as a CP run's shards
    do (Gemma's norms compute their weights' gradients in float32: ~1e-7; `noise`, (logits,
    gradients)). Where that noise shows at all (over the float64 budget), the default tolerance
    is float32's, 2 n u, for every quantity, as the `--model` verdict's budget is: which
    parameters a CP run's other shapes move is not the noise runs' to say (measured: a real
    window-dropping glue at P=4 on gemma3_text, 9.7e-8 on a gradient the noise runs left exact)."""

    def __init__(self, model, tiny, micro_batches: list[dict], *, world_size: int, layout: str = "contiguous",
                 gradients: bool = True, tolerance: float | None = None):
        self.model, self.micro_batches, self.gradients = model, micro_batches, gradients
        native = layer_semantics(tiny)
        head_dims = {layer.index: int(layer.head_dim) for layer in tiny.layers}
        n = max(1, sum(int((shift_labels(mb["labels"]) != IGNORE).sum()) for mb in micro_batches))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self._scale = (n, dtype if dtype in REFERENCE_DTYPES else "float32")
        self._exact = exact = budgets(n, self._scale[1], None)[1]
        self.tolerance = exact if tolerance is None else float(tolerance)
        self.truth = self._step(None)
        self.error, self.shape_dependence, self.candidates, self._logits, self._grads = "", 0.0, [], [], {}
        try:
            noise_z, noise_g = _distances(self._step(native), self.truth, self._scale)
        except (RuntimeError, ValueError, TypeError) as exc:  # e.g. an attention module no layer describes
            self.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            noise_z, noise_g = [math.inf], None
        self.reproduced = max(noise_z)
        self.reproducible = self.reproduced <= exact
        self.noise, self.tol_z, self.tol_g, self._noise = (self.reproduced, math.inf), self.tolerance, {}, None
        if not self.reproducible:
            return
        packed = any(len(segments(mb["input_ids"].shape[1], mb.get("cu_seqlens"))) > 1 for mb in micro_batches)
        # other matrix shapes through the model's own float32 steps, as a CP run's shards are: one forward over
        # a packed batch, and every row twice (the same figures: the global count doubles with the sum)
        doubled = [{k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
                   for mb in micro_batches]
        z2, g2 = self._step(native, doubled)
        shapes = [([z[: len(z) // 2] for z in z2], g2)]
        rounding = budgets(n, "float32", None)[1] / K_COND  # 2 n u of float32
        # a document of 16 tokens before every row, in one forward: the same figures for the rows' own tokens,
        # unless the model computes something from a token's index in the forward (llama4's temperature)
        with torch.no_grad(), recomputed(native, whole=True):
            z = [semantic_logits(model, torch.cat([mb["input_ids"][:, :1].expand(-1, 16), mb["input_ids"]], 1),
                                 torch.cat([torch.arange(16).expand(len(mb["input_ids"]), 16).to(mb["position_ids"]),
                                            mb["position_ids"]], 1),
                                 (0, 16, *[16 + b for a, b in segments(mb["input_ids"].shape[1], mb.get("cu_seqlens"))]))
                 for mb in micro_batches]
        moved = max(_distances(([x[:, 16:] for x in z], None), (self.truth[0], None), self._scale)[0])
        self.shape_dependence = moved if moved > rounding else 0.0
        if packed:
            whole = self._step(native, whole=True)
            dz, dg = _distances(whole, self.truth, self._scale)
            if max([*dz, *(dg or {}).values()]) <= rounding:
                shapes.append(whole)
        for figures in shapes:
            dz, dg = _distances(figures, self.truth, self._scale)
            noise_z = [max(a, b) for a, b in zip(noise_z, dz)]
            noise_g = None if noise_g is None else {k: max(v, dg[k]) for k, v in noise_g.items()}
        self.noise = max(noise_z), max((noise_g or {0: 0.0}).values())
        self._noise = (noise_z, noise_g)
        self.tolerate(tolerance)
        seq_len = max(mb["input_ids"].shape[1] for mb in micro_batches)
        longest = max(b - a for mb in micro_batches for a, b in segments(mb["input_ids"].shape[1], mb.get("cu_seqlens")))
        self.candidates = candidates(native, head_dims, seq_len=seq_len, world_size=world_size, layout=layout,
                                     packed=packed, longest=longest)
        shapes = {layer.index: (int(layer.heads), int(layer.kv_heads)) for layer in tiny.layers
                  if getattr(layer, "heads", None) and getattr(layer, "kv_heads", None)}  # a model described without
        self.candidates += ulysses_candidates(native, shapes, world_size=world_size, seq_len=seq_len, longest=longest)
        self.candidates += shard_candidates(native, world_size=world_size, layout=layout, seq_len=seq_len,
                                            longest=longest, gradients=gradients)
        self.world_size, self.layout = world_size, layout
        self._logits = [self._candidate_step(c, grad=False)[0] for c in self.candidates]

    def tolerate(self, tolerance: float | None) -> Diagnoser:
        """This diagnoser judging within `tolerance` (the constructor's argument; the recomputations
        do not depend on it: another glue's figures on the same model and batch reuse them)."""
        self.tolerance = self._exact if tolerance is None else float(tolerance)
        if self._noise is None:  # not reproducible: nothing is diagnosed
            self.tol_z, self.tol_g = self.tolerance, {}
            return self
        noise_z, noise_g = self._noise
        if tolerance is None and max(self.noise) > self._exact:  # the model's own float32 steps show: float32's 2 n u
            self.tolerance = budgets(self._scale[0], "float32", None)[1] / K_COND
        self.tol_z = max(self.tolerance, 16 * max(noise_z))
        self.tol_g = {k: max(self.tolerance, 16 * v) for k, v in (noise_g or {}).items()}
        return self

    def _step(self, layers, micro_batches=None, *, whole: bool = False, grad: bool | None = None):
        """(logits, gradients or None) of the truth (layers None) or of a recomputation."""
        grad = self.gradients if grad is None else grad
        mbs = self.micro_batches if micro_batches is None else micro_batches
        with torch.enable_grad() if grad else torch.no_grad():
            _, g, z = native_step(self.model, mbs) if layers is None else semantic_step(self.model, layers, mbs,
                                                                                          whole=whole)
        return z, g if grad else None

    def _candidate_step(self, candidate: Candidate, grad: bool | None = None):
        """(logits, gradients or None) of a candidate: its layers' semantics, and the position ids and
        targets its step gives (`heads.shard_inputs`)."""
        mbs, targets = shard_inputs(candidate, self.micro_batches, world_size=self.world_size, layout=self.layout)
        if targets is None:
            return self._step(dict(candidate.semantics), mbs, grad=grad)
        grad = self.gradients if grad is None else grad
        with torch.enable_grad() if grad else torch.no_grad():
            _, g, z = semantic_step(self.model, dict(candidate.semantics), mbs, targets=targets)
        z = [x[:, :mb["input_ids"].shape[1]] for x, mb in zip(z, self.micro_batches)]   # padded: the real tokens'
        return z, g if grad else None

    def figures(self, candidate: Candidate):
        """(logits, gradients or None) of a candidate (its gradients computed once, when asked)."""
        i = self.candidates.index(candidate)
        if self.gradients and i not in self._grads:
            self._grads[i] = self._candidate_step(candidate)[1]
        return self._logits[i], self._grads.get(i)

    def _match(self, candidate, observed, figures) -> Match:
        dz, dg = _distances(observed, figures, self._scale)
        within = max(dz) <= self.tol_z and (dg is None or all(v <= self.tol_g.get(k, self.tolerance) for k, v in dg.items()))
        return Match(candidate, max(dz), None if dg is None else max(dg.values(), default=0.0), within)

    def diagnose(self, observed_logits, observed_grads) -> Diagnosis:
        """The candidates the observed figures equal: every candidate's logits compared, the
        gradients of those whose logits are within tolerance (the others' Match has grads None)."""
        if (observed_grads is not None) != self.gradients:
            raise ValueError(f"observed gradients {'given' if observed_grads is not None else 'absent'}, but the "
                             f"diagnoser was made with gradients={self.gradients}: make it to match the figures")
        observed = (_as_list(observed_logits), observed_grads)
        truth = self._match(None, observed, self.truth)
        if not self.reproducible or truth.within:
            return Diagnosis((), truth, None, (), self.reproduced, self.reproducible, self.tolerance,
                             self.shape_dependence, self.error)
        tried = []
        for c, z in zip(self.candidates, self._logits):
            m = self._match(c, (observed[0], None), (z, None))
            tried.append(self._match(c, observed, self.figures(c)) if m.within and self.gradients else m)
        tried.sort(key=lambda m: (max(m.logits, m.grads or 0.0), len(m.candidate.layers)))
        matches = tuple(m for m in tried if m.within)
        return Diagnosis(matches, truth, tried[0] if tried else None, tuple(tried), self.reproduced,
                         self.reproducible, self.tolerance, self.shape_dependence)


_MADE: dict[tuple, Diagnoser] = {}  # per process, the latest diagnosers by what they depend on (`diagnose`'s key)
KEPT = 16  # diagnosers kept (a model's failed cases at one ring size)


def diagnose(model, tiny, micro_batches: list[dict], observed_logits, observed_grads, *, world_size: int,
             layout: str = "contiguous", tolerance: float | None = None, key: tuple | None = None) -> Diagnosis:
    """The lost semantic (and on which layers) the observed CP=P figures match (`Diagnoser`).

    `observed_logits`: the gathered global logits, one (batch, seq, vocab) per micro-batch (or
    one tensor, for one micro-batch); `observed_grads`: {parameter name: gradient}, summed over
    the CP group (None for an evaluation); `layout`: the sharding of the glue's ring. `key`: what
    the model and the batch are (the caller's word for them), under which the diagnoser is kept
    for another glue's figures (with `world_size`, `layout` and whether gradients are observed):
    its recomputations made once, each glue's figures judged within its own tolerance."""
    gradients = observed_grads is not None
    kept = None if key is None else (key, world_size, layout, gradients)
    found = _MADE.get(kept) if kept is not None else None
    if found is None:
        found = Diagnoser(model, tiny, micro_batches, world_size=world_size, layout=layout, gradients=gradients,
                          tolerance=tolerance)
        if kept is not None:
            while len(_MADE) >= KEPT:
                _MADE.pop(next(iter(_MADE)))
            _MADE[kept] = found
    return found.tolerate(tolerance).diagnose(observed_logits, observed_grads)

