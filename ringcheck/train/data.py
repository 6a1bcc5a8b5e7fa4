"""The training data: a seeded copy task whose answers sit on other ranks.

Every document of a sequence (the whole sequence without ``--documents``) is random tokens
(Zipf-distributed, as words are) whose second part repeats the first: the target of query
position j is the token at j - `gap`, `gap` about half the document. The loss counts exactly
those predictable targets (the copies), so a model can only lower it below the unigram
entropy by attending half a document back. Without documents, half a sequence back lies on
another rank in every layout at even P: contiguous (another half), zig-zag (P chunks back:
rank r's partner chunk is never its own) and striped (an odd gap there, off the querying
rank's stripe); with documents most answers do (suites/test_train.py checks both).

Documents are the variant's (`--documents`, with `--pad` padding tokens after them): rotary
positions restart at 0 in each document, padding tokens (id 0) are no one's target and the
loss skips them. A batch is drawn from (seed, step) alone, the same in every run: the
reference, the noise runs and every rank of the ring build the same global batch and take
their parts of it (`rank_part`). The global batch holds every CP group's sequences: group g
of a mesh trains on sequences [g B, (g + 1) B), as data parallelism deals them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ring.layouts import positions
from .config import TrainConfig

PAD_TOKEN = 0
STEP_SEED = 1_000_003  # batch of step t: seed x this + t


MIN_DOCUMENT = 4  # a shorter document is random tokens with no counted target


def gap(length: int, layout: str) -> int:
    """How far back the answer of a counted query sits in a document of `length` tokens: half
    of it (exactly P zig-zag chunks), made odd on striped shards (an even gap would keep the
    answer on the query's own stripe for every even P)."""
    half = length // 2
    return half + 1 if layout == "striped" and half % 2 == 0 else half


def zipf(size: int) -> torch.Tensor:
    """Token frequencies 1/rank (Zipf's law, as in text): a model learns them in a few steps."""
    weights = 1.0 / torch.arange(1, size + 1, dtype=torch.float64)
    return weights / weights.sum()


def documents(config: TrainConfig) -> list[tuple[int, int]]:
    """[start, end) of every document (without --documents: one, the whole sequence)."""
    cu = config.cu_seqlens
    if cu is None:
        return [(0, config.seq_len)]
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


@dataclass(frozen=True)
class Batch:
    """One step's data: tokens, targets (the next token), which targets the loss counts, and
    the rotary positions (restarting per document)."""

    tokens: torch.Tensor   # (sequences, seq_len) int64
    labels: torch.Tensor   # (sequences, seq_len) int64, PAD_TOKEN where there is no target
    counted: torch.Tensor  # (sequences, seq_len) bool
    rope: torch.Tensor     # (seq_len,) int64

    def part(self, index: torch.Tensor, rows: slice) -> Batch:
        """The sequences `rows` at the positions `index` (a rank's shard)."""
        return Batch(self.tokens[rows][:, index], self.labels[rows][:, index], self.counted[rows][:, index],
                     self.rope[index])


def rope_positions(config: TrainConfig) -> torch.Tensor:
    """(seq_len,) rotary positions: the offset inside each document, 0 on padding."""
    rope = torch.zeros(config.seq_len, dtype=torch.int64)
    for a, b in documents(config):
        rope[a:b] = torch.arange(b - a)
    return rope


def counted_mask(config: TrainConfig) -> torch.Tensor:
    """(seq_len,) bool: the query positions whose next token is a copy (the same for every
    sequence and step)."""
    counted = torch.zeros(config.seq_len, dtype=torch.bool)
    for a, b in documents(config):
        if b - a >= MIN_DOCUMENT:
            counted[a + gap(b - a, config.layout):b - 1] = True
    return counted


def make_batch(config: TrainConfig, step: int, sequences: int) -> Batch:
    """Step `step`'s global batch of `sequences` sequences."""
    gen = torch.Generator().manual_seed(config.seed * STEP_SEED + step)
    n = config.seq_len
    tokens = 1 + torch.multinomial(zipf(config.vocab - 1), sequences * n, replacement=True,
                                   generator=gen).view(sequences, n)
    end = documents(config)[-1][1] if config.cu_seqlens is not None else n
    tokens[:, end:] = PAD_TOKEN
    for a, b in documents(config):
        if b - a >= MIN_DOCUMENT:
            d = gap(b - a, config.layout) + 1  # token i + d repeats token i
            tokens[:, a + d:b] = tokens[:, a:b - d]
    labels = torch.full_like(tokens, PAD_TOKEN)
    counted = counted_mask(config).expand(sequences, n).clone()
    labels[:, :-1] = tokens[:, 1:]
    labels[~counted] = PAD_TOKEN
    return Batch(tokens, labels, counted, rope_positions(config))


def counted_tokens(config: TrainConfig, rings: int) -> int:
    """Targets the loss counts in one step's global batch (every CP group's sequences)."""
    return int(counted_mask(config).sum()) * config.batch * rings


def rank_part(config: TrainConfig, batch: Batch, *, rank: int, group_index: int) -> Batch:
    """What rank `rank` of CP group `group_index` holds: its group's sequences at the global
    positions its layout gives it."""
    index = positions(layout=config.layout, rank=rank, world_size=config.world_size, seq_len=config.seq_len,
                      cu_seqlens=config.cu_seqlens)
    rows = slice(group_index * config.batch, (group_index + 1) * config.batch)
    return batch.part(index, rows)
