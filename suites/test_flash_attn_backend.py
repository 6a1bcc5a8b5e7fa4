"""The flash-attn block backend.

- Where flash-attn imports and CUDA is present: the ring on flash-attn blocks meets the same
  budget as the other backends (bf16/fp16; bidirectional, causal, zig-zag, striped).
- Without it: an explicit request fails with a RuntimeError that says how to install it.
- Everywhere: the mapping of the contract's top-left causal and band masks onto flash-attn's
  bottom-right causal flag and window is checked exhaustively, and the backend's glue (mask
  mapping, D through a stand-in `out`, lse conventions, head-dim padding, both argument
  spellings of `_flash_attn_backward`, the softcap passed through) runs in the ring and block
  by block against a CPU stand-in for flash-attn written from its documented semantics. The
  stand-in checks the glue, not flash-attn itself. A softcap on a flash-attn older than 2.6
  and a value head dim of its own (which flash-attn 2 lacks) raise.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from ringcheck.judge.check import run_case
from ringcheck.ring import simulate_ring
from ringcheck.ring.backends import get_backend
from ringcheck.ring.backends.flash_attn_backend import FlashAttnBackend, FlashGeometry, flash_geometry
from ringcheck.testing.cases import FLASH_CASES, FLASH_STAND_IN_CASES


def _flash_available() -> tuple[bool, str]:
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed (pip install flash-attn, CUDA only)"
    try:
        get_backend("flash_attn")
    except RuntimeError as error:
        return False, str(error)
    if not torch.cuda.is_available():
        return False, "flash-attn needs a CUDA device"
    return True, ""


# --- the mask mapping, exhaustively -----------------------------------------------------------

def flash_mask(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """flash-attn's documented mask: query i sees keys in [i + sk - sq - left, i + sk - sq + right]
    (a bound of -1 is unbounded; causal means right = 0), aligned to the bottom-right corner."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + sk - sq + right
    if left >= 0:
        visible &= j >= i + sk - sq - left
    return visible


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_geometry_reproduces_the_contract_mask(mask):
    for sq in range(1, 9):
        for sk in range(1, 9):
            for diagonal in range(-10, 11):
                want = torch.ones(sq, sk, dtype=torch.bool)
                if mask == "causal":
                    want = want.tril(diagonal)
                g = flash_geometry(sq, sk, mask, diagonal)
                got = torch.zeros(sq, sk, dtype=torch.bool)
                if g is not None:
                    got[g.first_row:, :g.keys] = flash_mask(sq - g.first_row, g.keys, g.causal, g.window)
                    assert got[g.first_row:, :g.keys].any(1).all(), "a row given to flash-attn sees no key"
                    assert g.window[1] != 0, "a zero right window is spelled causal=True"
                assert torch.equal(got, want), (sq, sk, diagonal, g)


def test_geometry_reproduces_the_contract_band_mask():
    """Bands lower <= j - i <= diagonal, inside, across and outside (sq, sk) blocks, empty ones too:
    the rows and keys cut off see nothing, every row left sees a key, and flash-attn's window
    (each side >= 0, or -1 where no row reaches it; causal=True for (-1, 0)) on the rest is the band."""
    for sq in range(1, 8):
        for sk in range(1, 8):
            rel = torch.arange(sk).unsqueeze(0) - torch.arange(sq).unsqueeze(1)   # j - i
            for diagonal in range(-9, 10):
                for lower in range(-9, diagonal + 2):
                    want = (rel <= diagonal) & (rel >= lower)
                    g = flash_geometry(sq, sk, "band", diagonal, lower)
                    got = torch.zeros(sq, sk, dtype=torch.bool)
                    if g is not None:
                        rows, keys = slice(g.first_row, g.last_row), slice(g.first_key, g.keys)
                        assert 0 <= g.first_row < g.last_row <= sq and 0 <= g.first_key < g.keys <= sk, g
                        assert min(g.window) >= -1 and g.window != (-1, 0), g
                        got[rows, keys] = flash_mask(g.last_row - g.first_row, g.keys - g.first_key, g.causal,
                                                     g.window)
                        assert got[rows, keys].any(1).all(), "a row given to flash-attn sees no key"
                    assert torch.equal(got, want), (sq, sk, diagonal, lower, g)


def test_geometry_of_a_sliding_window_block():
    # a square block of a window (left 3, right 0): the band -3 <= j - i <= 0 is flash-attn's window (3, 0)
    assert flash_geometry(16, 16, "band", 0, -3) == FlashGeometry(0, 16, False, (3, 0), 16, 0)
    # the band far outside the block on one side is causal, on both sides full
    assert flash_geometry(16, 16, "band", 0, -16) == flash_geometry(16, 16, "causal", 0)
    assert flash_geometry(16, 16, "band", 16, -16) == flash_geometry(16, 16, "full", 0)
    # a band past the keys (or lower > diagonal) leaves nothing to call flash-attn for
    assert flash_geometry(8, 8, "band", 20, 8) is None and flash_geometry(8, 8, "band", 1, 2) is None


