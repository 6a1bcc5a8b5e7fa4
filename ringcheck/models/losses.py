"""The known losses of attention semantics a glue can make, as candidates for the diagnosis.

A `LayerSemantics` says what one layer's attention computes; a `Candidate` is the native
semantics of every layer with one loss (`LOSSES`) applied to the layers having the feature (all
of them, or one alone), or two losses of different features together on all their layers (a
glue that drops the window and the scale at once, as prime-rl PR #2828's did). Candidates that
come to the same computation are one, with every reading of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LOSSES = ("window_dropped", "window_wider", "window_narrower", "window_dropped_short_shard",
          "sinks_dropped", "softcap_dropped", "scale_default", "documents_crossed", "mask_plain_causal",
          "chunk_dropped_short_shard")
# the losses that depend on the ring size: the feature lost only where a rank's shard is not longer
# than it (a glue testing its local key length against the window or chunk), and the feature's size
SHARD_SHORT = {"window_dropped_short_shard": "window", "chunk_dropped_short_shard": "chunk"}


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
    # the heads regrouped as a Ulysses glue can regroup them (`ringcheck.models.heads`; None: each its own):
    # query head h meets K/V head kv_map[h], takes the sink sinks_map[h], and its output is head out_map[h]'s
    kv_map: tuple[int, ...] | None = None
    sinks_map: tuple[int, ...] | None = None
    out_map: tuple[int, ...] | None = None


def _has(loss: str, sem: LayerSemantics, short: int, head_dim: int) -> bool:
    """Whether `loss` changes a layer (`short`: the local key length of the shard-short rule)."""
    return {"window_dropped": sem.window is not None, "window_wider": sem.window is not None,
            "window_narrower": sem.window is not None and sem.window >= 2,
            "window_dropped_short_shard": sem.window is not None and short <= sem.window,
            "chunk_dropped_short_shard": sem.chunk is not None and short <= sem.chunk,
            "sinks_dropped": sem.sinks, "softcap_dropped": sem.softcap is not None,
            "scale_default": abs(sem.scaling - head_dim ** -0.5) > 1e-12 * sem.scaling, "documents_crossed": True,
            "mask_plain_causal": sem.window is not None or sem.chunk is not None}[loss]


def _lose(loss: str, sem: LayerSemantics, head_dim: int) -> LayerSemantics:
    """The layer's semantics with `loss` applied."""
    if loss in ("window_dropped", "window_dropped_short_shard"):
        return replace(sem, window=None)
    if loss in ("window_wider", "window_narrower"):
        return replace(sem, window=sem.window + (1 if loss == "window_wider" else -1))
    return {"chunk_dropped_short_shard": lambda: replace(sem, chunk=None),
            "sinks_dropped": lambda: replace(sem, sinks=False), "softcap_dropped": lambda: replace(sem, softcap=None),
            "scale_default": lambda: replace(sem, scaling=head_dim ** -0.5),
            "documents_crossed": lambda: replace(sem, documents=False),
            "mask_plain_causal": lambda: replace(sem, window=None, chunk=None)}[loss]()


def _words(loss: str, native: dict[int, LayerSemantics], layers, head_dims, short: int, world_size: int) -> str:
    w = sorted({native[i].window for i in layers if native[i].window is not None})
    c = sorted({native[i].chunk for i in layers if native[i].chunk is not None})
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
        "chunk_dropped_short_shard": f"the chunked attention removed where the shard is not longer than the chunk "
                                     f"({short} keys per rank at P={world_size}, chunk = {', '.join(map(str, c))}), as "
                                     f"a glue does that chunks only when its local key length exceeds the chunk",
    }[loss]


def on_layers(layers) -> str:
    """'on layer 3', 'on layers 0 and 2', 'on layers 0, 2 and 4'."""
    xs = [str(i) for i in sorted(layers)]
    return f"on layer {xs[0]}" if len(xs) == 1 else f"on layers {', '.join(xs[:-1])} and {xs[-1]}"


