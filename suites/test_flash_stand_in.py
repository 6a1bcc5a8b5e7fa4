"""The CPU stand-in for flash-attn (`ringcheck.flash_stand_in`) against float64.

Every function of the API the ring libraries call, with flash-attn's conventions (bottom-right
causal for sq != sk, windows, softcap, GQA, lse (b, h, s) float32 and (h, total) for varlen,
backward into the caller's buffers, views included), is compared with the float64 dense
reference (`ringcheck.reference.dense`) on the same inputs under a stated budget:

    |got - ref| <= u_dtype * |ref| + 64 * u_fp32 * max|ref|      per element

u_dtype is the unit roundoff of the output dtype (one rounding, 2^-8 bf16, 2^-11 fp16, 2^-24
fp32; lse, softmax_d: fp32) and the second term bounds float32 accumulation over these short
rows (tens of terms). A planted bug (top-left causal alignment, a window off by one, a
missing GQA sum) must fail the same check, and `install` must never shadow a real flash-attn.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ringcheck import flash_stand_in
from ringcheck.flash_stand_in import interface, kernel
from ringcheck.reference.dense import attention_mask, dense_grads

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def within_budget(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The worst |got - ref| / budget over the finite reference elements (<= 1 passes)."""
    got, ref = got.detach().double(), ref.detach().double()
    scale = ref.abs().max().clamp_min(1e-30)
    budget = UNIT[dtype] * ref.abs() + 64 * UNIT[torch.float32] * scale
    return float(((got - ref).abs() / budget).max())


def inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, heads, d, generator=g).to(dtype) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    return q, k, v, dout


def truth(q, k, v, dout, *, causal, window, softcap, scale):
    """float64 out, lse, dq, dk, dv with flash-attn's conventions: the reference aligns query
    rows bottom-right (positions sk - sq .. sk - 1) as flash-attn does; an empty row's lse is
    +inf in flash-attn (-inf in the reference)."""
    out, lse, dq, dk, dv = dense_grads(*(t.double() for t in (q, k, v, dout)), causal=causal, softmax_scale=scale,
                                       window=None if window == (-1, -1) else window, softcap=softcap)
    return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse), dq, dk, dv


def backward_truth(q, k, v, dout, out, *, causal, window, softcap, scale):
    """float64 dq, dk, dv of flash-attn's backward given the (rounded) `out`: D = rowsum(dout *
    out) from the out the caller passes, as flash-attn computes it; probabilities in float64."""
    h, group = q.shape[2], q.shape[2] // k.shape[2]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    slope = torch.ones_like(s)
    if softcap:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    seen = attention_mask(q.shape[1], key_len=k.shape[1], causal=causal, window=None if window == (-1, -1) else window)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    do = dout.double().transpose(1, 2)
    ds = p * (do @ vh.transpose(-1, -2) - (do * out.double().transpose(1, 2)).sum(-1, keepdim=True)) * slope
    b, sk = q.shape[0], k.shape[1]

    def fold(x):
        return x.reshape(b, h // group, group, sk, -1).sum(2).transpose(1, 2)
    return (ds @ kh * scale).transpose(1, 2), fold(ds.transpose(-1, -2) @ qh * scale), fold(p.transpose(-1, -2) @ do)


def worst_ratio(q, k, v, dout, *, causal, window=(-1, -1), softcap=None, scale=0.3) -> dict[str, float]:
    """Every tensor of `_flash_attn_forward` / `_flash_attn_backward` (2.7 spelling, gradients
    written into strided views of larger buffers) against `truth`: the worst ratio each."""
    out, lse, _, _ = interface._flash_attn_forward(q, k, v, 0.0, scale, causal, window[0], window[1],
                                                   softcap or 0.0, None, False)
    bufs = [torch.full((t.shape[0], t.shape[1] + 3, *t.shape[2:]), 7.0, dtype=t.dtype) for t in (q, k, v)]
    views = [buf[:, 1:-2] for buf in bufs]
    interface._flash_attn_backward(dout, q, k, v, out, lse, *views, 0.0, scale, causal, window[0], window[1],
                                   softcap or 0.0, None, False)
    for buf in bufs:  # nothing written outside the views
        assert torch.all(buf[:, :1] == 7.0) and torch.all(buf[:, -2:] == 7.0)
    ref = truth(q, k, v, dout, causal=causal, window=window, softcap=softcap, scale=scale)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isinf(lse), ~finite), "empty rows must have lse +inf, and only they"
    ratios = {"out": within_budget(out, ref[0], q.dtype),
              "lse": within_budget(lse[finite], ref[1][finite], torch.float32)}
    grads = backward_truth(q, k, v, dout, out, causal=causal, window=window, softcap=softcap, scale=scale)
    for name, got, want, exact in zip(("dq", "dk", "dv"), views, grads, ref[2:]):
        ratios[name] = within_budget(got, want, q.dtype)
        if q.dtype == torch.float32:  # out's rounding is negligible: the true gradients too
            ratios[name + " (true)"] = within_budget(got, exact, q.dtype)
    return ratios


