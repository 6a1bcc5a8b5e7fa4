"""Hypothesis strategies for attention *variants*: packed documents, sliding windows, logit
softcaps, sinks and a value head dim of its own, on every layout including zigzag_docs.

`variant_cases` draws a plain case with `ringcheck.testing.strategies.cases` (shape, dtype,
distribution, ring, seed) and then its variant: document boundaries (`cu_seqlens`), a window,
a softcap, a sink kind and `v_head_dim`. Like `cases` it draws specs, never tensors, so a
failing case is reproduced by its repr alone, and it shrinks towards plain attention.

What the variant draws aim at (the places a ring cuts the sequence):

- documents: boundaries at rank boundaries, at zig-zag chunk boundaries and one token either
  side of them, anywhere else, empty documents (repeated boundaries), length-1 documents, odd
  lengths, and a padding tail (the last boundary before seq_len; possibly all padding);
  under zigzag_docs every document and the tail are multiples of 2P (the layout's rule), and
  the sequence is any multiple of 2P up to max_world_size x max_tokens_per_rank tokens;
- windows: each side unbounded (-1), 0, smaller than a zig-zag chunk, about a chunk or a
  rank's shard, several ranks, or past the whole sequence; (0, 0) and one-sided included;
- softcaps from 0.01 to 1000 (a small cap saturates under the large logits of ``wide``,
  ``outlier``, ``sink``, ...: every distribution is drawn with every variant);
- sinks: None or a kind of `ringcheck.spec.SINK_KINDS`; v_head_dim: None or 1..max_head_dim;
- ring sizes 1..max_world_size (weighted towards small rings, as `cases`), every layout,
  float32, bfloat16 and float16, causal and bidirectional, grouped-query heads.

Where late-max would meet zigzag_docs (it places values by the plain layouts' positions) the
other distributions are drawn instead (``normal`` if late-max was the only one).
"""

from __future__ import annotations

from hypothesis import strategies as st

from ..judge.check import Case
from ..judge.distributions import DISTRIBUTIONS, min_head_dim
from ..judge.variant_options import VariantOptions
from ..ring.layouts import positions
from ..spec import ALL_LAYOUTS, DOC_LAYOUTS, DTYPES, SINK_KINDS, RingSpec, Variant, check_int
from .strategies import Bounds, Profile, cases

# distributions that place values by ring step without knowing the documents (late-max reads
# every layout's positions without cu_seqlens, which zigzag_docs does not have)
_NEEDS_PLAIN_POSITIONS = ("late-max",)
SOFTCAPS = (0.05, 0.5, 1.0, 5.0, 30.0, 1000.0)
# the ci profile draws 40 examples of each property; its variant cases stay tiny (seq <= 48)
CI_VARIANT_BOUNDS = Bounds(max_world_size=8, max_tokens_per_rank=6, max_batch=2, max_heads=4, max_head_dim=16)


def variant_bounds(profile: Profile) -> Bounds:
    """The size bounds of the variant suites for a search profile: the profile's own, except
    for ci, where a variant case costs several ring runs and stays within seq_len 48 and
    head_dim 16 (`CI_VARIANT_BOUNDS`)."""
    return CI_VARIANT_BOUNDS if profile.name == "ci" else profile.bounds


def _special_points(n: int, ring: RingSpec) -> list[int]:
    """Rank and zig-zag chunk boundaries of a sequence of n tokens, and one token either side."""
    per_rank, chunk = n // ring.world_size, max(1, n // (2 * ring.world_size))
    edges = set(range(0, n + 1, per_rank)) | set(range(0, n + 1, chunk))
    return sorted({p + d for p in edges for d in (-1, 0, 1) if 0 <= p + d <= n})


