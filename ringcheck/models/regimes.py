"""The cases of `ringcheck step --model` whose point is the ring size (issue 48).

A glue can be right only where a rank's shard is long: transformers' flash path tests the key
length it is handed (a shard's, under CP) against the window, so a glue built on it keeps a
layer's sliding window (or llama4's chunk) only where the shard is longer than it. The tiny
models' windows are 12 at 64 tokens, so the shard (32 tokens at P=2, 16 at P=4) is always longer
and such a glue passes every case but at P=8. These cases put the shard on both sides of the
model's window W at whatever P is checked, by giving each its own sequence length (P x the shard
it needs, a multiple of the layout's pieces, so no padding moves it):

| case | shard (keys per rank) | documents |
|---|---|---|
| `shard_shorter_than_window` | the largest below W | one |
| `shard_equal_to_window` | W | one |
| `shard_longer_than_window` | W + 4 | packed on the shards: one shorter than a shard, one across three (every one below four), one starting exactly on a shard boundary |

W is the smallest window or chunk of the model's layers (a model with none: the window the tiny
models scale to, so the cases are the same everywhere), rounded to the layout's pieces (zigzag
holds two per rank, so its shard is even). `shape_words` says, for every case of a run, the
tokens, the shard and the windows it ran with (the report's column); `regime_reading` names a
shard-short loss once the cases show it: the window lost where the shard is not longer than it,
kept where it is.
"""

from __future__ import annotations

from ..spec import RingSpec
from ..step.cases import CASES, DOCUMENTS, Case
from .losses import SHARD_SHORT, local_key_length
from .scale import scaled_window

REGIME_CASES = ("shard_shorter_than_window", "shard_equal_to_window", "shard_longer_than_window")
LONGER_BY = 4  # the longer case's shard: W + 4 keys (16 at the tiny models' 12)


def reaches(tiny) -> dict[str, list[int]]:
    """The model's windows and chunks, distinct and sorted: {"window": [...], "chunk": [...]}."""
    return {"window": sorted({x.window for x in tiny.layers if x.window}),
            "chunk": sorted({x.chunk for x in tiny.layers if x.chunk})}


def reach_of(tiny) -> int:
    """W: the smallest window or chunk of the model's layers; for a model with neither, the window
    the tiny models scale to (`scaled_window`)."""
    found = reaches(tiny)
    return min(found["window"] + found["chunk"], default=scaled_window(tiny.seq_len))


def pieces_per_rank(world_size: int, layout: str) -> int:
    """How many contiguous pieces a rank holds in `layout` (zigzag 2, contiguous 1): a shard is a
    multiple of it."""
    return RingSpec(world_size, layout).chunks // world_size


