"""The search works: bugs planted for a narrow class of inputs are found by the property
suite and shrunk to a small spec, while hand-picked benign cases miss them.

Each bug is planted by swapping one piece of the real ring through its seam
(`ringcheck.catalogue.planted`); the
search is `hypothesis.find` over the same strategy and property as test_properties.py, with
a fixed (derandomized) search so the test is deterministic.
"""

import pytest
from hypothesis import HealthCheck, find, settings

from ringcheck.catalogue.planted import PLANTED
from ringcheck.judge.check import run_case, simulated_impl
from ringcheck.testing.cases import SEARCH_BENIGN_CASES
from ringcheck.testing.properties import budget_cases, check_budget
from ringcheck.testing.strategies import Bounds, tokens_per_rank

SEARCH = settings(max_examples=400, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
# small rings and shapes: a found bug shrinks in a few hundred quick runs
BOUNDS = Bounds(max_world_size=8, max_tokens_per_rank=8, max_batch=2, max_heads=4, max_head_dim=16)


def _fails(check):
    def failing(case):
        try:
            check(case)
        except AssertionError:
            return True
        return False
    return failing


# ---- (a) a merge that overflows when a block's lse is > 88 above the running one ------------
# ---- (b) zig-zag half split that assumes a power-of-two number of tokens per rank ----------
# (both in ringcheck.catalogue.planted)

def _impl(name):
    return lambda case: simulated_impl(case, parts=PLANTED[name])


def test_overflowing_merge_passes_benign_cases():
    for case in SEARCH_BENIGN_CASES.values():  # hand-picked, in the style of test_ring.py
        verdict = run_case(case, impl=_impl("merge_overflowing_past_88")(case))
        assert verdict.passed, verdict.message()


def test_overflowing_merge_is_found_and_shrunk_to_a_small_spec():
    broken = _impl("merge_overflowing_past_88")
    found = find(budget_cases(BOUNDS), _fails(lambda case: check_budget(case, impl=broken)), settings=SEARCH)
    spec = found.spec
    assert found.distribution in ("wide", "outlier", "sink", "late-max"), found
    assert found.ring.world_size == 2 and tokens_per_rank(found) <= 2, found
    assert (spec.batch, spec.heads, spec.kv_heads) == (1, 1, 1) and spec.head_dim <= 2, found
    with pytest.raises(AssertionError, match="NaN/Inf"):
        check_budget(found, impl=broken)
    check_budget(found)  # the real merge passes the shrunk case


def test_power_of_two_zigzag_split_passes_benign_cases():
    for case in SEARCH_BENIGN_CASES.values():
        verdict = run_case(case, impl=_impl("zigzag_power_of_two_half")(case))
        assert verdict.passed, verdict.message()


def test_power_of_two_zigzag_split_is_found_and_shrunk_to_a_small_spec():
    broken = _impl("zigzag_power_of_two_half")
    found = find(budget_cases(BOUNDS), _fails(lambda case: check_budget(case, impl=broken)), settings=SEARCH)
    spec = found.spec
    assert found.ring.layout == "zigzag" and spec.causal, found
    assert tokens_per_rank(found) == 6 and found.ring.world_size == 2, found
    assert (spec.batch, spec.heads, spec.kv_heads, spec.head_dim) == (1, 1, 1, 1), found
    assert found.distribution == "normal", found
    check_budget(found)
