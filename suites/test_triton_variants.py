"""The Triton block backend's attention variants, block by block against float64.

The variants of the block contract (`ringcheck.ring.backends`): the "band" mask
(lower <= j - i <= diagonal: sliding windows, bounds inside or far outside the block), causal
diagonals other than 0, a logit softcap (s = softcap tanh(scale q.k / softcap), its tanh' in the
backward), a value head dim of its own (MLA), grouped-query heads, float32 and bfloat16.

The truth is `truth` below: a plain float64 masked softmax written here, from the inputs as
given (bf16 inputs upcast exactly). The backward is judged given the *true* lse and
D = rowsum(dout * out), as the ring hands them to a block. Every check is one number per
tensor: max |got - truth| / max |truth| (absolute where the truth is all zero), against
BUDGET. Rows that see no key must give out 0, lse -inf (exactly where the truth has it) and
zero gradients, never NaN.

Planted bugs show the check can fail: an off-by-one window, a backward without the tanh'
factor, a forward that ignores the cap, a window shifted in the backward alone. Small shapes
(seq 8-40, heads 2-4) for the interpreter on a 2-core CPU (16-wide interpreter tiles: every
shape spans several tiles and ragged tails).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

if not torch.cuda.is_available():
    # before the kernels are first imported: Triton decides interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ringcheck.judge.check import run_case
from ringcheck.ring.backends.triton_backend import TritonBackend, mask_flags
from ringcheck.ring.backends.triton_fwd import attention_forward
from ringcheck.testing.variant_cases import variant_case

# DOT_FP32 on: every tl.dot multiplies in IEEE float32, on the GPU too (where bf16 would
# otherwise take the tensor cores and round P to bf16), so one budget holds everywhere
BACKEND = TritonBackend(dot_fp32=True)
if BACKEND.interpreted:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("the Triton kernels were compiled (TRITON_INTERPRET unset at their import) and there is "
                "no CUDA device; run with TRITON_INTERPRET=1", allow_module_level=True)
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="relies on the interpreter's 16-wide tiles")

# The budget, for float32 and for bf16 inputs alike: with float32 dots on inputs that float32
# holds exactly (bf16 upcasts are exact), the kernels differ from float64 only by float32
# rounding: a few ulp (6e-8) per operation, grown by sums over <= 40 keys and <= 24 head
# columns and the softcap's exp2-built tanh (absolute error ~1e-7): ~1e-6 of max |truth| at
# worst (measured on these cases: <= 6.1e-7). 1e-5 leaves 16x headroom; the planted bugs below are >= 1e-2.
BUDGET = 1e-5
NAMES = ("out", "lse", "dq", "dk", "dv")


# --- the truth ----------------------------------------------------------------------------------

def visible_mask(sq: int, sk: int, mask: str, diagonal: int, lower: int) -> torch.Tensor:
    """(sq, sk) bool: query i sees key j (block-local indices)."""
    rel = torch.arange(sk).unsqueeze(0) - torch.arange(sq).unsqueeze(1)  # j - i
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if mask in ("causal", "band"):
        seen &= rel <= diagonal
    if mask == "band":
        seen &= rel >= lower
    return seen


def truth(q, k, v, dout, *, scale, mask, diagonal=0, lower=0, softcap=None, tanh_prime=True):
    """float64 (out, lse, dq, dk, dv) of one block; `tanh_prime=False` is a planted bug (the
    softcap's derivative left out of dS)."""
    b, sq, h, d = q.shape
    sk, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    f = torch.float64
    qh = q.cpu().to(f).transpose(1, 2)                                            # (b, h, sq, d)
    kh, vh = (x.cpu().to(f).transpose(1, 2).repeat_interleave(h // kvh, dim=1) for x in (k, v))
    x = qh @ kh.transpose(-1, -2) * scale                                         # scale q.k
    t = torch.tanh(x / softcap) if softcap is not None else None
    s = softcap * t if softcap is not None else x
    s = s.masked_fill(~visible_mask(sq, sk, mask, diagonal, lower), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))        # 0 on empty rows
    out = p @ vh
    doh = dout.cpu().to(f).transpose(1, 2)
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * out).sum(-1, keepdim=True))
    if softcap is not None and tanh_prime:
        ds = ds * (1 - t * t)
    dq = ds @ kh * scale
    dk = (ds.transpose(-1, -2) @ qh * scale).view(b, kvh, h // kvh, sk, d).sum(2)
    dvv = (p.transpose(-1, -2) @ doh).view(b, kvh, h // kvh, sk, dv).sum(2)
    return out.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2), dvv.transpose(1, 2)


def relative_errors(got, true) -> dict[str, float]:
    """max |got - truth| / max |truth| per tensor (inf on NaN, or on -inf where the truth has none)."""
    errors = {}
    for name, g, t in zip(NAMES, got, true):
        g = g.detach().cpu().to(torch.float64)
        assert g.shape == t.shape, f"{name}: shape {tuple(g.shape)}, truth {tuple(t.shape)}"
        finite = torch.isfinite(t)
        if g.isnan().any() or not torch.equal(torch.isfinite(g), finite) or not torch.equal(g[~finite], t[~finite]):
            errors[name] = float("inf")
            continue
        if not finite.any():
            errors[name] = 0.0
            continue
        peak = t[finite].abs().max().item()
        errors[name] = (g[finite] - t[finite]).abs().max().item() / (peak if peak > 0 else 1.0)
    return errors


# --- the cases ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    sq: int
    sk: int
    mask: str
    diagonal: int = 0
    lower: int = 0
    softcap: float | None = None
    scale: float | None = None       # None: head_dim ** -0.5
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    v_head_dim: int = 16
    dtype: torch.dtype = torch.float32

    def inputs(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)

        def rand(seq, heads, dim):
            return torch.randn(self.batch, seq, heads, dim, generator=gen).to(self.dtype)
        return (rand(self.sq, self.heads, self.head_dim), rand(self.sk, self.kv_heads, self.head_dim),
                rand(self.sk, self.kv_heads, self.v_head_dim), rand(self.sq, self.heads, self.v_head_dim))

    @property
    def opts(self) -> dict:
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        return {"scale": scale, "mask": self.mask, "diagonal": self.diagonal, "lower": self.lower,
                "softcap": self.softcap}


def run(block: Block, backend=BACKEND, *, inputs=None, truth_inputs=None, truth_opts=None, backward=True):
    """(got, true): the backend's forward and backward of `block` (the forward alone without
    `backward`), and the float64 truth (of `truth_inputs` if given, with `truth_opts` overriding
    the block's options: a planted bug in the truth). The backward gets the truth's lse and D."""
    q, k, v, dout = block.inputs() if inputs is None else inputs
    true = truth(*(truth_inputs or (q, k, v, dout)), **(block.opts | (truth_opts or {})))
    lse = true[1].float()
    delta = (dout.to(torch.float64) * true[0]).sum(-1).transpose(1, 2).float()
    qd, kd, vd, dod = (t.to(DEVICE) for t in (q, k, v, dout))
    got = backend.forward(qd, kd, vd, **block.opts)
    if backward:
        got = (*got, *backend.backward(qd, kd, vd, dod, lse.to(DEVICE), delta.to(DEVICE), **block.opts))
    for name, g in zip(NAMES, got):
        assert g.dtype == torch.float32, f"{name} is {g.dtype}; the contract says float32"
    return got, true[:len(got)]


def failures(errors: dict[str, float]) -> set[str]:
    return {name for name, e in errors.items() if not e <= BUDGET}


BF16 = torch.bfloat16
CASES = {
    # band masks
    "band_narrow_inside": Block(40, 40, "band", diagonal=2, lower=-3),
    "band_narrow_rect_gqa3": Block(23, 37, "band", diagonal=9, lower=4, heads=3, kv_heads=1, batch=2),
    "band_lower_only": Block(33, 40, "band", diagonal=40, lower=-6),                 # upper bound far out
    "band_upper_only": Block(40, 24, "band", diagonal=-3, lower=-40, dtype=BF16),    # lower bound far out
    "band_empty_rows": Block(40, 24, "band", diagonal=-2, lower=-6),   # rows 0-1 and 30-39 see nothing
    "band_empty": Block(20, 20, "band", diagonal=2, lower=3),          # lower > diagonal: no key at all
    "band_outside": Block(16, 24, "band", diagonal=40, lower=30, heads=2, kv_heads=2),  # past every key
    # bounds on the tile edges of the 16-wide interpreter tiles, in bands wide enough to hold
    # unmasked tiles: an off-by-one in any of the 8 tile-range bounds of the kernels (first and
    # last tile, first and last unmasked tile; forward/dQ and dK/dV) fails one of these two
    # (checked by moving each bound by one in the direction that drops or unmasks keys)
    "band_edges_17_-30": Block(40, 40, "band", diagonal=17, lower=-30, heads=2, kv_heads=1),
    "band_edges_30_-17": Block(40, 40, "band", diagonal=30, lower=-17, heads=2, kv_heads=1),
    # causal diagonals other than 0
    "causal_diag_plus5": Block(37, 29, "causal", diagonal=5, dtype=BF16),
    "causal_diag_minus7": Block(29, 37, "causal", diagonal=-7, batch=2, heads=2, kv_heads=1),
    # softcap: |scale q.k| reaches tens against a cap of 2 (tanh saturated), and a mild cap
    "softcap_saturated": Block(24, 40, "full", softcap=2.0, scale=4.0),
    "softcap_saturated_band_bf16": Block(40, 40, "band", diagonal=6, lower=-9, softcap=1.5, scale=5.0, dtype=BF16),
    "softcap_mild_causal": Block(30, 30, "causal", diagonal=-1, softcap=8.0, heads=4, kv_heads=1),
    # a value head dim of its own (MLA-like), with the other variants
    "dv_12_8_band_softcap": Block(40, 33, "band", diagonal=4, lower=-10, softcap=3.0, head_dim=12, v_head_dim=8),
    "dv_24_16_causal_bf16": Block(36, 36, "causal", head_dim=24, v_head_dim=16, dtype=BF16, batch=2, heads=2,
                                  kv_heads=1),
    "dv_8_24_full": Block(17, 21, "full", head_dim=8, v_head_dim=24, heads=2, kv_heads=1),
}


@pytest.mark.parametrize("name", CASES)
def test_block_matches_float64(name):
    got, true = run(CASES[name])
    errors = relative_errors(got, true)
    assert not failures(errors), f"{name}: errors {errors} over the budget {BUDGET}"


def test_cases_reach_the_paths_they_name():
    """The table means what its names say (so a case cannot silently turn into another)."""
    def rows_seeing(block):
        return visible_mask(block.sq, block.sk, block.mask, block.diagonal, block.lower).any(1)
    assert rows_seeing(CASES["band_empty_rows"]).tolist() == [False] * 2 + [True] * 28 + [False] * 10
    assert not rows_seeing(CASES["band_empty"]).any() and not rows_seeing(CASES["band_outside"]).any()
    assert mask_flags("band", 40, -6, 33, 40) == {"causal": False, "band": True, "diagonal": 40, "lower": -6}
    assert mask_flags("band", -3, -40, 40, 24) == {"causal": True, "band": False, "diagonal": -3, "lower": -40}
    assert mask_flags("band", 2, -3, 40, 40) == {"causal": True, "band": True, "diagonal": 2, "lower": -3}
    # a bound is switched off exactly where no row of a (10, 12) block reaches it, and clamped
    assert [mask_flags("band", d, -9, 10, 12)["causal"] for d in (10, 11, 10**9)] == [True, False, False]
    assert [mask_flags("band", 0, lower, 10, 12)["band"] for lower in (-8, -9, -10**9)] == [True, False, False]
    assert mask_flags("causal", 10**9, 0, 10, 12) == {"causal": False, "band": False, "diagonal": 12, "lower": 0}
    assert mask_flags("band", 1, -10**9, 10, 12)["lower"] == -10
    q, k, _, _ = CASES["softcap_saturated"].inputs()
    peak = (torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 4.0).abs().max()
    assert peak > 10 * 2.0, "the saturated softcap case does not reach far beyond its cap"


def test_empty_rows_are_exactly_zero_and_minus_inf_never_nan():
    """Exactly: out 0, lse -inf, dq 0 on rows that see no key (rows 0-1 and 22-23 here), and
    every gradient 0 when the band holds no key at all."""
    got, _ = run(Block(24, 16, "band", diagonal=-2, lower=-6, heads=2, kv_heads=1))
    out, lse, dq = got[:3]
    empty = torch.tensor([True] * 2 + [False] * 20 + [True] * 2)
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
    assert (out[:, empty] == 0).all() and (dq[:, empty] == 0).all()
    assert not any(g.isnan().any() for g in got)
    got, _ = run(Block(16, 16, "band", diagonal=-1, lower=0, heads=2, kv_heads=1))
    assert torch.isneginf(got[1]).all() and all((g == 0).all() for i, g in enumerate(got) if i != 1)


def test_far_bounds_switched_on_in_the_kernel_are_the_full_mask():
    """The glue switches a bound that no row reaches off (`mask_flags`); the kernels must also
    handle it on: a band of lower = -sq, diagonal = sk run with both bounds is the full mask."""
    block = Block(33, 21, "full", dtype=BF16, heads=2, kv_heads=1)
    q, k, v, dout = (t.to(DEVICE) for t in block.inputs())
    true = truth(q, k, v, dout, **block.opts)
    for diagonal, lower in ((21, -33), (10**6, -10**6)):
        flags = mask_flags("band", diagonal, lower, 33, 21) | {"causal": True, "band": True}
        out, lse = attention_forward(q, k, v, scale=block.opts["scale"], **flags, softcap=None, dot_fp32=True)
        errors = relative_errors((out, lse), true[:2])
        assert not failures(errors), (diagonal, lower, errors)


@interpreter_only
def test_keys_outside_the_band_are_never_loaded():
    """Tile skipping: with a band of keys [i + 30, i + 35] for 16 queries, the K/V tiles of keys
    0-15 and 64-79 (16-wide interpreter tiles) hold no visible key. Filled with NaN they would
    poison any product they enter (0 x NaN = NaN): the results stay exact, so they were skipped
    (a narrow band costs O(rows x band), not O(rows x keys))."""
    block = Block(16, 80, "band", diagonal=35, lower=30)
    q, k, v, dout = block.inputs()
    k_bad, v_bad = k.clone(), v.clone()
    for t in (k_bad, v_bad):
        t[:, :16] = float("nan")
        t[:, 64:] = float("nan")
    got, true = run(block, inputs=(q, k_bad, v_bad, dout), truth_inputs=(q, k, v, dout))
    errors = relative_errors(got, true)
    assert not failures(errors), errors
    assert (got[3][:, :16] == 0).all() and (got[4][:, 64:] == 0).all()


# --- planted bugs: the check must fail ------------------------------------------------------------

def test_planted_off_by_one_window_is_detected():
    """The kernel's band against a truth whose window is one wider on either side."""
    block = CASES["band_narrow_inside"]
    got, true = run(block, truth_opts={"lower": block.lower - 1}, backward=False)
    assert failures(relative_errors(got, true)) == {"out", "lse"}
    got, true = run(block, truth_opts={"diagonal": block.diagonal + 1}, backward=False)
    assert failures(relative_errors(got, true)) == {"out", "lse"}


def test_planted_backward_without_tanh_prime_is_detected():
    """dS without the softcap's tanh' (a truth that drops it) fails dq and dk, not dv or the forward."""
    got, true = run(CASES["softcap_mild_causal"], truth_opts={"tanh_prime": False})
    errors = relative_errors(got, true)
    assert failures(errors) == {"dq", "dk"}, errors
    assert min(errors["dq"], errors["dk"]) > 1e-2, errors


class IgnoresSoftcap(TritonBackend):
    """A planted bug: the forward drops the cap."""

    def forward(self, q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None):
        return super().forward(q, k, v, scale=scale, mask=mask, diagonal=diagonal, lower=lower)


class BackwardWindowShifted(TritonBackend):
    """A planted bug: the backward's window one key further left than the forward's."""

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        return super().backward(q, k, v, dout, lse, delta, scale=scale, mask=mask, diagonal=diagonal - 1,
                                lower=lower - 1, softcap=softcap)


def test_planted_backend_bugs_are_detected():
    got, true = run(CASES["softcap_saturated"], IgnoresSoftcap(dot_fp32=True), backward=False)
    assert failures(relative_errors(got, true)) == {"out", "lse"}
    got, true = run(CASES["band_narrow_inside"], BackwardWindowShifted(dot_fp32=True))
    assert failures(relative_errors(got, true)) == {"dq", "dk", "dv"}


# --- validation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,error", [
    ({"softcap": 0.0}, ValueError),
    ({"softcap": -1.0}, ValueError),
    ({"lower": 1.5}, TypeError),
    ({"v_seq": 5}, ValueError),
    ({"v_head_dim": 320}, ValueError),
])
def test_invalid_variants_raise(bad, error):
    opts = {"softcap": None, "lower": 0, "v_seq": 4, "v_head_dim": 8} | bad
    q = torch.zeros(1, 4, 2, 16, device=DEVICE)
    k = torch.zeros(1, 4, 1, 16, device=DEVICE)
    v = torch.zeros(1, opts["v_seq"], 1, opts["v_head_dim"], device=DEVICE)
    with pytest.raises(error):
        BACKEND.forward(q, k, v, scale=0.25, mask="band", diagonal=0, lower=opts["lower"], softcap=opts["softcap"])


