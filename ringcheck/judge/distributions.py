"""Named generators of (q, k, v, dout): the logit distributions the suites search over.

Every generator has the signature ``fn(spec, gen, ring=None) -> (q, k, v, dout)``: it draws
contiguous float32 tensors on the CPU from the seeded `torch.Generator` `gen` (so the same
spec, seed and ring give the same tensors on every rank; contiguous because CPU matmuls
round differently for transposed operands, which would break bit-for-bit comparisons), and `inputs.make_inputs` casts them to the spec's
dtype afterwards. Shapes: q and dout (batch, seq_len, heads, head_dim), k and v (batch,
seq_len, kv_heads, head_dim). Only ``late-max`` needs the ring (it places maxima by ring
step); the others ignore it. All values stay far inside the float16 range (|x| < 1e4), so the
inputs are the same tensors in every dtype up to rounding; the *logits* of ``wide``, ``sink``
and ``late-max`` do leave the range where exp overflows float16 (logit > 11.1) and float32
(logit > 88.7), on purpose.

| name | what it generates | what it stresses |
| --- | --- | --- |
| ``normal`` | q, k, v, dout ~ N(0, 1) | the benign baseline |
| ``near-uniform`` | q x 0.3 (near-ties), V + 6 | rounding of the running output adding up |
| ``wide`` | logit std per (batch, kv head) log-uniform in [1, 50], the largest exactly 50 | models without QK-norm: exp overflow, far-apart block lse |
| ``outlier`` | N(0, 1) + N(0, 100) x Bernoulli(0.001) in q, k, v (FlashAttention-3) | rare huge entries |
| ``sink`` | key 0 dominates every row by a logit of 12..120 | a late block lse far above the running one |
| ``late-max`` | each row's maximum in the chunk that reaches its rank last | the running max changing at the last ring step |
| ``repeated-max`` | several keys tie exactly at each row's maximum; V > 0 | the bf16 bias case (many P = 1 exactly, same-sign V) |
| ``one-hot-backward`` | P nearly one-hot, dO aligned with O | cancellation in dP - D |

`tests: suites/test_distributions.py` checks that each one produces what it promises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..ring.layouts import positions
from ..spec import AttentionSpec, RingSpec, Variant

Generator = Callable[..., tuple[torch.Tensor, ...]]  # (spec, gen, ring=None) -> (q, k, v, dout)


def _shapes(spec: AttentionSpec):
    q = (spec.batch, spec.seq_len, spec.heads, spec.head_dim)
    kv = (spec.batch, spec.seq_len, spec.kv_heads, spec.head_dim)
    return q, kv


def _per_query_head(x: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """(batch, kv_heads) -> (batch, heads): each K/V head's value for its group of query heads."""
    return x.repeat_interleave(spec.group_size, dim=1)


