"""Named placements of the attention variants at the points where context-parallel rings
break, and the case table that runs every placement on every layout, ring size and dtype.

A *placement* is a function ``(seq_len, ring) -> (Variant, sinks kind) | None`` that puts
documents, windows, a softcap or sinks exactly where a ring is known to go wrong (see
REPORTED_BUGS: a last token dropped at odd lengths, tail padding attended, NaN on a rank
holding only padding, sinks dropped or counted per step, a window ignored across ranks).
None: the placement does not exist on that ring (zigzag_docs needs every document to be a
multiple of 2P tokens).

    VARIANT_CASES                  suites/test_variants.py (budget rule, every tensor)
    VARIANT_PLANTED_CASES          suites/test_variants.py (planted bugs per variant)
    DISTRIBUTED_VARIANT_CASES      suites/test_distributed_variants.py (bit for bit over gloo)
"""

from __future__ import annotations

from collections.abc import Callable

from ..judge.check import Case
from ..spec import AttentionSpec, RingSpec, Variant

__all__ = ["PLACEMENTS", "VARIANT_MODES", "variant_case", "VARIANT_CASES", "VARIANT_PLANTED_CASES",
           "DISTRIBUTED_VARIANT_CASES"]

Placement = Callable[[int, RingSpec], "tuple[Variant, str | None] | None"]

# mode -> (causal, layout): the four modes of plain attention plus per-document zig-zag
VARIANT_MODES = {
    "bidirectional": (False, "contiguous"),
    "causal": (True, "contiguous"),
    "zigzag": (True, "zigzag"),
    "striped": (True, "striped"),
    "zigzag_docs": (True, "zigzag_docs"),
    "bidirectional_docs": (False, "zigzag_docs"),
}


def _cu(*lengths: int) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def _per_doc(ring: RingSpec) -> bool:
    return ring.layout == "zigzag_docs"


def _boundary_at_rank(seq_len: int, ring: RingSpec):
    """Documents ending exactly where a rank's (contiguous) shard ends; for zig-zag layouts
    at a chunk boundary of the whole sequence."""
    n = seq_len // ring.world_size
    if _per_doc(ring):
        c = 2 * ring.world_size
        return Variant(cu_seqlens=_cu(c, seq_len - 2 * c, c)), None
    return Variant(cu_seqlens=tuple(range(0, seq_len + 1, n))), None


def _boundary_at_chunk(seq_len: int, ring: RingSpec):
    """Boundaries at every zig-zag chunk (half a rank's tokens): one document per chunk."""
    if _per_doc(ring):
        return None
    half = seq_len // ring.chunks
    return Variant(cu_seqlens=tuple(range(0, seq_len + 1, half))), None


def _length_one(seq_len: int, ring: RingSpec):
    """A document of one token first, one in the middle and the last token alone."""
    if _per_doc(ring) or seq_len < 4:
        return None
    mid = seq_len // 2
    return Variant(cu_seqlens=(0, 1, mid, mid + 1, seq_len - 1, seq_len)), None


def _odd_lengths(seq_len: int, ring: RingSpec):
    """Odd document lengths (3, 5, 7, ...) and an odd tail of padding."""
    if _per_doc(ring):
        return None
    cu, n = [0], 3
    while cu[-1] + n < seq_len:
        cu.append(cu[-1] + n)
        n += 2
    return Variant(cu_seqlens=tuple(cu)), None


