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

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..spec import DOC_LAYOUTS, RingSpec, check_cu_seqlens, check_layout, check_window, is_custom_layout
from .custom_layout import custom_positions

MASK_KINDS = ("full", "causal", "band")


def check_mask(mask: object, diagonal: object = 0, lower: object = 0) -> None:
    """A block's mask kind, causal diagonal and (for "band") lower diagonal: the block contract
    of every backend. "causal": query i sees key j iff j - i <= diagonal; "band": iff
    lower <= j - i <= diagonal (block-local indices)."""
    if mask not in MASK_KINDS:
        raise ValueError(f"mask={mask!r} is unknown; choose one of {list(MASK_KINDS)}")
    for name, value in (("diagonal", diagonal), ("lower", lower)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")


@dataclass(frozen=True)
class Block:
    """One rectangle of attention work between a rank's queries and a visiting K/V shard.

    ``q`` and ``kv`` are slices of the *local* rows; with ``mask == "causal"`` query i of the
    block sees key j of the block iff ``j <= i + diagonal``, with ``mask == "band"`` iff
    ``lower <= j - i <= diagonal``.
    """

    q: slice
    kv: slice
    mask: str = "full"
    diagonal: int = 0
    lower: int = 0

    def __post_init__(self) -> None:
        check_mask(self.mask, self.diagonal, self.lower)

    def kernel_args(self) -> dict:
        """The mask keywords of the backend contract for this block."""
        return {"mask": self.mask, "diagonal": self.diagonal, "lower": self.lower}

    def unmasked(self, local_len: int) -> int:
        """Number of visible (query, key) pairs of this block: the work it does."""
        nq = len(range(*self.q.indices(local_len)))
        nk = len(range(*self.kv.indices(local_len)))
        if self.mask == "full":
            return nq * nk
        lower = self.lower if self.mask == "band" else -nq
        return sum(max(min(i + self.diagonal, nk - 1) - max(i + lower, 0) + 1, 0) for i in range(nq))


def _ring(layout: str, world_size: int) -> RingSpec:
    return RingSpec(world_size=world_size, layout=layout)


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the ring of world_size={world_size} (0..{world_size - 1})")


def _doc_chunks(cu_seqlens, world_size: int, seq_len: int) -> list[tuple[int, int]]:
    """zigzag_docs: (start, length) of each document and of the padding tail, every length
    divisible by 2 x world_size (a ValueError naming the document and the fix otherwise)."""
    if cu_seqlens is None:
        raise ValueError("layout='zigzag_docs' balances each document of a packed sequence: pass its "
                         "cu_seqlens (global document boundaries)")
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    pieces = [(cu[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)] + [(cu[-1], seq_len - cu[-1])]
    chunks = 2 * world_size
    for i, (start, length) in enumerate(pieces):
        if length % chunks:
            what = (f"document {i} (tokens {start}..{start + length - 1})" if i < len(pieces) - 1
                    else f"the padding tail (tokens {start}..{seq_len - 1})")
            nearest = max(chunks, (length + chunks // 2) // chunks * chunks)
            raise ValueError(
                f"{what} has length {length}, not divisible by 2 x world_size={chunks} as the zigzag_docs "
                f"layout needs (each document is cut into {chunks} equal chunks); pad it to a multiple of "
                f"{chunks} (nearest valid length: {nearest})")
    return pieces


def positions(*, layout: str, rank: int, world_size: int, seq_len: int, cu_seqlens=None) -> torch.Tensor:
    """Global token positions held by `rank`, in local order (int64, increasing). The
    zigzag_docs layout needs the packed sequence's `cu_seqlens`; the others ignore it."""
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
    if is_custom_layout(layout):  # the user's function, checked to partition the sequence
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len)
        return custom_positions(layout, world_size, seq_len, cu)[rank].clone()
    if layout in DOC_LAYOUTS:  # every document (and the padding tail) dealt out like zigzag
        parts = []
        for start, length in _doc_chunks(cu_seqlens, world_size, seq_len):
            c = length // (2 * world_size)
            parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + (2 * world_size - 1 - rank) * c, start + (2 * world_size - rank) * c)]
        return torch.cat(parts)
    return torch.arange(rank, seq_len, world_size)


def shard(x: torch.Tensor, *, layout: str, rank: int, world_size: int, dim: int = 1,
          cu_seqlens=None) -> torch.Tensor:
    """This rank's part of `x` along `dim` (differentiable; a copy except for contiguous).
    `cu_seqlens` (the packed sequence's document boundaries) is needed by zigzag_docs."""
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
    pos = positions(layout=layout, rank=rank, world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens)
    return x.index_select(dim, pos.to(x.device))


def unshard(shards, *, layout: str, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
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
    if layout in DOC_LAYOUTS or is_custom_layout(layout):
        p = len(shards)
        where = torch.cat([positions(layout=layout, rank=r, world_size=p, seq_len=n * p, cu_seqlens=cu_seqlens)
                           for r in range(p)])
        return torch.cat(shards, dim=dim).index_select(dim, torch.argsort(where).to(shards[0].device))
    stacked = torch.stack(shards, dim=dim + 1)  # (..., n, P, ...): token a*P + r
    return stacked.flatten(dim, dim + 1)


def block_plan(*, layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
               causal: bool, cu_seqlens=None, window=(-1, -1)) -> tuple[Block, ...]:
    """The blocks that `q_rank`'s queries compute against `kv_rank`'s keys (empty: none).

    With packed documents (`cu_seqlens`, global boundaries), a sliding `window` or the
    zigzag_docs layout the plan is cut along documents and window bands (see `masks`):
    a pair with no visible (query, key) is no block, a fully visible one a "full" block."""
    _check_rank(q_rank, world_size)
    _check_rank(kv_rank, world_size)
    _ring(layout, world_size)
    window = check_window(window)
    if cu_seqlens is not None or window != (-1, -1) or layout in DOC_LAYOUTS or is_custom_layout(layout):
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, local_len * world_size)
        return variant_plan(layout, q_rank, kv_rank, world_size, local_len, causal, cu, window)
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


def work_counts(*, layout: str, world_size: int, seq_len: int, causal: bool, cu_seqlens=None,
                window=(-1, -1)) -> list[int]:
    """Visible score entries each rank computes over the whole ring (index = rank)."""
    n = _ring(layout, world_size).check_seq_len(seq_len)
    return [
        sum(block.unmasked(n)
            for kv_rank in range(world_size)
            for block in block_plan(layout=layout, q_rank=q_rank, kv_rank=kv_rank, world_size=world_size,
                                    local_len=n, causal=causal, cu_seqlens=cu_seqlens, window=window))
        for q_rank in range(world_size)
    ]


# ------------------------------------------------- documents and windows: the variant plan
#
# A rank's tokens fall into *segments*: runs of local rows in one document whose global
# positions step by a constant stride S (1, or P for striped). Between a query segment
# (global positions a + S i) and a key segment of the same document (b + S j), causal and
# window constraints are all bounds on t = j - i:
#   key <= query + R   <=>  t <= floor((a - b + R) / S)      (R = 0 for causal, right window)
#   key >= query - L   <=>  t >= ceil((a - b - L) / S)       (left window)
# so each pair is one rectangle with a band mask, trimmed to the rows and columns that see
# anything, and cut into row tiles when the band is narrow (a window of w costs O(N w)).

BAND_TILE = 64  # rows per tile of a narrow band (at least the band's width)


def _segments(pos: list[int], stride: int, cu: tuple[int, ...] | None) -> list[tuple[int, int, int, int]]:
    """(first local row, end local row, first global position, document) of each segment;
    padding (past the last document) belongs to none."""
    doc_of = (lambda p: 0) if cu is None else (lambda p: bisect_right(cu, p) - 1 if p < cu[-1] else -1)
    segments: list[tuple[int, int, int, int]] = []
    start = 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] - pos[i - 1] != stride or doc_of(pos[i]) != doc_of(pos[start]):
            doc = doc_of(pos[start])
            if doc >= 0:
                segments.append((start, i, pos[start], doc))
            start = i
    return segments