def normal(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Standard normal q, k, v and dout (drawn in that order)."""
    qs, kvs = _shapes(spec)
    return (torch.randn(qs, generator=gen), torch.randn(kvs, generator=gen),
            torch.randn(kvs, generator=gen), torch.randn(qs, generator=gen))


def near_uniform(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Near-ties: the `normal` draws with q scaled by 0.3, so every row's probabilities are
    close to uniform (logit std 0.3 at the default scale), and V offset by +6, so every partial
    output of the ring is large and of one sign. Any rounding of the running output (a
    low-precision partial at every hop) adds up here instead of averaging out."""
    q, k, v, dout = normal(spec, gen)
    return 0.3 * q, k, v + 6.0, dout


# ---- wide ------------------------------------------------------------------------------

WIDE_MAX_STD = 50.0  # largest logit std of the sweep (models without QK-norm reach this)


def wide_factor(sigma: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The factor a applied to both q and k so that scale * q.k has std sigma: with q, k entries
    N(0, a^2) the logit std is scale * sqrt(head_dim) * a^2."""
    return (sigma / (spec.scale * math.sqrt(spec.head_dim))).sqrt()


def wide(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Wide logits: the `normal` draws with q and k scaled so that the logit std of each
    (batch, K/V head) is sigma = 50**u, u uniform in [0, 1] (log-uniform in [1, 50]), and the
    largest sigma of the tensor set to exactly 50, so every draw reaches logits of a few
    hundred: past fp16's exp overflow (11.1) and past float32's (88.7), with block lse that
    differ by more than 88 within a row. q and k get the same factor sqrt(sigma / (scale *
    sqrt(d))) (at most ~7 at the default scale), so the entries and their fp16 products stay
    representable and the gradients stay moderate."""
    q, k, v, dout = normal(spec, gen)
    u = torch.rand(spec.batch, spec.kv_heads, generator=gen)
    u.view(-1)[int(u.argmax())] = 1.0
    a = wide_factor(WIDE_MAX_STD ** u, spec)
    k = k * a[:, None, :, None]
    q = q * _per_query_head(a, spec)[:, None, :, None]
    return q, k, v, dout


# ---- outlier ---------------------------------------------------------------------------

OUTLIER_RATE = 0.001
OUTLIER_STD = 10.0  # N(0, 100)


def _add_outliers(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    hit = torch.rand(x.shape, generator=gen) < OUTLIER_RATE
    if not bool(hit.any()):  # small tensors: keep at least one outlier, or the case is just `normal`
        hit.view(-1)[int(torch.randint(x.numel(), (1,), generator=gen))] = True
    return x + OUTLIER_STD * torch.randn(x.shape, generator=gen) * hit


def outlier(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """FlashAttention-3's numerics test distribution: every entry of q, k and v is N(0, 1)
    plus, with probability 0.001, an independent N(0, 100) (std 10) term. One change for small
    tensors: a tensor that drew no outlier gets one at a random entry, so each of q, k, v holds
    at least one. dout stays N(0, 1). The `normal` draws come first, so `outlier - normal` of
    the same seed is exactly the added term."""
    q, k, v, dout = normal(spec, gen)
    return _add_outliers(q, gen), _add_outliers(k, gen), _add_outliers(v, gen), dout


# ---- directions shared by sink, late-max and one-hot-backward ---------------------------
#
# A "target" key of a row is made its maximum by construction: some channels of q and k are
# reserved ("target channels"); a target key is s * u_g there (u_g a unit vector, g the target's
# index) and 0 in the other channels, every other key is 0 in the target channels, and a row
# aimed at target g has c * u_g there. Its logit to its own target is then exactly
# scale * c * s = L, to another target L * u_g . u_g' <= L * (1 - f), and to an ordinary key only
# the noise channels count (std <= 1 at the default scale).

MAX_TARGET_LOGIT = 2000.0  # keeps raw fp16 products (logit / scale) far below 65504
# smallest separation f of late-max's targets: bf16 rounds a logit L by ~L / 256, so f >= 1/64
# keeps the margin L f >= 4x that rounding (and, with L <= 2000, >= 31)
MIN_SEPARATION = 1 / 64


def directions(count: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`count` unit vectors in the target channels of a head_dim-vector.

    Returns (U (count, head_dim) float64, target channel mask (head_dim,), f) with
    U[g] . U[g'] <= 1 - f for g != g'. At least head_dim // 4 channels stay noise; the rest
    form pairs (those not needed stay noise too); target g sits in pair g mod pairs at angle 2 pi (g // pairs) / m,
    m = ceil(count / pairs) targets per pair, so targets in different pairs are orthogonal and
    f = min(1, 1 - cos(2 pi / m)). With head_dim 1 there are two directions, +1 and -1.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    mask = torch.zeros(head_dim, dtype=torch.bool)
    if head_dim == 1:
        if count > 2:
            raise ValueError(f"head_dim=1 has 2 directions (+1, -1), {count} targets need head_dim >= 2")
        mask[0] = True
        return torch.tensor([[1.0], [-1.0]], dtype=torch.float64)[:count], mask, 1.0
    pairs = max(1, (head_dim - head_dim // 4) // 2)
    per_pair = math.ceil(count / pairs)
    u = torch.zeros(count, head_dim, dtype=torch.float64)
    for g in range(count):
        p, i = g % pairs, g // pairs
        theta = 2 * math.pi * i / per_pair
        u[g, 2 * p], u[g, 2 * p + 1] = math.cos(theta), math.sin(theta)
    mask[: 2 * min(pairs, count)] = True
    f = 1.0 if per_pair == 1 else min(1.0, 1.0 - math.cos(2 * math.pi / per_pair))
    return u, mask, f


def _aim(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, row_target: torch.Tensor,
         target_keys: torch.Tensor, logit: torch.Tensor, u: torch.Tensor, mask: torch.Tensor):
    """Make key target_keys[g] the maximum of every row t with row_target[t] == g, with logit
    `logit` (batch, kv_heads) to its own target (see the comment above `directions`)."""
    c = (logit / spec.scale).sqrt()  # c = s, so scale * c * s = logit
    q, k = q.clone(), k.clone()
    k[..., mask] = 0.0
    k[:, target_keys] = c[:, None, :, None] * u.float()[None, :, None, :]
    qc = _per_query_head(c, spec)
    q[..., mask] = 0.0
    q += qc[:, None, :, None] * u[row_target].float()[None, :, None, :]
    return q, k


# ---- sink ------------------------------------------------------------------------------

SINK_LOGIT = (12.0, 120.0)  # the sink's logit, uniform in this range per (batch, kv head)


def sink(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """An attention sink: key 0 (the first token, visible to every row, also causal) has logit
    L to every query, L uniform in [12, 120] per (batch, K/V head), while every other logit
    is the noise of the remaining channels (~N(0, 1 - 1/d) at the default scale; exactly 0
    for head_dim 1). So key 0 takes >99% of every row, and a rank that meets it after its own
    block sees a block lse up to ~120 above its running lse."""
    q, k, v, dout = normal(spec, gen)
    lo, hi = SINK_LOGIT
    logit = lo + (hi - lo) * torch.rand(spec.batch, spec.kv_heads, generator=gen)
    mask = torch.zeros(spec.head_dim, dtype=torch.bool)
    mask[0] = True
    u = torch.zeros(1, spec.head_dim, dtype=torch.float64)
    u[0, 0] = 1.0
    rows = torch.zeros(spec.seq_len, dtype=torch.int64)
    q, k = _aim(q, k, spec, rows, torch.tensor([0]), logit, u, mask)
    return q, k, v, dout


# ---- late-max --------------------------------------------------------------------------

# margin of each row's maximum over the other targets; >= 16 so that it also stays >= 8 over
# the ordinary keys, whose noise logits (std <= 1) reach ~6 over thousands of them
LATE_MAX_MARGIN = (16.0, 120.0)


def owners(ring: RingSpec, seq_len: int, cu_seqlens=None) -> torch.Tensor:
    """Rank holding each token position (int64, (seq_len,)); zigzag_docs needs `cu_seqlens`."""
    owner = torch.empty(seq_len, dtype=torch.int64)
    for r in range(ring.world_size):
        owner[positions(layout=ring.layout, rank=r, world_size=ring.world_size, seq_len=seq_len,
                        cu_seqlens=cu_seqlens)] = r
    return owner


def arrival_steps(ring: RingSpec, seq_len: int, causal: bool,
                  variant: Variant = Variant()) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, visible), both (seq_len, seq_len) indexed [query position, key position]: the
    ring step at which the key's K/V reaches the query's rank (rank r holds the K/V of rank
    (r - s) mod P at step s) and whether the query sees the key in one unbroken sequence;
    `variant` gives the documents the zigzag_docs layout deals out."""
    owner = owners(ring, seq_len, variant.cu_seqlens)
    step = (owner[:, None] - owner[None, :]) % ring.world_size
    # visibility is that of one unbroken sequence: with documents or a window the placement is
    # still valid input, only less adversarial (validate leaves late-max out there)
    t = torch.arange(seq_len)
    visible = (t[None, :] <= t[:, None]) if causal else torch.ones(seq_len, seq_len, dtype=torch.bool)
    return step, visible


def last_steps(ring: RingSpec, seq_len: int, causal: bool) -> torch.Tensor:
    """For every query position, the last ring step at which its rank receives a key it sees."""
    step, visible = arrival_steps(ring, seq_len, causal)
    return step.masked_fill(~visible, -1).max(dim=1).values


def min_head_dim(name: str, ring: RingSpec | None = None) -> int:
    """Smallest head_dim the distribution supports on this ring (1 for most)."""
    if name != "late-max":
        return 1
    if ring is None or ring.world_size <= 2:
        return 1
    for d in range(2, 1025):
        if directions(ring.world_size, d)[2] >= MIN_SEPARATION:
            return d
    raise ValueError(f"no head_dim separates {ring.world_size} targets")  # pragma: no cover


def late_max(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Every row's maximum in the K/V chunk that reaches its rank *last* among the chunks it
    sees (for causal rows that is not always step P-1: a contiguous causal rank r >= 1 last
    sees rank 0's chunk, at step r).

    Rows are grouped by the rank whose chunk they see last; each group gets one target key in
    that chunk, visible to all of its rows, and (see `directions`) its own direction, so that
    the target's logit L beats every other target by a margin M uniform in [16, 120] per
    (batch, K/V head) (L = M / f, capped at 2000, so M >= 31 where f is small) and every
    ordinary key by ~L. The other
    groups' targets arrive earlier with logits up to L - M: the running max climbs through the
    ring and jumps at the row's last step. Needs the ring (world size and layout) and
    head_dim >= `min_head_dim("late-max", ring)` (2 up to 32 ranks)."""
    if ring is None:
        raise ValueError("distribution='late-max' places each row's maximum by ring step and needs the "
                         "ring: make_inputs(spec, seed=..., distribution='late-max', ring=RingSpec(...))")
    ring.check_seq_len(spec.seq_len)
    q, k, v, dout = normal(spec, gen)
    step, visible = arrival_steps(ring, spec.seq_len, spec.causal, spec.variant)
    last = step.masked_fill(~visible, -1).max(dim=1).values
    owner = owners(ring, spec.seq_len, spec.variant.cu_seqlens)
    source = (owner - last) % ring.world_size            # the rank whose chunk each row sees last
    groups = torch.unique(source)                         # sorted
    row_target = torch.searchsorted(groups, source)
    target_keys = []
    for g, src in enumerate(groups.tolist()):
        rows = row_target == g
        candidates = torch.nonzero(visible[rows].all(dim=0) & (owner == src)).flatten()
        if candidates.numel() == 0:  # pragma: no cover - the layouts guarantee one
            raise RuntimeError(f"late-max: no key of rank {src} is visible to all rows that see it last")
        target_keys.append(int(candidates[torch.randint(candidates.numel(), (1,), generator=gen)]))
    if spec.head_dim == 1 and len(target_keys) > 2 or \
            spec.head_dim > 1 and directions(len(target_keys), spec.head_dim)[2] < MIN_SEPARATION:
        raise ValueError(
            f"late-max cannot separate the {len(target_keys)} targets of this ring with head_dim="
            f"{spec.head_dim}; use head_dim >= {min_head_dim('late-max', ring)}")
    u, mask, f = directions(len(target_keys), spec.head_dim)
    lo, hi = LATE_MAX_MARGIN
    margin = lo + (hi - lo) * torch.rand(spec.batch, spec.kv_heads, generator=gen)
    logit = (margin / f).clamp(max=MAX_TARGET_LOGIT)
    q, k = _aim(q, k, spec, row_target, torch.tensor(target_keys), logit, u, mask)
    return q, k, v, dout


# ---- repeated-max ----------------------------------------------------------------------

REPEATED_MAX_SHARE = 1 / 8      # share of further key positions that are copies of the max key
REPEATED_MAX_GAP = (0.5, 2.0)   # logit gap of the tied maximum over the best other key


def repeated_max(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Exactly repeated row maxima over same-sign V (the bf16 bias case of low-precision
    flash attention: many P = exp(s - m) are exactly 1, and V of one sign lets the rounding of
    P V add up instead of cancel).

    Keys at positions 0, 1 and a random 1/8 of the others are one identical vector (s, 0, ..,
    0) (so their logits tie bit for bit in every dtype and every summation order: the other
    products are exact zeros); the other keys have channel 0 set to 0. Each row's channel 0 of
    q is set so that the tied logit is 0.5..2 above the row's best other key, so the other
    probabilities stay sizeable. Every row with two or more visible keys has at least two
    tied maxima; V = |N(0, 1)| >= 0."""
    q, k, v, dout = normal(spec, gen)
    n = spec.seq_len
    copies = torch.rand(n, generator=gen) < REPEATED_MAX_SHARE
    copies[: min(2, n)] = True
    lo, hi = REPEATED_MAX_GAP
    gap = lo + (hi - lo) * torch.rand(spec.batch, n, spec.heads, generator=gen)
    s = 2.0
    k = k.clone()
    k[:, copies] = 0.0
    k[:, copies, :, 0] = s
    k[:, ~copies, :, 0] = 0.0
    q = q.clone()
    q[..., 0] = 0.0
    # best logit of each row over the non-copies (channel 0 of those keys is 0, so q[..., 0] does not enter)
    others = torch.einsum("bthd,bjhd->bhtj", q.double(), k.double().repeat_interleave(spec.group_size, dim=2))
    others = others * spec.scale
    if bool((~copies).any()):
        best = others[..., ~copies].max(dim=-1).values.transpose(1, 2)  # (b, t, h)
    else:
        best = torch.zeros(spec.batch, n, spec.heads, dtype=torch.float64)
    q[..., 0] = ((best + gap.double()) / (spec.scale * s)).float()
    return q, k, v.abs(), dout


# ---- one-hot-backward ------------------------------------------------------------------

ONE_HOT_LOGIT = (18.0, 24.0)  # logit of each row's target key; ordinary keys have std <= 1
ONE_HOT_HUBS = 4
ONE_HOT_DOUT_NOISE = 0.05     # relative size of the part of dO orthogonal-ish to O


def _dense_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """float64 attention output of the inputs as the spec's dtype will hold them."""
    dt = spec.torch_dtype
    qh = q.to(dt).double().transpose(1, 2)
    kh = k.to(dt).double().transpose(1, 2).repeat_interleave(spec.group_size, dim=1)
    vh = v.to(dt).double().transpose(1, 2).repeat_interleave(spec.group_size, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale
    if spec.causal:
        s = s.masked_fill(~torch.ones(spec.seq_len, spec.seq_len, dtype=torch.bool).tril(), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vh).transpose(1, 2)


def one_hot_backward(spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """Nearly one-hot probabilities with dO aligned to O, the case where the backward's
    dP - D (D = rowsum(dO * O)) cancels: for the target key dP_j - D = dO . (v_j - O) is a small
    difference of two large numbers.

    Up to 4 "hub" keys (position 0 and random others; 2 hubs for head_dim 1, so the hubs are
    mutually at most orthogonal) get their own directions; each row aims at a random hub it
    sees (causal rows see hub 0 at least) with logit L uniform in [18, 24] per (batch, K/V
    head); the other hubs' logits are <= 0 and the ordinary keys' are noise of std <= 1, so the
    target takes > 99.9% of every row up to ~1000 keys. dO = O + noise of exactly 5% of |O| in
    norm per row, with O the float64 output of the inputs as the spec's dtype holds
    them, so cos(dO, O) > 0.99 in every row."""
    q, k, v, dout = normal(spec, gen)
    n = spec.seq_len
    capacity = 2 if spec.head_dim == 1 else 2 * max(1, (spec.head_dim - spec.head_dim // 4) // 2)
    hubs_n = min(n, ONE_HOT_HUBS, capacity)
    hubs = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(n - 1, generator=gen)[: hubs_n - 1]])
    pos = torch.arange(n)
    seen = (hubs[None, :] <= pos[:, None]) if spec.causal else torch.ones(n, hubs_n, dtype=torch.bool)
    pick = torch.rand(n, hubs_n, generator=gen).masked_fill(~seen, -1.0)
    row_target = pick.argmax(dim=1)
    u, mask, _ = directions(hubs_n, spec.head_dim)
    lo, hi = ONE_HOT_LOGIT
    logit = lo + (hi - lo) * torch.rand(spec.batch, spec.kv_heads, generator=gen)
    q, k = _aim(q, k, spec, row_target, hubs, logit, u, mask)
    out = _dense_out(q, k, v, spec)
    noise = torch.randn(dout.shape, generator=gen).double()
    # each row's noise is exactly 5% of |O| in norm (not only on average: with a small head_dim a
    # per-element draw can be 3x that), so cos(dO, O) >= 1 / sqrt(1 + 0.05^2) > 0.998 in every row
    noise = noise / noise.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    dout = (out + ONE_HOT_DOUT_NOISE * out.norm(dim=-1, keepdim=True) * noise).float().contiguous()
    return q, k, v, dout


DISTRIBUTIONS: dict[str, Generator] = {
    "normal": normal,
    "near-uniform": near_uniform,
    "wide": wide,
    "outlier": outlier,
    "sink": sink,
    "late-max": late_max,
    "repeated-max": repeated_max,
    "one-hot-backward": one_hot_backward,
}


def generate(name: str, spec: AttentionSpec, gen: torch.Generator, ring: RingSpec | None = None):
    """(q, k, v, dout) float32 of the distribution `name` (see the table in the module doc)."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution={name!r} is unknown; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name](spec, gen, ring)
