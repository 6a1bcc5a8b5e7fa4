"""One validation vocabulary: the same bad argument gets the same error, with the same
message, from the ring and from every reference."""

import pytest
import torch

import ringcheck
from ringcheck.reference import dense_attention, dense_grads, mp_attention, peer_attention
from ringcheck.spec import check_qkv, check_rows, check_softmax_scale


def _qkv(dtype=torch.float32, seq=8, heads=2, kv_heads=1, d=4):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, d, generator=g).to(dtype)
    k = torch.randn(1, seq, kv_heads, d, generator=g).to(dtype)
    return q, k, torch.randn(1, seq, kv_heads, d, generator=g).to(dtype)


CALLERS = {
    "simulate_ring": lambda q, k, v, **kw: ringcheck.simulate_ring(q, k, v, world_size=2, **kw),
    "dense_attention": dense_attention,
    "peer_attention": peer_attention,
    "dense_grads": lambda q, k, v, **kw: dense_grads(q, k, v, torch.zeros_like(q), **kw),
    "mp_attention": lambda q, k, v, **kw: mp_attention(q, k, v, cache=False, **kw),
}

BAD = {
    "scale_zero": (dict(softmax_scale=0.0), ValueError, "softmax_scale must be a finite positive number, got 0.0"),
    "scale_negative": (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a finite positive number"),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite positive number"),
    "scale_bool": (dict(softmax_scale=True), ValueError, "softmax_scale must be a finite positive number"),
    "causal_int": (dict(causal=1), TypeError, "causal must be a bool, got 1"),
}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("bad", BAD)
def test_the_same_argument_gets_the_same_rule_and_message_everywhere(caller, bad):
    kwargs, error, message = BAD[bad]
    with pytest.raises(error) as info:
        CALLERS[caller](*_qkv(), **kwargs)
    assert message in str(info.value)


SHAPES = {
    "kv_heads_do_not_divide": (lambda: (*_qkv(heads=3, kv_heads=2),), ValueError,
                               "heads=3 (q) is not divisible by kv_heads=2 (k, v)"),
    "k_v_lengths_differ": (lambda: (lambda q, k, v: (q, k, v[:, :2]))(*_qkv()), ValueError,
                           "k and v must agree on (batch, seq, kv_heads)"),
    "d_v_on_k": (lambda: (lambda q, k, v: (q, k[..., :2], v[..., :2]))(*_qkv()), ValueError,
                 "must share the query/key head dim"),
    "three_d": (lambda: (lambda q, k, v: (q[0], k, v))(*_qkv()), ValueError, "q must be 4-D"),
    "mixed_dtypes": (lambda: (lambda q, k, v: (q, k.half(), v))(*_qkv()), TypeError, "q, k, v must share one dtype"),
    "integer_dtype": (lambda: (lambda q, k, v: (q.int(), k.int(), v.int()))(*_qkv()), TypeError,
                      "has dtype torch.int32; supported floating-point dtypes"),
    "empty": (lambda: (lambda q, k, v: (q[:, :, :0], k, v))(*_qkv()), ValueError, "empty dimension"),
}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bad_tensors_get_the_same_message_everywhere(caller, shape):
    make, error, message = SHAPES[shape]
    with pytest.raises(error) as info:
        CALLERS[caller](*make())
    assert message in str(info.value)


def test_the_references_widen_the_ring_rules_only_where_they_do_more():
    q, k, v = _qkv(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        check_qkv(q, k, v)  # the ring: no float64 inputs
    dense_attention(q, k, v)  # the truth: float64 inputs too
    out = dense_attention(q[:, :3], k, v, causal=True)  # one block: 3 queries, bottom-right causal
    assert out.shape == (1, 3, 2, 4)


@pytest.mark.parametrize("rows, message", [
    ([], "non-empty 1-D"), ([[0, 1]], "non-empty 1-D"), ([0.5], "non-empty 1-D"),
    ([0, 8], r"rows must lie in \[0, 8\)"), ([-1], r"rows must lie in \[0, 8\)")])
def test_rows_rule(rows, message):
    with pytest.raises(ValueError, match=message):
        check_rows(rows, 8)
    with pytest.raises(ValueError, match=message):
        dense_attention(*_qkv(), rows=rows)


def test_default_scale():
    assert check_softmax_scale(None, 16) == 0.25 and check_softmax_scale(2, 16) == 2.0
