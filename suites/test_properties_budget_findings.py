"""Where flash-attention's budget rule alone failed a correct ring: findings of the property
search, kept as regression tests.

Each case below failed flash-attention's rule (error <= k x peer error + output rounding
floor) with our unmodified ring, and so did the same case on a ring of size 1 (the plain
block kernel): limits of the rule, not ring bugs. The rule now adds the per-element float32
rounding bound of `ringcheck.judge.verdict.float32_floors`; these tests assert that the correct
ring passes every one of them, and that each still fails the bare rule (so each keeps
testing the floor).
"""

import pytest

from ringcheck.judge.check import Case, run_case
from ringcheck.spec import AttentionSpec, RingSpec

FLOAT32_PEER = ("float32 inputs: the peer computes in float32 too, as precisely as the ring; with "
                "logit std 50 the recomputed P = exp(s - lse) carries lse's rounding along whole rows")
ZERO_TRUTH = ("one key: dq = dk = 0 exactly, the budget is 0, and D = rowsum(dO * O) and dP = dO V^T "
              "(two float32 sums of the same products) differ by an ulp")
SATURATED = ("saturated rows: the peer's softmax is exactly one-hot, its dq/dk error ~1e-17; the "
             "flash-attention backward leaves ~eps32 |dO||V||K| scale")
TIED = "every key tied: dq = 0 exactly, the peer's is exact, ours has a cancellation residue"


def _case(batch, heads, kv_heads, seq_len, head_dim, dtype, world_size, seed, distribution, *,
          causal=False, layout="contiguous"):
    spec = AttentionSpec(batch, heads, kv_heads, seq_len, head_dim, dtype, causal)
    return Case(spec, RingSpec(world_size, layout), seed=seed, distribution=distribution)


FINDINGS = [
    # (case, reason, tensors that fail)
    (_case(1, 2, 1, 16, 16, "float32", 4, 2, "wide"), FLOAT32_PEER, {"out", "dq", "dk", "dv"}),
    (_case(1, 2, 1, 16, 16, "float32", 1, 2, "wide"), FLOAT32_PEER, {"out", "dq", "dk", "dv"}),
    (_case(1, 1, 1, 1, 9, "float16", 1, 2, "normal"), ZERO_TRUTH, {"dq", "dk"}),
    (_case(2, 4, 2, 16, 16, "float16", 4, 0, "sink"), SATURATED, {"dq", "dk"}),
    (_case(2, 4, 2, 16, 16, "float16", 1, 0, "sink"), SATURATED, {"dq", "dk"}),
    (_case(2, 4, 2, 15, 32, "bfloat16", 3, 1, "late-max", causal=True, layout="striped"), SATURATED, {"dq", "dk"}),
    (_case(1, 2, 2, 2, 30, "bfloat16", 1, 801, "repeated-max"), TIED, {"dq"}),
]


@pytest.mark.parametrize("case, reason, failing", [
    pytest.param(case, reason, failing, id=f"{case.distribution}-{case.spec.dtype}-P{case.ring.world_size}")
    for case, reason, failing in FINDINGS])
def test_the_correct_ring_passes_where_the_bare_rule_failed(case, reason, failing):
    verdict = run_case(case)
    assert verdict.passed, f"{reason}\n{verdict.message()}"


@pytest.mark.parametrize("case, reason, failing", [
    pytest.param(case, reason, failing, id=f"{case.distribution}-{case.spec.dtype}-P{case.ring.world_size}")
    for case, reason, failing in FINDINGS])
def test_without_the_float32_floor_the_finding_returns(case, reason, failing):
    verdict = run_case(case, use_float32_floors=False)
    assert not verdict.passed, f"the bare rule now passes this case ({reason}); drop it"
