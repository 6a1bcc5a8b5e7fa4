"""`ringcheck.models.shares`: the truth and the diagnoses of `step --model` dealt among the ranks
and put back together as one rank would have made them."""

from __future__ import annotations

from ringcheck.launch import GroupPlan
from ringcheck.models.shares import merged_truth, placed_shares, shares_of, shares_plan


def test_the_cases_are_dealt_round_robin_into_at_most_ranks_non_empty_shares():
    names = ("a", "b", "c", "d", "e")
    assert shares_of(names, 2) == (("a", "c", "e"), ("b", "d"))
    assert shares_of(names, 4) == (("a", "e"), ("b",), ("c",), ("d",))
    assert shares_of(names[:2], 8) == (("a",), ("b",))     # never an empty share, never more than the items
    assert shares_of(names, 1) == (names,)
    assert shares_of((), 4) == ()
    assert sorted(n for share in shares_of(names, 3) for n in share) == list(names)


def test_one_rank_per_share_from_the_first_rank():
    plan = shares_plan(4, (("a",), ("b",), ("c",)), "the truth")
    assert plan == GroupPlan(((4,), (5,), (6,)), label="the truth, on 3 ranks")
    assert shares_plan(0, (("a", "b"),), "diagnosis").label == "diagnosis, on 1 rank"


def test_the_shares_truths_merge_in_the_cases_order_with_every_error_and_the_float32_steps():
    ranks = [[{"cases": {"c": 3, "a": 1}, "errors": {}, "float32_steps": 0}],
             [{"cases": {"b": 2}, "errors": {"d": "ValueError: no"}, "float32_steps": 2}]]
    merged = merged_truth(ranks, ("a", "b", "c", "d"))
    assert list(merged["cases"]) == ["a", "b", "c"] and merged["cases"] == {"a": 1, "b": 2, "c": 3}
    assert merged["errors"] == {"d": "ValueError: no"}
    assert merged["float32_steps"] == 2


def test_an_item_placed_goes_to_the_same_rank_whichever_others_are_dealt_with_it():
    """The diagnoses: a case to the rank of its place modulo the ranks (a rank's kept diagnoser
    serves the next glue's same case), the ranks with nothing left out of the plan."""
    assert placed_shares(("a", "b", "c", "d", "e"), [0, 1, 2, 3, 4], 4) == ((0, 1, 2, 3), (("a", "e"), ("b",), ("c",), ("d",)))
    assert placed_shares(("c", "e"), [2, 4], 4) == ((0, 2), (("e",), ("c",)))
    assert placed_shares((), [], 4) == ((), ())
    plan = shares_plan(4, (("e",), ("c",)), "diagnosis", (0, 2))
    assert plan == GroupPlan(((4,), (6,)), label="diagnosis, on 2 ranks")
