"""`ringcheck step`: the user's training step at CP=P against the same step at CP=1, in float64.

The ring itself in float64 first (the step's exact arithmetic needs it), then the recipe
contract, the cases, the verdict and its budget, the diagnosis of every catalogue mutant, and
the command end to end.
"""

from __future__ import annotations

import pytest
import torch

import ringcheck
from reference import dense_attention


# ---- the ring in float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("layout, variant", [
    ("contiguous", {}), ("zigzag", {}), ("striped", {}), ("zigzag", {"cu_seqlens": (0, 10, 27, 32)}),
    ("zigzag", {"window": (5, 0)}), ("zigzag", {"softcap": 3.0})])
def test_our_ring_in_float64_matches_the_dense_float64_reference(layout, variant):
    """float64 in, float64 throughout (merge, accumulators, block kernels), float64 out: forward
    and backward within a few float64 roundings of the dense float64 attention (a float32 step
    anywhere would leave errors near 1e-7)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    out = ringcheck.simulate_ring(q, k, v, world_size=4, causal=True, layout=layout, sinks=sinks, **variant)
    want = dense_attention(q, k, v, causal=True, sinks=sinks, **variant)
    assert out.dtype == torch.float64
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref = torch.autograd.grad(want, (q, k, v, sinks), dout)
    assert float((out - want).detach().abs().max()) < 1e-13
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert a.dtype == torch.float64 and float((a - b).abs().max()) < 1e-13, name