@st.composite
def document_boundaries(draw, n: int, ring: RingSpec) -> tuple[int, ...]:
    """cu_seqlens for a sequence of n tokens on `ring`: (0, ..., end) with end <= n (the rest
    is padding). Under zigzag_docs every document and the padding tail are multiples of 2P."""
    if ring.layout in DOC_LAYOUTS:  # in units of 2P tokens
        unit = 2 * ring.world_size
        units = n // unit
        end = draw(st.one_of(st.just(units), st.integers(0, units)), label="documents end (units)")
        cuts = draw(st.lists(st.integers(0, end), max_size=4), label="document cuts (units)")
        return tuple(unit * c for c in sorted([0, end, *cuts, *_repeats(draw, cuts)]))
    special = _special_points(n, ring)
    point = st.one_of(st.sampled_from(special), st.integers(0, n))
    end = draw(st.one_of(st.just(n), point), label="documents end")
    cuts = [c for c in draw(st.lists(point, max_size=5), label="document cuts") if c <= end]
    singles = draw(st.lists(st.integers(0, max(0, end - 1)), max_size=2), label="length-1 documents")
    cuts += [p for s in singles if end >= 1 for p in (s, s + 1)]
    return tuple(sorted([0, end, *set(cuts), *_repeats(draw, cuts)]))


def _repeats(draw, cuts) -> list[int]:
    """A few boundaries drawn again: empty documents."""
    if not cuts:
        return []
    return draw(st.lists(st.sampled_from(sorted(cuts)), max_size=2), label="empty documents")


def window_sides(n: int, ring: RingSpec) -> st.SearchStrategy[int]:
    """One bounded side of a window: 0, below a zig-zag chunk, about a chunk or a shard,
    several shards, at least the whole sequence, or anything up to it."""
    per_rank, chunk = n // ring.world_size, max(1, n // (2 * ring.world_size))
    return st.one_of(
        st.just(0), st.integers(1, max(1, chunk - 1)),
        st.sampled_from(sorted({chunk - 1, chunk, chunk + 1, per_rank - 1, per_rank, per_rank + 1} - {-1})),
        st.integers(per_rank, max(per_rank, (ring.world_size - 1) * per_rank)), st.integers(n, 2 * n + 3),
        st.integers(0, n + 2))


def windows(n: int, ring: RingSpec) -> st.SearchStrategy[tuple[int, int]]:
    """A (left, right) window, never (-1, -1) (that is no window): (0, 0), one-sided (the
    other side -1: unbounded), or bounded on both sides."""
    side = window_sides(n, ring)
    return st.one_of(st.just((0, 0)), st.tuples(st.just(-1), side), st.tuples(side, st.just(-1)),
                     st.tuples(side, side))


