"""`ringcheck step --model` at any ring size (issue 48): the regime cases put each rank's shard on
both sides of the model's window and chunk whatever P is, and pack documents on the shards.

A glue that keeps the window only where the shard is longer than it (transformers' flash path
testing a shard's key length) passed every default case at P=2 and 4 before these cases; now it
fails at both, and the diagnosis names it from the cases whose shard is longer passing. A glue
that drops the window everywhere is still named so; the correct glue passes.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from ringcheck.models.regimes import (
    REGIME_CASES,
    reach_of,
    regime_case,
    regime_reading,
    regime_shards,
    shape_words,
    shard_documents,
)
from ringcheck.models.step import MODEL_CASES
from ringcheck.ring.layouts import positions


def _tiny(window=12, chunk=None, seq_len=64):
    layers = (SimpleNamespace(window=window, chunk=None), SimpleNamespace(window=None, chunk=chunk))
    return SimpleNamespace(layers=layers, seq_len=seq_len)


RINGS = [(p, layout) for p in (2, 3, 4, 8, 16) for layout in ("contiguous", "zigzag")]


def test_the_regime_cases_are_default_cases():
    assert set(REGIME_CASES) <= set(MODEL_CASES)


@pytest.mark.parametrize("world_size, layout", RINGS)
@pytest.mark.parametrize("window", [12, 5, 7])
def test_every_ring_gets_a_shard_shorter_equal_and_longer_than_the_window(world_size, layout, window):
    tiny = _tiny(window)
    sides = {}
    for name in REGIME_CASES:
        case = regime_case(name, tiny, world_size, layout)
        shape = shape_words(case, tiny, world_size, layout)
        held = positions(layout=layout, rank=0, world_size=world_size, seq_len=case.seq_len)
        assert shape["shard"] == len(held) == case.seq_len // world_size, (name, shape)  # no padding moved it
        assert case.seq_len > window, (name, case.seq_len)  # the window bites in the sequence
        sides[name] = shape["sides"][f"window {window}"]
    even = layout == "zigzag" and window % 2  # zigzag holds two pieces per rank: its shard is even
    assert sides == {"shard_shorter_than_window": "shorter",
                     "shard_equal_to_window": "longer" if even else "equal",
                     "shard_longer_than_window": "longer"}


def test_the_smallest_window_or_chunk_sets_the_regime():
    assert reach_of(_tiny(12, 10)) == 10
    assert reach_of(_tiny(None, None)) == 12  # no window: the tiny models' scaled one, the same cases everywhere
    assert regime_shards(12, 4, "zigzag") == {"shard_shorter_than_window": 10, "shard_equal_to_window": 12,
                                             "shard_longer_than_window": 16}


@pytest.mark.parametrize("world_size, layout", RINGS)
def test_documents_shorter_than_a_shard_across_three_and_on_a_boundary(world_size, layout):
    case = regime_case("shard_longer_than_window", _tiny(), world_size, layout)
    docs = shard_documents(case.seq_len, world_size, layout)
    assert case.packed and case.documents == docs and case.micro == len(docs)
    pieces = world_size * (2 if layout == "zigzag" else 1)
    u = case.seq_len // pieces
    spans = [(a, b) for cu in docs for a, b in zip(cu, cu[1:])]
    assert all(cu[0] == 0 and cu[-1] == case.seq_len for cu in docs)
    assert any(b - a < u for a, b in spans), spans                               # shorter than a shard
    assert any(a > 0 and a % u == 0 for a, b in spans), spans                   # starts on a shard boundary
    crossed = max(len({x // u for x in range(a, b)}) for a, b in spans)
    assert crossed >= min(3, pieces), (spans, u)                                # across three shards (or all)


def _row(case, verdict, shard, loss=None, docs=None, seq_len=64):
    d = None if loss is None else {"matched": True, "loss": loss[0], "words": "w", "what": "your logits",
                                   "distance": "logits to 0", "readings": [{"losses": [x], "words": x} for x in loss]}
    return {"case": case, "verdict": verdict, "diagnosis": d,
            "shape": {"shard": shard, "seq_len": seq_len, "documents": docs}}


def test_a_window_lost_only_on_short_shards_is_named_from_the_long_ones_passing():
    both = ("window_dropped", "window_dropped_short_shard")
    rows = [_row("one_sequence", "pass", 16), _row("shard_shorter_than_window", "fail", 10, both),
            _row("shard_equal_to_window", "fail", 12, both)]
    regime_reading(rows, _tiny())
    for r in rows[1:]:
        assert r["diagnosis"]["loss"] == "window_dropped_short_shard"
        assert "keep it (1 pass" in r["diagnosis"]["words"]
        assert "lost only where the shard is not longer than it" in r["diagnosis"]["words"]


def test_a_long_shard_failing_on_a_window_one_token_too_wide_still_shows_the_window_kept():
    """ring-flash-attn's adapter: (W, W) where the shard is longer than W, no window where it is not."""
    both = ("window_dropped", "window_dropped_short_shard")
    rows = [_row("one_sequence", "fail", 16, ("window_wider",)), _row("shard_equal_to_window", "fail", 12, both)]
    regime_reading(rows, _tiny())
    assert rows[0]["diagnosis"]["loss"] == "window_wider"
    assert rows[1]["diagnosis"]["loss"] == "window_dropped_short_shard"
    assert "1 fail on another loss: window_wider" in rows[1]["diagnosis"]["words"]


