"""The budget rule's floor (`ringcheck.judge.verdict.judge`): the peer error is taken at no less
than half an ulp of the delivered dtype at each element.

flash-attention's rule (error <= k x the peer's max error + slack) assumes tensors large enough
that some element of the peer rounds by about half an ulp. The property suites draw tensors of
four elements, where the peer may round luckily close everywhere: then even the correctly
rounded truth failed. With the floor it always passes, a result rounded twice passes (k = 2),
and a result off by more than k half-ulps still fails.
"""

import pytest
import torch

from ringcheck.judge.metrics import ulp
from ringcheck.judge.verdict import judge

DTYPES = [torch.bfloat16, torch.float16]


def _truth(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(1, 4, 1, 1, generator=g, dtype=torch.float64) + 6.0)  # out of the near-uniform case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(20))
def test_the_correctly_rounded_truth_passes_beside_a_peer_that_is_exact(dtype, seed):
    truth = _truth(seed)
    exact_peer = truth.clone()  # error 0: before the floor the budget was the slack alone
    verdict = judge("out", truth.to(dtype), truth, exact_peer, k=2, dtype=dtype)
    assert verdict.passed, verdict.describe()
    assert verdict.peer_error == 0.0 and verdict.half_ulp > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_ulp_off_passes_for_k_2_and_three_ulps_off_fails(dtype):
    truth = _truth(0).to(dtype).double()  # on the dtype's grid
    step = ulp(truth, dtype)
    twice = judge("out", (truth + step).to(dtype), truth, truth, k=2, dtype=dtype)
    assert twice.passed, twice.describe()  # two roundings of half an ulp each
    off = judge("out", (truth + 3 * step).to(dtype), truth, truth, k=2, dtype=dtype)
    assert not off.passed and off.over_budget == 4, off.describe()
    assert "half an ulp" in off.describe(), off.describe()


def test_a_peer_error_above_the_floor_sets_the_budget_as_before():
    truth = _truth(1)
    peer = truth + 0.25  # far above half an ulp (bfloat16 at 6: 2^-6)
    verdict = judge("out", (truth + 0.45).to(torch.bfloat16), truth, peer, k=2, dtype=torch.bfloat16)
    assert verdict.passed and verdict.budget == pytest.approx(2 * 0.25 + verdict.slack)
    assert "peer error" in verdict.describe()
    worse = judge("out", (truth + 0.6).to(torch.bfloat16), truth, peer, k=2, dtype=torch.bfloat16)
    assert not worse.passed, worse.describe()