def test_backward_wants_dout_as_wide_as_v():
    block = replace(CASES["dv_12_8_band_softcap"], sq=8, sk=8)
    q, k, v, _ = (t.to(DEVICE) for t in block.inputs())
    lse = torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="v_head_dim"):
        BACKEND.backward(q, k, v, torch.zeros_like(q), lse, lse, **block.opts)


# --- compiled for the GPU, without one: test_triton_backend (one process compiles every kernel it reads)


# ------------------------------------------------------------- the whole ring on Triton blocks

def _ring_cases():
    return {
        "everything_zigzag_docs_p2": variant_case("everything", "zigzag_docs", world_size=2, backend="triton"),
        "window_3_ranks_striped_p4_bf16": variant_case("window-3-ranks", "striped", world_size=4, dtype="bfloat16",
                                                       backend="triton"),
        "softcap_zigzag_p2_dv8": variant_case("softcap-saturated", "zigzag", world_size=2, v_head_dim=8,
                                              backend="triton"),
        "sinks_odd_docs_causal_p3": variant_case("sink-low", "causal", world_size=3, backend="triton"),
    }


@pytest.mark.skipif(DEVICE != "cpu", reason="the ring's simulated cases run on CPU tensors here")
@pytest.mark.parametrize("name", ["everything_zigzag_docs_p2", "window_3_ranks_striped_p4_bf16",
                                  "softcap_zigzag_p2_dv8", "sinks_odd_docs_causal_p3"])
def test_the_ring_on_triton_blocks_is_within_budget_for_the_variants(name):
    verdict = run_case(_ring_cases()[name])
    assert verdict.passed, verdict.message()