@pytest.mark.parametrize("rows", [
    # the long shard failed too: the window is lost everywhere
    [_row("one_sequence", "fail", 16, ("window_dropped",)), _row("shard_equal_to_window", "fail", 12,
                                                                  ("window_dropped", "window_dropped_short_shard"))],
    # the only long shard passing holds documents no longer than the window: it could not show the window kept
    [_row("packed", "pass", 16, docs=[[4, 12]]), _row("shard_equal_to_window", "fail", 12,
                                                      ("window_dropped", "window_dropped_short_shard"))],
])
def test_no_shard_short_name_without_a_long_shard_that_kept_the_window(rows):
    regime_reading(rows, _tiny())
    assert rows[-1]["diagnosis"]["loss"] == "window_dropped"


# --- end to end: the mutants at the default P's ----------------------------------------------

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _judged(ring_processes, model, glue, world_size):
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.models.step import ModelStepConfig

    return run_model_step(ModelStepConfig(model=model, glue=glue, world_size=world_size, cases=REGIME_CASES),
                          ring_processes)


@needs_transformers
# each mutant at P=2 in make test; mistral's again at P=4 carries the marker thorough (make test-thorough, CI)
@pytest.mark.parametrize("model, mutant, world_size", [("mistral", "window_dropped_short_shard", 2),
                                                       pytest.param("mistral", "window_dropped_short_shard", 4,
                                                                    marks=pytest.mark.thorough),
                                                       ("llama4_text", "chunk_dropped_short_shard", 2)])
def test_a_glue_right_only_on_long_shards_fails_at_small_rings_naming_it(ring_processes, model, mutant, world_size):
    judged = _judged(ring_processes, model, f"ringcheck.catalogue.glue_mutants:{mutant}", world_size)
    verdicts = {r["case"]: r["verdict"] for r in judged["cases"]}
    assert verdicts == {"shard_shorter_than_window": "fail", "shard_equal_to_window": "fail",
                        "shard_longer_than_window": "pass"}, judged["why"]
    for row in judged["cases"][:2]:
        assert row["logits"]["error"] > 1e4 * row["logits"]["budget"], row["logits"]
        assert row["diagnosis"]["loss"] == mutant, row["diagnosis"]
    assert "where the shard is not longer than the" in judged["why"]


@needs_transformers
def test_a_glue_that_drops_the_window_everywhere_is_not_called_shard_short(ring_processes):
    judged = _judged(ring_processes, "mistral", "ringcheck.catalogue.glue_mutants:window_dropped", 2)
    assert {r["verdict"] for r in judged["cases"]} == {"fail"}, judged["why"]
    assert {r["diagnosis"]["loss"] for r in judged["cases"]} == {"window_dropped"}


@needs_transformers
def test_the_correct_glue_passes_the_regime_cases(ring_processes):
    judged = _judged(ring_processes, "mistral", "ringcheck", 4)
    assert judged["verdict"] == "pass", judged["why"]
    assert [r["shape"]["shard"] for r in judged["cases"]] == [11, 12, 16]
