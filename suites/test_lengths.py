"""The lengths where kernels break (issue 43): shards longer than a tile and not a multiple of
it, and calls whose length changes in one process.

- validate's ragged shards straddle every tile (16, 32, 64, 128), their zig-zag chunks too, and
  their sampled rows hold every rank's ragged tails;
- the ragged rows pass the textbook ring and fail each length mutant of
  `ringcheck.catalogue.length_mutants` (the stale workspace by the calls that change length
  alone, with every other case at one length);
- the property kit: `check_changing_lengths` fails a ring that keeps an earlier call's state,
  the strategies draw ragged shards (above 64 in `ragged_cases`, leaning to tiles in nightly);
- a document run alone stays in a zig-zag-only ring's layout (the false alarm of item 6).
"""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from ringcheck.commands.validate import Target, validate
from ringcheck.commands.validate.ragged import ragged_rows_sampled
from ringcheck.commands.validate.steps import DETERMINISM_ROW
from ringcheck.commands.validate.target import RAGGED_LENGTHS, ragged_cases, ragged_fit
from ringcheck.judge.check import Case, simulated_impl
from ringcheck.judge.inputs import TILES
from ringcheck.ring.layouts import positions
from ringcheck.spec import AttentionSpec, RingSpec, Variant
from ringcheck.testing.properties import check_budget, check_changing_lengths
from ringcheck.testing.strategies import PROFILES, tile_tokens
from ringcheck.testing.strategies import ragged_cases as ragged_strategy
from ringcheck.testing.variant_properties import check_documents_are_separate, document_case

RAGGED_ROW = "ragged shards (66, 130 tokens per rank)"
CHANGING_ROW = "calls that change length (130, 66, 130 tokens per rank, one process)"


# ---- what the lengths are --------------------------------------------------------------------