def _band_blocks(q0: int, nq: int, k0: int, nk: int, upper: int | None, lower: int | None) -> list[Block]:
    """The blocks of the rectangle rows [q0, q0+nq) x keys [k0, k0+nk) where query i sees key j
    iff lower <= j - i <= upper (None: unbounded), trimmed, classified and tiled."""
    if (nq <= 0 or nk <= 0 or upper is not None and upper < -(nq - 1) or lower is not None and lower > nk - 1
            or upper is not None and lower is not None and lower > upper):
        return []
    up = nk - 1 if upper is None else min(upper, nk - 1)
    lo = -(nq - 1) if lower is None else max(lower, -(nq - 1))
    i0, i1 = max(0, -up), min(nq, nk - lo)      # rows that see some key
    j0, j1 = max(0, lo), min(nk, nq + up)       # keys seen by some row
    nq, nk = i1 - i0, j1 - j0
    if nq <= 0 or nk <= 0:
        return []
    up, lo = up - j0 + i0, lo - j0 + i0
    rows, keys = slice(q0 + i0, q0 + i1), slice(k0 + j0, k0 + j1)
    whole_up, whole_lo = up >= nk - 1, lo <= -(nq - 1)
    if whole_up and whole_lo:
        return [Block(rows, keys, "full")]
    if whole_lo:
        return [Block(rows, keys, "causal", up)]
    width = up - lo + 1
    tile = max(BAND_TILE, width)
    if nq <= 2 * tile or whole_up:
        return [Block(rows, keys, "band", nk if whole_up else up, lo)]
    blocks: list[Block] = []
    for r in range(0, nq, tile):  # each row tile against the keys its band reaches
        m = min(tile, nq - r)
        c0, c1 = max(0, r + lo), min(nk, r + m + up)
        blocks += _band_blocks(q0 + i0 + r, m, k0 + j0 + c0, c1 - c0, up - c0 + r, lo - c0 + r)
    return blocks