def regime_shards(reach: int, world_size: int, layout: str) -> dict[str, int]:
    """The shard of each regime case: below, at and above `reach`, each a multiple of the rank's
    pieces (the equal one rounded up to it where `reach` is not: zigzag holds even shards)."""
    m = pieces_per_rank(world_size, layout)
    up = lambda x: -(-x // m) * m  # noqa: E731
    below = max(m, (reach - 1) // m * m)
    return {"shard_shorter_than_window": below, "shard_equal_to_window": up(reach),
            "shard_longer_than_window": up(reach + LONGER_BY)}


def shard_documents(seq_len: int, world_size: int, layout: str) -> tuple[tuple[int, ...], ...]:
    """Per micro-batch, document boundaries on the layout's pieces (u tokens each, n of them): one
    document shorter than a piece, one across three pieces, one starting exactly on a piece
    boundary ([0, u/2), [u/2, 3u), [3u, L)). A ring of fewer than four pieces has no three to
    span: one micro-batch with a document across every piece, a second starting one on a boundary."""
    n = RingSpec(world_size, layout).chunks
    u = seq_len // n
    if n >= 4:
        return ((0, u // 2, 3 * u, seq_len),)
    return ((0, u // 2, seq_len), (0, u, seq_len))


def regime_case(name: str, tiny, world_size: int, layout: str) -> Case:
    """The regime case `name` for this model at this ring size and layout."""
    reach = reach_of(tiny)
    shard = regime_shards(reach, world_size, layout)[name]
    seq_len = shard * world_size
    side = {"shard_shorter_than_window": "shorter than", "shard_equal_to_window": "as long as",
            "shard_longer_than_window": "longer than"}[name]
    words = f"each rank's shard ({shard} keys at P={world_size}) {side} the window or chunk ({reach})"
    if name != "shard_longer_than_window":
        return Case(name, words, seq_len=seq_len)
    docs = shard_documents(seq_len, world_size, layout)
    return Case(name, words + ", packed documents on the shards: one shorter than a shard, one across three, one "
                "starting on a shard boundary", seq_len=seq_len, packed=True, micro=len(docs), documents=docs)


def model_case(name: str, tiny, world_size: int, layout: str) -> Case:
    """A `--model` case by name: a regime case made for this ring, else step's (`CASES`)."""
    if name in REGIME_CASES:
        return regime_case(name, tiny, world_size, layout)
    return CASES[name]


def shape_words(case: Case, tiny, world_size: int, layout: str) -> dict:
    """What a case ran with, for the report: its tokens, the shard (keys per rank, after the
    layout's padding), the model's windows and chunks, the shard's side of each, its documents."""
    shard = local_key_length(case.seq_len, world_size, layout)
    found = reaches(tiny)
    docs = None
    if case.packed:
        bounds = case.documents or (DOCUMENTS,)
        docs = [[b - a for a, b in zip(cu, cu[1:])] for cu in bounds]
    marks = [(kind, w, "shorter" if shard < w else "equal" if shard == w else "longer")
             for kind, ws in found.items() for w in ws]
    sides = {f"{kind} {w}": side for kind, w, side in marks}
    sign = {"shorter": "<", "equal": "=", "longer": ">"}
    brief = f"{case.seq_len} tok, shard {shard}" + "".join(
        f" {sign[side]} {w}" for w, side in sorted({(w, side) for _, w, side in marks}))
    text = f"{case.seq_len} tokens, shard {shard} keys per rank" + "".join(
        f", {side} than the {k}" if side != "equal" else f", equal to the {k}" for k, side in sides.items())
    if docs:
        text += "; documents of " + " | ".join(" + ".join(map(str, d)) for d in docs) + " tokens"
    return {"seq_len": case.seq_len, "shard": shard, "windows": found["window"], "chunks": found["chunk"],
            "sides": sides, "documents": docs, "brief": brief, "text": text}


# the losses that leave no window (chunk) at all: a case diagnosed with none of them kept it
REMOVES = {"window": ("window_dropped", "window_dropped_short_shard", "mask_plain_causal"),
           "chunk": ("chunk_dropped_short_shard", "mask_plain_causal")}


def regime_reading(rows: list[dict], tiny) -> None:
    """Where the cases show a shard-short loss, say it on the failed cases (in place).

    On a case whose shard is not longer than the window, a glue that drops the window only there
    computes what one dropping it everywhere computes (the diagnosis reads both); the cases whose
    shard is longer tell them apart. A failed case whose matched reading includes
    `window_dropped_short_shard` (or the chunk's) is named by it when some case with a shard
    longer than every window (chunk), and a sequence or document longer than it too, kept it:
    passed, or failed with a matched loss that leaves the window in place (one token too wide)."""
    found = reaches(tiny)
    for loss, kind in SHARD_SHORT.items():
        sizes = found[kind]
        kept = [r for r in rows if sizes and _bites_beyond_shard(r.get("shape"), max(sizes)) and _keeps(r, kind)]
        if not kept:
            continue
        passed = sum(r["verdict"] == "pass" for r in kept)
        how = (f"{passed} pass" if passed == len(kept) else
               f"{passed} pass, {len(kept) - passed} fail on another loss: "
               + ", ".join(sorted({r["diagnosis"]["loss"] for r in kept if r["verdict"] == "fail"})))
        shards = sorted({r["shape"]["shard"] for r in kept})
        span = f"{shards[0]}" if len(shards) == 1 else f"{shards[0]} to {shards[-1]}"
        for row in rows:
            d = row.get("diagnosis") or {}
            named = next((r for r in d.get("readings") or [] if tuple(r["losses"]) == (loss,)), None)
            if row["verdict"] != "fail" or not d.get("matched") or named is None:
                continue
            d.update(loss=loss, named_by="regimes", words=(
                f"{d.get('what', 'your logits and gradients')} equal the model with {named['words']} "
                f"({d.get('distance', '')}); the {len(kept)} case(s) whose shard is longer than the {kind} keep it "
                f"({how}; shards of {span} keys, e.g. {kept[-1]['case']}): the {kind} is lost only where the shard "
                f"is not longer than it"))


def _keeps(row: dict, kind: str) -> bool:
    """Whether a case's figures show the window (chunk) applied: it passed, or its diagnosis matched
    only losses that leave it in place."""
    if row["verdict"] == "pass":
        return True
    d = row.get("diagnosis") or {}
    losses = {x for r in d.get("readings") or [] for x in r["losses"]}
    return row["verdict"] == "fail" and bool(d.get("matched")) and bool(losses) and not losses & set(REMOVES[kind])


def _bites_beyond_shard(shape: dict | None, size: int) -> bool:
    """A case whose shard is longer than `size` and whose sequence (its longest document) is too."""
    if not shape or shape["shard"] <= size:
        return False
    longest = max((max(d) for d in shape["documents"]), default=0) if shape["documents"] else shape["seq_len"]
    return longest > size
