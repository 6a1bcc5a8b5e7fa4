"""Attention variants in our ring: packed documents with padding, sliding windows, softcap,
sinks and a value head dim of its own, against the float64 reference with the budget rule
(out, lse, dq, dk, dv and dsinks), plus the block plan against a brute-force mask, the
variant argument errors, and one planted bug per variant that the verdict must reject.

The cases are the tables of `ringcheck.testing.variant_cases`: every named placement
(documents at rank and chunk boundaries, length-1 and odd documents, a rank of padding,
windows inside a chunk and across three ranks, windows with documents, a saturated softcap,
sinks far above and far below every score, everything at once) on every mode, ring sizes 1
to 8 and every dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from ringcheck import shard, simulate_ring, unshard
from ringcheck.catalogue.planted import PLANTED
from ringcheck.judge.check import run_case, simulated_impl
from ringcheck.reference import attention_mask, dense_grads
from ringcheck.ring.layouts import block_plan, positions, work_counts
from ringcheck.ring.merge import finish, start_state
from ringcheck.testing.variant_cases import VARIANT_CASES, VARIANT_PLANTED_CASES

# make test runs each (placement, mode) at two ring sizes four apart (so in two dtypes), every ring size
# 1-8 among them; the other six of its eight carry the marker thorough (make test-thorough, in CI)
_GROUPS = list(dict.fromkeys(name.rsplit("_", 2)[0] for name in VARIANT_CASES))


def _tiered(name: str):
    group, p, _ = name.rsplit("_", 2)
    covering = (int(p.removeprefix("p")) + _GROUPS.index(group)) % 4 == 0
    return pytest.param(name, marks=() if covering else pytest.mark.thorough)


@pytest.mark.parametrize("name", [_tiered(name) for name in VARIANT_CASES])
def test_variant_within_budget_of_float64(name):
    verdict = run_case(VARIANT_CASES[name])
    assert verdict.passed, verdict.message()


# ------------------------------------------------------------------------------ the block plan

def _random_problem(rng: random.Random):
    """A random (layout, P, seq_len, cu_seqlens, window, causal) the plan must cover."""
    p = rng.choice([1, 2, 3, 4, 5])
    layout = rng.choice(["contiguous", "zigzag", "striped", "zigzag_docs"])
    chunks = 2 * p if layout in ("zigzag", "zigzag_docs") else p
    if layout == "zigzag_docs":
        lengths = [chunks * rng.randint(0, 3) for _ in range(rng.randint(1, 4))] + [chunks * rng.randint(0, 2)]
        if not sum(lengths):
            lengths[0] = chunks
    else:
        n = chunks * rng.randint(1, 6)
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 4)))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    seq_len = sum(lengths)
    cu = [0]
    for n in lengths[:-1] if rng.random() < 0.5 else lengths:  # half the time the last piece is padding
        cu.append(cu[-1] + n)
    if layout != "zigzag_docs" and rng.random() < 0.2:
        cu = None
    window = (rng.choice([-1, 0, 1, 2, 5, 9]), rng.choice([-1, 0, 1, 3]))
    return layout, p, seq_len, cu, window, rng.random() < 0.5


def _plan_coverage(layout, p, seq_len, cu, window, causal) -> torch.Tensor:
    """How often each (query, key) pair of the whole sequence is computed by the plan."""
    n = seq_len // p
    seen = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for q_rank in range(p):
        qpos = positions(layout=layout, rank=q_rank, world_size=p, seq_len=seq_len, cu_seqlens=cu)
        for kv_rank in range(p):
            kpos = positions(layout=layout, rank=kv_rank, world_size=p, seq_len=seq_len, cu_seqlens=cu)
            for block in block_plan(layout=layout, q_rank=q_rank, kv_rank=kv_rank, world_size=p, local_len=n,
                                    causal=causal, cu_seqlens=cu, window=window):
                rows, keys = torch.arange(n)[block.q], torch.arange(n)[block.kv]
                t = torch.arange(len(keys))[None, :] - torch.arange(len(rows))[:, None]
                mask = {"full": torch.ones_like(t, dtype=torch.bool), "causal": t <= block.diagonal,
                        "band": (t <= block.diagonal) & (t >= block.lower)}[block.mask]
                assert mask.any(), f"an empty block {block} in the plan"
                qi, kj = torch.broadcast_tensors(qpos[rows][:, None], kpos[keys][None, :])
                seen.index_put_((qi[mask], kj[mask]), torch.ones(int(mask.sum()), dtype=torch.int64),
                                accumulate=True)
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_computes_every_visible_pair_once_and_nothing_else(seed):
    rng = random.Random(seed)
    for _ in range(60):
        layout, p, seq_len, cu, window, causal = _random_problem(rng)
        truth = attention_mask(seq_len, causal=causal, cu_seqlens=cu, window=window).to(torch.int64)
        got = _plan_coverage(layout, p, seq_len, cu, window, causal)
        what = f"layout={layout} P={p} seq_len={seq_len} cu_seqlens={cu} window={window} causal={causal}"
        assert torch.equal(got, truth), f"{what}: {int((got != truth).sum())} pairs wrong"
        counts = work_counts(layout=layout, world_size=p, seq_len=seq_len, causal=causal, cu_seqlens=cu,
                             window=window)
        assert sum(counts) == int(truth.sum()), what


def test_a_narrow_window_costs_n_times_w_not_n_squared():
    # one rank, 4096 tokens, window 32 on each side: the plan tiles the band, so the pairs it
    # computes (visible or masked inside its blocks) stay within a few times N x (2w + 1)
    n, w = 4096, 32
    plan = block_plan(layout="contiguous", q_rank=0, kv_rank=0, world_size=1, local_len=n, causal=False,
                      window=(w, w))
    computed = sum(len(range(*b.q.indices(n))) * len(range(*b.kv.indices(n))) for b in plan)
    visible = sum(b.unmasked(n) for b in plan)
    assert visible == int(attention_mask(n, window=(w, w)).sum())
    assert computed <= 3 * n * (2 * w + 1), (computed, n * n)


# ----------------------------------------------------------------------------- the layouts

def test_zigzag_docs_deals_every_document_out_head_and_tail():
    cu = [0, 8, 8, 24, 32]  # P = 2: every document in 4 chunks; an empty one; 8 tokens of padding at the end
    pos = [positions(layout="zigzag_docs", rank=r, world_size=2, seq_len=40, cu_seqlens=cu).tolist() for r in (0, 1)]
    assert pos[0] == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33, 38, 39]
    assert sorted(pos[0] + pos[1]) == list(range(40))
    x = torch.arange(40.0).view(1, 40, 1)
    parts = [shard(x, layout="zigzag_docs", rank=r, world_size=2, cu_seqlens=cu) for r in (0, 1)]
    assert torch.equal(unshard(parts, layout="zigzag_docs", cu_seqlens=cu), x)


def test_zigzag_docs_balances_causal_work_over_mixed_documents():
    p = 4
    lengths = [8 * 7, 8 * 1, 8 * 12, 8 * 3, 8 * 9]  # multiples of 2P, mixed
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    counts = work_counts(layout="zigzag_docs", world_size=p, seq_len=cu[-1], causal=True, cu_seqlens=cu)
    assert max(counts) / (sum(counts) / p) <= 1.05, counts
    plain = work_counts(layout="contiguous", world_size=p, seq_len=cu[-1], causal=True, cu_seqlens=cu)
    assert max(plain) / (sum(plain) / p) > 1.05, plain  # what the per-document layout fixes


def test_zigzag_docs_names_the_document_that_does_not_divide():
    with pytest.raises(ValueError, match=r"document 1 \(tokens 8\.\.14\) has length 7, not divisible by "
                                         r"2 x world_size=4.*nearest valid length: 8"):
        positions(layout="zigzag_docs", rank=0, world_size=2, seq_len=16, cu_seqlens=[0, 8, 15, 16])
    with pytest.raises(ValueError, match="pass its cu_seqlens"):
        simulate_ring(*_qkv(16), world_size=2, layout="zigzag_docs")


# ------------------------------------------------------------------------ semantics and errors

def _qkv(n, *, d=8, dv=8, heads=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, heads, d, generator=g, dtype=dtype), torch.randn(1, n, heads, d, generator=g, dtype=dtype),
            torch.randn(1, n, heads, dv, generator=g, dtype=dtype))


def test_padding_rows_are_zero_with_lse_minus_inf_and_no_gradient():
    q, k, v = (t.requires_grad_(True) for t in _qkv(16, dv=4))
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = simulate_ring(q, k, v, world_size=4, cu_seqlens=torch.tensor([0, 5, 11], dtype=torch.int32),
                             sinks=sinks, causal=True, return_lse=True)
    assert out.shape == (1, 16, 2, 4)
    assert torch.equal(out[:, 11:], torch.zeros_like(out[:, 11:]))
    assert torch.isneginf(lse[..., 11:]).all() and torch.isfinite(lse[..., :11]).all()
    dq, dk, dv, ds = torch.autograd.grad(out.sum() + lse[..., :11].sum(), (q, k, v, sinks))
    for grad in (dq, dk, dv):
        assert torch.equal(grad[:, 11:], torch.zeros_like(grad[:, 11:]))
    assert torch.isfinite(ds).all()


def test_a_row_with_only_a_sink_has_output_zero_and_lse_the_sink():
    # in self-attention every non-padding row sees itself, so a row whose only term is the
    # sink exists in the merge (a rank's partial over keys it cannot see): finish() decides
    acc, m, l = start_state(1, 3, 2, 4)
    sink = torch.tensor([[[1.25, 1.25, float("-inf")], [-3.0, -3.0, float("-inf")]]])
    out, lse = finish(acc, m, l, sink)
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.tolist() == [[[1.25, 1.25, float("-inf")], [-3.0, -3.0, float("-inf")]]]


def test_an_empty_document_changes_nothing():
    q, k, v = _qkv(8)
    sinks = torch.tensor([1.25, -3.0])
    with_empty = simulate_ring(q, k, v, world_size=2, causal=True, sinks=sinks, return_lse=True,
                               cu_seqlens=torch.tensor([0, 0, 3, 3, 8]))
    without = simulate_ring(q, k, v, world_size=2, causal=True, sinks=sinks, return_lse=True,
                            cu_seqlens=torch.tensor([0, 3, 8]))
    assert all(torch.equal(a, b) for a, b in zip(with_empty, without))


BAD_VARIANTS = {
    "cu_not_from_zero": ({"cu_seqlens": torch.tensor([1, 8])}, ValueError, "cu_seqlens must start at 0"),
    "cu_decreasing": ({"cu_seqlens": torch.tensor([0, 6, 4, 8])}, ValueError, "must be non-decreasing"),
    "cu_past_end": ({"cu_seqlens": torch.tensor([0, 9])}, ValueError, "past seq_len=8"),
    "cu_float": ({"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError, "int32 or int64 tensor"),
    "window_below_minus_one": ({"window": (-2, 0)}, ValueError, "a side below -1"),
    "window_not_a_pair": ({"window": 3}, TypeError, "pair of ints"),
    "softcap_zero": ({"softcap": 0.0}, ValueError, "softcap must be None or a finite number > 0"),
    "sinks_wrong_shape": ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(heads,\) = \(2,\)"),
    "sinks_int": ({"sinks": torch.zeros(2, dtype=torch.int64)}, TypeError, "floating-point"),
}


@pytest.mark.parametrize("name", BAD_VARIANTS)
@pytest.mark.parametrize("entry", ["simulate_ring", "dense_grads"])
def test_bad_variant_arguments_get_one_message_everywhere(name, entry):
    kwargs, error, message = BAD_VARIANTS[name]
    q, k, v = _qkv(8)
    with pytest.raises(error, match=message):
        if entry == "simulate_ring":
            simulate_ring(q, k, v, world_size=2, **kwargs)
        else:
            dense_grads(q, k, v, torch.ones_like(q), **kwargs)


# ----------------------------------------------------------------------------- planted bugs

PLANTED_VARIANT_BUGS = {
    # planted bug: (case of VARIANT_PLANTED_CASES, tensors that must fail)
    "window_off_by_one": ("window_p4", ("out", "dk")),
    "documents_within_rank_only": ("documents_zigzag_p4", ("out", "dq", "dk")),
    "padding_attended": ("padding_p4", ("out", "lse", "dk")),
    "sink_on_every_step": ("sinks_normal_p4", ("out", "lse", "dsinks")),
    "softcap_backward_without_tanh_grad": ("softcap_p4", ("dq", "dk")),
    "padding_rows_nan": ("padding_p4", ("out",)),
}


def test_the_unbroken_ring_passes_the_planted_cases():
    for c in VARIANT_PLANTED_CASES.values():
        verdict = run_case(c)
        assert verdict.passed, verdict.message()


@pytest.mark.parametrize("bug", PLANTED_VARIANT_BUGS)
def test_a_planted_variant_bug_is_rejected(bug):
    name, tensors = PLANTED_VARIANT_BUGS[bug]
    c = VARIANT_PLANTED_CASES[name]
    verdict = run_case(c, impl=simulated_impl(c, parts=PLANTED[bug]))
    assert not verdict.passed
    for tensor in tensors:
        assert not verdict[tensor].passed, f"{bug}: {tensor} passed\n{verdict.message()}"
