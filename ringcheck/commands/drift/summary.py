"""The summary of a drift document (`summarise`): per accumulation the groups flagged, judged
and too weak to judge, per setting the flags of the ring under test against the control, the
verdict on the ring under test ("pass", "flagged" or "no verdict") and, where groups were too
weak to judge, the ring sizes and seeds that would judge them (`ringcheck.commands.drift`
builds the document; `ringcheck.render.drift_content` words it). Plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import CONFIDENCE, FIT_MIN_P, FLAGS, MIN_FIT_SAMPLES, MIN_FIT_SIZES

# "float32" is the ring under test (the default merge of our simulated ring; its control,
# "input", rounds the running output to the input dtype at every hop)
UNDER_TEST = "float32"
# the accumulation label of an --impl: it has no switch, it runs as it is built (and is under test)
AS_IMPLEMENTED = "impl"


def fit_seeds(fitted: int, seeds: int) -> int:
    """The seed count for MIN_FIT_SAMPLES points per slope fit over `fitted` ring sizes P >=
    FIT_MIN_P, at least `seeds`; `seeds` where fewer than MIN_FIT_SIZES ring sizes fit no slope
    (`ringcheck.commands.drift.seeds_for_fit`)."""
    if fitted < MIN_FIT_SIZES:  # no seed count makes a fit of these ring sizes: the report says so
        return seeds
    return max(seeds, -(-MIN_FIT_SAMPLES // fitted))


def summarise(fits: dict[str, dict], *, ring_sizes: Sequence[int] = (), seeds: int = 1) -> dict:
    """Per accumulation: how many groups, how many flagged, by which flag, how many judged
    and how many too weak to judge (`judgement`); per (backend, mode, dtype, distribution):
    the flagged tensors per accumulation, whether the flags separate the ring under test from
    the control, and the slope and projected budget crossing of `out` per accumulation (where
    the flags do not separate the two, the slopes may). Then the verdict on the ring under
    test (`verdict`) and, where a group was too weak to judge, what would judge it
    (`to_judge`, from the sweep's `ring_sizes` and `seeds`)."""
    by_acc: dict[str, dict] = {}
    for fit in fits.values():
        s = by_acc.setdefault(fit["accumulation"], {
            "groups": 0, "flagged": 0, "flags": {k: 0 for k in FLAGS}, "max_slope": None,
            "judged": 0, "too_weak": 0, "per_head": 0})
        s["groups"] += 1
        s["flagged"] += bool(fit["flags"])
        judged = judgement(fit)
        s["judged"] += judged != TOO_WEAK
        s["too_weak"] += judged == TOO_WEAK
        s["per_head"] += judged == PER_HEAD
        for f in fit["flags"]:
            s["flags"][f] += 1
        if fit["slope"] is not None and (s["max_slope"] is None or fit["slope"] > s["max_slope"]):
            s["max_slope"] = fit["slope"]
    settings: dict[str, dict] = {}
    for fit in fits.values():
        name = "/".join((fit["backend"], fit["mode"], fit["dtype"], fit["distribution"]))
        row = settings.setdefault(name, {"backend": fit["backend"], "mode": fit["mode"], "dtype": fit["dtype"],
                                         "distribution": fit["distribution"], "flagged": {}, "out_slope": {},
                                         "out_projected_budget_P": {}})
        flagged = row["flagged"].setdefault(fit["accumulation"], [])
        if fit["flags"]:
            flagged.append(fit["tensor"])
        if fit["tensor"] == "out":
            row["out_slope"][fit["accumulation"]] = fit["slope"]
            row["out_projected_budget_P"][fit["accumulation"]] = fit["projected_budget_P"]
    under_test = AS_IMPLEMENTED if AS_IMPLEMENTED in by_acc else UNDER_TEST
    for row in settings.values():
        under = row["flagged"].get(under_test)
        control = row["flagged"].get("input")
        # for float32 inputs the round trip goes through float32 itself: no contrast to find
        row["separated"] = (None if under is None or control is None or row["dtype"] == "float32"
                            else (not under) and bool(control))
    under = by_acc.get(under_test)
    verdict = _verdict(under)
    return {
        "under_test": under_test,
        "accumulations": by_acc,
        "settings": settings,
        "verdict": verdict,
        "passed": verdict == "pass",
        "to_judge": _to_judge(under, ring_sizes, seeds) if verdict != "flagged" else None,
    }


# how a group's fit was judged (`judgement`)
TOO_WEAK = "too weak to judge"  # no flag, and its slope's evidence decides nothing
PER_HEAD = "per head"  # no flag on its only rules, budget and non-finite values (`PER_HEAD_RULE`)


def judgement(fit: dict) -> str:
    """"flagged", "within" (its slope decided under the threshold, no flag), `PER_HEAD` or
    `TOO_WEAK`: a group flagged on any rule is judged whatever its slope (a budget flag needs no
    fit); an unflagged one is judged only where its slope was decided."""
    if fit["flags"]:
        return "flagged"
    if fit["slope_judgement"] == "too weak to judge":
        return TOO_WEAK
    return "within" if fit["slope_judgement"] == "within" else PER_HEAD


def _verdict(under: dict | None) -> str:
    """"flagged" (any group of the ring under test is), "pass" (none is, and the slope of at
    least one was decided), or "no verdict" (none was: every group too weak to judge, or judged
    on a per-head budget alone; or no ring under test ran): DESIGN's rule 7, no PASS without
    evidence."""
    if under is None:
        return "no verdict"
    if under["flagged"]:
        return "flagged"
    return "pass" if under["judged"] > under["per_head"] else "no verdict"


def _to_judge(under: dict | None, ring_sizes: Sequence[int], seeds: int) -> dict | None:
    """What would judge the groups that were too weak to judge: {"why", "flags" (the command
    line's), "ring_sizes", "seeds"}; None when every group was judged. Too few ring sizes P >=
    FIT_MIN_P for a fit: powers of two beyond the largest, up to MIN_FIT_SIZES of them, and the
    seed count that gives MIN_FIT_SAMPLES points (the command raises --seeds to it by itself);
    enough of them (the bounds straddle the threshold): one more ring size and twice the seeds."""
    if under is None:
        return {"why": "the sweep ran no ring under test, only the control (--accumulate input)",
                "flags": f"--accumulate {UNDER_TEST},input"}
    if not under["too_weak"] and under["judged"] > under["per_head"]:
        return None
    sizes = sorted(ring_sizes)
    fitted = [p for p in sizes if p >= FIT_MIN_P]
    if len(fitted) < MIN_FIT_SIZES:
        why = (f"a slope fit needs {MIN_FIT_SIZES} ring sizes P >= {FIT_MIN_P}, and this sweep has "
               f"{len(fitted)} ({', '.join(map(str, fitted)) or 'none'})")
    else:
        why = (f"the slopes' {CONFIDENCE:.0%} bounds straddle their thresholds with {len(fitted)} ring sizes "
               f"P >= {FIT_MIN_P} and {seeds} seed{'' if seeds == 1 else 's'}")
    more = list(sizes)
    for _ in range(max(MIN_FIT_SIZES - len(fitted), 1)):
        more.append(2 * more[-1])
    need = fit_seeds(sum(1 for p in more if p >= FIT_MIN_P), 2 * seeds if len(fitted) >= MIN_FIT_SIZES else seeds)
    return {"why": why, "flags": f"--ring-sizes {','.join(map(str, more))} --seeds {need}",
            "ring_sizes": more, "seeds": need}
