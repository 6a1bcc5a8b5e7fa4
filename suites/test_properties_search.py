"""The search works: bugs planted for a narrow class of inputs are found by the property
suite and shrunk to a small spec, while hand-picked benign cases miss them.

Each bug is planted by swapping one piece of the real ring (as in test_planted_bugs.py); the
search is `hypothesis.find` over the same strategy and property as test_properties.py, with
a fixed (derandomized) search so the test is deterministic.
"""

import pytest
import torch
from hypothesis import HealthCheck, find, settings

import ringcheck.ring as ring_module
from ringcheck.check import MODES, Case, run_case
from ringcheck.layouts import Block, block_plan
from ringcheck.spec import AttentionSpec, RingSpec
from ringcheck.strategies import Bounds, tokens_per_rank

from suites.test_properties import budget_cases, check_budget

SEARCH = settings(max_examples=400, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
# small rings and shapes: a found bug shrinks in a few hundred quick runs
BOUNDS = Bounds(max_world_size=8, max_tokens_per_rank=8, max_batch=2, max_heads=4, max_head_dim=16)


def _fails(check):
    def failing(case):
        try:
            check(case)
        except AssertionError:
            return True
        return False
    return failing


def _benign_cases():
    """Hand-picked cases in the style of test_ring.py: normal inputs, power-of-two shapes."""
    out = []
    for mode, world_size in (("bidirectional", 4), ("causal", 4), ("zigzag", 4), ("zigzag", 8)):
        causal, layout = MODES[mode]
        spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_len=8 * world_size, head_dim=16,
                             dtype="bfloat16", causal=causal)
        out.append(Case(spec, RingSpec(world_size, layout), seed=world_size))
    return out


# ---- (a) a merge that overflows when a block's lse is > 88 above the running one ------------

def merge_overflowing_past_88(acc, m, l, block_out, block_lse):
    """Keeps the first block's lse as the reference instead of moving to the new max, so it
    computes exp(block_lse - m) directly in float32: right while the gap is < 88.7, Inf (and
    then NaN) beyond."""
    ref = torch.where(torch.isneginf(m), block_lse, m)
    safe = ref.masked_fill(torch.isneginf(ref), 0.0)
    keep, add = torch.exp(m - safe), torch.exp(block_lse - safe)

    def rows(x):
        return x.transpose(1, 2).unsqueeze(-1)

    return acc * rows(keep) + block_out * rows(add), ref, l * keep + add


def test_overflowing_merge_passes_benign_cases(monkeypatch):
    monkeypatch.setattr(ring_module, "merge_into", merge_overflowing_past_88)
    for case in _benign_cases():
        verdict = run_case(case)
        assert verdict.passed, verdict.message()


def test_overflowing_merge_is_found_and_shrunk_to_a_small_spec(monkeypatch):
    monkeypatch.setattr(ring_module, "merge_into", merge_overflowing_past_88)
    found = find(budget_cases(BOUNDS), _fails(check_budget), settings=SEARCH)
    spec = found.spec
    assert found.distribution in ("wide", "outlier", "sink", "late-max"), found
    assert found.ring.world_size == 2 and tokens_per_rank(found) <= 2, found
    assert (spec.batch, spec.heads, spec.kv_heads) == (1, 1, 1) and spec.head_dim <= 2, found
    with pytest.raises(AssertionError, match="NaN/Inf"):
        check_budget(found)
    monkeypatch.undo()
    check_budget(found)  # the real merge passes the shrunk case


# ---- (b) zig-zag half split that assumes a power-of-two number of tokens per rank ----------

def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def zigzag_plan_with_power_of_two_half(**kwargs):
    """The zig-zag plan with its half split computed as next_power_of_2(n) // 2 (a habit from
    kernels with power-of-two block sizes): right for n = 2, 4, 8, ..., wrong for 6, 10, 12."""
    plan = block_plan(**kwargs)
    if kwargs["layout"] != "zigzag" or not kwargs["causal"]:
        return plan
    n = kwargs["local_len"]
    half, wrong = n // 2, _next_power_of_2(n) // 2

    def split(s):
        return slice(wrong if s.start == half else s.start, wrong if s.stop == half else s.stop)

    return tuple(Block(split(b.q), split(b.kv), b.mask, b.diagonal) for b in plan)


def test_power_of_two_zigzag_split_passes_benign_cases(monkeypatch):
    monkeypatch.setattr(ring_module, "block_plan", zigzag_plan_with_power_of_two_half)
    for case in _benign_cases():
        verdict = run_case(case)
        assert verdict.passed, verdict.message()


def test_power_of_two_zigzag_split_is_found_and_shrunk_to_a_small_spec(monkeypatch):
    monkeypatch.setattr(ring_module, "block_plan", zigzag_plan_with_power_of_two_half)
    found = find(budget_cases(BOUNDS), _fails(check_budget), settings=SEARCH)
    spec = found.spec
    assert found.ring.layout == "zigzag" and spec.causal, found
    assert tokens_per_rank(found) == 6 and found.ring.world_size == 2, found
    assert (spec.batch, spec.heads, spec.kv_heads, spec.head_dim) == (1, 1, 1, 1), found
    assert found.distribution == "normal", found
    monkeypatch.undo()
    check_budget(found)
