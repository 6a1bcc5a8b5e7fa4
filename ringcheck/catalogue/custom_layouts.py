"""Example custom layouts (`--layout ringcheck.catalogue.custom_layouts:NAME`), and broken ones.

A custom layout is `FN(rank, world_size, seq_len, cu_seqlens=None) -> LongTensor`: the global
positions `rank` holds, in its local order. The correct ones here are what suites and users
can start from; the broken ones are what ringcheck must refuse with a clear error.
"""

from __future__ import annotations

import torch


def zigzag_again(rank, world_size, seq_len, cu_seqlens=None):
    """The built-in zigzag, written as a custom layout: chunk r and chunk 2P-1-r."""
    c = seq_len // (2 * world_size)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)])


def reversed_blocks(rank, world_size, seq_len, cu_seqlens=None):
    """Rank r holds the (P-1-r)-th contiguous block, in reverse order: no position is where a
    contiguous ring would expect it, and the local order runs backwards."""
    n = seq_len // world_size
    return torch.arange((world_size - 1 - rank) * n, (world_size - rank) * n).flip(0)


def ulysses_zigzag(rank, world_size, seq_len, cu_seqlens=None, ulysses=2):
    """A hybrid scheme's sequence split: `ulysses` ranks share each zig-zag ring slot (a rank
    holds every `ulysses`-th token of its slot's two chunks, offset by its Ulysses rank)."""
    if world_size % ulysses:  # no Ulysses split of this ring: plain zig-zag
        return zigzag_again(rank, world_size, seq_len)
    slot, offset = divmod(rank, ulysses)
    return zigzag_again(slot, world_size // ulysses, seq_len)[offset::ulysses]


def overlapping(rank, world_size, seq_len, cu_seqlens=None):
    """Broken: every rank holds the first block."""
    return torch.arange(seq_len // world_size)


def uneven(rank, world_size, seq_len, cu_seqlens=None):
    """Broken: rank 0 holds one token more than the others (and the last rank one fewer)."""
    n = seq_len // world_size
    bounds = [0] + [min(seq_len, r * n + 1) for r in range(1, world_size)] + [seq_len]
    return torch.arange(bounds[rank], bounds[rank + 1])


def floats(rank, world_size, seq_len, cu_seqlens=None):
    """Broken: positions as floats."""
    n = seq_len // world_size
    return torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)