@dataclass(frozen=True)
class Candidate:
    """One recomputation: the native semantics with `parts` (one loss, or two of different
    features) applied on `layers`. `losses`: every loss this computation is a reading of (a
    sliding window dropped is also a sliding mask replaced by plain causal); `readings`: each
    reading in words, with its layers; `reading_losses`: each reading's losses, in the same order;
    `name`: the first reading's losses, joined by "+"."""

    parts: tuple[str, ...]
    layers: tuple[int, ...]
    semantics: tuple[tuple[int, LayerSemantics], ...]
    readings: tuple[str, ...]
    reading_losses: tuple[tuple[str, ...], ...]
    # what the step around the attention changed, model-wide (`ringcheck.models.heads.SHARD_LOSSES`; "" none):
    # the position ids the rotary embedding is given, and the targets of the loss
    positions: str = ""
    targets: str = ""

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(loss for names in self.reading_losses for loss in names)

    @property
    def name(self) -> str:
        return "+".join(self.parts)

    def describe(self) -> str:
        also = "".join(f" (equally: {w})" for w in self.readings[1:])
        return f"the model with {self.readings[0]}{also}"


def local_key_length(seq_len: int, world_size: int, layout: str) -> int:
    """The keys a rank holds of a global sequence padded to the layout's multiple (P for
    contiguous, 2P for zigzag): what a glue's attention sees as its key length."""
    multiple = world_size * (2 if layout == "zigzag" else 1)
    return -(-seq_len // multiple) * multiple // world_size


def canonical(layers: dict[int, LayerSemantics], seq_len: int, longest: int) -> tuple:
    """The computation the layers make: a window or chunk that no span it attends over fills (the
    longest document where documents are kept apart, else the sequence) is none, so candidates
    differing only there, which compute the same figures, are one."""
    def bite(x, span):
        return x if x is not None and x < span else None
    return tuple((i, replace(s, window=bite(s.window, longest if s.documents else seq_len),
                             chunk=bite(s.chunk, longest if s.documents else seq_len)))
                 for i, s in sorted(layers.items()))


# losses of one feature: two of them together are no candidate (one overrides the other)
_FEATURE = {"window_dropped": "mask", "window_wider": "mask", "window_narrower": "mask",
            "window_dropped_short_shard": "mask", "mask_plain_causal": "mask", "chunk_dropped_short_shard": "mask",
            "sinks_dropped": "sinks",
            "softcap_dropped": "softcap", "scale_default": "scale", "documents_crossed": "documents"}


def candidates(native: dict[int, LayerSemantics], head_dims: dict[int, int], *, seq_len: int, world_size: int,
               layout: str, packed: bool, longest: int | None = None) -> list[Candidate]:
    """Every known loss (`LOSSES`) on all the layers having its feature and on each such layer
    alone, then every two losses of different features together, each on all its layers;
    documents_crossed only where a micro-batch is packed; scale_default only on layers whose
    scaling is not head_dim^-0.5. Candidates with the same computation are merged (the first
    found names it: a single loss before a pair; `longest`: the longest document, default
    `seq_len`)."""
    short = local_key_length(seq_len, world_size, layout)
    merged: dict[tuple, Candidate] = {}
    wholes: list[tuple[str, tuple[int, ...]]] = []

    def add(parts: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        sem = dict(native)
        for loss, layers in parts:
            sem.update({i: _lose(loss, sem[i], head_dims[i]) for i in layers})
        key = canonical(sem, seq_len, longest or seq_len)
        if key == canonical(native, seq_len, longest or seq_len):
            return
        reading = " and ".join(f"{_words(loss, native, layers, head_dims, short, world_size)} {on_layers(layers)}"
                               for loss, layers in parts)
        names = tuple(loss for loss, _ in parts)
        layers = tuple(sorted({i for _, ls in parts for i in ls}))
        if key not in merged:
            merged[key] = Candidate(names, layers, key, (reading,), (names,))
        elif len(parts) == 1 or len(merged[key].parts) > 1:
            c = merged[key]
            merged[key] = replace(c, readings=c.readings + (reading,), reading_losses=c.reading_losses + (names,))

    for loss in LOSSES:
        if loss == "documents_crossed" and not packed:
            continue
        having = tuple(i for i, sem in sorted(native.items()) if _has(loss, sem, short, head_dims[i]))
        if having:
            wholes.append((loss, having))
        for layers in [having] + ([(i,) for i in having] if len(having) > 1 else []) if having else ():
            add(((loss, layers),))
    for a, (x, xs) in enumerate(wholes):
        for y, ys in wholes[a + 1:]:
            if _FEATURE[x] != _FEATURE[y]:
                add(((x, xs), (y, ys)))
    return list(merged.values())
