"""The ring as training wraps it: validate's recompute row (two layers under
`torch.utils.checkpoint`, use_reentrant False and True, against the same two layers without)
and compile row (`torch.compile` against eager), the catalogue's rings for them
(`ringcheck.catalogue.wrapped_mutants`), and the harness calls under them.

Cheap here (a ring of 2, one small case); the proof over ring sizes 2, 4, 8, every ring that
runs on the CPU and five runs under load is `python -m benchmarks.wrapped` (reports/wrapped/).
"""

from __future__ import annotations

from html import escape

import pytest
from rich.console import Console

from ringcheck.commands.validate import Target, report_dict, validate
from ringcheck.commands.validate.wrapped import COMPILE_ROW, RECOMPUTE_ROW
from ringcheck.documents import VALIDATE_SCHEMA, dumps, loads
from ringcheck.render.html import validate_html
from ringcheck.render.markdown import validate_markdown
from ringcheck.render.terminal import print_check_rows

WRAPPED = "ringcheck.catalogue.wrapped_mutants"
SMALL = dict(seq_len=64, heads=4, kv_heads=2, head_dim=32, dtype="bfloat16", causal=True, layout="zigzag",
             world_size=2, local_lengths=(2,), sample_rows=4, distributions=("normal",),
             ragged_lengths=())  # the ragged rows: suites/test_lengths.py


def _rows(ring_processes, **changes):
    return {r.check: r for r in validate(Target(**{**SMALL, **changes}), ring_processes)}


def _failed(rows):
    return {check: r for check, r in rows.items() if r.status == "fail"}


@pytest.mark.parametrize("impl", ["ringcheck", "ringcheck.catalogue.mutants:textbook"])
def test_correct_rings_give_the_same_bits_under_checkpointing(ring_processes, impl):
    rows = _rows(ring_processes, impl=impl)
    assert not _failed(rows), [r.detail for r in _failed(rows).values()]
    row = rows[RECOMPUTE_ROW]
    assert row.status == "pass" and "the same bits as without checkpointing" in row.detail
    assert row.figures["comparison"] == "bits" and row.figures["deterministic"]
    assert all(not m["differ"] and m["raised"] is None for m in row.figures["modes"].values())
    assert rows[COMPILE_ROW].status == "info" and "pass --compile" in rows[COMPILE_ROW].detail


def test_a_ring_whose_backward_reads_a_slot_the_recompute_overwrote_fails_the_recompute_row_only(ring_processes):
    rows = _rows(ring_processes, impl=f"{WRAPPED}:recompute_slot")
    assert list(_failed(rows)) == [RECOMPUTE_ROW], list(_failed(rows))
    row = rows[RECOMPUTE_ROW]
    modes = row.figures["modes"]
    assert list(modes["use_reentrant=False"]["differ"]) == ["layer 1 dq, dk, dv"], modes
    assert not modes["use_reentrant=True"]["differ"]  # the recompute runs just before its own backward there
    for words in ("use_reentrant=False: layer 1 dq, dk, dv (every CP group) differ", "over the budget",
                  "the backward's recompute overwrote it"):
        assert words in row.detail, row.detail
    assert set(row.failing_ranks) == {0, 1}
    # every output says it: the terminal, the JSON document (with the figures), Markdown and HTML
    console = Console(width=200, record=True)
    print_check_rows(list(rows.values()), False, console)
    said = "use_reentrant=False: layer 1 dq, dk, dv (every CP group) differ from the run without checkpointing"
    assert f"FAIL {RECOMPUTE_ROW}: {said}" in console.export_text().replace("\n", " ")
    doc = loads(dumps(report_dict(Target(**SMALL), list(rows.values()))), schema=VALIDATE_SCHEMA)
    check = next(c for c in doc["checks"] if c["check"] == RECOMPUTE_ROW)
    assert check["status"] == "fail" and check["figures"]["modes"]["use_reentrant=False"]["differ"] == {
        "layer 1 dq, dk, dv": [0, 1]}
    assert said in validate_markdown(doc) and escape(said) in validate_html(doc, plot=False)


def test_a_ring_that_is_not_deterministic_is_judged_by_the_budget_rule_not_by_its_bits(ring_processes):
    """No crying wolf: its bits differ from run to run, so the recompute row cannot ask for the same
    bits; the determinism row says what it is (FLAG: reported, not failed)."""
    rows = _rows(ring_processes, impl=f"{WRAPPED}:textbook_nondeterministic", dtype="float32")
    assert not _failed(rows), list(_failed(rows))
    assert rows["determinism (two runs, same bits)"].status == "flag"
    row = rows[RECOMPUTE_ROW]
    assert row.status == "pass" and row.figures["comparison"] == "budget rule", row.detail
    assert "not deterministic" in row.detail and "within the budget" in row.detail
    assert any(m["differ"] for m in row.figures["modes"].values())  # its bits did differ


def test_a_state_bug_that_a_plain_second_call_also_shows_is_named_in_both_rows(ring_processes):
    """workspace_state keeps what its backward needs in one module-level slot: two plain calls
    before a backward fail, and under use_reentrant=True (which recomputes each call just before
    its backward) it is right, so the recompute row says the plain run is the one over budget."""
    rows = _rows(ring_processes, impl="ringcheck.catalogue.embedded_mutants:workspace_state")
    assert {"two calls before backward", RECOMPUTE_ROW} <= set(_failed(rows))
    assert "the run without checkpointing is itself over budget" in rows[RECOMPUTE_ROW].detail


def test_forward_only_rings_have_nothing_to_recompute(ring_processes):
    rows = _rows(ring_processes, forward_only=True)
    assert rows[RECOMPUTE_ROW].status == "not run" and "--forward-only" in rows[RECOMPUTE_ROW].detail


@pytest.mark.slow
def test_the_compile_row_passes_the_textbook_ring_and_fails_a_compile_only_branch(request, ring_processes):
    """dynamo takes seconds per rank (about 10 s of this test on 2 cores): run with -m slow;
    benchmarks.wrapped runs the compile row on every ring."""
    chosen = request.config.getoption("markexpr")
    if "slow" not in chosen or "not slow" in chosen:
        pytest.skip("slow (torch.compile on every rank): select with -m slow")
    good = _rows(ring_processes, impl="ringcheck.catalogue.mutants:textbook", compile=True)[COMPILE_ROW]
    assert good.status == "pass" and good.figures["comparison"] == "bits", good.detail
    assert good.figures["graph_breaks"][0] > 0 and not good.figures["fullgraph"]
    assert "P2P compilation disabled" in " ".join(good.figures["reasons"])
    rows = _rows(ring_processes, impl=f"{WRAPPED}:compile_path_mask", compile=True)
    assert list(_failed(rows)) == [COMPILE_ROW]
    assert "differ from eager, where aot_eager runs the same kernels" in rows[COMPILE_ROW].detail