# b, sq, sk, h, hk, d, causal, window, softcap: square, wide, tall (empty rows), GQA, windows
CASES = {
    "full": (2, 12, 12, 4, 4, 16, False, (-1, -1), None),
    "causal_square_gqa": (1, 16, 16, 4, 2, 8, True, (-1, -1), None),
    "causal_wide": (1, 6, 20, 2, 1, 8, True, (-1, -1), None),           # bottom-right: last query sees all
    "causal_tall": (1, 20, 6, 2, 2, 8, True, (-1, -1), None),           # first 14 rows see nothing
    "window_both": (1, 14, 18, 4, 2, 8, False, (3, 2), None),
    "window_causal": (1, 16, 16, 2, 1, 8, True, (5, -1), None),
    "softcap": (1, 10, 10, 2, 2, 8, False, (-1, -1), 2.0),
    "softcap_window_gqa": (1, 12, 15, 6, 2, 8, True, (4, 0), 5.0),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_float64(case, dtype):
    b, sq, sk, h, hk, d, causal, window, softcap = CASES[case]
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, dtype, seed=len(case))
    ratios = worst_ratio(q, k, v, dout, causal=causal, window=window, softcap=softcap)
    assert max(ratios.values()) <= 1.0, ratios


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_in_float32_gives_the_true_gradients(case, monkeypatch):
    """The interface takes fp16/bf16 only (as flash-attn); its kernel in float32, where out's
    rounding is negligible, meets the budget against the true float64 gradients too."""
    monkeypatch.setattr(interface, "DTYPES", (*interface.DTYPES, torch.float32))
    b, sq, sk, h, hk, d, causal, window, softcap = CASES[case]
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, torch.float32, seed=len(case))
    ratios = worst_ratio(q, k, v, dout, causal=causal, window=window, softcap=softcap)
    assert {"dq (true)", "dk (true)", "dv (true)"} <= set(ratios) and max(ratios.values()) <= 1.0, ratios


@pytest.mark.parametrize("planted", ["top_left_causal", "window_off_by_one", "no_gqa_sum"])
def test_a_planted_bug_fails_the_check(monkeypatch, planted):
    """The same check with one defect planted in the stand-in's kernel must fail."""
    case = {"top_left_causal": "causal_wide", "window_off_by_one": "window_both",
            "no_gqa_sum": "causal_square_gqa"}[planted]
    b, sq, sk, h, hk, d, causal, window, softcap = CASES[case]
    right_visible, right_backward = kernel.visible, kernel.backward
    if planted == "top_left_causal":
        monkeypatch.setattr(kernel, "visible", lambda sq, sk, causal, window, device=None: (
            right_visible(sq, sq, causal, window, device)[:, :sk] if sk <= sq else
            torch.cat([right_visible(sq, sq, causal, window, device),
                       torch.zeros(sq, sk - sq, dtype=torch.bool)], 1)))
    elif planted == "window_off_by_one":
        monkeypatch.setattr(kernel, "visible", lambda sq, sk, causal, window, device=None: right_visible(
            sq, sk, causal, (window[0] + 1, window[1]), device))
    else:
        def first_head_only(*args, **kwargs):
            dq, dk, dv, d = right_backward(*args, **kwargs)
            return dq, dk * 0 + dk[:, :, :1], dv, d
        monkeypatch.setattr(kernel, "backward", first_head_only)
    q, k, v, dout = inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed=len(case))
    ratios = worst_ratio(q, k, v, dout, causal=causal, window=window, softcap=softcap)
    assert max(ratios.values()) > 10.0, ratios