def test_ragged_lengths_straddle_every_tile_and_their_chunks_are_ragged():
    for n in RAGGED_LENGTHS:
        assert all(n % t for t in TILES), n  # a multiple of no tile
        assert n > 64 and any(n > t for t in TILES)
        assert (n // 2) % 2 == 1  # each zig-zag chunk odd: ragged against every tile
    assert max(RAGGED_LENGTHS) > max(TILES)  # past the largest tile


def test_ragged_cases_run_long_short_long_with_every_distribution():
    target = Target()
    calls = ragged_cases(target)
    lengths = [c[0].spec.seq_len // target.world_size for c in calls]
    assert lengths == [130, 66, 130]
    assert calls[2] is calls[0]  # the first call again: its inputs, so its bits are known
    dists = {c.distribution for c in calls[0]}
    assert len(dists) == len(calls[0]) >= 8  # every distribution, one batch element each
    assert all(c.spec.batch == 1 for c in calls[0]) and len(calls[0]) >= 2


def test_ragged_lengths_a_layout_cannot_hold_are_left_out_and_said():
    fit, left_out = ragged_fit(Target(ragged_lengths=(66, 130), world_size=4, layout="zigzag"))
    assert fit == (66, 130) and not left_out
    with pytest.raises(ValueError, match="ragged length 1"):
        Target(ragged_lengths=(1,))


def test_sampled_rows_hold_every_ranks_ragged_tails():
    target = Target()
    for call in ragged_cases(target)[:2]:
        case = call[0]
        rows = set(ragged_rows_sampled(case, 16, case.seed).tolist())
        n = case.spec.seq_len // target.world_size
        for rank in range(target.world_size):
            held = positions(layout="zigzag", rank=rank, world_size=4, seq_len=case.spec.seq_len).tolist()
            tails = {n - 1, n // 2 - 1} | {n // t * t for t in TILES if t < n}
            assert {held[i] for i in tails} <= rows, (n, rank)
        assert case.spec.seq_len - 1 in rows  # the last row: it sees every key


# ---- validate: the ragged rows on the textbook ring and the length mutants -------------------------

SMALL = dict(world_size=2, seq_len=256, heads=2, kv_heads=1, head_dim=16, distributions=("normal", "wide"),
             local_lengths=(2,), sample_rows=8)


def _rows(impl: str, ring_processes, **changes):
    rows = validate(Target(impl=impl, **{**SMALL, **changes}), ring_processes, recompute=False)
    return {r.check: r for r in rows}


@pytest.mark.parametrize("mutant", ["tail_keys_forward", "tail_dkdv_backward", "tail_query_rows"])
def test_validate_fails_the_tail_mutants_at_the_ragged_shards_alone(mutant, ring_processes):
    rows = _rows(f"ringcheck.catalogue.length_mutants:{mutant}", ring_processes)
    failing = {name for name, r in rows.items() if not r.passed}
    assert RAGGED_ROW in failing, rows[RAGGED_ROW]
    assert all(name in (RAGGED_ROW, CHANGING_ROW, "no NaN/Inf") for name in failing), failing


def test_validate_passes_the_textbook_ring_and_fails_a_stale_workspace_by_its_length_change(ring_processes,
                                                                                           torchrun_world):
    good = _rows("ringcheck.catalogue.mutants:textbook", ring_processes)
    assert all(r.passed for r in good.values()), [r for r in good.values() if not r.passed]
    assert good[RAGGED_ROW].status == good[CHANGING_ROW].status == "pass"
    stale = _rows("ringcheck.catalogue.length_mutants:stale_workspace", ring_processes, distributions=("normal",))
    failing = {name for name, r in stale.items() if not r.passed}
    assert "call 2 of 3" in stale[CHANGING_ROW].detail, stale[CHANGING_ROW]
    # local rings: every other case ran at one length in its processes, so only the length change
    # (and the ragged rows' 66 after 130) shows it. Under torchrun one set of processes runs every
    # case: the determinism row's two runs come after the 130-token calls, and the second reads the
    # stale tail the first left, so the mutant's hidden state fails that row too (a true catch)
    expected = {RAGGED_ROW, CHANGING_ROW} | ({DETERMINISM_ROW} if torchrun_world is not None else set())
    assert failing == expected, failing


def test_ragged_lengths_none_says_not_run(ring_processes):
    rows = _rows("ringcheck.catalogue.mutants:textbook", ring_processes, ragged_lengths=(), distributions=("normal",))
    assert rows["ragged shards ( tokens per rank)"].status == "not run"


# ---- the property kit -------------------------------------------------------------------------

def _case(tokens, p=2, seed=0):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=tokens * p, head_dim=8, dtype="bfloat16", causal=True)
    return Case(spec, RingSpec(p, "zigzag"), seed=seed)


def test_changing_lengths_passes_the_simulated_ring_and_fails_a_ring_that_keeps_an_earlier_length():
    check_changing_lengths(_case(66), shorter=34)
    longest = {"n": 0}

    def remembers(case):  # a whole-tensor ring whose result depends on an earlier, longer call
        whole = simulated_impl(case)
        stale = case.spec.seq_len < longest["n"]
        longest["n"] = max(longest["n"], case.spec.seq_len)

        def run(q, k, v, **kw):
            out, lse = whole(q, k, v, **kw)
            return (out * 1.5, lse) if stale else (out, lse)
        return run

    with pytest.raises(AssertionError, match=r"call 2 of 3 \(34 tokens per rank, after a call at 66\)") as info:
        check_changing_lengths(_case(66), shorter=34, impl=remembers)
    assert "shorter=34" in str(info.value)  # the reproduce: line holds the lengths
    with pytest.raises(ValueError, match="shorter=66"):
        check_changing_lengths(_case(66), shorter=66)


@settings(max_examples=4, deadline=None, database=None)
@given(data=st.data())
def test_budget_at_ragged_shards_on_the_simulated_ring(data):
    case = data.draw(ragged_strategy(PROFILES["ci"].bounds), label="case")
    assert case.spec.seq_len // case.ring.world_size > 64
    check_budget(case)


@settings(max_examples=60, deadline=None, database=None)
@given(tokens=tile_tokens(65, 136))
def test_tile_tokens_stay_in_bounds(tokens):
    assert 65 <= tokens <= 136


def test_nightly_draws_lean_to_tiles_past_two_tiles():
    from ringcheck.testing.strategies import cases

    bounds = PROFILES["nightly"].bounds
    assert bounds.max_ragged_tokens > 2 * 64 and PROFILES["deep"].bounds.max_ragged_tokens > 2 * 128
    seen = []

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(case=cases(bounds, world_size=2, layouts=("contiguous",)))
    def draw(case):
        seen.append(case.spec.seq_len // 2)
    draw()
    assert max(seen) > bounds.max_tokens_per_rank
    assert any(abs(n - t) <= 3 and n % t for n in seen for t in TILES if n > t), sorted(set(seen))
    assert find(tile_tokens(1, bounds.max_ragged_tokens), lambda n: n > 2 * 64 and n % 2 == 1) > 128


# ---- a document alone stays in the declared layout (issue 43, item 6) ---------------------------

def _zigzag_only(case):
    """A correct ring that runs only the zig-zag layout it was declared with (no layout keyword)."""
    n, p = case.spec.seq_len, case.ring.world_size
    if case.ring.layout != "zigzag" or n % (2 * p):
        raise ValueError(f"this ring runs zigzag only: handed {case.ring.layout} with {n} tokens on {p} ranks")
    return simulated_impl(case)


@pytest.mark.parametrize("cu, p", [((0, 0, 1, 2), 1), ((0, 3, 5, 8), 2), ((0, 1, 4), 1)])
def test_documents_alone_stay_in_a_zigzag_only_rings_layout(cu, p):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=cu[-1], head_dim=8, dtype="bfloat16", causal=True,
                         variant=Variant(cu_seqlens=cu))
    case = Case(spec, RingSpec(p, "zigzag"), seed=3)
    check_documents_are_separate(case, impl=_zigzag_only)
    sub = document_case(case, 1)
    assert (sub.ring.layout, sub.ring.world_size) == ("zigzag", p)
    assert sub.spec.seq_len == 2 * p and sub.spec.variant.cu_seqlens == (0, 1)  # padded, the padding marked


def test_ragged_lengths_flag_and_the_rerun_command(tmp_path):
    from ringcheck.cli import rerun_command
    from ringcheck.cli.validate import ragged_lengths_flag, read_config

    assert ragged_lengths_flag("none") == () and ragged_lengths_flag("66,130") == (66, 130)
    assert "--ragged-lengths 130,66" in rerun_command(Target(), 60.0)
    assert "--ragged-lengths none" in rerun_command(Target(ragged_lengths=()), 60.0)
    config = tmp_path / "target.toml"
    config.write_text("ragged_lengths = []\n")
    assert Target.from_mapping(read_config(str(config))).ragged_lengths == ()


@pytest.mark.slow
def test_the_ragged_rows_hold_every_variant_on_the_textbook_varlen_ring(ring_processes):
    """Documents (zigzag_docs, padding), a window, softcap, sinks and a value head dim of its own
    at the ragged shards: the correct ring passes both rows (each distribution a call of its own
    with sinks)."""
    target = Target(impl="ringcheck.catalogue.variant_textbook:textbook_varlen", seq_len=128, world_size=2,
                    layout="zigzag_docs", documents="random:4", pad=16, window=(24, 0), softcap=20.0, sinks=True,
                    head_dim_v=16, head_dim=16, heads=2, kv_heads=1, local_lengths=(4,), distributions=("normal",),
                    sample_rows=4)
    rows = {r.check: r for r in validate(target, ring_processes, recompute=False)}
    assert rows[RAGGED_ROW].status == rows[CHANGING_ROW].status == "pass", (rows[RAGGED_ROW], rows[CHANGING_ROW])
    assert "dsinks" in rows[RAGGED_ROW].tensors
