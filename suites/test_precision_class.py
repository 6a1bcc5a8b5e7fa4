"""The precision-class check (`ringcheck.judge.precision`): each tensor against what a correct
flash-style kernel reaches on one device, measured against the exact truth and the computation
conventions a correct kernel may follow (`ringcheck.judge.conventions`). Correct rings never
fail it (PyTorch's ring and kernel included, which round P, dS and each step's partials to the
input dtype); a tensor rounded through a narrower dtype than the input's fails it by >= 3x.

Most of it judges computed tensors directly (our ring through `simulate_ring`, the narrowing
applied to its results, which is exactly what the public mutants do to the textbook ring's);
two local rings show the public mutants and PyTorch's ring, and one validate run shows the rows.
The larger sweep is `python -m benchmarks.precision_class` (reports/precision_class/).
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings

import pytest
import torch

from ringcheck.adapters import load_impl
from ringcheck.catalogue.mutants import CATALOGUES
from ringcheck.catalogue.precision_mutants import (
    NARROWER,
    PRECISION_MUTANTS,
    narrowing,
    ring_results_task,
    whole_results,
)
from ringcheck.commands.validate import Target, validate
from ringcheck.judge.check import Case, Results, run_whole, simulated_impl, truth
from ringcheck.judge.distributions import DISTRIBUTIONS
from ringcheck.judge.inputs import make_inputs
from ringcheck.judge.precision import CLASS_K, class_context, class_reference, flash_class, judge_class, judge_precision
from ringcheck.launch import RingError
from ringcheck.spec import DTYPES, AttentionSpec, RingSpec, Variant

TENSORS = ("out", "lse", "dq", "dk", "dv")
MODES = {"bidirectional": (False, "contiguous"), "causal": (True, "contiguous"), "zigzag": (True, "zigzag"),
         "striped": (True, "striped")}
# CI size: three ring sizes, each with two of the four modes (all four covered), one seed each; make test
# runs the first two (every mode), P=8 carries the marker thorough (make test-thorough, in CI)
CI_SWEEP = [(2, ("bidirectional", "zigzag"), 1), (5, ("causal", "striped"), 2),
            pytest.param(8, ("zigzag", "bidirectional"), 3, marks=pytest.mark.thorough)]


def _case(world, mode, dtype, dist, seed, local=4):
    causal, layout = MODES[mode]
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_len=local * world, head_dim=32, dtype=dtype, causal=causal)
    return Case(spec, RingSpec(world, layout), seed=seed, distribution=dist)


def _narrowed(got: Results, tensor: str, narrow: str) -> Results:
    values = {name: getattr(got, name) for name in ("out", "lse", "dq", "dk", "dv", "dsinks")}
    values[tensor] = values[tensor].to(DTYPES[narrow]).to(values[tensor].dtype)
    return Results(**values)


@pytest.mark.parametrize("world, modes, seed", CI_SWEEP)
def test_our_ring_passes_and_every_narrowing_fails(world, modes, seed):
    """Every distribution x dtype x mode: our ring's worst error / budget <= 1 (it lands at ~0.3:
    one rounding), and per (mode, dtype) the worst over the distributions (validate's row) of
    every narrowing of every tensor is >= 3."""
    worst, rows = {}, {}
    for mode, dtype, dist in itertools.product(modes, DTYPES, DISTRIBUTIONS):
        case = _case(world, mode, dtype, dist, seed)
        inputs = make_inputs(case.spec, seed=seed, distribution=dist, ring=case.ring)
        got, true = run_whole(simulated_impl(case), inputs), truth(case.spec, inputs)
        context = class_context(case, true, inputs)  # the case's references, computed once for every narrowing
        for t in judge_precision(case, got, true, inputs, context=context).tensors:
            assert t.passed, f"false alarm on our ring: {t.describe()} [{case.describe()}]"
            worst[dtype] = max(worst.get(dtype, 0.0), t.ratio)
        for narrow, tensor in itertools.product(NARROWER[dtype], TENSORS):
            bad = judge_precision(case, _narrowed(got, tensor, narrow), true, inputs, tensors=(tensor,),
                                  context=context)[tensor]
            key = (mode, dtype, narrow, tensor)
            rows[key] = max(rows.get(key, 0.0), bad.ratio)
    assert worst["float16"] < 0.6 and worst["bfloat16"] < 0.6 and worst["float32"] < 0.2, worst
    weak = {key: round(r, 2) for key, r in rows.items() if r < 3}
    assert not weak, f"narrowings under 3x the budget at P={world} seed={seed}: {weak}"
    assert len(rows) == len(modes) * 3 * len(TENSORS)  # fp16: bf16; fp32: fp16 and bf16


def test_the_class_reference_is_one_rounding_for_16_bit_inputs_and_float32_arithmetic_otherwise():
    for dtype in ("float16", "bfloat16", "float32"):
        case = _case(4, "zigzag", dtype, "normal", 0)
        inputs = make_inputs(case.spec, seed=0, distribution="normal", ring=case.ring)
        true = truth(case.spec, inputs)
        ref, flash = class_reference(case.spec, inputs, true), flash_class(case.spec, inputs)
        for name in TENSORS:
            one = judge_class(name, flash.get(name), true.get(name), ref.get(name), k=1.0, dtype=case.spec.torch_dtype)
            # the float32 flash-style kernel is as precise as the class (within its float32 arithmetic)
            assert one.units < (0.6 if dtype != "float32" else 20.0), (dtype, name, one.describe())
            if dtype != "float32" and name != "lse":
                assert 0.3 < one.class_units < 0.6, (dtype, name, one.class_units)  # one rounding: ~0.42 u


def test_a_wrong_value_or_nan_fails_and_names_its_rank():
    case = _case(4, "zigzag", "float16", "normal", 0)
    inputs = make_inputs(case.spec, seed=0, distribution="normal", ring=case.ring)
    got, true = run_whole(simulated_impl(case), inputs), truth(case.spec, inputs)
    dq = got.dq.clone()
    dq[0, 3] = math.nan  # token 3: rank 0 of 4 under zig-zag (chunks of 2 tokens)
    bad = judge_precision(case, Results(got.out, got.lse, dq, got.dk, got.dv), true, inputs)
    assert not bad["dq"].passed and bad["dq"].nonfinite and bad["out"].passed
    assert "NaN/Inf" in bad["dq"].describe()
    dv = got.dv.clone()
    dv[0, 5] *= 1.05  # token 5: rank 2
    bad = judge_precision(case, Results(got.out, got.lse, got.dq, got.dk, dv), true, inputs)
    assert not bad["dv"].passed and bad["dv"].failing_ranks == (2,) and bad["dv"].ratio > 3


def test_variants_and_dsinks_pass_on_our_ring():
    target = Target(seq_len=64, world_size=4, dtype="float16", documents="random:3", window=(8, 0), softcap=30.0,
                    sinks=True, heads=4, kv_heads=2, head_dim=32)
    spec = target.spec(32, seed=1)
    case = Case(spec, target.ring, seed=1, distribution="normal")
    inputs = make_inputs(spec, seed=1, distribution="normal", ring=case.ring)
    got, true = run_whole(simulated_impl(case), inputs), truth(spec, inputs)
    context = class_context(case, true, inputs)
    verdict = judge_precision(case, got, true, inputs, context=context)
    assert [t.tensor for t in verdict.tensors] == [*TENSORS, "dsinks"] and verdict.passed, verdict.message()
    for name in TENSORS:  # one case with documents, a window, softcap and sinks: every narrowing by >= 3x
        bad = judge_precision(case, _narrowed(got, name, "bfloat16"), true, inputs, tensors=(name,),
                              context=context)[name]
        assert bad.ratio > 3, bad.describe()


def test_the_catalogue_has_a_mutant_per_tensor_and_narrow_dtype():
    assert sorted(PRECISION_MUTANTS) == sorted(f"narrow_{t}_{n}" for t in TENSORS for n in ("bfloat16", "float16"))
    for name, (fn, tensor, narrow, line) in PRECISION_MUTANTS.items():
        assert fn.__name__ == name and tensor in line and narrow in line
    with pytest.raises(ValueError, match="not one of"):
        narrowing("dz", "bfloat16")
    with pytest.raises(ValueError, match="not one of"):
        narrowing("dq", "float8")
    assert CATALOGUES["ringcheck.catalogue.precision_mutants"] == "PRECISION_MUTANTS"
    for module, name in CATALOGUES.items():
        assert getattr(importlib.import_module(module), name)
    impl = load_impl("ringcheck.catalogue.precision_mutants:narrow_dk_float16", layout="zigzag")
    assert impl.fn is PRECISION_MUTANTS["narrow_dk_float16"][0]


def test_public_mutants_fail_and_the_textbook_and_torch_cp_rings_pass(run_on_ring):
    """On a local ring of 2: the textbook ring and PyTorch's ring pass; a public mutant's tensors
    are the textbook ring's with one tensor narrowed, bit for bit (what the benchmark judges),
    and fail by >= 3x."""
    cases = [_case(2, "zigzag", dtype, "normal", seed, local=8) for dtype in ("float16", "float32") for seed in (1, 2)]
    textbook = "ringcheck.catalogue.variant_textbook:textbook_varlen"
    results = {impl: run_on_ring(2, ring_results_task, impl, "zigzag", cases)
               for impl in (textbook, "torch_cp", "ringcheck.catalogue.precision_mutants:narrow_dq_bfloat16",
                            "ringcheck.catalogue.precision_mutants:narrow_lse_float16")}
    for i, case in enumerate(cases):
        inputs = make_inputs(case.spec, seed=case.seed, distribution="normal", ring=case.ring)
        true = truth(case.spec, inputs)
        whole = {impl: whole_results([p[i] for p in parts], case) for impl, parts in results.items()}
        for impl in (textbook, "torch_cp"):
            verdict = judge_precision(case, whole[impl], true, inputs)
            assert verdict.passed, f"{impl}: {verdict.message()}"
        for name, tensor, narrow in (("narrow_dq_bfloat16", "dq", "bfloat16"),
                                     ("narrow_lse_float16", "lse", "float16")):
            got = whole[f"ringcheck.catalogue.precision_mutants:{name}"]
            assert torch.equal(got.get(tensor), _narrowed(whole[textbook], tensor, narrow).get(tensor))
            others = [t for t in TENSORS if t != tensor]
            assert all(torch.equal(got.get(t), whole[textbook].get(t)) for t in others), name
            if narrow in NARROWER[case.spec.dtype]:
                verdict = judge_precision(case, got, true, inputs)
                assert verdict[tensor].ratio >= 3, verdict[tensor].describe()
                assert all(verdict[t].passed for t in others), verdict.message()


# CI size of the report's sweep for the other correct rings: (ring size, mode, seed) rows
PEER_SWEEP = [(2, "bidirectional", 1), (3, "zigzag", 2), (4, "causal", 3), (3, "striped", 4)]


def _run_torch_cp(run_on_ring, world, *args):
    """PyTorch's ring's results. On local gloo rings it died once in CI, one rank by SIGABRT
    inside its backward's all-to-all wait (a native crash in PyTorch, not a verdict; not
    reproduced here in about 2,000 runs of the same cases): such a death is retried once on a
    fresh ring, with a warning that quotes the dead rank's last words. Anything else raises."""
    try:
        return run_on_ring(world, ring_results_task, "torch_cp", *args)
    except RingError as error:
        died = [text for text in error.failures.values()
                if text.startswith("died during the task: killed by SIG") and "SIGKILL" not in text]
        if not died:
            raise
        warnings.warn(f"torch_cp crashed on a local ring; retried once on a fresh ring:\n{died[0]}", stacklevel=2)
    return run_on_ring(world, ring_results_task, "torch_cp", *args)


