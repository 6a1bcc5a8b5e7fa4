"""The certified mpmath reference's attention variants - packed documents, sliding windows, a
logit softcap, attention sinks, a value head dim of its own - against the float64 dense
reference, which implements the same semantics (`ringcheck.reference.dense.dense_grads`).

Every case is certified (default digits=30) and must agree with dense to RTOL. Also here:
the exact semantics of padding rows and of rows that see only their sink, the certification
of what is new (tanh evaluated at both precisions, dsinks), planted disagreements that the
comparison must catch, the cache key, and argument errors identical to dense_attention's.
Small shapes (seq 8-24, d 8-16): the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringcheck.judge.metrics import error_stats
from ringcheck.reference import dense_attention, dense_grads, mp_attention
from ringcheck.reference.mp_group import Tiling

TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")
RTOL = 1e-13  # normwise relative agreement of float64 dense with the certified truth
DIGITS = 30  # mp_attention's default: every call below is certified to it (or raises)
N = 16


def make(seed=0, *, b=1, n=N, nk=None, h=2, kv=1, d=8, dv=None, dtype=torch.float32, sigma=1.0):
    """q (b, n, h, d), k (b, nk, kv, d), v (b, nk, kv, dv), dout (b, n, h, dv)."""
    g = torch.Generator().manual_seed(seed)
    nk, dv = nk or n, dv or d
    q = torch.randn(b, n, h, d, generator=g) * sigma
    k = torch.randn(b, nk, kv, d, generator=g) * sigma
    v, do = torch.randn(b, nk, kv, dv, generator=g), torch.randn(b, n, h, dv, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def assert_agrees(got: torch.Tensor, truth: torch.Tensor, *, rtol: float, name: str) -> None:
    __tracebackhide__ = True
    s = error_stats(got, truth)
    if not s.finite or s.rel_norm > rtol:
        raise AssertionError(
            f"{name}: normwise relative error {s.rel_norm:.3e} > {rtol:.0e}; max |err| {s.max_abs:.3e} "
            f"at index {s.worst_index}; {s.nonfinite} wrong non-finite of {s.numel}")


def check(q, k, v, do, *, rows=None, dense_kwargs=None, **kw):
    """mp (certified) against dense_grads with the same arguments (or `dense_kwargs`)."""
    __tracebackhide__ = True
    truth = mp_attention(q, k, v, do, rows=rows, cache=False, **kw)
    assert truth.certified_digits >= DIGITS, truth.digits_by_tensor
    got = dense_grads(q, k, v, do, rows=rows, **(kw if dense_kwargs is None else dense_kwargs))
    for name, x in zip(TENSORS, got):
        if getattr(truth, name) is not None:
            assert_agrees(x, getattr(truth, name), rtol=RTOL, name=name)
    assert (truth.dsinks is None) == (kw.get("sinks") is None)
    return truth


DOCS = [0, 5, 5, 6, N - 3]  # an empty document, a one-token document, 3 padding tokens
VARIANTS = {
    "documents": {"cu_seqlens": torch.tensor(DOCS, dtype=torch.int32)},
    "window": {"window": (3, 2)},
    "window_0_0": {"window": (0, 0)},
    "window_left": {"window": (4, -1)},
    "window_right": {"window": (-1, 2)},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.25])},
    "sinks_far": {"sinks": torch.tensor([40.0, -40.0])},  # far above every score; far below
    "documents_window_softcap_sinks": {"cu_seqlens": torch.tensor(DOCS), "window": (3, 1), "softcap": 1.5,
                                       "sinks": torch.tensor([0.75, 2.0])},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_agrees_with_dense(variant, causal, dtype):
    q, k, v, do = make(1, dtype=dtype)
    truth = check(q, k, v, do, causal=causal, **VARIANTS[variant])
    if variant == "window_0_0" and not causal:  # each row sees itself only: P = 1, dq = dk = 0
        assert not truth.dq.any() and not truth.dk.any()


def test_saturated_softcap():
    """scale q.k up to ~100x the cap: most tanh are 1 - O(1e-30) in float64 terms; 1 - t^2
    underflows in dense and must still agree normwise."""
    q, k, v, do = make(2, sigma=3.0)
    cap = 0.25
    y = torch.einsum("bihd,bjkd->bhij", q.double(), k.double()) / math.sqrt(q.shape[-1]) / cap
    assert float(y.abs().max()) > 50  # the case contains what it is named for
    check(q, k, v, do, causal=True, softcap=cap)
    check(q, k, v, do, softcap=cap, sinks=torch.tensor([0.2, -0.1]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_value_head_dim_gqa_batch_and_everything(causal):
    """d_v != d_qk, grouped-query (4 heads on 2 K/V heads), two batches, bf16, every variant."""
    q, k, v, do = make(3, b=2, h=4, kv=2, d=8, dv=12, dtype=torch.bfloat16)
    kw = {"cu_seqlens": torch.tensor(DOCS, dtype=torch.int64), "window": (5, 2), "softcap": 3.0,
              "sinks": torch.tensor([0.5, -3.0, 1.0, 40.0])}
    truth = check(q, k, v, do, causal=causal, softmax_scale=0.3, **kw)
    assert truth.out.shape == (2, N, 4, 12) and truth.dq.shape == q.shape
    assert truth.dk.shape == k.shape and truth.dv.shape == v.shape and truth.dsinks.shape == (4,)
    assert set(truth.digits_by_tensor) == set(TENSORS)


def test_value_head_dim_alone():
    q, k, v, do = make(4, d=16, dv=8)
    check(q, k, v, do, causal=True)
    mp_attention(q, k, v, cache=False)  # forward only


# ---------------------------------------------------------------------------------------
# rows, positions, the semantics of empty rows


def test_sampled_rows_with_variants():
    """Rows are the full result's rows; with them, dsinks is the gradient when dout is zero on
    every other row (as dense_grads)."""
    q, k, v, do = make(5, h=4, kv=2, dv=12)
    kw = dict(causal=True, **VARIANTS["documents_window_softcap_sinks"])
    kw["sinks"] = torch.tensor([0.75, 2.0, -1.0, 40.0])
    full = mp_attention(q, k, v, do, cache=False, **kw)
    rows = [N - 1, 0, 5, 7, 7, 12]  # padding, a first token, the one-token document, a repeat
    part = check(q, k, v, do, rows=rows, **kw)
    assert part.dk is None and part.dv is None
    for name, at in (("out", (slice(None), rows)), ("lse", (slice(None), slice(None), rows)),
                     ("dq", (slice(None), rows))):
        assert torch.equal(getattr(part, name), getattr(full, name)[at]), name
    masked = do.clone()
    keep = torch.zeros(N, dtype=torch.bool)
    keep[[N - 1, 0, 5, 7, 12]] = True
    masked[:, ~keep] = 0
    once = mp_attention(q, k, v, masked, cache=False, **kw).dsinks  # each row once; 7 is twice in rows
    twice = once + mp_attention(q, k, v, torch.where(torch.arange(N).view(1, N, 1, 1) == 7, do, 0),
                                cache=False, **kw).dsinks
    assert_agrees(part.dsinks, twice, rtol=1e-14, name="dsinks")


@pytest.mark.parametrize("nq, nk", [(12, 16), (16, 10)])
def test_unequal_lengths_are_bottom_right_aligned(nq, nk):
    """Query i is at global position i + nk - nq, for documents and windows as for causal; with
    rows too (rows are the full result's rows)."""
    q, k, v, do = make(6, n=nq, nk=nk)
    kw = {"causal": True, "cu_seqlens": torch.tensor([0, 2, 2, 3, nk - 2]), "window": (4, -1), "softcap": 2.0,
              "sinks": torch.tensor([0.25, -2.0])}
    full = check(q, k, v, do, **kw)
    rows = [nq - 1, 0, 4, nq - 3]
    part = mp_attention(q, k, v, do, rows=rows, cache=False, **kw)
    assert torch.equal(part.out, full.out[:, rows]) and torch.equal(part.dq, full.dq[:, rows])
    assert torch.equal(part.lse, full.lse[:, :, rows])


def test_streaming_over_small_tiles_with_variants():
    """Key tiles of 5, row blocks of 3 rows (some of padding rows only), nothing kept between
    passes: out, lse, dq and dsinks are bit-identical; dk and dv (rounded per tile) agree to
    the certified digits."""
    q, k, v, do = make(13, h=4, kv=2, dv=12)
    kw = {"causal": True, "cu_seqlens": torch.tensor(DOCS), "window": (6, -1), "softcap": 2.0,
              "sinks": torch.tensor([0.5, -40.0, float("-inf"), 3.0])}
    whole = mp_attention(q, k, v, do, cache=False, **kw)
    tiled = mp_attention(q, k, v, do, cache=False, tiling=Tiling(key_tile=5, tile=15, keep=0), **kw)
    assert tiled.certified_digits >= DIGITS
    for name in ("out", "lse", "dq", "dsinks"):
        assert torch.equal(getattr(tiled, name), getattr(whole, name)), name
    for name in ("dk", "dv"):
        assert_agrees(getattr(tiled, name), getattr(whole, name), rtol=1e-15, name=name)


def test_padding_rows_and_rows_that_see_only_their_sink():
    """12 queries on 8 keys, causal: queries 0-3 sit at positions -4..-1 and see no key. With a
    sink they see only it: out 0, lse = the sink, dq 0. Padding (past cu_seqlens[-1] = 6):
    out 0, lse -inf, every gradient 0, no sink. Everything exact."""
    q, k, v, do = make(7, n=12, nk=8)
    sinks = torch.tensor([1.5, -0.5])
    truth = check(q, k, v, do, causal=True, cu_seqlens=torch.tensor([0, 6]), sinks=sinks, softcap=4.0)
    zero = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    assert torch.equal(truth.out[:, :4], zero) and torch.equal(truth.dq[:, :4], zero)
    assert torch.equal(truth.lse[0, :, :4], sinks.double().view(2, 1).expand(2, 4))
    pad = slice(4 + 6, 12)  # queries at positions 6, 7
    assert not truth.out[:, pad].any() and not truth.dq[:, pad].any()
    assert torch.isneginf(truth.lse[:, :, pad]).all()
    assert not truth.dk[:, 6:].any() and not truth.dv[:, 6:].any()  # padding keys
    # no document: every query at a position >= 0 is padding; those before position 0 are not
    nothing = check(q, k, v, do, causal=True, cu_seqlens=torch.tensor([0, 0]), sinks=sinks)
    assert torch.isneginf(nothing.lse[:, :, 4:]).all() and torch.equal(nothing.lse[:, :, :4], truth.lse[:, :, :4])
    assert not nothing.out.any() and not nothing.dq.any() and not nothing.dsinks.any()


def test_sinks_of_minus_infinity_are_no_sinks():
    q, k, v, do = make(8, h=4, kv=2)
    kw = {"causal": True, "cu_seqlens": torch.tensor(DOCS), "window": (6, 0), "softcap": 2.5}
    plain = mp_attention(q, k, v, do, cache=False, **kw)
    none = mp_attention(q, k, v, do, cache=False, sinks=torch.full((4,), float("-inf")), **kw)
    for name in TENSORS[:5]:
        assert torch.equal(getattr(none, name), getattr(plain, name)), name
    assert torch.equal(none.dsinks, torch.zeros(4, dtype=torch.float64))
    assert none.digits_by_tensor["dsinks"] == (none.precision[1] + 31) * math.log10(2)  # exactly 0: the cap
    mixed = torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0])
    check(q, k, v, do, sinks=mixed, **kw)