@st.composite
def _variant_cases(draw, bounds, dtypes, distributions, layouts, causal, backends, world_size,
                   documents, windowed, softcapped, sinks, own_v_dim):
    layout = draw(st.sampled_from(layouts), label="layout")
    doc_layout = layout in DOC_LAYOUTS
    usable = tuple(d for d in distributions if not (doc_layout and d in _NEEDS_PLAIN_POSITIONS)) or ("normal",)
    base = draw(cases(bounds, dtypes=dtypes, distributions=usable, layouts=("zigzag",) if doc_layout else (layout,),
                      causal=causal, backends=backends, world_size=world_size), label="plain case")
    spec, ring = base.spec, RingSpec(base.ring.world_size, layout)
    if doc_layout:  # room for several documents of 2P tokens: up to the bounds' largest sequence
        most = max(1, bounds.max_world_size * bounds.max_tokens_per_rank // ring.chunks)
        spec = spec.replace(seq_len=ring.chunks * draw(st.integers(1, most), label="zigzag_docs units"))
    n = spec.seq_len
    has_docs = doc_layout or draw(st.sampled_from(documents), label="documents")
    cu = draw(document_boundaries(n, ring)) if has_docs else None
    window = draw(windows(n, ring), label="window") if draw(st.sampled_from(windowed), label="windowed") else (-1, -1)
    softcap = draw(st.one_of(st.sampled_from(SOFTCAPS), st.floats(0.01, 100.0)), label="softcap") \
        if draw(st.sampled_from(softcapped), label="softcapped") else None
    sink = draw(st.sampled_from(sinks), label="sinks")
    # make_inputs draws V with the case's distribution at head dim v_head_dim (late-max needs >= 2)
    v_dim = draw(st.integers(min(min_head_dim(base.distribution, base.ring), bounds.max_head_dim),
                             bounds.max_head_dim), label="v_head_dim") \
        if draw(st.sampled_from(own_v_dim), label="own v head dim") else None
    spec = spec.replace(variant=Variant(cu_seqlens=cu, window=window, softcap=softcap), sinks=sink, v_head_dim=v_dim)
    return Case(spec, ring, seed=base.seed, distribution=base.distribution, backend=base.backend)


def _choices(name: str, values, allowed) -> tuple:
    values = tuple(values)
    if not values or any(v not in allowed for v in values):
        raise ValueError(f"{name} must be a non-empty tuple of choices from {list(allowed)}, got {values!r}")
    return values


def variant_cases(bounds: Bounds = CI_VARIANT_BOUNDS, *, dtypes=tuple(DTYPES), distributions=tuple(DISTRIBUTIONS),
                  layouts=ALL_LAYOUTS, causal=(False, True), backends=("torch",), world_size: int | None = None,
                  documents=(False, True), windowed=(False, True), softcapped=(False, True),
                  sinks=(None, *SINK_KINDS), own_v_dim=(False, True)) -> st.SearchStrategy[Case]:
    """Cases with variants within `bounds` (see the module doc for what is drawn).

    Every feature is a tuple of choices like `causal`: ``documents=(True,)`` always draws
    cu_seqlens (zigzag_docs always has them), ``windowed=(False,)`` never a window,
    ``sinks=(None,)`` no sinks, ``own_v_dim=(True,)`` always a v_head_dim. Shrinking goes
    towards the first choice of each (plain attention by default) and the plain case's own
    shrink targets (`cases`)."""
    if not isinstance(bounds, Bounds):
        raise TypeError(f"bounds must be a Bounds, got {type(bounds).__name__}")
    layouts = _choices("layouts", layouts, ALL_LAYOUTS)
    for name, values in (("documents", documents), ("windowed", windowed), ("softcapped", softcapped),
                         ("own_v_dim", own_v_dim)):
        _choices(name, values, (False, True))
    sinks = _choices("sinks", sinks, (None, *SINK_KINDS))
    if world_size is not None:
        check_int("world_size", world_size)
    if any(layout in ("zigzag", *DOC_LAYOUTS) for layout in layouts) and bounds.max_tokens_per_rank < 2:
        raise ValueError("the zigzag layouts need 2 tokens per rank: raise max_tokens_per_rank")
    return _variant_cases(bounds, tuple(dtypes), tuple(distributions), layouts, tuple(causal), tuple(backends),
                          world_size, tuple(documents), tuple(windowed), tuple(softcapped), sinks, tuple(own_v_dim))


def with_variant_options(case: Case, options: VariantOptions, seed: int = 0) -> Case | None:
    """`case` at the variant given on the command line (`VariantOptions`: --documents, --pad,
    --window, --softcap, --sinks, --head-dim-v, the meaning of ringcheck drift's flags) instead
    of its drawn one; explicit document lengths also fix seq_len (their sum plus --pad). None
    where the options cannot be laid out on the case's ring (the search draws another)."""
    spec, ring = case.spec, case.ring
    seq_len = spec.seq_len
    if options.documents is not None and not options.documents.startswith("random:"):
        seq_len = sum(int(n) for n in options.documents.split(",")) + options.pad
    try:
        ring.check_seq_len(seq_len)
        variant, sinks, v_head_dim = options.resolve(seq_len, ring, seed)
        if ring.layout in DOC_LAYOUTS:  # the per-document layout's own checks
            positions(layout=ring.layout, rank=0, world_size=ring.world_size, seq_len=seq_len,
                      cu_seqlens=variant.cu_seqlens)
        spec = spec.replace(seq_len=seq_len, variant=variant, sinks=sinks, v_head_dim=v_head_dim)
    except ValueError:
        return None
    return Case(spec, ring, seed=case.seed, distribution=case.distribution, backend=case.backend)
