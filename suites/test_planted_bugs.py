"""Deliberately broken rings: the verdict (or the ring's own home check) must reject each.

Each bug is planted by swapping one piece of the real ring for a wrong one through its seam
(`ringcheck.catalogue.planted.PLANTED`), so these tests prove that the checks of test_ring.py
can fail.
"""

import pytest

from ringcheck.catalogue.planted import PLANTED
from ringcheck.judge.check import run_case, simulated_impl
from ringcheck.testing.cases import PLANTED_CASES


def test_the_unbroken_ring_passes_these_cases():
    for case in PLANTED_CASES.values():
        verdict = run_case(case)
        assert verdict.passed, verdict.message()


def _planted(case, name):
    return run_case(case, impl=simulated_impl(case, parts=PLANTED[name]))


def test_merge_without_rescaling_is_rejected():
    verdict = _planted(PLANTED_CASES["p4_bidirectional"], "merge_without_rescaling")
    assert not verdict.passed
    assert not verdict["out"].passed and not verdict["lse"].passed


def test_wrong_causal_offset_in_the_zigzag_diagonal_is_rejected():
    verdict = _planted(PLANTED_CASES["p4_zigzag"], "diagonal_off_by_one")
    assert not verdict.passed
    assert "FAILED" in verdict.message() and "zigzag" in verdict.message()
    assert not verdict["out"].passed and not verdict["dk"].passed


def test_dk_dv_not_sent_home_is_caught_by_the_home_check():
    with pytest.raises(RuntimeError, match=r"gradients for rank \d did not return home"):
        _planted(PLANTED_CASES["p4_bidirectional"], "dk_dv_not_sent_home")


def test_low_precision_partial_output_at_every_hop_is_rejected():
    """A bf16 round trip of the running output at every ring step (accumulate="input"): on
    near-tied rows over same-sign V the roundings add up past the budget at 16 ranks."""
    case = PLANTED_CASES["p16_near_uniform"]
    verdict = run_case(case, impl=simulated_impl(case, accumulate="input"))
    assert not verdict.passed
    assert not verdict["out"].passed