# ---------------------------------------------------------------------------------------
# certification of what is new


def test_softcap_tanh_is_certified_not_assumed():
    """window (0, 0): every row sees one key, so P = 1, out = v and dq = dk = 0 exactly; lse is
    c tanh(y / c) itself, which only an evaluation can give. At 20 and 80 bits, lse is certified
    to what the two tanh evaluations agree on (~20 + 25 bits of fixed point), far less than
    without the cap (lse = y exactly, capped by the a-priori bound, ~80 bits), while out and dq
    reach the cap of exact values (the 80 + 32 bits results are rounded to). Escalation then
    certifies 30 digits."""
    q, k, v, do = make(9)
    low = mp_attention(q, k, v, do, window=(0, 0), softcap=2.0, precision=(20, 80), digits=0, cache=False)
    exact = (80 + 32 - 1) * math.log10(2)
    assert low.digits_by_tensor["out"] == exact and low.digits_by_tensor["dq"] == exact
    uncapped = mp_attention(q, k, v, do, window=(0, 0), precision=(20, 80), digits=0, cache=False)
    assert 6 < low.digits_by_tensor["lse"] < 16
    assert uncapped.digits_by_tensor["lse"] > 20
    check(q, k, v, do, window=(0, 0), softcap=2.0)


def test_dsinks_certification_follows_the_precision():
    q, k, v, do = make(10)
    sinks = torch.tensor([1.0, -2.0])
    low = mp_attention(q, k, v, do, sinks=sinks, precision=(20, 40), digits=0, cache=False)
    assert 2 < low.digits_by_tensor["dsinks"] < 10
    high = check(q, k, v, do, sinks=sinks)
    assert_agrees(low.dsinks, high.dsinks, rtol=1e-4, name="dsinks")


