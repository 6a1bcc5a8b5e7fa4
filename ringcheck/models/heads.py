"""The Ulysses failure classes, as candidates for the diagnosis by semantics (`semantics.Diagnoser`).

A Ulysses glue regroups heads twice per layer (an all-to-all from sequence shards to head groups,
the attention over the whole sequence, the all-to-all back), and its step shards positions and
labels. Where it goes wrong the figures equal the native model with one of these changed, which is
what these candidates recompute (issue 61; the reports in ../shared/REPORTED_BUGS.md's Ulysses table):

| loss | what changed | parametrised by |
|---|---|---|
| `kv_heads_regrouped` | query head h meets another K/V head than its group's h // (H/K) | the K/V heads tiled to the H query heads (h mod K), or tiled instead of interleaved when replicated to P > K ranks ((h // (H/P)) mod K) |
| `heads_permuted` | the head groups come home to the wrong heads | rank r's group returned as rank r + 1's, or r - 1's (mod P) |
| `sinks_misrouted` | query head h takes another head's sink (any per-head parameter) | every rank the first group's sinks (s_aux[:H/P]), or rank r + 1's, or r - 1's |
| `local_positions` | the rotary embedding's position ids local to each rank's shard (0 .. n - 1) | the layout's local index |
| `labels_shifted_in_shards` | labels shifted inside each shard: the last token of every shard loses its target | the layout |
| `labels_rolled_in_shards` | labels rolled inside each shard: its last token's target wraps to its own first | the layout |

The head classes are layer semantics (`LayerSemantics.kv_map`, `sinks_map`, `out_map`) applied to
every layer having the feature and to each such layer alone, never all permutations: only those a
Ulysses all-to-all of P ranks over this layer's head layout makes. The shard classes change the
step around the attention, model-wide (`Candidate.positions`, `Candidate.targets`); their names are
those of `ringcheck step --recipe`'s diagnosis (`ringcheck.step.diagnosis`), where the loss's
normaliser reduced per rank (`mean_of_rank_means`) is named: under `--model` ringcheck's own step
computes the loss, so no glue can change its normaliser.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..step.contract import IGNORE, shift_labels
from ..step.diagnosis import Layout, shard_targets
from .losses import Candidate, LayerSemantics, canonical, on_layers

HEAD_LOSSES = ("kv_heads_regrouped", "heads_permuted", "sinks_misrouted")
SHARD_LOSSES = ("local_positions", "labels_shifted_in_shards", "labels_rolled_in_shards")
ULYSSES_LOSSES = HEAD_LOSSES + SHARD_LOSSES
FIELD = {"kv_heads_regrouped": "kv_map", "heads_permuted": "out_map", "sinks_misrouted": "sinks_map"}


def _pairs(mapping: tuple[int, ...], right: tuple[int, ...], what: str, limit: int = 6) -> str:
    """'query head 1 with K/V head 1 instead of 0, ...' for the heads the mapping changes."""
    wrong = [(h, m, r) for h, (m, r) in enumerate(zip(mapping, right)) if m != r]
    text = ", ".join(f"{h}: {what} {m} instead of {r}" for h, m, r in wrong[:limit])
    return text + (f", ... ({len(wrong)} heads)" if len(wrong) > limit else "")


def head_variants(loss: str, heads: int, kv_heads: int, world: int) -> list[tuple[tuple[int, ...], str, str]]:
    """The maps (one entry per query head) of `loss` that a Ulysses all-to-all of `world` ranks over
    `heads` query and `kv_heads` K/V heads makes, each with its kind and its words; none that change
    nothing."""
    h, k, p = heads, kv_heads, world
    out: list[tuple[tuple[int, ...], str, str]] = []
    if loss == "kv_heads_regrouped" and k and h % k == 0:
        right = tuple(i // (h // k) for i in range(h))
        tiled = tuple(i % k for i in range(h))
        out.append((tiled, "tiled", f"the {k} K/V heads tiled to the {h} query heads (query head h with K/V head h mod {k}, "
                           f"not its group's h // {h // k}; query head {_pairs(tiled, right, 'K/V head')})"))
        if k < p and p % k == 0 and h % p == 0:
            rep = tuple((i // (h // p)) % k for i in range(h))
            out.append((rep, "tiled_to_ranks", f"the {k} K/V heads replicated to the P={p} ranks by tiling, not interleaving (rank r "
                             f"given K/V head r mod {k}, not r // {p // k}; query head {_pairs(rep, right, 'K/V head')})"))
        return [v for v in out if v[0] != right]
    if h % p or p < 2 or loss not in ("heads_permuted", "sinks_misrouted"):
        return []
    g = h // p
    ident = tuple(range(h))
    if loss == "heads_permuted":
        for step, to in ((1, "r + 1"), (-1, "r - 1")):
            m = tuple((i - step * g) % h for i in ident)   # the heads of group r + step hold group r's output
            out.append((m, to, f"rank r's head group returned as rank ({to}) mod {p}'s heads ({g} heads a group; "
                           f"output head {_pairs(m, ident, 'holds head')})"))
    else:
        first = tuple(i % g for i in ident)
        out.append((first, "first", f"every rank given the first head group's sinks (s_aux[:{g}]) ({_pairs(first, ident, 'sink of')})"))
        for step, to in ((1, "r + 1"), (-1, "r - 1")):
            m = tuple((i + step * g) % h for i in ident)
            out.append((m, to, f"rank r given rank ({to}) mod {p}'s sinks ({_pairs(m, ident, 'sink of')})"))
    seen: set = set()
    return [v for v in out if v[0] != ident and not (v[0] in seen or seen.add(v[0]))]


def _applies(loss: str, sem: LayerSemantics) -> bool:
    return loss != "sinks_misrouted" or sem.sinks


_WHAT = {"kv_heads_regrouped": "query heads meeting the wrong K/V head", "heads_permuted":
         "the attention's head groups returned to the wrong heads", "sinks_misrouted": "the sinks taken from other heads"}


def ulysses_candidates(native: dict[int, LayerSemantics], shapes: dict[int, tuple[int, int]], *, world_size: int,
                       seq_len: int, longest: int) -> list[Candidate]:
    """Every head class (`HEAD_LOSSES`) on all the layers it applies to and on each alone, in each
    of its variants for this layer's heads (`shapes`: layer -> (heads, kv_heads)) at P=`world_size`;
    variants that compute the same are one, with every reading."""
    merged: dict[tuple, Candidate] = {}
    base = canonical(native, seq_len, longest)
    for loss in HEAD_LOSSES:
        # the variants by kind, so that the layers of one variant go together
        variants: dict[str, dict[int, tuple[tuple[int, ...], str]]] = {}
        for i, sem in sorted(native.items()):
            if not _applies(loss, sem) or i not in shapes:
                continue
            for m, kind, words in head_variants(loss, *shapes[i], world_size):
                variants.setdefault(kind, {})[i] = (m, words)
        for per_layer in variants.values():
            having = tuple(sorted(per_layer))
            for layers in [having] + ([(i,) for i in having] if len(having) > 1 else []):
                sem = dict(native)
                sem.update({i: replace(sem[i], **{FIELD[loss]: per_layer[i][0]}) for i in layers})
                key = canonical(sem, seq_len, longest)
                if key == base:
                    continue
                reading = f"{_WHAT[loss]}: {per_layer[layers[0]][1]} {on_layers(layers)}"
                if key in merged:
                    c = merged[key]
                    merged[key] = replace(c, readings=c.readings + (reading,), reading_losses=c.reading_losses + ((loss,),))
                else:
                    merged[key] = Candidate((loss,), layers, key, (reading,), ((loss,),))
    return list(merged.values())


def shard_candidates(native: dict[int, LayerSemantics], *, world_size: int, layout: str, seq_len: int,
                     longest: int, gradients: bool) -> list[Candidate]:
    """The shard classes (`SHARD_LOSSES`), model-wide; the labels' only where gradients are observed
    (they change no logit)."""
    key = canonical(native, seq_len, longest)
    layers = tuple(sorted(native))
    words = {"local_positions": f"the rotary position ids local to each rank's shard (restarting at 0 on every rank "
                                f"of {layout} shards at P={world_size}) instead of the tokens' global positions",
             "labels_shifted_in_shards": f"the labels shifted inside each rank's shard ({layout}, P={world_size}): the "
                                         f"last token of every shard loses its target (pass labels shifted on the "
                                         f"whole sequence, transformers' shift_labels)",
             "labels_rolled_in_shards": f"the labels rolled inside each rank's shard ({layout}, P={world_size}): the "
                                        f"last token of every shard is given its own shard's first token as target "
                                        f"(roll the labels on the whole sequence, then shard them)"}
    out = []
    for loss in SHARD_LOSSES:
        if loss.startswith("labels") and not gradients:
            continue
        positions = "local" if loss == "local_positions" else ""
        targets = loss.removeprefix("labels_").removesuffix("_in_shards") if loss.startswith("labels") else ""
        out.append(Candidate((loss,), layers, key, (words[loss],), ((loss,),), positions, targets))
    return out


def padded_batch(mb: dict, padded: int) -> dict:
    """A micro-batch padded as the step pads it for its layout: token 0, positions continuing the
    last, labels -100, the padding in the last document (causal: no real token sees it)."""
    extra = padded - mb["input_ids"].shape[1]
    if extra <= 0:
        return mb
    pos = mb["position_ids"]
    cu = mb.get("cu_seqlens")
    return {**mb, "input_ids": F.pad(mb["input_ids"], (0, extra), value=0),
            "labels": F.pad(mb["labels"], (0, extra), value=IGNORE),
            "position_ids": torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)], dim=1),
            "cu_seqlens": None if cu is None else [*[int(x) for x in cu][:-1], padded]}


def shard_inputs(candidate: Candidate, micro_batches: list[dict], *, world_size: int, layout: str):
    """The micro-batches (their position ids local where the candidate says so) and the targets
    (None: the correct ones) a candidate's step computes with. Labels rolled inside the shards give
    the last shard's padding a target (its first token's): those micro-batches are padded as the
    step pads them, and their logits are to be cut back to the real tokens (`Diagnoser`)."""
    if not candidate.positions and not candidate.targets:
        return micro_batches, None
    out, targets = [], []
    for mb in micro_batches:
        where = Layout(layout, world_size, mb["input_ids"].shape[1], mb.get("cu_seqlens"))
        if candidate.targets == "rolled":
            mb = padded_batch(mb, where.padded)
        n = mb["input_ids"].shape[1]
        if candidate.positions == "local":
            mb = {**mb, "position_ids": where.local[:n].to(mb["position_ids"]).expand_as(mb["position_ids"]).clone()}
        out.append(mb)
        targets.append(shard_targets(mb["labels"], where, candidate.targets == "rolled") if candidate.targets
                       else shift_labels(mb["labels"]))
    return out, targets if candidate.targets else None