def test_geometry_of_the_ring_blocks_is_plain_causal():
    assert flash_geometry(16, 16, "causal", 0).causal
    striped = flash_geometry(16, 16, "causal", -1)   # query i sees j <= i - 1: row 0 is empty
    assert (striped.first_row, striped.keys, striped.causal) == (1, 15, True)


# --- without flash-attn: a clear error, never a fallback --------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_explicit_request_without_flash_attn_raises_with_the_fix():
    with pytest.raises(RuntimeError, match="pip install flash-attn"):
        get_backend("flash_attn")
    x = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash-attn"):
        simulate_ring(x, x, x, world_size=2, backend="flash_attn")


def test_float32_and_cpu_inputs_are_refused(monkeypatch):
    install_stand_in(monkeypatch, new_signature=True)
    backend = FlashAttnBackend()
    x32 = torch.zeros(1, 8, 1, 16)
    with pytest.raises(ValueError, match="CUDA"):
        backend.forward(x32.bfloat16(), x32.bfloat16(), x32.bfloat16(), scale=1.0, mask="full", diagonal=0)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        backend.forward(x32, x32, x32, scale=1.0, mask="full", diagonal=0)


# --- the glue in the ring, on a CPU stand-in for flash-attn ------------------------------------

def _stand_in_scores(q, k, scale, causal, window, softcap=0.0):
    """float32 scores (b, h, sq, sk) under flash-attn's mask, capped by softcap * tanh(s / softcap)
    where softcap > 0 (flash-attn's 0 means no cap), and tanh' (1 where there is no cap); GQA
    by repeating K heads."""
    h, kvh = q.shape[2], k.shape[2]
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    slope = torch.ones_like(s)
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    return s.masked_fill(~flash_mask(q.shape[1], k.shape[1], causal, window), float("-inf")), slope


def _stand_in_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    assert q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
    assert v.shape == k.shape, "flash-attn 2: v must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)"
    h, kvh = q.shape[2], k.shape[2]
    s, _ = _stand_in_scores(q, k, softmax_scale, causal, window_size, softcap)
    lse = torch.logsumexp(s, -1)
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)      # flash-attn's mark of an empty row
    p = torch.exp(s - lse.unsqueeze(-1)).to(q.dtype)                # P rounded for the P @ V product
    vh = v.transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    out = (p.float() @ vh.float()).to(q.dtype).transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def _stand_in_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    assert q.shape[-1] % 8 == 0, "flash-attn's backward needs head_dim % 8 == 0"
    h, kvh = q.shape[2], k.shape[2]
    group = h // kvh
    s, slope = _stand_in_scores(q, k, softmax_scale, causal, window_size, softcap)
    p = torch.exp(s - softmax_lse.unsqueeze(-1))
    doh = dout.float().transpose(1, 2)
    vh = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # D from `out`, as flash-attn does
    ds = (p * (doh @ vh.transpose(-1, -2) - delta.unsqueeze(-1)) * slope).to(q.dtype).float()
    kh = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    qh = q.float().transpose(1, 2)
    b, n, _, d = k.shape
    dq.copy_((ds @ kh * softmax_scale).transpose(1, 2))
    dk.copy_((ds.transpose(-1, -2) @ qh * softmax_scale).view(b, kvh, group, n, d).sum(2).transpose(1, 2))
    dv.copy_((p.to(q.dtype).float().transpose(-1, -2) @ doh).view(b, kvh, group, n, d).sum(2).transpose(1, 2))


def _backward_2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _stand_in_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                       (window_size_left, window_size_right), softcap, alibi_slopes, deterministic)


def _backward_2_5(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size, alibi_slopes, deterministic, rng_state=None):
    _stand_in_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                       window_size, 0.0, alibi_slopes, deterministic)


def _forward_2_5(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2.5's `flash_attn_func`: no softcap argument yet."""
    return _stand_in_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, alibi_slopes,
                             deterministic, return_attn_probs)


def install_stand_in(monkeypatch, *, new_signature: bool) -> None:
    package = types.ModuleType("flash_attn")
    package.__version__ = "2.7.4" if new_signature else "2.5.9"
    package.flash_attn_func = _stand_in_forward if new_signature else _forward_2_5
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = _backward_2_7 if new_signature else _backward_2_5
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