@pytest.mark.parametrize("world, mode, seed", PEER_SWEEP)
def test_the_textbook_and_torch_cp_rings_raise_no_false_alarm(run_on_ring, world, mode, seed):
    """Every distribution x dtype on a local ring: the textbook ring and PyTorch's ring (on the
    layouts it has: contiguous and zigzag) pass every tensor, with room (< 0.75 of the budget;
    the report's 5-seed sweep: <= 0.59)."""
    causal, layout = MODES[mode]
    cases = [_case(world, mode, dtype, dist, seed, local=8) for dtype in DTYPES for dist in DISTRIBUTIONS]
    impls = ["ringcheck.catalogue.variant_textbook:textbook_varlen"] + (["torch_cp"] if layout != "striped" else [])
    worst = {}
    for impl in impls:
        parts = (_run_torch_cp(run_on_ring, world, layout, cases) if impl == "torch_cp"
                 else run_on_ring(world, ring_results_task, impl, layout, cases))
        for i, case in enumerate(cases):
            inputs = make_inputs(case.spec, seed=seed, distribution=case.distribution, ring=case.ring)
            verdict = judge_precision(case, whole_results([p[i] for p in parts], case), truth(case.spec, inputs),
                                      inputs)
            assert verdict.passed, f"false alarm on {impl}: {verdict.message()}"
            worst[impl] = max(worst.get(impl, 0.0), max(t.ratio for t in verdict.tensors))
    assert max(worst.values()) < 0.75, worst


