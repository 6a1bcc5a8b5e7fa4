"""Where the budget rule fails a correct ring: findings of the property search, pinned.

Each case below fails flash-attention's rule (error <= k x peer error + rounding floor) with
our unmodified ring, and so does the same case on a ring of size 1, which is the plain block
kernel with no ring at all: these are limits of the rule (or of the flash-attention
formulation of the backward), not ring bugs. Each test asserts the finding exactly as
reported (which tensors fail); a change to the rule that resolves one makes its test fail
with a note to widen the budget property's domain (`test_properties.budget_tensors`), which
meanwhile stays where the rule holds.
"""

import pytest
import torch

from ringcheck.check import Case, run_case
from ringcheck.spec import AttentionSpec, RingSpec

FLOAT32_PEER = ("float32 inputs: the peer computes in float32 too, as precisely as the ring; with "
                "logit std 50 the recomputed P = exp(s - lse) carries lse's rounding along whole rows")
COIN_TOSS = "float32 inputs on 12 elements: the ring and the float32 peer are equally precise, k = 3 is luck"
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
    (_case(2, 3, 3, 2, 1, "float32", 1, 349274, "normal"), COIN_TOSS, {"dq", "dk"}),
    (_case(1, 1, 1, 1, 9, "float16", 1, 2, "normal"), ZERO_TRUTH, {"dq", "dk"}),
    (_case(2, 4, 2, 16, 16, "float16", 4, 0, "sink"), SATURATED, {"dq", "dk"}),
    (_case(2, 4, 2, 16, 16, "float16", 1, 0, "sink"), SATURATED, {"dq", "dk"}),
    (_case(2, 4, 2, 15, 32, "bfloat16", 3, 1, "late-max", causal=True, layout="striped"), SATURATED, {"dq", "dk"}),
    (_case(1, 2, 2, 2, 30, "bfloat16", 1, 801, "repeated-max"), TIED, {"dq"}),
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case, reason, failing", [
    pytest.param(case, reason, failing, id=f"{case.distribution}-{case.spec.dtype}-P{case.ring.world_size}")
    for case, reason, failing in FINDINGS])
def test_the_correct_ring_fails_the_budget_rule_here(case, reason, failing):
    verdict = run_case(case)
    got = {t.tensor for t in verdict.failures}
    assert got == failing, (
        f"finding changed: expected {sorted(failing)} over budget ({reason}), got {sorted(got)}. "
        f"If the budget rule now covers this case, widen test_properties.budget_tensors and drop "
        f"it here.\n{verdict.message()}")
