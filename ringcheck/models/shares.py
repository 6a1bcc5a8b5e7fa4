"""The truth and the diagnoses of `ringcheck step --model`, shared among the ranks.

Both are per case and independent of one another: the truth of a case (`reference_task`) needs
only the configuration, a diagnosis (`diagnosis_task`) only its own case's figures. Run on one
rank, they kept one core busy while the others waited (on 2 cores at P=4, half a zoo row's time).
Here each runs on up to `ranks` ranks at once, one share of the cases per rank (round robin, in
the cases' order), and the shares' results come back as one: the same figures, computed by the
same code with the same seed and one intra-op thread, on whichever rank.
"""

from __future__ import annotations

from typing import Any

from ..launch import GroupPlan
from .step import diagnosis_task, error_words, reference_task, tiny_of


def shares_of(items: list | tuple, ranks: int) -> tuple[tuple, ...]:
    """`items` dealt round robin into at most `ranks` non-empty shares (none for no items)."""
    count = max(1, min(len(items), int(ranks)))
    return tuple(tuple(items[i::count]) for i in range(count) if items[i::count])


def placed_shares(items: list | tuple, places: list[int], ranks: int) -> tuple[tuple[int, ...], tuple[tuple, ...]]:
    """`items` dealt by their `places` (each one's index, e.g. its case's among the run's cases)
    modulo `ranks`: an item goes to the same rank whichever others are dealt with it (the
    diagnoser a rank kept for a case, `semantics.diagnose`'s key, serves the next glue's same
    case). (The ranks that have a share, their shares), the empty ones left out."""
    count = max(1, int(ranks))
    dealt = [tuple(x for x, p in zip(items, places) if p % count == r) for r in range(count)]
    held = tuple(r for r in range(count) if dealt[r])
    return held, tuple(dealt[r] for r in held)


def shares_plan(first: int, shares: tuple, label: str, held: tuple[int, ...] | None = None) -> GroupPlan:
    """One group of one rank per share, from global rank `first` on (`held`: each share's rank,
    counted from `first`; default the first ranks in turn)."""
    held = tuple(range(len(shares))) if held is None else held
    return GroupPlan(tuple((first + i,) for i in held), label=f"{label}, on {len(shares)} "
                                                              f"rank{'s' if len(shares) > 1 else ''}")


def reference_shares_task(member, config, shares: tuple[tuple[str, ...], ...], dp: int, layout: str,
                          narrow: str | None = None, only_narrow: bool = False,
                          known: tuple[dict, ...] | None = None) -> dict[str, Any]:
    """`reference_task` on this rank's share of the cases (`member.group_index`; `known`: per
    share, what runs of the same cases found, as `reference_task` takes it)."""
    i = member.group_index
    return reference_task(member, config, shares[i], dp, layout, narrow, only_narrow, None if known is None else known[i])


def merged_truth(results: list[list[dict]], names: tuple[str, ...]) -> dict[str, Any]:
    """The shares' truths as one: every case and every error, in the order of `names` (as one rank
    would have made them); the model's own float32 steps as the share that counted them found them
    (0 where none ran on float64)."""
    out: dict[str, Any] = {"cases": {}, "errors": {}, "float32_steps": 0}
    for group in results:
        share = group[0]
        out["cases"].update(share["cases"])
        out["errors"].update(share["errors"])
        out["float32_steps"] = max(out["float32_steps"], share.get("float32_steps", 0) or 0)
    for key in ("cases", "errors"):
        out[key] = {n: out[key][n] for n in names if n in out[key]}
    return out


def diagnoses_task(member, config, shares: tuple[tuple[tuple, ...], ...], dp: int) -> dict[str, dict]:
    """`diagnosis_task` for each (case, logits, grads, tolerance) of this rank's share; a diagnosis
    that raises says so in its words (the case's verdict stands without it). The share's cases
    build the model once (`reused_builds`: each a pristine copy)."""
    from .tiny import reused_builds  # start-up time: only a --model run imports the tiny models

    out, tiny = {}, None
    with reused_builds():
        for name, logits, grads, tolerance in shares[member.group_index]:
            try:
                tiny = tiny_of(config) if tiny is None else tiny
                out[name] = diagnosis_task(member, config, name, dp, logits, grads, tolerance, tiny=tiny)
            except Exception as exc:
                out[name] = {"matched": False, "words": f"the diagnosis could not run: {error_words(exc)}"}
    return out
