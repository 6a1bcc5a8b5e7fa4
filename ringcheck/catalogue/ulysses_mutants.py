"""Mutant Ulysses glues: ringcheck's Ulysses glue (`ringcheck.glues.ulysses`) with one bug each, the
kinds reported in trainers' Ulysses glues (../shared/REPORTED_BUGS.md), as user-contract glue
objects, re-exported by `ringcheck.catalogue.glue_mutants`:
`ringcheck step --model gemma3_text --glue ringcheck.catalogue.glue_mutants:ulysses_gqa_regrouped`.

Each is named by the diagnosis with its class (`ringcheck.models.heads`) on every model having the
feature, and equals the correct glue on a model without it:

| mutant | the bug | class named | the feature | as in |
|---|---|---|---|---|
| `ulysses_gqa_regrouped` | K/V heads expanded to the query heads with `repeat` (tiled) instead of `repeat_interleave` | kv_heads_regrouped | 1 < kv_heads < heads | vllm-omni PR #5716, verl #1226 |
| `ulysses_heads_permuted` | the returning all-to-all's head groups put back one group on: rank r's heads land on rank r + 1's | heads_permuted | any (P > 1) | VeOmni PR #1076 (the wrong shard indexed) |
| `ulysses_sinks_misrouted` | every rank takes s_aux[:H/P], the first head group's sinks | sinks_misrouted | sinks | verl PR #4551, SkyRL PR #558 |
| `ulysses_rotary_local` | position ids restart at 0 on every rank's shard (the rotary embedding local) | local_positions | rotary | ms-swift #8468, Automodel #1482 |
| `ulysses_documents_crossed` | the global document boundaries never reach the attention over the whole sequence | documents_crossed | packed documents | LlamaFactory PR #7338 |
| `ulysses_labels_rolled` | labels rolled inside each shard: its last token's target wraps to its first | labels_rolled_in_shards | any | verl #6068 |

The loss's normaliser reduced per rank has no mutant here: under `--model`, ringcheck's own step
computes the loss, so a glue cannot change it (`ringcheck step --recipe` names it: mean_of_rank_means).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..glues.ours import refuses, refuses_calls
from ..glues.ulysses import UlyssesGlue, refuses_ring
from ..step.contract import shift_labels

ULYSSES_BUGS = {"ulysses_gqa_regrouped": "kv_heads_regrouped", "ulysses_heads_permuted": "heads_permuted",
                "ulysses_sinks_misrouted": "sinks_misrouted", "ulysses_rotary_local": "local_positions",
                "ulysses_documents_crossed": "documents_crossed", "ulysses_labels_rolled": "labels_rolled_in_shards"}
SHARDING = ("ulysses_rotary_local", "ulysses_labels_rolled")   # the bugs in the glue's own sharding of the batch


class UlyssesMutant(UlyssesGlue):
    """ringcheck's Ulysses glue with the bug `bug` (a name of `ULYSSES_BUGS`)."""

    refuses = staticmethod(refuses)
    refuses_calls = staticmethod(refuses_calls)
    refuses_ring = staticmethod(refuses_ring)

    def __init__(self, bug: str):
        if bug not in ULYSSES_BUGS:
            raise ValueError(f"unknown Ulysses bug {bug!r}; one of {', '.join(ULYSSES_BUGS)}")
        super().__init__(name=f"ringcheck_mutant_{bug}")
        self.bug = bug
        self.describe = f"ringcheck's Ulysses glue with one bug: {bug} (ringcheck.catalogue.glue_mutants)"
        self.shard = self.sharded if bug in SHARDING else None

    def prepare(self, cu_seqlens, group) -> None:
        super().prepare(None if self.bug == "ulysses_documents_crossed" else cu_seqlens, group)

    def kv_heads(self, kv: torch.Tensor, heads: int, world: int) -> torch.Tensor:
        if self.bug == "ulysses_gqa_regrouped":
            return kv.repeat(1, 1, heads // kv.shape[2], 1)   # tiled: query head h meets K/V head h mod K
        return super().kv_heads(kv, heads, world)

    def rank_sinks(self, sinks: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        if self.bug == "ulysses_sinks_misrouted":
            return sinks[:sinks.shape[0] // world]
        return super().rank_sinks(sinks, rank, world)

    def head_order(self, world: int):
        if self.bug == "ulysses_heads_permuted":
            return [(g - 1) % world for g in range(world)]
        return super().head_order(world)

    def sharded(self, batch: dict, group) -> dict:
        """The glue's own contiguous sharding (`Glue.shard`), with its bug in the positions or the labels."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ids = batch["input_ids"]
        n = ids.shape[1] // world
        held = torch.arange(rank * n, (rank + 1) * n, device=ids.device)
        pos = batch["position_ids"][:, held]
        targets = shift_labels(batch["labels"])[:, held]
        if self.bug == "ulysses_rotary_local":
            pos = torch.arange(n, device=ids.device).expand_as(pos).to(pos.dtype)
        if self.bug == "ulysses_labels_rolled":
            targets = torch.roll(batch["labels"][:, held], -1, dims=1)
        return {"input_ids": ids[:, held], "position_ids": pos, "labels": targets, "positions": held}


# one object per bug, in ULYSSES_BUGS' order
(ulysses_gqa_regrouped, ulysses_heads_permuted, ulysses_sinks_misrouted, ulysses_rotary_local, ulysses_documents_crossed,
 ulysses_labels_rolled) = (UlyssesMutant(bug) for bug in ULYSSES_BUGS)
