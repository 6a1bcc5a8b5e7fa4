"""The variant mutant catalogue (ringcheck.catalogue.variant_mutants) on real rings: the budget
rule passes `textbook_varlen`, a plain correct ring with documents, padding, windows, softcap,
sinks and MLA head dims, on every configuration here (no false alarm), and fails every mutant on
the configurations that expose its defect (placed where rings break: boundaries on rank and
zig-zag chunk boundaries, odd document lengths, a rank holding only padding, GQA heads).

Each implementation runs on a local gloo ring (the torchrun world under torchrun) through the
`--impl` contract, fn(q, k, v, *, causal, softmax_scale, group, layout, **variant); the whole
out, lse, dq, dk, dv and every rank's sinks.grad are gathered and judged against float64
(`judge_results`, with every rank's dsinks judged, since each must be the whole sequence's).
One task call per ring size runs every job of that size.

Which tensor catches each mutant ("catcher": asserted to fail on every configuration of the
mutant; "failing": every tensor over budget there, as measured; "all" = out, lse, dq, dk, dv, and
dsinks where the configuration has sinks):

    mutant                  configurations                          catcher  failing
    window_ignored          window_causal_p4, window_bidir_p2       out      all
    window_off_by_one       window_causal_p4, window_bidir_p2       out      all
    docs_rank_local         docs_rank_boundary_p4, docs_odd_p2      out      all (lse: -inf vs finite)
    odd_doc_drops_last      docs_odd_p2, docs_odd_bidir_p4          out      all (dropped rows' lse -inf)
    padding_attended        padding_rank_p4, docs_rank_boundary_p4  out      all (padding rows' lse finite)
    padding_rank_nan        padding_rank_p4, padding_rank_p2_sinks  out      out, dq, dk (+ dsinks): NaN
    empty_block_lse_posinf  plain_causal_p4, padding_rank_p4        out      all (NaN in out, lse, dq, dk)
    merge_nan               padding_rank_p4, padding_rank_p2_sinks  out      out, dq, dk (+ dsinks): NaN
    sinks_dropped           sinks_p4, sinks_docs_p3                 out      all
    sink_per_step           sinks_p4, sinks_docs_p3                 out      all
    sinks_no_grad           sinks_p4, sinks_docs_p3                 dsinks   dsinks only
    dsinks_all_reduced      sinks_p4, sinks_docs_p3                 dsinks   dsinks only (P times the share summed)
    softcap_before_scale    softcap_p2, softcap_wide_p4             out      all
    softcap_no_tanh_grad    softcap_p2, softcap_wide_p4             dq       dq, dk only
    sinks_gqa_order         sinks_p4, sinks_docs_p3                 out      all
"""

from __future__ import annotations

import pytest
import torch

import ringcheck
from ringcheck.catalogue.variant_mutants import VARIANT_MUTANTS, textbook_varlen
from ringcheck.catalogue.variant_textbook import BUGS
from ringcheck.judge.check import Case, Results, judge_results, peer, truth
from ringcheck.judge.inputs import make_inputs
from ringcheck.judge.sinks import combine
from ringcheck.spec import AttentionSpec, RingSpec, Variant

IMPLS = {"textbook_varlen": textbook_varlen, **{name: fn for name, (fn, _, _) in VARIANT_MUTANTS.items()}}


def _case(world_size, seq_len, *, dtype="float32", causal=True, layout="zigzag", cu=None, window=(-1, -1),
          softcap=None, sinks=None, dv=None, batch=1, seed=0, distribution="normal") -> Case:
    spec = AttentionSpec(batch=batch, heads=4, kv_heads=2, seq_len=seq_len, head_dim=8, dtype=dtype, causal=causal,
                         v_head_dim=dv, variant=Variant(cu_seqlens=cu, window=window, softcap=softcap), sinks=sinks)
    return Case(spec, RingSpec(world_size, layout), seed=seed, distribution=distribution)


