"""The simulated ring against float64: every tensor, every mode, ring sizes 1 to 16."""


import pytest
import torch

import ringcheck
from ringcheck.judge.check import run_case
from ringcheck.judge.metrics import abs_error
from ringcheck.ring.backends import get_backend, row_delta
from ringcheck.spec import AttentionSpec
from ringcheck.testing.cases import RING_CASES, RING_NEAR_UNIFORM_CASES, RING_PLAIN_CASES

DTYPES = ["float32", "bfloat16", "float16"]


_SIZES = sorted({int(name.split("_")[0].removeprefix("p")) for name in RING_CASES})
_MODES = ("bidirectional", "causal", "zigzag", "striped")
_CASE_DTYPES = ("fp32", "bf16", "fp16")


def _tiered(name: str):
    """make test runs each (ring size, mode) once, its dtype and heads turning with them (every ring
    size, mode, dtype and head layout among them: 24 of 144); the rest carry the marker thorough
    (make test-thorough, in CI)."""
    p, mode, dtype, *rest = name.split("_")
    turn = _SIZES.index(int(p.removeprefix("p"))) + _MODES.index(mode)
    covering = _CASE_DTYPES.index(dtype) == turn % 3 and ("h4kv4" in rest) == bool(turn % 2)
    return pytest.param(name, marks=() if covering else pytest.mark.thorough)


@pytest.mark.parametrize("name", [_tiered(name) for name in RING_CASES])
def test_ring_within_budget_of_float64(name):
    verdict = run_case(RING_CASES[name])
    assert verdict.passed, verdict.message()


@pytest.mark.parametrize("name", RING_PLAIN_CASES)
def test_plain_matmul_backend_within_budget(name):
    verdict = run_case(RING_PLAIN_CASES[name])
    assert verdict.passed, verdict.message()


@pytest.mark.parametrize("mask, sq, sk, diagonal", [("full", 8, 4, 0), ("causal", 8, 8, 0), ("causal", 8, 8, -1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_and_plain_paths_agree_to_float32_rounding(dtype, mask, sq, sk, diagonal):
    g = torch.Generator().manual_seed(7)
    dt = getattr(torch, dtype)
    q, dout = (torch.randn(2, sq, 4, 16, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(2, sk, 2, 16, generator=g).to(dt) for _ in range(2))
    fast, plain = get_backend("torch"), get_backend("torch_plain")
    out, lse = plain.forward(q, k, v, scale=0.25, mask=mask, diagonal=diagonal)
    out_f, lse_f = fast.forward(q, k, v, scale=0.25, mask=mask, diagonal=diagonal)
    delta = row_delta(out, dout)
    grads = plain.backward(q, k, v, dout, lse, delta, scale=0.25, mask=mask, diagonal=diagonal)
    grads_f = fast.backward(q, k, v, dout, lse, delta, scale=0.25, mask=mask, diagonal=diagonal)
    for a, b in zip((out, lse, *grads), (out_f, lse_f, *grads_f)):
        assert a.dtype == b.dtype == torch.float32
        diff, bad = abs_error(b, a)  # the striped diagonal -1 leaves row 0 empty: lse -inf on both
        assert not bad.any()
        scale = float(a[torch.isfinite(a)].abs().max())
        assert diff.max() <= 8 * torch.finfo(torch.float32).eps * max(1.0, scale)


@pytest.mark.parametrize("name", RING_NEAR_UNIFORM_CASES)
def test_ring_within_budget_on_near_uniform_rows(name):
    verdict = run_case(RING_NEAR_UNIFORM_CASES[name])
    assert verdict.passed, verdict.message()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_size_one_equals_the_block_kernel_bit_for_bit(dtype, causal):
    g = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    q = torch.randn(2, 12, 4, 16, generator=g).to(dt).requires_grad_()
    k = torch.randn(2, 12, 2, 16, generator=g).to(dt).requires_grad_()
    v = torch.randn(2, 12, 2, 16, generator=g).to(dt).requires_grad_()
    dout = torch.randn(2, 12, 4, 16, generator=g).to(dt)
    out, lse = ringcheck.simulate_ring(q, k, v, world_size=1, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    backend, scale, mask = get_backend("torch"), 16 ** -0.5, "causal" if causal else "full"
    with torch.no_grad():
        ref_out, ref_lse = backend.forward(q, k, v, scale=scale, mask=mask, diagonal=0)
        ref_grads = backend.backward(q, k, v, dout, ref_lse, row_delta(ref_out, dout),
                                     scale=scale, mask=mask, diagonal=0)
    assert torch.equal(out, ref_out.to(dt)) and torch.equal(lse, ref_lse)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert torch.equal(got, want.to(dt))


def test_outputs_have_the_promised_shapes_dtypes_and_gradients():
    q = torch.randn(2, 16, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    out, lse = ringcheck.simulate_ring(q, k, v, world_size=4, layout="zigzag", causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == t.dtype and torch.isfinite(t.grad).all()


def test_gradient_through_lse_matches_float64():
    """lse is differentiable too: d lse / d s = P enters the backward as dS += P * dlse."""
    from ringcheck.reference import dense_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64).float().requires_grad_()
               for _ in range(3))
    w = torch.randn(1, 2, 16, generator=g)
    _, lse = ringcheck.simulate_ring(q, k, v, world_size=4, causal=True, return_lse=True)
    got = torch.autograd.grad((lse * w).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, lse_ref = dense_attention(qd, kd, vd, causal=True, return_lse=True)
    want = torch.autograd.grad((lse_ref * w.double()).sum(), (qd, kd, vd), allow_unused=True)
    for a, b in zip(got, want):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        assert (a.double() - b).abs().max() < 1e-5


def _qkv(shape_q=(1, 8, 4, 8), shape_kv=(1, 8, 2, 8), dtype=torch.float32):
    return torch.randn(shape_q, dtype=dtype), torch.randn(shape_kv, dtype=dtype), torch.randn(shape_kv, dtype=dtype)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=3), ValueError, r"seq_len=8 is not divisible by world_size=3"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=3, layout="zigzag"), ValueError, r"2 x world_size=6"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=2, layout="ring"), ValueError, r"layout='ring' is unknown"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=2, backend="cuda"), ValueError, r"backend='cuda' is unknown"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=0), ValueError, r"world_size must be >= 1"),
    (lambda: ringcheck.simulate_ring(*_qkv((1, 8, 3, 8)), world_size=2), ValueError, r"heads=3 \(q\) is not divisible by kv_heads=2"),
    (lambda: ringcheck.simulate_ring(*_qkv((8, 4, 8), (8, 2, 8)), world_size=2), ValueError, r"must be 4-D"),
    (lambda: ringcheck.simulate_ring(*(t.to(torch.int64) for t in _qkv()), world_size=2), TypeError,
     r"dtype torch.int64"),
    (lambda: ringcheck.simulate_ring(_qkv()[0].half(), *_qkv()[1:], world_size=2), TypeError, r"share one dtype"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=2, softmax_scale=-1.0), ValueError, r"softmax_scale"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=2, causal="yes"), TypeError, r"causal must be a bool"),
    (lambda: ringcheck.simulate_ring(*_qkv(), world_size=2, accumulate="bf16"), ValueError, r"accumulate='bf16'"),
    (lambda: AttentionSpec(1, 4, 3, 8, 8), ValueError, r"heads=4 is not divisible by kv_heads=3"),
])
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()
