"""How a sequence is dealt out to the ranks of a ring, and which blocks of work that leaves.

Three layouts, each a pure function of (rank, world_size, seq_len):

- ``contiguous``: rank r holds tokens [r n, (r + 1) n), n = seq_len / P.
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, which
  balances causal work (every rank gets one early and one late chunk).
- ``striped``: token t lives on rank t mod P (Striped Attention), also balanced.

Within a rank the tokens are kept in increasing position order, so for the ring every
(query rank, K/V rank) pair reduces to a short list of `Block` s: a rectangle of local rows
and columns with a mask kind. Only two mask kinds exist: ``full`` and ``causal`` (key j is
seen by query i iff j <= i + diagonal); a pair that sees nothing has no block at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import RingSpec, check_layout

MASK_KINDS = ("full", "causal")


def check_mask(mask: object, diagonal: object = 0) -> None:
    """A block's mask kind and causal diagonal (the block contract of every backend)."""
    if mask not in MASK_KINDS:
        raise ValueError(f"mask={mask!r} is unknown; choose one of {list(MASK_KINDS)}")
    if isinstance(diagonal, bool) or not isinstance(diagonal, int):
        raise TypeError(f"diagonal must be an int, got {diagonal!r}")


@dataclass(frozen=True)
class Block:
    """One rectangle of attention work between a rank's queries and a visiting K/V shard.

    ``q`` and ``kv`` are slices of the *local* rows; with ``mask == "causal"`` query i of the
    block sees key j of the block iff ``j <= i + diagonal``.
    """

    q: slice
    kv: slice
    mask: str = "full"
    diagonal: int = 0

    def __post_init__(self) -> None:
        check_mask(self.mask, self.diagonal)

    def unmasked(self, local_len: int) -> int:
        """Number of (query, key) pairs this block computes."""
        nq = len(range(*self.q.indices(local_len)))
        nk = len(range(*self.kv.indices(local_len)))
        if self.mask == "full":
            return nq * nk
        return sum(min(max(i + self.diagonal + 1, 0), nk) for i in range(nq))


def _ring(layout: str, world_size: int) -> RingSpec:
    return RingSpec(world_size=world_size, layout=layout)


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the ring of world_size={world_size} (0..{world_size - 1})")


def positions(*, layout: str, rank: int, world_size: int, seq_len: int) -> torch.Tensor:
    """Global token positions held by `rank`, in local order (int64, increasing)."""
    ring = _ring(layout, world_size)
    n = ring.check_seq_len(seq_len)
    _check_rank(rank, world_size)
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        half = n // 2
        return torch.cat([
            torch.arange(rank * half, (rank + 1) * half),
            torch.arange((2 * world_size - 1 - rank) * half, (2 * world_size - rank) * half),
        ])
    return torch.arange(rank, seq_len, world_size)


def shard(x: torch.Tensor, *, layout: str, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (differentiable; a copy except for contiguous)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard expects a torch.Tensor, got {type(x).__name__}")
    dim = dim % x.dim()
    seq_len = x.shape[dim]
    ring = _ring(layout, world_size)
    n = ring.check_seq_len(seq_len)
    _check_rank(rank, world_size)
    if layout == "contiguous":
        return x.narrow(dim, rank * n, n)
    if layout == "zigzag":
        half = n // 2
        return torch.cat([
            x.narrow(dim, rank * half, half),
            x.narrow(dim, (2 * world_size - 1 - rank) * half, half),
        ], dim=dim)
    return x.index_select(dim, positions(layout=layout, rank=rank, world_size=world_size, seq_len=seq_len).to(x.device))


def unshard(shards, *, layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the whole tensor from the list of every rank's shard, rank order."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard needs the shards of every rank, got an empty list")
    check_layout(layout)
    dim = dim % shards[0].dim()
    n = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"shards must all have one shape, got {[tuple(s.shape) for s in shards]}")
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    if layout == "zigzag":
        if n % 2:
            raise ValueError(f"zigzag shards hold two equal chunks, but a shard has {n} rows along dim {dim}")
        firsts = [s.narrow(dim, 0, n // 2) for s in shards]
        seconds = [s.narrow(dim, n // 2, n // 2) for s in reversed(shards)]
        return torch.cat(firsts + seconds, dim=dim)
    stacked = torch.stack(shards, dim=dim + 1)  # (..., n, P, ...): token a*P + r
    return stacked.flatten(dim, dim + 1)


def block_plan(*, layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
               causal: bool) -> tuple[Block, ...]:
    """The blocks that `q_rank`'s queries compute against `kv_rank`'s keys (empty: none)."""
    _check_rank(q_rank, world_size)
    _check_rank(kv_rank, world_size)
    _ring(layout, world_size)
    every = slice(0, local_len)
    if not causal:
        return (Block(every, every, "full"),)
    if layout == "contiguous":
        if kv_rank < q_rank:
            return (Block(every, every, "full"),)
        if kv_rank == q_rank:
            return (Block(every, every, "causal", 0),)
        return ()
    if layout == "zigzag":
        half = local_len // 2
        if kv_rank == q_rank:
            return (Block(every, every, "causal", 0),)
        if kv_rank < q_rank:  # both query chunks come after the early K/V chunk, before the late one
            return (Block(every, slice(0, half), "full"),)
        return (Block(slice(half, local_len), every, "full"),)  # only the late query chunk sees it
    # striped: query a*P+q sees key b*P+k iff b < a, or b == a and k <= q
    return (Block(every, every, "causal", 0 if kv_rank <= q_rank else -1),)


def work_counts(*, layout: str, world_size: int, seq_len: int, causal: bool) -> list[int]:
    """Unmasked score entries each rank computes over the whole ring (index = rank)."""
    n = _ring(layout, world_size).check_seq_len(seq_len)
    return [
        sum(block.unmasked(n)
            for kv_rank in range(world_size)
            for block in block_plan(layout=layout, q_rank=q_rank, kv_rank=kv_rank,
                                    world_size=world_size, local_len=n, causal=causal))
        for q_rank in range(world_size)
    ]