# zig-zag chunks are seq_len / 2P tokens: P=2 seq 16 -> 4, P=3 seq 24 -> 4, P=4 seq 32 -> 4
CONFIGS = {
    "plain_causal_p4": _case(4, 32, batch=2),
    "plain_bidir_p3": _case(3, 24, dtype="bfloat16", causal=False, dv=4),
    "window_causal_p4": _case(4, 32, window=(5, 0), seed=1),  # the window spans two chunks
    "window_bidir_p2": _case(2, 16, dtype="bfloat16", causal=False, window=(3, 2), dv=4, seed=2),
    "window_docs_p3": _case(3, 24, window=(4, 1), cu=(0, 5, 12, 19), dv=4, seed=3),
    # boundaries at chunk (= rank) boundaries 4, 16, 28; the padding tail is rank 0's second chunk
    "docs_rank_boundary_p4": _case(4, 32, dtype="bfloat16", cu=(0, 4, 16, 28), seed=4),
    "docs_odd_p2": _case(2, 24, cu=(0, 3, 8, 15, 22), batch=2, seed=5),  # lengths 3, 5, 7, 7; padding 2
    "docs_odd_bidir_p4": _case(4, 40, dtype="bfloat16", causal=False, cu=(0, 1, 6, 13, 27, 37), seed=6),
    # rank 3 holds chunks 3 and 4 (tokens 12..19): nothing but padding
    "padding_rank_p4": _case(4, 32, cu=(0, 5, 12), seed=7),
    "padding_rank_p2_sinks": _case(2, 16, dtype="bfloat16", cu=(0, 3), sinks="normal", dv=4, seed=8),  # rank 1
    "sinks_p4": _case(4, 32, sinks="typical", batch=2, seed=9),
    "sinks_docs_p3": _case(3, 24, dtype="bfloat16", cu=(0, 6, 13, 21), sinks="normal", dv=4, seed=10),
    "softcap_p2": _case(2, 16, dtype="bfloat16", softcap=1.0, seed=11),
    "softcap_wide_p4": _case(4, 32, softcap=0.5, distribution="wide", seed=12),  # saturated: tanh' ~ 0
    "everything_p3": _case(3, 24, cu=(0, 5, 12, 20), window=(5, 3), softcap=4.0, sinks="normal", dv=4, seed=13),
    "zigzag_docs_p2": _case(2, 32, dtype="bfloat16", layout="zigzag_docs", cu=(0, 8, 24), window=(6, -1),
                            softcap=3.0, sinks="typical", seed=14),
    "zigzag_docs_bidir_p4": _case(4, 48, causal=False, layout="zigzag_docs", cu=(0, 16, 40), dv=4, seed=15),
}

# mutant -> (configurations where it must fail, the tensor that must catch it there)
MUST_FAIL = {
    "window_ignored": (("window_causal_p4", "window_bidir_p2"), "out"),
    "window_off_by_one": (("window_causal_p4", "window_bidir_p2"), "out"),
    "docs_rank_local": (("docs_rank_boundary_p4", "docs_odd_p2"), "out"),
    "odd_doc_drops_last": (("docs_odd_p2", "docs_odd_bidir_p4"), "out"),
    "padding_attended": (("padding_rank_p4", "docs_rank_boundary_p4"), "out"),
    "padding_rank_nan": (("padding_rank_p4", "padding_rank_p2_sinks"), "out"),
    "empty_block_lse_posinf": (("plain_causal_p4", "padding_rank_p4"), "out"),
    "merge_nan": (("padding_rank_p4", "padding_rank_p2_sinks"), "out"),
    "sinks_dropped": (("sinks_p4", "sinks_docs_p3"), "out"),
    "sink_per_step": (("sinks_p4", "sinks_docs_p3"), "out"),
    "sinks_no_grad": (("sinks_p4", "sinks_docs_p3"), "dsinks"),
    "dsinks_all_reduced": (("sinks_p4", "sinks_docs_p3"), "dsinks"),
    "softcap_before_scale": (("softcap_p2", "softcap_wide_p4"), "out"),
    "softcap_no_tanh_grad": (("softcap_p2", "softcap_wide_p4"), "dq"),
    "sinks_gqa_order": (("sinks_p4", "sinks_docs_p3"), "out"),
}
# defects that live only in the backward: the forward (out, lse) must pass
BACKWARD_ONLY = {"sinks_no_grad", "dsinks_all_reduced", "softcap_no_tanh_grad"}
CONTROL = "plain_bidir_p3"  # no variant, no empty block: every mutant must pass it

JOBS = ([("textbook_varlen", name) for name in CONFIGS]
        + [(mutant, name) for mutant, (names, _) in MUST_FAIL.items() for name in names]
        + [(mutant, CONTROL) for mutant in MUST_FAIL])


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def run_jobs_task(member, jobs):
    """Each (implementation, case) on this rank's shards; returns this rank's out, lse, q.grad,
    k.grad, v.grad and sinks.grad (None where the implementation left a gradient unset)."""
    results = []
    for impl, case in jobs:
        s, ring = case.spec, case.ring
        inputs = make_inputs(s, seed=case.seed, distribution=case.distribution, device=member.device, ring=ring)
        kwargs = s.variant_kwargs()
        cu = kwargs.get("cu_seqlens")

        def cut(t, dim=1, ring=ring, cu=cu):
            return ringcheck.shard(t, layout=ring.layout, rank=member.rank, world_size=ring.world_size, dim=dim,
                                   cu_seqlens=cu)

        q, k, v = (_leaf(cut(t)) for t in (inputs.q, inputs.k, inputs.v))
        sinks = None if inputs.sinks is None else _leaf(inputs.sinks)
        if sinks is not None:
            kwargs["sinks"] = sinks
        out, lse = IMPLS[impl](q, k, v, causal=s.causal, softmax_scale=s.softmax_scale, group=member.group,
                               layout=ring.layout, **kwargs)
        out.backward(cut(inputs.dout))
        grads = [None if t is None or t.grad is None else t.grad.cpu() for t in (q, k, v, sinks)]
        results.append((out.detach().cpu(), lse.detach().cpu(), *grads))
    return results


