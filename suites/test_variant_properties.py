"""Property-based suites for attention variants on our simulated ring: Hypothesis draws packed
documents, windows, softcaps, sinks and value head dims on every layout (zigzag_docs too);
the bodies live in `ringcheck.testing.variant_properties`, the strategies in
`ringcheck.testing.variant_strategies`. Example counts come from the search profile
(``pytest --profile {ci,nightly,deep}``); sizes from `variant_bounds` (tiny under ci).

Each property family also meets a planted bug: a wrong ring built here as a whole-tensor
implementation (our ring called with one argument changed), which the property must reject
while the real ring passes the same case.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ringcheck import simulate_ring
from ringcheck.judge.check import Case, simulated_impl
from ringcheck.ring.layouts import positions
from ringcheck.spec import AttentionSpec, RingSpec, Variant
from ringcheck.testing.strategies import PROFILES
from ringcheck.testing.variant_properties import (
    check_documents_are_separate,
    check_full_window_is_no_window,
    check_padding_is_inert,
    check_sink_minus_inf,
    check_softcap_to_infinity,
    check_variant_budget,
    check_zigzag_docs_is_contiguous_permuted,
    failure,
)
from ringcheck.testing.variant_strategies import variant_bounds, variant_cases, with_variant_options


@pytest.fixture(scope="module")
def bounds(search_profile):
    return variant_bounds(search_profile)


@pytest.fixture(scope="module")
def at_options(variant_options):
    """Cases at the variant given on the command line (``pytest --documents random:8 --window
    256,0 --sinks ...``, the plugin's `variant_options`), or the drawn ones when none is given."""
    def strategy(cases):
        if variant_options is None:
            return cases
        return cases.map(lambda c: with_variant_options(c, variant_options, seed=c.seed)).filter(
            lambda c: c is not None)
    return strategy


# ---- the properties ----------------------------------------------------------------------------

@given(data=st.data())
def test_variant_budget_against_float64(data, bounds, at_options):
    check_variant_budget(data.draw(at_options(variant_cases(bounds)), label="case"))


@given(data=st.data())
def test_packed_documents_equal_separate_documents(data, bounds):
    check_documents_are_separate(data.draw(variant_cases(bounds, documents=(True,)), label="case"))


@given(data=st.data())
def test_a_window_covering_everything_is_no_window(data, bounds):
    case = data.draw(variant_cases(bounds), label="case")
    n = case.spec.seq_len
    side = st.one_of(st.just(-1), st.integers(n - 1, 2 * n + 3))
    left, right = data.draw(st.tuples(side, side).filter(lambda w: w != (-1, -1)), label="window")
    check_full_window_is_no_window(case, left, right)


@given(data=st.data())
def test_softcap_to_infinity_is_no_softcap(data, bounds):
    check_softcap_to_infinity(data.draw(variant_cases(bounds, softcapped=(False,)), label="case"))


@given(data=st.data())
def test_sinks_of_minus_infinity_are_no_sinks(data, bounds, at_options):
    check_sink_minus_inf(data.draw(at_options(variant_cases(bounds)), label="case"))


@given(data=st.data())
def test_padding_is_inert(data, bounds):
    case = data.draw(variant_cases(bounds, documents=(True, False)), label="case")
    extra = case.ring.chunks * data.draw(st.integers(1, 3), label="padding chunks")
    check_padding_is_inert(case, extra)


def test_padding_is_inert_bit_for_bit_on_a_window_band():
    """Found by the search above: a window band (the backend's plain path) on zigzag_docs, where
    the plan of the 42 real tokens is unchanged by padding; rank 1's float32 dout reached the
    matmuls as a view into the whole tensor in one run and as its own tensor in the other, and
    dq came out with other last bits (0.0 vs -5e-08)."""
    spec = AttentionSpec(1, 1, 1, 42, 9, "float32", causal=False, variant=Variant(cu_seqlens=(0, 42), window=(0, 0)))
    check_padding_is_inert(Case(spec, RingSpec(3, "zigzag_docs"), seed=0), 6)


@given(data=st.data())
def test_zigzag_docs_is_contiguous_permuted(data, bounds):
    check_zigzag_docs_is_contiguous_permuted(data.draw(variant_cases(bounds, layouts=("zigzag_docs",)), label="case"))


# ---- the strategy reaches the places a ring cuts -------------------------------------------------

def _docs(case):
    cu = case.spec.variant.cu_seqlens or ()
    return [b - a for a, b in pairwise(cu)]


def _chunk(case):
    return case.spec.seq_len // (2 * case.ring.world_size)


def _cuts_at(case, step):
    cu = case.spec.variant.cu_seqlens or ()
    return case.ring.world_size > 1 and step > 0 and any(0 < c < case.spec.seq_len and c % step == 0 for c in cu)


REACHES = {
    "an empty document": lambda c: 0 in _docs(c),
    "a length-1 document": lambda c: 1 in _docs(c),
    "an odd-length document": lambda c: any(d % 2 for d in _docs(c) if d > 1),
    "a padding tail": lambda c: bool(_docs(c)) and c.spec.variant.cu_seqlens[-1] < c.spec.seq_len,
    "a boundary at a rank boundary": lambda c: c.ring.layout == "contiguous" and _cuts_at(c, c.spec.seq_len
                                                                                         // c.ring.world_size),
    "a boundary at a zig-zag chunk boundary": lambda c: c.ring.layout == "zigzag" and _chunk(c) > 1 and _cuts_at(
        c, _chunk(c)) and not _cuts_at(c, 2 * _chunk(c)),
    "zigzag_docs with two documents and padding": lambda c: c.ring.layout == "zigzag_docs" and c.ring.world_size > 1
    and len([d for d in _docs(c) if d]) >= 2 and c.spec.variant.cu_seqlens[-1] < c.spec.seq_len,
    "a window inside a chunk": lambda c: c.spec.variant.window != (-1, -1) and 0 < max(c.spec.variant.window)
    < _chunk(c),
    "a window spanning ranks": lambda c: c.ring.world_size > 2 and max(c.spec.variant.window)
    > c.spec.seq_len // c.ring.world_size,
    "a one-sided window": lambda c: -1 in c.spec.variant.window and c.spec.variant.window != (-1, -1),
    "the window (0, 0)": lambda c: c.spec.variant.window == (0, 0),
    "a saturated softcap": lambda c: c.spec.variant.softcap is not None and c.spec.variant.softcap <= 0.5
    and c.distribution in ("wide", "outlier", "sink", "late-max", "one-hot-backward"),  # large logits
    "high sinks with documents": lambda c: c.spec.sinks == "high" and c.spec.variant.cu_seqlens is not None,
    "d_v != d_qk in bfloat16": lambda c: c.spec.v_head_dim not in (None, c.spec.head_dim) and c.spec.dtype == "bfloat16",
    "everything at once": lambda c: (c.spec.variant.cu_seqlens is not None and c.spec.variant.window != (-1, -1)
                                     and c.spec.variant.softcap is not None and c.spec.sinks is not None
                                     and c.spec.v_head_dim is not None and c.ring.world_size > 1),
}


def test_the_strategy_draws_every_place_it_promises():
    """Generation only (no ring runs), derandomized: among 600 drawn cases each place of
    `REACHES` occurs."""
    seen = set()

    @settings(max_examples=600, phases=[Phase.generate], derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=variant_cases(PROFILES["ci"].bounds))
    def draw(case):
        seen.update(what for what, reached in REACHES.items() if reached(case))

    draw()
    assert set(REACHES) - seen == set()


# ---- planted bugs: wrong rings as whole-tensor implementations -----------------------------------

def _ring(case, *, sinks=lambda s: s, **changes):
    """Factory of our ring for `case` with some simulate_ring arguments changed and the sinks
    passed through `sinks` (each planted bug below is one such change)."""
    spec = case.spec
    kwargs = dict(world_size=case.ring.world_size, causal=spec.causal, softmax_scale=spec.softmax_scale,
                  layout=case.ring.layout, backend=case.backend, return_lse=True, **spec.variant_kwargs())
    kwargs.update(changes)

    def impl(q, k, v, s=None):
        return simulate_ring(q, k, v, **kwargs, **({} if s is None else {"sinks": sinks(s)}))
    return impl


def ignores_documents(case):
    return _ring(case, cu_seqlens=None)


def padding_as_a_document(case):
    cu = case.spec.variant.cu_seqlens
    if cu is None or cu[-1] == case.spec.seq_len:
        return simulated_impl(case)
    return _ring(case, cu_seqlens=torch.tensor([*cu, case.spec.seq_len]))


def window_off_by_one(case):
    left, right = case.spec.variant.window
    return _ring(case, window=(left + 1, right) if left >= 0 else (left, right + 1))


def window_clamped_to_shard(case):
    """Window sides measured against one rank's shard: clamped to its length."""
    n = case.spec.seq_len // case.ring.world_size
    return _ring(case, window=tuple(min(w, n) if w >= 0 else w for w in case.spec.variant.window))


def softcap_without_division(case):
    """softcap * tanh(s) instead of softcap * tanh(s / softcap)."""
    cap = case.spec.variant.softcap
    return simulated_impl(case) if cap is None else _ring(case, softmax_scale=case.spec.scale * cap)


def sink_added_twice(case):
    return _ring(case, sinks=lambda s: s + math.log(2.0))  # exp(s) twice in every denominator


def minus_inf_sink_as_zero(case):
    """Non-finite sink logits 'sanitised' to 0: a sink of weight exp(0) = 1 appears."""
    return _ring(case, sinks=lambda s: torch.nan_to_num(s, neginf=0.0))


def zigzag_docs_with_local_positions(case):
    """zigzag_docs whose masks see the rank-local order of the tokens, not their positions: the
    inputs dealt out (rank 0's tokens, then rank 1's, ...) and attended as if contiguous."""
    if case.ring.layout != "zigzag_docs":
        return simulated_impl(case)
    spec, p = case.spec, case.ring.world_size
    order = torch.cat([positions(layout="zigzag_docs", rank=r, world_size=p, seq_len=spec.seq_len,
                                 cu_seqlens=spec.variant.cu_seqlens) for r in range(p)])
    back = torch.argsort(order)
    inner = _ring(case, layout="contiguous")

    def impl(q, k, v, s=None):
        out, lse = inner(q[:, order], k[:, order], v[:, order], s)
        return out[:, back], lse[:, :, back]
    return impl


def _case(seq_len, *, causal=True, cu=None, window=(-1, -1), softcap=None, sinks=None, ring=None,
          dtype="bfloat16", distribution="normal", v_head_dim=None):
    spec = AttentionSpec(2, 4, 2, seq_len, 8, dtype, causal, v_head_dim=v_head_dim,
                         variant=Variant(cu_seqlens=cu, window=window, softcap=softcap), sinks=sinks)
    return Case(spec, ring or RingSpec(2), seed=7, distribution=distribution)


DOCS = _case(16, cu=(0, 3, 3, 9, 13), ring=RingSpec(4))
PLANTED = [  # (property, case, extra arguments, wrong ring)
    (check_variant_budget, _case(16, window=(2, -1), ring=RingSpec(4, "striped")), (), window_off_by_one),
    (check_variant_budget, _case(16, sinks="normal", cu=(0, 5, 16)), (), sink_added_twice),
    (check_variant_budget, _case(16, softcap=5.0, distribution="wide", v_head_dim=5), (), softcap_without_division),
    (check_variant_budget, DOCS, (), ignores_documents),
    (check_documents_are_separate, DOCS, (), ignores_documents),
    (check_documents_are_separate, DOCS, (), padding_as_a_document),
    (check_full_window_is_no_window, _case(16, ring=RingSpec(4)), (16, -1), window_clamped_to_shard),
    (check_softcap_to_infinity, _case(16, ring=RingSpec(2, "zigzag")), (), softcap_without_division),
    (check_sink_minus_inf, _case(16, sinks="normal", cu=(0, 7, 12)), (), minus_inf_sink_as_zero),
    (check_padding_is_inert, _case(16, cu=(0, 6, 11), ring=RingSpec(2, "striped")), (4,), padding_as_a_document),
    (check_padding_is_inert, _case(16, cu=(0, 6, 11), ring=RingSpec(1)), (4,), ignores_documents),
    (check_zigzag_docs_is_contiguous_permuted, _case(32, cu=(0, 8, 24), ring=RingSpec(2, "zigzag_docs")), (),
     zigzag_docs_with_local_positions),
]


@pytest.mark.parametrize("check, case, args, wrong", PLANTED,
                         ids=[f"{c.__name__}-{w.__name__}" for c, _, _, w in PLANTED])
def test_a_planted_bug_fails_the_property(check, case, args, wrong):
    check(case, *args)  # the real ring passes this case
    with pytest.raises(AssertionError, match=check.__name__):
        check(case, *args, impl=wrong)


def test_a_failure_message_names_the_case_and_reproduces_it():
    case = _case(8, cu=(0, 3, 8), window=(2, 0), softcap=5.0, sinks="low")
    message = str(failure("check_documents_are_separate", case, "out differs"))
    assert case.describe() in message and "cu_seqlens=[0, 3, 8]" in message
    line = message.splitlines()[-1]
    assert "check_documents_are_separate(Case(spec=AttentionSpec(" in line and "Variant(cu_seqlens=(0, 3, 8)" in line
    exec(line.split('-c "', 1)[1].rstrip('"'), {})