def _padding_rank(seq_len: int, ring: RingSpec):
    """The last rank of a contiguous ring (the last chunks of a zig-zag one) hold only
    padding: the documents end one shard before the sequence does."""
    n = seq_len // ring.world_size
    if ring.world_size == 1:
        return Variant(cu_seqlens=(0, seq_len // 2)), None
    if _per_doc(ring):  # a whole 2P-chunk tail of padding: every rank holds some
        c = 2 * ring.world_size
        return Variant(cu_seqlens=_cu(c, seq_len - 2 * c)), None
    return Variant(cu_seqlens=(0, (seq_len - n) // 2, seq_len - n)), None


def _window_in_chunk(seq_len: int, ring: RingSpec):
    """A sliding window narrower than a chunk (every rank sees at most its neighbour's tail)."""
    w = max(1, seq_len // ring.chunks // 2)
    return Variant(window=(w, w)), None


def _window_three_ranks(seq_len: int, ring: RingSpec):
    """A left window spanning three ranks' worth of tokens (and no right limit)."""
    return Variant(window=(3 * seq_len // ring.world_size - 1, -1)), None


def _window_and_documents(seq_len: int, ring: RingSpec):
    """Documents and a window together, the window shorter than some documents."""
    base = _per_doc(ring) and _boundary_at_rank(seq_len, ring) or _odd_lengths(seq_len, ring)
    return Variant(cu_seqlens=base[0].cu_seqlens, window=(2, 1)), None


def _softcap_saturated(seq_len: int, ring: RingSpec):
    """A softcap far below the scores (used with the `wide` distribution): most scores sit on
    the flat part of tanh, where the backward's tanh' is ~0."""
    return Variant(softcap=0.5), None


def _sink_high(seq_len: int, ring: RingSpec):
    """A sink far above every score (it takes ~all of each row's mass), with documents."""
    return Variant(cu_seqlens=_boundary_at_rank(seq_len, ring)[0].cu_seqlens), "high"


def _sink_low(seq_len: int, ring: RingSpec):
    """A sink far below every score (it must not change anything), with a padding rank."""
    return Variant(cu_seqlens=_padding_rank(seq_len, ring)[0].cu_seqlens), "low"


def _everything(seq_len: int, ring: RingSpec):
    """Documents with padding, a window, a softcap and sinks at once."""
    return Variant(cu_seqlens=_padding_rank(seq_len, ring)[0].cu_seqlens, window=(5, 3), softcap=4.0), "normal"


PLACEMENTS: dict[str, Placement] = {
    "boundary-at-rank": _boundary_at_rank,
    "boundary-at-chunk": _boundary_at_chunk,
    "length-1-docs": _length_one,
    "odd-docs": _odd_lengths,
    "padding-rank": _padding_rank,
    "window-in-chunk": _window_in_chunk,
    "window-3-ranks": _window_three_ranks,
    "window-and-docs": _window_and_documents,
    "softcap-saturated": _softcap_saturated,
    "sink-high": _sink_high,
    "sink-low": _sink_low,
    "everything": _everything,
}
# placements whose inputs need a distribution of their own
_DISTRIBUTION = {"softcap-saturated": "wide"}


def variant_case(placement: str, mode: str, *, world_size: int, dtype: str = "float32", tokens: int = 4,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 16, v_head_dim: int | None = None,
                 batch: int = 1, seed: int = 0, backend: str = "torch") -> Case | None:
    """The case of `placement` on the ring of `mode` (a key of VARIANT_MODES) and
    `world_size`, seq_len = 2 x world_size x tokens; None where the placement does not exist."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is unknown; choose one of {list(PLACEMENTS)}")
    if mode not in VARIANT_MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {list(VARIANT_MODES)}")
    causal, layout = VARIANT_MODES[mode]
    ring = RingSpec(world_size, layout)
    seq_len = 2 * world_size * tokens
    placed = PLACEMENTS[placement](seq_len, ring)
    if placed is None:
        return None
    variant, sinks = placed
    if layout == "zigzag_docs" and variant.cu_seqlens is None:  # the layout needs documents: one
        variant = Variant(cu_seqlens=(0, seq_len), window=variant.window, softcap=variant.softcap)
    spec = AttentionSpec(batch=batch, heads=heads, kv_heads=kv_heads, seq_len=seq_len, head_dim=head_dim,
                         dtype=dtype, causal=causal, v_head_dim=v_head_dim, variant=variant, sinks=sinks)
    return Case(spec, ring, seed=seed, distribution=_DISTRIBUTION.get(placement, "normal"), backend=backend)


def _table(cases) -> dict[str, Case]:
    return {name: c for name, c in cases if c is not None}


# suites/test_variants.py: every placement x every mode x P 1..8, the dtype rotating with P
# and the placement so that each (placement, mode) meets every dtype (seed = P); MLA-style
# d_v != d_qk on odd ring sizes
_DTYPES = ("float32", "bfloat16", "float16")
VARIANT_CASES = _table(
    (f"{placement}_{mode}_p{p}_{_DTYPES[(p + i) % 3]}",
     variant_case(placement, mode, world_size=p, dtype=_DTYPES[(p + i) % 3], seed=p, v_head_dim=8 if p % 2 else None))
    for i, placement in enumerate(PLACEMENTS)
    for mode in VARIANT_MODES
    for p in range(1, 9)
)

# suites/test_variants.py: the cases the planted bugs run on (each must fail there)
VARIANT_PLANTED_CASES = _table((name, c) for name, c in {
    "window_p4": variant_case("window-in-chunk", "causal", world_size=4),
    "window_striped_p4": variant_case("window-3-ranks", "striped", world_size=4),
    "documents_p4": variant_case("boundary-at-chunk", "bidirectional", world_size=4),
    "documents_zigzag_p4": variant_case("odd-docs", "zigzag", world_size=4, tokens=6),
    "padding_p4": variant_case("padding-rank", "causal", world_size=4),
    "sinks_p4": variant_case("sink-high", "zigzag", world_size=4),
    "sinks_normal_p4": variant_case("everything", "zigzag_docs", world_size=4, tokens=8),
    "softcap_p4": variant_case("softcap-saturated", "zigzag", world_size=4, dtype="bfloat16"),
}.items())

# suites/test_distributed_variants.py: ring_attention over gloo equals the simulated ring bit
# for bit, for every variant, on rings of 1, 2, 3, 4 and 8
DISTRIBUTED_VARIANT_CASES = _table(
    (f"{placement}_{mode}_p{p}_{dtype}", variant_case(placement, mode, world_size=p, dtype=dtype, seed=p,
                                                      v_head_dim=8 if p == 3 else None))
    for p in (8, 4, 3, 2, 1)
    for placement, mode, dtype in (
        ("everything", "zigzag_docs", "float32"),
        ("everything", "striped", "bfloat16"),
        ("padding-rank", "causal", "float32"),
        ("window-3-ranks", "zigzag", "bfloat16"),
        ("odd-docs", "bidirectional", "float32"),
        ("softcap-saturated", "zigzag", "bfloat16"),
        ("sink-high", "causal", "float32"),
    )
)
