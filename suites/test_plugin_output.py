"""What a user of the in-package suite (`pytest --ring-impl`, `ringcheck test`) reads.

A ring invariance failure names both rings and the one off from float64 (it named only the
case's own ring, e.g. P=1, for a bug that exists only at P > 1).
"""

from __future__ import annotations

import pytest

from ringcheck.judge.check import Case, simulated_impl
from ringcheck.spec import AttentionSpec, RingSpec
from ringcheck.testing.properties import check_ring_invariance


def _dk_doubled_beyond_one_rank(case: Case):
    """Our simulated ring, with dK doubled on rings of 2 or more (out, lse, dq, dv untouched)."""
    ring = simulated_impl(case)
    if case.ring.world_size == 1:
        return ring
    return lambda q, k, v: ring(q, 2 * k - k.detach(), v)  # the value of k, twice its gradient


@pytest.mark.parametrize("first, other", [(1, 2), (2, 1)])
def test_which_ring_is_off_does_not_depend_on_which_is_drawn_first(first, other):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=8, head_dim=4, dtype="float32", causal=True)
    case = Case(spec, RingSpec(first, "zigzag"), seed=3)
    with pytest.raises(AssertionError) as failed:
        check_ring_invariance(case, other, "zigzag", impl=_dk_doubled_beyond_one_rank)
    said = str(failed.value)
    assert said.startswith(f"check_ring_invariance failed for P={first} zigzag vs P={other} zigzag, causal float32 "
                           f"batch=1 heads=2/1 seq=8 d=4 dist=normal seed=3"), said
    assert f"dk of P={first} zigzag and of P={other} zigzag differ by more than the two budgets" in said, said
    assert "against float64, P=2 zigzag is further off" in said and "P=1 zigzag's" in said, said
    assert f"world_size={other}, layout='zigzag')" in said, said  # the reproduce line
