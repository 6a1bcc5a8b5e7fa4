"""Custom layouts: `--layout package.module:function`, a user's way of dealing tokens to ranks.

    FN(rank, world_size, seq_len, cu_seqlens=None) -> LongTensor

gives the global positions `rank` holds, in its local order (a hybrid scheme, e.g. Ulysses x
ring with its own zig-zag, names its own). `custom_positions` calls it for every rank once per
(layout, world size, length, documents) and checks that the ranks partition the sequence, each
holding seq_len / world_size tokens (what a ring of equal shards needs); anything else is a
ValueError naming the ranks and positions at fault. Sharding, unsharding, the references, our
ring's block plan and the work accounting then all follow those positions.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from ..spec import check_layout
from ..user_code import import_object


def _load(layout: str):
    fn = import_object(layout, f"layout {layout!r}")
    if not callable(fn):
        raise ValueError(f"layout {layout!r} is a {type(fn).__name__}, not a function")
    return fn


def _call(fn, layout: str, rank: int, world_size: int, seq_len: int, cu: tuple[int, ...] | None) -> torch.Tensor:
    try:
        takes_cu = "cu_seqlens" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_cu = False
    if cu is not None and not takes_cu:
        raise ValueError(f"layout {layout!r} was given documents (cu_seqlens) but its function takes no "
                         f"cu_seqlens keyword; add `cu_seqlens=None` to FN(rank, world_size, seq_len, cu_seqlens)")
    got = fn(rank, world_size, seq_len, cu_seqlens=torch.tensor(cu)) if cu is not None else fn(rank, world_size,
                                                                                               seq_len)
    if isinstance(got, (list, tuple)):
        got = torch.tensor(got, dtype=torch.long)
    if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.dtype.is_floating_point or got.dtype == torch.bool:
        raise ValueError(f"layout {layout!r} returned {type(got).__name__}"
                         f"{'' if not isinstance(got, torch.Tensor) else f' {got.dtype} of shape {tuple(got.shape)}'}"
                         f" for rank {rank}; it must return a 1-D integer tensor of global positions")
    return got.to(device="cpu", dtype=torch.long)


@lru_cache(maxsize=64)
def custom_positions(layout: str, world_size: int, seq_len: int,
                     cu: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """Every rank's positions under the custom `layout`, checked to partition range(seq_len)."""
    check_layout(layout)
    fn = _load(layout)
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} is not divisible by world_size={world_size}: a custom layout deals "
                         f"equal shards (seq_len / world_size tokens per rank); pad the sequence")
    per_rank = seq_len // world_size
    parts = tuple(_call(fn, layout, r, world_size, seq_len, cu) for r in range(world_size))
    owner = torch.full((seq_len,), -1, dtype=torch.long)
    for r, pos in enumerate(parts):
        if pos.numel() != per_rank:
            raise ValueError(f"layout {layout!r} gives rank {r} {pos.numel()} positions; a ring of {world_size} "
                             f"over seq_len={seq_len} needs {per_rank} per rank")
        outside = pos[(pos < 0) | (pos >= seq_len)]
        if outside.numel():
            raise ValueError(f"layout {layout!r} gives rank {r} positions outside 0..{seq_len - 1}: "
                             f"{outside[:5].tolist()}")
        if torch.unique(pos).numel() != pos.numel():
            raise ValueError(f"layout {layout!r} gives rank {r} the same position twice")
        taken = owner[pos]
        if (taken >= 0).any():
            clash = pos[taken >= 0][:5].tolist()
            raise ValueError(f"layout {layout!r}: ranks {int(taken[taken >= 0][0])} and {r} both hold positions "
                             f"{clash}; the ranks must partition the sequence")
        owner[pos] = r
    missing = (owner < 0).nonzero().flatten()
    if missing.numel():  # cannot happen with equal, disjoint, in-range shards; kept for clarity
        raise ValueError(f"layout {layout!r}: positions {missing[:5].tolist()} are held by no rank")
    return parts