def test_validate_reports_the_precision_rows_and_fails_a_narrowed_dq(ring_processes):
    """The issue's bug: dq rounded through bfloat16 for float16 inputs. validate's precision
    backward row fails it by >= 3x on dq alone; the forward row passes."""
    target = Target(seq_len=64, world_size=2, heads=4, kv_heads=2, head_dim=32, dtype="float16", causal=True,
                    layout="zigzag", impl="ringcheck.catalogue.precision_mutants:narrow_dq_bfloat16",
                    local_lengths=(16,), sample_rows=4, distributions=("normal", "outlier"), ragged_lengths=())
    rows = {r.check: r for r in validate(target, ring_processes, recompute=False)}
    forward = rows["precision forward  vs flash-style kernel (local 16)"]
    backward = rows["precision backward vs flash-style kernel (local 16)"]
    assert forward.status == "pass" and list(forward.tensors) == ["out", "lse"]
    assert backward.status == "fail" and list(backward.tensors) == ["dq", "dk", "dv"]
    assert backward.tensors["dq"]["ratio"] >= 3 and not backward.tensors["dq"]["passed"]
    assert backward.tensors["dk"]["passed"] and backward.tensors["dv"]["passed"]
    assert backward.error > 3 * backward.budget and "dq FAILED (precision class)" in backward.detail
    assert CLASS_K[torch.float16] == CLASS_K[torch.bfloat16] == 2.0  # the budget the README states


