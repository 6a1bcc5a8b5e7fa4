"""The online-softmax merge: exact, NaN-free with empty sides, no overflow."""

import pytest
import torch

from ringcheck.ring.merge import finish, merge, merge_into, start_state


def _partial(s, v):
    """Exact partial (out, lse) of scores s (b, h, sq, sk) over values v (b, sk, h, d)."""
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def test_merging_two_halves_gives_the_whole():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 5, 8, dtype=torch.float64) * 3
    v = torch.randn(2, 8, 3, 4, dtype=torch.float64)
    whole = _partial(s, v)
    a, b = _partial(s[..., :3], v[:, :3]), _partial(s[..., 3:], v[:, 3:])
    out, lse = merge(a[0].float(), a[1].float(), b[0].float(), b[1].float())
    assert (out.double() - whole[0]).abs().max() < 1e-6
    assert (lse.double() - whole[1]).abs().max() < 1e-6


def test_a_fully_masked_block_leaves_out_and_lse_unchanged_bit_for_bit():
    torch.manual_seed(1)
    out, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for merged in (merge(out, lse, empty_out, empty_lse), merge(empty_out, empty_lse, out, lse)):
        assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)


def test_both_sides_empty_gives_zero_and_minus_inf_without_nan():
    acc, m, l = start_state(1, 3, 2, 4)
    out, lse = finish(*merge_into(acc, m, l, torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf"))))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("gap", [88.0, 1e4, 1e30])
def test_far_apart_lse_do_not_overflow(gap):
    out_a, out_b = torch.full((1, 2, 1, 4), 1.0), torch.full((1, 2, 1, 4), 2.0)
    lse_a = torch.zeros(1, 1, 2)
    out, lse = merge(out_a, lse_a, out_b, lse_a + gap)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.allclose(out, out_b) and torch.allclose(lse, lse_a + gap)
    out, lse = merge(out_b, lse_a + gap, out_a, lse_a)
    assert torch.allclose(out, out_b) and torch.allclose(lse, lse_a + gap)


def test_merge_rejects_other_dtypes_and_shapes():
    out, lse = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 2)
    with pytest.raises(TypeError, match="float32"):
        merge(out.half(), lse, out, lse)
    with pytest.raises(ValueError, match="matching partials"):
        merge(out, lse, torch.zeros(1, 3, 1, 4), torch.zeros(1, 1, 3))