# the stand-in cases whose stand-in takes flash-attn 2.5's `_flash_attn_backward` arguments
# (window_size as one tuple); the others take 2.7's (window_size_left, window_size_right, softcap)
OLD_SIGNATURE = {"p4_zigzag_fp16_h2kv1_d59_flash_attn", "p2_striped_fp16_h3kv1_d20_t6_flash_attn"}
assert OLD_SIGNATURE <= FLASH_STAND_IN_CASES.keys()


@pytest.mark.parametrize("name", FLASH_STAND_IN_CASES,
                         ids=lambda name: f"{name}-{'2.5' if name in OLD_SIGNATURE else '2.7'}")
def test_glue_in_the_ring_on_a_stand_in(monkeypatch, name):
    install_stand_in(monkeypatch, new_signature=name not in OLD_SIGNATURE)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    verdict = run_case(FLASH_STAND_IN_CASES[name])
    assert verdict.passed, verdict.message()


# --- the variants, block by block, on the stand-in ----------------------------------------------

def block_truth(q, k, v, dout, *, scale, mask, diagonal=0, lower=0, softcap=None):
    """float64 out, lse, dq, dk, dv of one block (its own lse and D), straight from the contract."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    f = torch.float64
    qh = q.to(f).transpose(1, 2)
    kh, vh = (x.to(f).transpose(1, 2).repeat_interleave(h // kvh, dim=1) for x in (k, v))
    x = qh @ kh.transpose(-1, -2) * scale
    t = torch.tanh(x / softcap) if softcap else None
    s = softcap * t if softcap else x
    rel = torch.arange(sk).unsqueeze(0) - torch.arange(sq).unsqueeze(1)
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if mask != "full":
        seen &= rel <= diagonal
    if mask == "band":
        seen &= rel >= lower
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))
    out = p @ vh
    doh = dout.to(f).transpose(1, 2)
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * out).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - t * t)
    dq = ds @ kh * scale
    dk = (ds.transpose(-1, -2) @ qh * scale).view(b, kvh, h // kvh, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ doh).view(b, kvh, h // kvh, sk, d).sum(2)
    return out.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def stand_in_errors(opts, *, sq=20, sk=24, heads=4, kv_heads=2, head_dim=20, truth_opts=None):
    """max |backend - truth| / max |truth| per tensor of one fp16 block on the stand-in; an
    empty row must be out 0 / lse -inf exactly where the truth has it."""
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, sq, heads, head_dim, generator=gen).half() for _ in range(2))
    k, v = (torch.randn(2, sk, kv_heads, head_dim, generator=gen).half() for _ in range(2))
    true = block_truth(q, k, v, dout, **(opts | (truth_opts or {})))
    lse, delta = true[1].float(), (dout.double() * true[0]).sum(-1).transpose(1, 2).float()
    backend = FlashAttnBackend()
    got = (*backend.forward(q, k, v, **opts), *backend.backward(q, k, v, dout, lse, delta, **opts))
    errors = {}
    for name, g, t in zip(("out", "lse", "dq", "dk", "dv"), got, true):
        finite = torch.isfinite(t)
        assert torch.equal(torch.isfinite(g), finite) and not g.isnan().any(), name
        peak = t[finite].abs().max().item() if finite.any() else 0.0
        errors[name] = (g.double()[finite] - t[finite]).abs().max().item() / (peak or 1.0) if finite.any() else 0.0
    return errors


# float16 blocks: the stand-in rounds P, out and dS to float16 as flash-attn does (measured
# <= 5.3e-4 of the peak here); 1e-2 is that with 20x headroom, while a window one key off or a
# dropped cap is >= 0.4 (the planted test below asks for > 5e-2)
STAND_IN_BUDGET = 1e-2
VARIANT_BLOCKS = {
    "window_inside": {"mask": "band", "diagonal": 0, "lower": -5},                   # window (5, 0)
    "band_both_sides": {"mask": "band", "diagonal": 6, "lower": -3},
    "band_empty_rows_and_keys": {"mask": "band", "diagonal": -2, "lower": -9},        # rows 0-1 see nothing
    "band_past_the_keys": {"mask": "band", "diagonal": 30, "lower": 8},               # rows 16-19 see nothing
    "band_lower_only": {"mask": "band", "diagonal": 24, "lower": -4},
    "softcap_full": {"mask": "full", "softcap": 2.0, "scale": 1.5},                   # saturated
    "softcap_band": {"mask": "band", "diagonal": 3, "lower": -7, "softcap": 5.0},
    "softcap_causal_striped": {"mask": "causal", "diagonal": -1, "softcap": 3.0},
}


@pytest.mark.parametrize("name", VARIANT_BLOCKS)
def test_variant_blocks_on_a_stand_in_match_float64(monkeypatch, name):
    install_stand_in(monkeypatch, new_signature=True)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    opts = {"scale": 20 ** -0.5} | VARIANT_BLOCKS[name]
    errors = stand_in_errors(opts)
    assert max(errors.values()) <= STAND_IN_BUDGET, errors


def test_stand_in_check_catches_a_window_off_by_one_and_a_dropped_cap(monkeypatch):
    install_stand_in(monkeypatch, new_signature=True)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    opts = {"scale": 20 ** -0.5, "mask": "band", "diagonal": 3, "lower": -7, "softcap": 5.0}
    for planted in ({"lower": -8}, {"diagonal": 4}, {"softcap": None}):
        errors = stand_in_errors(opts, truth_opts=planted)
        assert max(errors.values()) > 5 * STAND_IN_BUDGET, (planted, errors)


def test_softcap_is_passed_to_flash_attn(monkeypatch):
    install_stand_in(monkeypatch, new_signature=True)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    seen = []
    package, interface = sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"]
    forward, backward = package.flash_attn_func, interface._flash_attn_backward

    def spy_forward(*args, **kwargs):
        seen.append(("forward", kwargs.get("softcap", "absent"), kwargs["window_size"]))
        return forward(*args, **kwargs)

    def spy_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        seen.append(("backward", softcap, (window_size_left, window_size_right)))
        return backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                        window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)
    monkeypatch.setattr(package, "flash_attn_func", spy_forward)
    monkeypatch.setattr(interface, "_flash_attn_backward", spy_backward)
    backend = FlashAttnBackend()
    x = torch.randn(1, 16, 2, 16).half()
    lse = torch.zeros(1, 2, 16)
    for softcap in (30.0, None):
        backend.forward(x, x, x, scale=0.25, mask="band", diagonal=0, lower=-3, softcap=softcap)
        backend.backward(x, x, x, x, lse, lse, scale=0.25, mask="band", diagonal=0, lower=-3, softcap=softcap)
    assert seen == [("forward", 30.0, (3, 0)), ("backward", 30.0, (3, 0)),
                    ("forward", "absent", (3, 0)), ("backward", 0.0, (3, 0))]


def test_softcap_on_an_old_flash_attn_raises_with_the_version_needed(monkeypatch):
    install_stand_in(monkeypatch, new_signature=False)   # 2.5.9: no softcap anywhere
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    backend = FlashAttnBackend()
    x = torch.randn(1, 16, 2, 16).half()
    with pytest.raises(RuntimeError, match=r"flash-attn >= 2\.6.*2\.5\.9"):
        backend.forward(x, x, x, scale=0.25, mask="full", softcap=30.0)
    with pytest.raises(RuntimeError, match=r"flash-attn >= 2\.6"):
        backend.backward(x, x, x, x, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), scale=0.25, mask="full",
                         softcap=30.0)
    out, _ = backend.forward(x, x, x, scale=0.25, mask="band", diagonal=0, lower=-3)  # no cap: runs
    assert out.shape == x.shape


def test_a_value_head_dim_of_its_own_is_refused(monkeypatch):
    """flash-attn 2 has one head dim for q, k and v (Dao-AILab/flash-attention#753)."""
    install_stand_in(monkeypatch, new_signature=True)
    monkeypatch.setattr(FlashAttnBackend, "_require_cuda", staticmethod(lambda name, t: None))
    backend = FlashAttnBackend()
    q, k = torch.zeros(1, 8, 2, 24).half(), torch.zeros(1, 8, 1, 24).half()
    v = torch.zeros(1, 8, 1, 16).half()
    with pytest.raises(NotImplementedError, match="one head dim.*backend='triton' or 'torch'"):
        backend.forward(q, k, v, scale=0.25, mask="causal")
    with pytest.raises(NotImplementedError, match="one head dim"):
        backend.backward(q, k, v, torch.zeros(1, 8, 2, 16).half(), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8),
                         scale=0.25, mask="causal")


# --- the real flash-attn, where it runs --------------------------------------------------------

AVAILABLE, WHY_NOT = _flash_available()
needs_flash = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)

@needs_flash
@pytest.mark.parametrize("name", FLASH_CASES)
def test_ring_with_flash_attn_blocks_meets_budget(name):
    case = FLASH_CASES[name]

    def on_cuda(q, k, v):
        out, lse = simulate_ring(q.cuda(), k.cuda(), v.cuda(), world_size=case.ring.world_size,
                                 causal=case.spec.causal, softmax_scale=case.spec.softmax_scale,
                                 layout=case.ring.layout, backend=case.backend, return_lse=True)
        return out.cpu(), lse.cpu()
    verdict = run_case(case, impl=on_cuda)
    assert verdict.passed, verdict.message()