@pytest.mark.parametrize("causal", [False, True])
def test_a_block_without_keys_gives_zero_out_and_lse_plus_infinity_as_flash_attn_does(causal):
    """flash-attn's mha_fwd runs no kernel when seqlen_k == 0: out is zeroed and lse filled with
    +inf; its backward then leaves dq 0 (no key to attend). A ring hands such a block to the
    kernel when a rank's shard is one token (ring-flash-attn's stripe ring: k[:, :-1]); the
    stand-in raised there, and the in-package suite blamed the ring."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 2, 4, generator=g).to(torch.bfloat16)
    k = v = torch.empty(1, 0, 1, 4, dtype=torch.bfloat16)
    out, lse, _ = kernel.forward(q, k, v, scale=0.5, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (1, 2, 3) and torch.isposinf(lse).all()
    dq, dk, dv, _ = kernel.backward(torch.randn(q.shape, generator=g).to(q.dtype), q, k, v, out, lse, scale=0.5,
                                    causal=causal)
    assert dq.shape == q.shape and not dq.any() and dk.shape == dv.shape == k.shape


def test_varlen_pair_matches_float64_per_sequence_and_leaves_the_rest():
    """Three sequences (q shorter than k in one: bottom-right causal) and two rows past the last
    sequence: lse (h, total) float32; out NaN there (flash-attn leaves it uninitialised), the
    gradient buffers untouched there."""
    dtype, h, hk, d, scale = torch.bfloat16, 4, 2, 8, 0.35
    cu_q, cu_k = torch.tensor([0, 5, 9, 16], dtype=torch.int32), torch.tensor([0, 5, 12, 19], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(18, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(19, hk, d, generator=g).to(dtype) for _ in range(2))
    out, lse, _, _ = interface._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 7, 7, 0.0, scale, True, 3, 0)
    assert lse.shape == (h, 18) and lse.dtype == torch.float32
    assert out[16:].isnan().all() and lse[:, 16:].isnan().all()
    dq, dk, dv = (torch.full_like(t, 7.0) for t in (q, k, v))
    interface._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 7, 7, 0.0, scale, True,
                                          3, 0, 0.0, None, False)
    assert (dq[16:] == 7.0).all()
    for i in range(3):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref = truth(q[rows][None], k[keys][None], v[keys][None], dout[rows][None], causal=True, window=(3, 0),
                    softcap=None, scale=scale)
        assert within_budget(out[rows], ref[0][0], dtype) <= 1.0
        assert within_budget(lse[:, rows], ref[1][0], torch.float32) <= 1.0
        grads = backward_truth(q[rows][None], k[keys][None], v[keys][None], dout[rows][None], out[rows][None],
                               causal=True, window=(3, 0), softcap=None, scale=scale)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), grads):
            assert within_budget(got, want[0], dtype) <= 1.0


def test_public_functions_are_differentiable_and_take_flash_attn_arguments():
    q, k, v, dout = inputs(1, 10, 10, 4, 2, 8, torch.float16, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, _probs = interface.flash_attn_func(*leaves, softmax_scale=0.3, causal=True, window_size=(4, 0),
                                                softcap=3.0, return_attn_probs=True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = truth(q, k, v, dout, causal=True, window=(4, 0), softcap=3.0, scale=0.3)
    assert within_budget(out, ref[0], torch.float16) <= 1.0 and within_budget(lse, ref[1], torch.float32) <= 1.0
    for got, want in zip(grads, backward_truth(q, k, v, dout, out, causal=True, window=(4, 0), softcap=3.0,
                                               scale=0.3)):
        assert within_budget(got, want, torch.float16) <= 1.0
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    vleaves = [t[0].clone().requires_grad_(True) for t in (q, k, v)]
    vout = interface.flash_attn_varlen_func(*vleaves, cu, cu, 6, 6, softmax_scale=0.3, causal=True)
    vgrads = torch.autograd.grad(vout, vleaves, dout[0])
    for rows in (slice(0, 4), slice(4, 10)):
        ref = truth(q[:, rows], k[:, rows], v[:, rows], dout[:, rows], causal=True, window=(-1, -1), softcap=None,
                    scale=0.3)
        want = backward_truth(q[:, rows], k[:, rows], v[:, rows], dout[:, rows], vout[rows][None].detach(),
                              causal=True, window=(-1, -1), softcap=None, scale=0.3)
        assert within_budget(vout[rows], ref[0][0], torch.float16) <= 1.0
        for got, w in zip(vgrads, want):
            assert within_budget(got[rows], w[0], torch.float16) <= 1.0


def test_arguments_flash_attn_refuses_are_refused():
    q, k, v, _ = inputs(1, 4, 4, 2, 2, 8, torch.bfloat16)
    with pytest.raises(TypeError, match="fp16 and bf16"):
        interface._flash_attn_forward(q.float(), k.float(), v.float(), 0.0, None, False, -1, -1, 0.0, None, False)
    with pytest.raises(ValueError, match="dropout_p"):
        interface.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        interface.flash_attn_func(q, k, v[..., :4])
    with pytest.raises(TypeError, match="int32"):
        cu = torch.tensor([0, 4])
        interface._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 4, 4, 0.0, None, False)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        interface._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 3, 4, 0.0, None, False)


def test_install_resolves_flash_attn_and_never_shadows_a_real_one(monkeypatch):
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    status = flash_stand_in.install()
    assert status.installed and flash_stand_in.active()
    assert status.describe().startswith("used:")
    import flash_attn  # the stand-in, through sys.modules (as a ring library imports it)
    import flash_attn.flash_attn_interface as api

    assert api is interface and flash_attn.__version__ >= "2.6.3"   # yunchang's test for the 2.7 spelling
    assert flash_attn.flash_attn_func is interface.flash_attn_func
    assert flash_stand_in.install().installed  # idempotent
    flash_stand_in.uninstall()
    assert "flash_attn" not in sys.modules
    real = type(sys)("flash_attn")
    real.__version__ = "2.8.3"
    monkeypatch.setitem(sys.modules, "flash_attn", real)  # a real flash-attn already imported
    status = flash_stand_in.install()
    assert not status.installed and status.real_version == "2.8.3" and sys.modules["flash_attn"] is real
    assert "not used" in status.describe()