def test_the_kernel_peer_is_a_ring_of_pytorchs_kernel_and_only_widens_the_budget():
    """`kernel_class`: a ring of PyTorch's CPU flash kernel over the case's shards, where the
    kernel runs the case; on any CPU path it is within one rounding of the exact truth's class
    on the forward, the budget with it is never below the class's, and a narrowing still fails
    by >= 3x on the normal distribution (the row's anchor) under every capability CI runs."""
    from ringcheck.judge.check import token_owners
    from ringcheck.judge.precision import KERNEL_BLOCK_ROWS, PEER_K, kernel_class

    case = _case(4, "zigzag", "float16", "normal", 1)
    inputs = make_inputs(case.spec, seed=1, distribution="normal", ring=case.ring)
    owner, _ = token_owners(case.spec.seq_len, case.ring)
    kernel = kernel_class(case.spec, inputs, owner)
    assert kernel is not None and kernel.dv.dtype == torch.float16 and kernel.lse.dtype == torch.float32
    true = truth(case.spec, inputs)
    got = run_whole(simulated_impl(case), inputs)
    context = class_context(case, true, inputs)
    with_peer = judge_precision(case, got, true, inputs, context=context)
    alone = judge_precision(case, got, true, inputs, reference=class_reference(case.spec, inputs, true))
    for name in TENSORS:
        assert with_peer[name].budget >= alone[name].budget * (1 - 1e-12), name
        bad = judge_precision(case, _narrowed(got, name, "bfloat16"), true, inputs, tensors=(name,),
                              context=context)[name]
        assert bad.ratio >= 3, bad.describe()
    assert PEER_K < CLASS_K[torch.float16]
    # where the kernel cannot run the case there is no peer
    softcap = case.spec.replace(variant=Variant(softcap=30.0))
    assert kernel_class(softcap, make_inputs(softcap, seed=1, ring=case.ring), owner) is None
    wide = _case(1, "bidirectional", "float16", "normal", 1, local=KERNEL_BLOCK_ROWS + 2)
    owner1, _ = token_owners(wide.spec.seq_len, wide.ring)
    assert kernel_class(wide.spec, make_inputs(wide.spec, seed=1, ring=wide.ring), owner1) is None