# ---------------------------------------------------------------------------------------
# the comparison can fail


PLANTS = {
    "window_left_minus_one": ({"window": (3, -1)}, {"window": (2, -1)}),
    "window_right_minus_one": ({"window": (-1, 2), "causal": False}, {"window": (-1, 1), "causal": False}),
    "document_boundary_moved": ({"cu_seqlens": [0, 7, 16]}, {"cu_seqlens": [0, 8, 16]}),
    "padding_forgotten": ({"cu_seqlens": [0, 7, 13]}, {"cu_seqlens": [0, 7, 16]}),
    "softcap_off_by_1e-9": ({"softcap": 2.0}, {"softcap": 2.0 * (1 + 1e-9)}),
    "sink_off_by_1e-9": ({"sinks": torch.tensor([0.5, -1.0])},
                         {"sinks": torch.tensor([0.5, -1.0], dtype=torch.float64) * (1 + 1e-9)}),
    "sink_dropped": ({"sinks": torch.tensor([-3.0, -40.0])}, {}),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_disagreement_is_caught(plant):
    q, k, v, do = make(11)
    mp_kw, dense_kw = ({"causal": True, **kw} for kw in PLANTS[plant])
    check(q, k, v, do, **mp_kw)  # the plant is what disagrees
    with pytest.raises(AssertionError, match="normwise relative error"):
        check(q, k, v, do, dense_kwargs=dense_kw, **mp_kw)


# ---------------------------------------------------------------------------------------
# cache


def test_cache_key_holds_every_variant(tmp_path):
    q, k, v, do = make(12, n=8)
    plain = mp_attention(q, k, v, do, cache_dir=tmp_path)
    same = mp_attention(q, k, v, do, window=(-1, -1), cache_dir=tmp_path)  # the default, spelled out
    assert same.from_cache and not plain.from_cache
    calls = [{"window": (2, 1)}, {"window": (1, 2)}, {"cu_seqlens": [0, 4, 8]}, {"cu_seqlens": [0, 4, 7]},
             {"softcap": 2.0}, {"softcap": 3.0}, {"sinks": torch.tensor([0.5, 1.0])},
             {"sinks": torch.tensor([0.5, 1.5])}, {"sinks": torch.tensor([0.5, 1.0]), "softcap": 2.0}]
    for kw in calls:
        assert not mp_attention(q, k, v, do, cache_dir=tmp_path, **kw).from_cache, kw
    assert len(list(tmp_path.glob("*.pt"))) == 1 + len(calls)
    first = mp_attention(q, k, v, do, cache_dir=tmp_path, sinks=torch.tensor([0.5, 1.0]), softcap=2.0)
    assert first.from_cache and first.dsinks is not None and "dsinks" in first.digits_by_tensor
    fresh = mp_attention(q, k, v, do, cache=False, sinks=torch.tensor([0.5, 1.0]), softcap=2.0)
    assert torch.equal(first.dsinks, fresh.dsinks)
    assert mp_attention(q, k, v, cache_dir=tmp_path, sinks=torch.tensor([0.5, 1.0])).dsinks is None


# ---------------------------------------------------------------------------------------
# argument errors: the same as dense_attention's


BAD = {
    "cu_float": {"cu_seqlens": torch.tensor([0.0, 8.0])},
    "cu_2d": {"cu_seqlens": torch.tensor([[0, 8]])},
    "cu_start": {"cu_seqlens": torch.tensor([1, 8])},
    "cu_decreasing": {"cu_seqlens": torch.tensor([0, 9, 5])},
    "cu_past_end": {"cu_seqlens": torch.tensor([0, N + 1])},
    "cu_empty": {"cu_seqlens": []},
    "cu_bools": {"cu_seqlens": [0, True]},
    "window_one_int": {"window": 3},
    "window_float": {"window": (2.0, 1)},
    "window_below_minus_one": {"window": (-2, 1)},
    "softcap_zero": {"softcap": 0.0},
    "softcap_negative": {"softcap": -1.0},
    "softcap_inf": {"softcap": float("inf")},
    "softcap_bool": {"softcap": True},
    "sinks_list": {"sinks": [0.5, 1.0]},
    "sinks_int": {"sinks": torch.tensor([1, 2])},
    "sinks_shape": {"sinks": torch.tensor([0.5, 1.0, 2.0])},
}


@pytest.mark.parametrize("bad", list(BAD))
def test_argument_errors_match_dense(bad):
    q, k, v, do = make()
    with pytest.raises((TypeError, ValueError)) as dense:
        dense_attention(q, k, v, **BAD[bad])
    with pytest.raises(type(dense.value)) as mp:
        mp_attention(q, k, v, do, cache=False, **BAD[bad])
    assert str(mp.value) == str(dense.value)


def test_errors_of_the_reference_itself():
    q, k, v, do = make(d=8, dv=12)
    with pytest.raises(ValueError) as dense:
        dense_grads(q, k, v, do[..., :8])
    with pytest.raises(ValueError) as mp:
        mp_attention(q, k, v, do[..., :8], cache=False)
    assert str(mp.value) == str(dense.value) and "v's head dim" in str(mp.value)
    for value in (float("nan"), float("inf")):  # -inf is no sink; these have no exact meaning
        with pytest.raises(ValueError, match=r"sinks contains NaN or \+Inf"):
            mp_attention(q, k, v, cache=False, sinks=torch.tensor([0.5, value]))