@lru_cache(maxsize=4096)
def variant_plan(layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int, causal: bool,
                 cu: tuple[int, ...] | None, window: tuple[int, int]) -> tuple[Block, ...]:
    """`block_plan` with documents and/or a window (arguments validated by it)."""
    seq_len = local_len * world_size
    stride = world_size if layout == "striped" else 1
    qpos = positions(layout=layout, rank=q_rank, world_size=world_size, seq_len=seq_len, cu_seqlens=cu).tolist()
    kpos = positions(layout=layout, rank=kv_rank, world_size=world_size, seq_len=seq_len, cu_seqlens=cu).tolist()
    left, right = window
    blocks: list[Block] = []
    for qa, qb, qg, qdoc in _segments(qpos, stride, cu):
        for ka, kb, kg, kdoc in _segments(kpos, stride, cu):
            if qdoc != kdoc:
                continue
            uppers = [(qg - kg + r) // stride for r in ((0,) if causal else ()) + ((right,) if right >= 0 else ())]
            lowers = [-((kg - qg + left) // stride)] if left >= 0 else []  # ceil((qg - kg - left) / S)
            blocks += _band_blocks(qa, qb - qa, ka, kb - ka, min(uppers, default=None), max(lowers, default=None))
    return tuple(_coalesce(blocks))


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Full blocks against one key range whose query rows are adjacent become one block (a
    zig-zag rank's two chunks of a document against a visiting chunk): fewer kernel calls,
    the same pairs."""
    merged: list[Block] = []
    for block in sorted(blocks, key=lambda b: (b.mask != "full", b.kv.start, b.kv.stop, b.q.start)):
        last = merged[-1] if merged else None
        if (last is not None and block.mask == last.mask == "full" and block.kv == last.kv
                and block.q.start == last.q.stop):
            merged[-1] = Block(slice(last.q.start, block.q.stop), block.kv, "full")
        else:
            merged.append(block)
    return _join_diagonals(merged)


def _join_diagonals(blocks: list[Block]) -> list[Block]:
    """Two causal squares on the diagonal ([a, b) and [b, c), rows = keys) and the full block
    between them (rows [b, c), keys [a, b)) are one causal square [a, c): a rank's own two
    chunks of a document."""
    squares = {b.q.start: b for b in blocks if b.mask == "causal" and b.diagonal == 0 and b.q == b.kv}
    fulls = {(b.q.start, b.q.stop, b.kv.start, b.kv.stop): b for b in blocks if b.mask == "full"}
    for start in sorted(squares):
        first = squares.get(start)
        second = squares.get(first.q.stop) if first is not None else None
        between = None if second is None else fulls.get((second.q.start, second.q.stop, first.q.start,
                                                         first.q.stop))
        if between is None:
            continue
        joined = Block(slice(first.q.start, second.q.stop), slice(first.q.start, second.q.stop), "causal", 0)
        blocks = [b for b in blocks if b is not first and b is not second and b is not between] + [joined]
        del squares[second.q.start]
        squares[start] = joined
    return blocks
