"""Each named logit distribution produces what its docstring promises.

The checks work on the tensors as the case's dtype holds them (after `make_inputs` casts
them), in float64, so a promise that rounding breaks (a margin, a tie) fails here.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringcheck
from ringcheck.judge.distributions import (
    DISTRIBUTIONS,
    OUTLIER_RATE,
    OUTLIER_STD,
    WIDE_MAX_STD,
    arrival_steps,
    directions,
    generate,
    last_steps,
    min_head_dim,
)
from ringcheck.judge.inputs import make_inputs
from ringcheck.spec import AttentionSpec, RingSpec
from ringcheck.testing.strategies import cases

F16_EXP_OVERFLOW = math.log(torch.finfo(torch.float16).max)   # 11.09
F32_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)   # 88.72


def _inputs(case):
    return make_inputs(case.spec, seed=case.seed, distribution=case.distribution, ring=case.ring)


def _heads(x, spec):
    """(b, s, kv_heads, d) -> (b, heads, s, d) float64, each K/V head repeated over its group."""
    return x.double().transpose(1, 2).repeat_interleave(spec.heads // x.shape[2], dim=1)


def _visible(spec):
    n = spec.seq_len
    if spec.causal:
        return torch.ones(n, n, dtype=torch.bool).tril()
    return torch.ones(n, n, dtype=torch.bool)


def _logits(spec, x):
    """float64 logits (b, heads, s, s) of the inputs as their dtype holds them; masked -inf."""
    s = torch.matmul(x.q.double().transpose(1, 2), _heads(x.k, spec).transpose(-1, -2)) * spec.scale
    return s.masked_fill(~_visible(spec), float("-inf"))


def _probabilities(spec, x):
    return torch.softmax(_logits(spec, x), dim=-1)


def _out(spec, x):
    return torch.matmul(_probabilities(spec, x), _heads(x.v, spec)).transpose(1, 2)


def _draw(data, profile, distribution, **kwargs):
    return data.draw(cases(profile.bounds, distributions=(distribution,), **kwargs), label="case")


# ---- every distribution -------------------------------------------------------------------

def test_the_registry_holds_the_named_distributions():
    assert set(DISTRIBUTIONS) == {"normal", "near-uniform", "wide", "outlier", "sink", "late-max",
                                  "repeated-max", "one-hot-backward"}


@given(data=st.data())
def test_generators_are_seeded_float32_cpu_tensors_of_the_spec_and_fit_fp16(data, search_profile):
    case = data.draw(cases(search_profile.bounds), label="case")
    spec = case.spec
    drawn = generate(case.distribution, spec, torch.Generator().manual_seed(case.seed), case.ring)
    again = generate(case.distribution, spec, torch.Generator().manual_seed(case.seed), case.ring)
    shapes = [(spec.batch, spec.seq_len, spec.heads, spec.head_dim),
              (spec.batch, spec.seq_len, spec.kv_heads, spec.head_dim)]
    for name, t, t2, shape in zip("q k v dout".split(), drawn, again, [shapes[0], shapes[1], shapes[1], shapes[0]]):
        assert t.shape == shape and t.dtype == torch.float32 and t.device.type == "cpu", name
        assert t.is_contiguous(), f"{name} of {case.describe()} is not contiguous"
        assert torch.equal(t, t2), f"{name} differs between two draws of {case.describe()}"
        assert torch.isfinite(t).all() and t.abs().max() < 1e4, \
            f"{name} of {case.describe()} leaves the fp16-safe range: max |x| = {float(t.abs().max()):.3g}"
    x = _inputs(case)
    for name in "q k v dout".split():
        assert torch.isfinite(getattr(x, name)).all(), f"{name} of {case.describe()} is not finite in {spec.dtype}"


def test_make_inputs_of_another_seed_differs():
    spec = AttentionSpec(1, 2, 1, 8, 4)
    for name in DISTRIBUTIONS:
        a, b = (make_inputs(spec, seed=s, distribution=name, ring=RingSpec(2)) for s in (1, 2))
        assert not torch.equal(a.q, b.q), name


def test_bad_requests_raise_with_the_fix():
    spec = AttentionSpec(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"distribution='gauss' is unknown"):
        make_inputs(spec, seed=0, distribution="gauss")
    with pytest.raises(ValueError, match=r"needs the ring: make_inputs\(.*ring=RingSpec"):
        make_inputs(spec, seed=0, distribution="late-max")
    with pytest.raises(ValueError, match=r"head_dim=1; use head_dim >= 2"):
        make_inputs(spec.replace(head_dim=1), seed=0, distribution="late-max", ring=RingSpec(4))
    with pytest.raises(ValueError, match=r"seq_len=8 is not divisible"):
        make_inputs(spec, seed=0, distribution="late-max", ring=RingSpec(3))


# ---- normal and near-uniform: unchanged ----------------------------------------------------

def test_normal_is_four_standard_normal_draws_in_order():
    spec = AttentionSpec(2, 4, 2, 12, 8)
    g = torch.Generator().manual_seed(7)
    want = [torch.randn(s, generator=g) for s in [(2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8), (2, 12, 4, 8)]]
    got = make_inputs(spec, seed=7)  # the default distribution
    for w, t in zip(want, (got.q, got.k, got.v, got.dout)):
        assert torch.equal(w, t)


def test_near_uniform_is_normal_with_q_times_0_3_and_v_plus_6():
    spec = AttentionSpec(2, 4, 2, 12, 8)
    n, u = make_inputs(spec, seed=3), make_inputs(spec, seed=3, distribution="near-uniform")
    assert torch.equal(u.q, 0.3 * n.q) and torch.equal(u.k, n.k)
    assert torch.equal(u.v, n.v + 6.0) and torch.equal(u.dout, n.dout)


def test_near_uniform_rows_are_near_ties_over_positive_v():
    spec = AttentionSpec(1, 4, 4, 256, 32)
    x = make_inputs(spec, seed=1, distribution="near-uniform")
    logits = _logits(spec, x)
    assert abs(float(logits.std()) - 0.3) < 0.03, "logit std should be 0.3"
    p = torch.softmax(logits, dim=-1)
    assert p.max() * spec.seq_len < 8, "a row is far from uniform"
    assert (x.v > 0).all(), "V + 6 must be of one sign"


# ---- wide ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wide_sweeps_logit_std_up_to_50_past_the_exp_overflows(dtype):
    spec = AttentionSpec(batch=2, heads=8, kv_heads=4, seq_len=256, head_dim=32, dtype=dtype)
    x = make_inputs(spec, seed=0, distribution="wide")
    s = _logits(spec, x)                                               # (b, h, s, s)
    std = s.view(spec.batch, spec.kv_heads, -1).std(dim=-1)            # per (batch, kv head)
    assert 0.8 * WIDE_MAX_STD < float(std.max()) < 1.2 * WIDE_MAX_STD
    assert float(std.min()) > 0.8 and float(std.max() / std.min()) > 2, f"no sweep: {std.tolist()}"
    assert s.max() > F32_EXP_OVERFLOW and (s > F16_EXP_OVERFLOW).any()
    assert torch.isfinite(x.q.half()).all() and torch.isfinite(x.k.half()).all()
    # on a ring of 8, some row meets a block whose lse is more than 88 above another's
    block_lse = torch.stack([torch.logsumexp(s[..., 32 * r:32 * (r + 1)], dim=-1) for r in range(8)])
    assert float((block_lse.max(0).values - block_lse.min(0).values).max()) > F32_EXP_OVERFLOW


def test_wide_reaches_std_50_in_every_draw_even_with_one_head():
    spec = AttentionSpec(batch=1, heads=1, kv_heads=1, seq_len=512, head_dim=64)
    for seed in range(3):
        s = _logits(spec, make_inputs(spec, seed=seed, distribution="wide"))
        assert 0.8 * WIDE_MAX_STD < float(s.std()) < 1.2 * WIDE_MAX_STD


# ---- outlier ------------------------------------------------------------------------------

@given(data=st.data())
def test_outlier_is_normal_plus_rare_std_10_terms_in_q_k_v(data, search_profile):
    case = _draw(data, search_profile, "outlier", dtypes=("float32",))
    g1, g2 = (torch.Generator().manual_seed(case.seed) for _ in range(2))
    base = generate("normal", case.spec, g1)
    drawn = generate("outlier", case.spec, g2)
    for name, b, o in zip("qkv", base, drawn):
        assert (o != b).any(), f"{name} of {case.describe()} holds no outlier"
    assert torch.equal(base[3], drawn[3]), "dout must stay normal"


def test_outlier_rate_is_0_001_and_their_std_is_10():
    spec = AttentionSpec(batch=1, heads=4, kv_heads=4, seq_len=4096, head_dim=64)
    base = generate("normal", spec, torch.Generator().manual_seed(0))
    drawn = generate("outlier", spec, torch.Generator().manual_seed(0))
    diff = torch.cat([(o - b).flatten() for o, b in zip(drawn[:3], base[:3])])
    hit = diff != 0
    n = diff.numel()
    sd = math.sqrt(n * OUTLIER_RATE)
    assert abs(int(hit.sum()) - n * OUTLIER_RATE) < 5 * sd, f"{int(hit.sum())} outliers in {n}"
    assert abs(float(diff[hit].std()) / OUTLIER_STD - 1) < 0.1


# ---- sink ---------------------------------------------------------------------------------

@given(data=st.data())
def test_sink_key_0_takes_over_99_percent_of_every_row(data, search_profile):
    case = _draw(data, search_profile, "sink")
    spec = case.spec
    p = _probabilities(spec, _inputs(case))
    assert float(p[..., 0].min()) > 0.99, f"{case.describe()}: key 0 takes only {float(p[..., 0].min()):.4f}"


def test_sink_logits_reach_past_float32_exp_overflow():
    spec = AttentionSpec(batch=4, heads=8, kv_heads=8, seq_len=16, head_dim=16)
    s = _logits(spec, make_inputs(spec, seed=0, distribution="sink"))
    assert s[..., 0].max() > F32_EXP_OVERFLOW and s[..., 0].min() >= 11.9


# ---- late-max -----------------------------------------------------------------------------

def _late_max_report(case):
    """Per row: (arrival step of its maximum, its last visible step, margin over the rest)."""
    spec = case.spec
    s = _logits(spec, _inputs(case))                                    # (b, h, t, j)
    step, visible = arrival_steps(case.ring, spec.seq_len, spec.causal)
    top2 = s.topk(min(2, spec.seq_len), dim=-1)
    arg = top2.indices[..., 0]
    got = step[torch.arange(spec.seq_len)[None, None, :], arg]            # (b, h, t)
    want = last_steps(case.ring, spec.seq_len, spec.causal)
    second = top2.values[..., 1] if spec.seq_len > 1 else torch.full_like(top2.values[..., 0], float("-inf"))
    return got, want.expand_as(got), top2.values[..., 0] - second, s


@given(data=st.data())
def test_late_max_row_maximum_arrives_at_the_rows_last_ring_step(data, search_profile):
    case = _draw(data, search_profile, "late-max")
    got, want, margin, _ = _late_max_report(case)
    wrong = got != want
    assert not wrong.any(), (
        f"{case.describe()}: {int(wrong.sum())} rows have their maximum at an earlier step, "
        f"e.g. (batch, head, token) {[int(i) for i in torch.nonzero(wrong)[0]]}: step "
        f"{int(got[wrong][0])} instead of {int(want[wrong][0])}")
    assert float(margin.min()) >= 8, f"{case.describe()}: margin only {float(margin.min()):.3g}"


@given(data=st.data())
def test_late_max_running_lse_jumps_at_the_last_step_in_the_ring(data, search_profile):
    """Seen from inside the simulated ring (its per-step observer): every row's running lse
    rises at its last visible step by at least its margin minus log(keys seen before)."""
    case = _draw(data, search_profile, "late-max", world_size=None)
    spec, ring = case.spec, case.ring
    x = _inputs(case)
    _, want, margin, s = _late_max_report(case)
    step, visible = arrival_steps(ring, spec.seq_len, spec.causal)
    seen = {}

    def observer(rank, ring_step, src, out, lse):
        seen[(rank, ring_step)] = lse.clone()

    ringcheck.simulate_ring(x.q, x.k, x.v, world_size=ring.world_size, causal=spec.causal,
                            layout=ring.layout, observer=observer)
    from ringcheck.ring.layouts import positions
    for rank in range(ring.world_size):
        pos = positions(layout=ring.layout, rank=rank, world_size=ring.world_size, seq_len=spec.seq_len)
        last = want[0, 0, pos]
        final = seen[(rank, ring.world_size - 1)]
        for i, t in enumerate(pos.tolist()):
            s_last = int(last[i])
            if s_last == 0:
                continue
            before = seen[(rank, s_last - 1)][:, :, i].double()
            n_before = int(((step[t] < s_last) & visible[t]).sum())
            jump = final[:, :, i].double() - before
            need = margin[:, :, t] - math.log(n_before) - 1e-2
            assert (jump >= need).all(), (
                f"{case.describe()}: token {t} on rank {rank}: running lse rose by "
                f"{float(jump.min()):.3g} at step {s_last}, expected >= {float(need.min()):.3g}")


def test_late_max_needs_head_dim_2_up_to_32_ranks():
    for p in (1, 2, 3, 8, 32):
        assert min_head_dim("late-max", RingSpec(p)) == (1 if p <= 2 else 2)
    u, mask, f = directions(5, 4)
    gram = u @ u.T
    assert torch.allclose(gram.diagonal(), torch.ones(5, dtype=torch.float64))
    assert float((gram - 2 * torch.eye(5, dtype=torch.float64)).max()) <= 1 - f + 1e-12


# ---- repeated-max -------------------------------------------------------------------------

@given(data=st.data())
def test_repeated_max_rows_tie_exactly_at_their_maximum_over_nonnegative_v(data, search_profile):
    case = _draw(data, search_profile, "repeated-max")
    spec = case.spec
    x = _inputs(case)
    assert (x.v >= 0).all(), f"{case.describe()}: V is not of one sign"
    s64 = _logits(spec, x)
    # as a float32 block kernel computes them (the torch backend upcasts, then matmul x scale)
    s32 = torch.matmul(x.q.float().transpose(1, 2), _heads(x.k, spec).float().transpose(-1, -2)) * spec.scale
    s32 = s32.masked_fill(~_visible(spec), float("-inf"))
    rows = _visible(spec).sum(-1) >= 2
    for name, s in (("float64", s64), ("float32", s32)):
        top = s.max(dim=-1, keepdim=True).values
        ties = (s == top).sum(-1)[..., rows]
        assert (ties >= 2).all(), (
            f"{case.describe()}: {int((ties < 2).sum())} rows with >= 2 keys have a single {name} maximum")
        others = s.masked_fill(s == top, float("-inf")).max(-1).values[..., rows]
        gap = top[..., 0][..., rows] - others
        assert (gap > 0.25).all(), f"{case.describe()}: the tied maximum is only {float(gap.min()):.3g} above the rest"


# ---- one-hot-backward ---------------------------------------------------------------------

@given(data=st.data())
def test_one_hot_backward_rows_are_one_hot_and_dout_aligned_with_out(data, search_profile):
    case = _draw(data, search_profile, "one-hot-backward")
    spec = case.spec
    x = _inputs(case)
    p = _probabilities(spec, x)
    assert float(p.max(-1).values.min()) > 0.999, f"{case.describe()}: a row is not one-hot"
    out, dout = _out(spec, x), x.dout.double()
    cos = (out * dout).sum(-1) / (out.norm(dim=-1) * dout.norm(dim=-1)).clamp_min(1e-300)
    nonzero = out.norm(dim=-1) > 0
    assert float(cos[nonzero].min()) > 0.99, f"{case.describe()}: cos(dO, O) = {float(cos[nonzero].min()):.4f}"