def _judge(case: Case, per_rank) -> list:
    """Verdicts of the gathered results: every tensor, dsinks as the sum of every rank's own
    share (the default "partial" convention: the framework reduces it)."""
    s, ring = case.spec, case.ring
    cu = s.variant_kwargs().get("cu_seqlens")
    inputs = make_inputs(s, seed=case.seed, distribution=case.distribution, ring=ring)
    true, peer_results = truth(s, inputs), peer(s, inputs)

    def whole(i, like, dim=1):
        shards = [r[i] if r[i] is not None else torch.zeros_like(ringcheck.shard(
            like, layout=ring.layout, rank=rank, world_size=ring.world_size, dim=dim, cu_seqlens=cu))
            for rank, r in enumerate(per_rank)]
        return ringcheck.unshard(shards, layout=ring.layout, dim=dim, cu_seqlens=cu)

    tensors = [whole(0, true.out), whole(1, true.lse, 2), whole(2, inputs.q), whole(3, inputs.k), whole(4, inputs.v)]
    if inputs.sinks is None:
        return [judge_results(case, Results(*tensors), true, peer_results, inputs=inputs)]
    parts = tuple(r[5] if r[5] is not None else torch.zeros_like(inputs.sinks) for r in per_rank)
    got = Results(*tensors, combine(parts, "partial"), parts, "partial")
    return [judge_results(case, got, true, peer_results, inputs=inputs)]


@pytest.fixture(scope="module")
def verdicts(run_on_ring):
    """(implementation, configuration) -> verdicts, every job run once, one task call per ring size."""
    by_size: dict[int, list] = {}
    for impl, name in JOBS:
        by_size.setdefault(CONFIGS[name].ring.world_size, []).append((impl, name))
    found = {}
    for size in sorted(by_size, reverse=True):  # largest first: its local ring then serves the smaller ones
        jobs = by_size[size]
        per_rank = run_on_ring(size, run_jobs_task, [(impl, CONFIGS[name]) for impl, name in jobs])
        for j, (impl, name) in enumerate(jobs):
            found[impl, name] = _judge(CONFIGS[name], [rank[j] for rank in per_rank])
    return found


def _failing(verdicts_of) -> set[str]:
    return {t.tensor for v in verdicts_of for t in v.failures}


def _message(verdicts_of) -> str:
    return "\n".join(v.message() for v in verdicts_of)


def test_the_catalogue_names_every_defect_once():
    assert set(VARIANT_MUTANTS) == BUGS == set(MUST_FAIL)
    assert len(VARIANT_MUTANTS) >= 12
    for name, (fn, keywords, line) in VARIANT_MUTANTS.items():
        assert fn.__name__ == name and fn.__doc__ and line
        assert set(keywords) <= {"cu_seqlens", "window", "softcap", "sinks"}
        for config in MUST_FAIL[name][0]:  # each configuration exposes what the mutant says it needs
            spec = CONFIGS[config].spec
            assert set(keywords) <= set(spec.variant_kwargs()) | ({"sinks"} if spec.sinks else set()), (name, config)


@pytest.mark.parametrize("config", CONFIGS)
def test_textbook_varlen_passes(verdicts, config):
    found = verdicts["textbook_varlen", config]
    assert all(v.passed for v in found), _message(found)


@pytest.mark.parametrize("mutant", MUST_FAIL)
def test_mutant_fails_where_its_defect_lives(verdicts, mutant):
    configs, catcher = MUST_FAIL[mutant]
    for config in configs:
        found = verdicts[mutant, config]
        failing = _failing(found)
        assert catcher in failing, f"{mutant} on {config}: expected {catcher} to fail, failing: {sorted(failing)}\n" \
                                   + _message(found)
        if mutant in BACKWARD_ONLY:
            assert not failing & {"out", "lse"}, f"{mutant} on {config}: a backward defect failed the forward\n" \
                                                 + _message(found)


@pytest.mark.parametrize("mutant", MUST_FAIL)
def test_mutant_passes_plain_bidirectional_attention(verdicts, mutant):
    """Without variants, padding or empty blocks each defect is dormant: the verdict blames no one."""
    found = verdicts[mutant, CONTROL]
    assert all(v.passed for v in found), _message(found)
