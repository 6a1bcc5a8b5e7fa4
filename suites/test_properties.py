"""Property-based suites on our simulated ring: Hypothesis searches shapes, dtypes, ring sizes
and distributions; the bodies live in `ringcheck.testing.properties` (the installable kit)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ringcheck.judge.check import Case
from ringcheck.spec import AttentionSpec, RingSpec
from ringcheck.testing.properties import (
    budget_cases,
    check_batch_and_head_independence,
    check_budget,
    check_causal_prefix,
    check_finite,
    check_gqa_is_mha_with_repeated_kv,
    check_kv_permutation,
    check_layout_round_trip,
    check_linear_in_v,
    check_ring_invariance,
    check_v_negation,
    failure,
    other_rings,
)
from ringcheck.testing.strategies import PROFILES, cases

# ---- the tests ---------------------------------------------------------------------------------

@given(data=st.data())
def test_budget_against_float64(data, search_profile):
    check_budget(data.draw(budget_cases(search_profile.bounds), label="case"))


@given(data=st.data())
def test_no_nan_or_inf_for_any_distribution(data, search_profile):
    check_finite(data.draw(cases(search_profile.bounds), label="case"))


@given(data=st.data())
def test_linear_in_v(data, search_profile):
    case = data.draw(cases(search_profile.bounds), label="case")
    a, b = data.draw(st.sampled_from([1.0, -1.0, 0.5, 2.0]), label="a"), data.draw(
        st.sampled_from([1.0, -1.0, 0.5, 2.0]), label="b")
    check_linear_in_v(case, a, b)


@given(data=st.data())
def test_v_negation_is_exact(data, search_profile):
    check_v_negation(data.draw(cases(search_profile.bounds), label="case"))


@given(data=st.data())
def test_bidirectional_invariant_under_kv_permutation(data, search_profile):
    case = data.draw(budget_cases(search_profile.bounds, causal=(False,)), label="case")
    permutation = data.draw(st.permutations(list(range(case.spec.seq_len))), label="permutation")
    check_kv_permutation(case, permutation)


@given(data=st.data())
def test_causal_prefix_independence_is_exact(data, search_profile):
    case = data.draw(cases(search_profile.bounds, causal=(True,)), label="case")
    cut = data.draw(st.integers(1, max(1, case.spec.seq_len - 1)), label="cut")
    check_causal_prefix(case, cut)


@given(data=st.data())
def test_batch_and_head_independence_is_exact(data, search_profile):
    check_batch_and_head_independence(data.draw(cases(search_profile.bounds), label="case"))


@given(data=st.data())
def test_gqa_equals_mha_with_repeated_kv(data, search_profile):
    check_gqa_is_mha_with_repeated_kv(data.draw(budget_cases(search_profile.bounds, min_group=2), label="case"))


@given(data=st.data())
def test_ring_size_and_layout_invariance(data, search_profile):
    case = data.draw(budget_cases(search_profile.bounds), label="case")
    world_size, layout = data.draw(st.sampled_from(other_rings(case, search_profile.bounds.max_world_size)),
                                   label="other ring")
    check_ring_invariance(case, world_size, layout)


@given(data=st.data())
def test_layout_round_trip(data, search_profile):
    check_layout_round_trip(data.draw(cases(search_profile.bounds), label="case"))


def test_a_failure_message_names_the_case_and_reproduces_it():
    case = Case(AttentionSpec(1, 1, 1, 4, 2, causal=True), RingSpec(2), seed=3)
    message = str(failure("check_causal_prefix", case, "out differs", cut=2))
    assert case.describe() in message
    line = message.splitlines()[-1]
    assert "check_causal_prefix(Case(spec=AttentionSpec(batch=1" in line and "cut=2)" in line
    namespace = {}
    exec(line.split('-c "', 1)[1].rstrip('"'), namespace)  # the reproduction runs (and passes)


def test_torchrun_profiles_draw_the_same_examples_in_the_same_order_on_every_rank():
    """Under torchrun each rank runs the property in its own process: the registered
    `<profile>-torchrun` settings are derandomized and database-free, so two runs (two ranks)
    draw identical example sequences."""
    for name, profile in PROFILES.items():
        registered = hypothesis_settings.get_profile(f"{name}-torchrun")
        assert registered.derandomize and registered.database is None
        assert registered.max_examples == profile.max_examples

    def one_rank():
        seen = []

        @hypothesis_settings(hypothesis_settings.get_profile("ci-torchrun"), max_examples=15)
        @given(case=cases(PROFILES["ci"].bounds))
        def record(case):
            seen.append(case)

        record()
        return seen

    first, second = one_rank(), one_rank()
    assert len(first) > 1 and first == second
