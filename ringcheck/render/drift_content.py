"""What a drift report says, in every format: the readings of a drift document (lookups by
setting, the verdict lines, the worst cases, the separation table) and `blocks`, the report
as a list of content blocks that `ringcheck.render.markdown` and `ringcheck.render.html` both
render, so the Markdown and the HTML say the same things (the HTML adds the plots,
`ringcheck.render.terminal` prints a summary from the same readings). Plain Python: no rich,
no matplotlib.
"""

from __future__ import annotations

import math

ACC_LABEL = {"float32": "float32 merge (default)", "input": "per-hop round trip (control)",
             "impl": "as implemented"}
ACC_NAME = {"float32": "float32 merge, the default", "input": "per-hop round trip in the input dtype",
            "impl": "as implemented"}
ACC_SHORT = {"float32": "f32 merge", "input": "round trip", "impl": "impl"}


def _e(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def _f(x, digits: int = 2, sign: bool = False) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _slope(fit: dict) -> str:
    if fit["slope"] is None:
        return "n/a"
    se = f" ± {fit['slope_stderr']:.2f}" if fit["slope_stderr"] is not None else ""
    return f"{fit['slope']:+.2f}{se}"


def _bounds(fit: dict) -> str:
    """The slope's confidence bounds against its threshold, and what they decide."""
    judgement = fit.get("slope_judgement")
    if judgement is None:  # a document from before the bounds
        return "n/a"
    if fit.get("slope_lower") is None:
        return judgement
    return (f"[{fit['slope_lower']:+.2f}, {fit['slope_upper']:+.2f}] vs {fit['slope_threshold']:.2f}: "
            f"{judgement}")


def _projected(x) -> str:
    if x is None:
        return "never"
    if math.isinf(x) or x > 1e6:
        return "> 1e6"
    return f"~{x:,.0f}"


def unit_roundoff(dtype: str) -> float:
    """u of a dtype named in the document (`judge.metrics.unit_roundoff` takes a torch dtype)."""
    return {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]


def _settings(doc: dict) -> list[tuple[str, str, str, str]]:
    """(backend, mode, dtype, distribution) in sweep order."""
    spec = doc["spec"]
    return [(b, m, d, dist) for b in spec["backends"] for m in spec["modes"] for d in spec["dtypes"]
            for dist in spec["distributions"]]


def accumulations(doc: dict) -> list[str]:
    """The accumulations the document measured, in the spec's order."""
    return [a for a in doc["spec"]["accumulations"] if a in doc["summary"]["accumulations"]]


def fit_of(doc, backend, mode, dtype, dist, acc, tensor):
    """The fit of one group, or None."""
    return doc["fits"].get("/".join((doc["implementation"], backend, mode, dtype, dist, f"acc={acc}", tensor)))


def case_of(doc, backend, mode, dtype, dist, acc, p):
    """The case of one setting at ring size p, or None."""
    return doc["cases"].get("/".join((doc["implementation"], backend, mode, dtype, dist, f"acc={acc}", f"P={p}")))


def ring_sizes(doc: dict) -> list[int]:
    return sorted({c["P"] for c in doc["cases"].values()})


def tensor_names(doc: dict) -> list[str]:
    first = next(iter(doc["cases"].values()))
    return list(first["tensors"])


def verdict(doc: dict) -> str:
    """The verdict on the ring under test: "pass", "flagged" or "no verdict" (a document from
    before the summary said so: "pass" or "flagged" from `passed`)."""
    s = doc["summary"]
    return s.get("verdict") or ("pass" if s["passed"] else "flagged")


def _to_judge_words(summary: dict) -> str:
    """What would judge the groups too weak to judge, with the flags to run again with."""
    to_judge = summary.get("to_judge")
    if not to_judge:  # a document from before the summary said so
        return "raise --seeds or add ring sizes to decide"
    return f"{to_judge['why']}; to decide, run again with `{to_judge['flags']}`"


def headline(doc: dict) -> tuple[str, str]:
    """(style, text) of the verdict on the ring under test: PASS with the groups judged and
    those too weak to judge, FLAGGED with the flagged groups, or NO VERDICT (style "warn") with
    what would judge it."""
    s = doc["summary"]
    what = ACC_NAME.get(s["under_test"], s["under_test"])
    a = s["accumulations"].get(s["under_test"])
    if a is None:
        return "warn", f"NO VERDICT: no ring under test ({what}) ran; {_to_judge_words(s)}"
    flags = ", ".join(f"{k}: {v}" for k, v in a["flags"].items() if v) or "none"
    slope = "n/a" if a["max_slope"] is None else f"{a['max_slope']:+.2f}"
    groups = "(mode x dtype x distribution x tensor)"
    found = verdict(doc)
    if found == "flagged":
        flagged = [f for f in doc["fits"].values() if f["accumulation"] == s["under_test"] and f["flags"]]
        named = "; ".join(_flagged_group(f) for f in flagged[:6]) + ("; ..." if len(flagged) > 6 else "")
        return "bad", (f"FLAGGED: the ring under test ({what}) is flagged in {a['flagged']} of {a['groups']} "
                       f"groups ({flags}); largest slope {slope}: {named}")
    if found == "no verdict":
        per_head = (f"; the {a['per_head']} with one value per head (dsinks) are judged on their budget alone, "
                    "which says nothing of the growth with ring size" if a.get("per_head") else "")
        return "warn", (f"NO VERDICT: the ring under test ({what}) raises no flag, but none of its {a['groups']} "
                        f"groups {groups} could be judged: {a['too_weak']} too weak to judge{per_head}; "
                        f"{_to_judge_words(s)}")
    judged = a.get("judged", a["groups"] - a.get("too_weak", 0))  # (a document from before it counted them)
    weak = f"; {a['too_weak']} too weak to judge" if a.get("too_weak") else ""
    return "good", (f"PASS: the ring under test ({what}) raises no flag in {judged} judged "
                    f"group{'' if judged == 1 else 's'} {groups}"
                    f"{weak}; largest slope {slope}")


def verdict_lines(doc: dict) -> list[tuple[str, str]]:
    """(style, text) lines: the verdict on the ring under test (`headline`), the notes, the
    groups too weak to judge, then the control, then the separation of the two."""
    s = doc["summary"]
    lines = [headline(doc)] + [("info", f"Note: {note}") for note in s.get("notes", [])]
    for tensor, why in s.get("not_run", {}).items():
        lines.append(("info", f"{tensor}: {why}; no verdict on it (not a pass)"))
    for acc, a in s["accumulations"].items():
        flags = ", ".join(f"{k}: {v}" for k, v in a["flags"].items() if v) or "none"
        slope = "n/a" if a["max_slope"] is None else f"{a['max_slope']:+.2f}"
        what = ACC_NAME.get(acc, acc)
        if acc == s["under_test"]:
            if a.get("too_weak"):
                weak = [f for f in doc["fits"].values()
                        if f["accumulation"] == acc and not f["flags"]
                        and f.get("slope_judgement") == "too weak to judge"]
                named = "; ".join(f"{f['mode']}/{f['dtype']}/{f['distribution']}/{f['tensor']} "
                                  f"{_bounds(f)}" for f in weak[:4]) + ("; ..." if len(weak) > 4 else "")
                lines.append(("info", (f"Too weak to judge: the slope of {a['too_weak']} of {a['groups']} groups "
                                      "of the ring under test (its confidence bounds straddle the threshold, or "
                                      f"too few ring sizes or seeds to fit): {named}. No flag is raised on them"
                                      + ("" if verdict(doc) == "no verdict" else f"; {_to_judge_words(s)}"))))
        else:
            weak = f"; slope too weak to judge in {a['too_weak']}" if a.get("too_weak") else ""
            lines.append(("info", (f"Control ({what}): flagged in {a['flagged']} of {a['groups']} groups "
                                  f"({flags}); largest slope {slope}{weak}")))
    rows = [r for r in s["settings"].values() if r["separated"] is not None]
    if rows:
        sep = [r for r in rows if r["separated"]]
        not_sep = [r for r in rows if not r["separated"]]
        text = (f"Separation: the flags tell the default ring from the per-hop round trip in {len(sep)} of "
                f"{len(rows)} settings (mode x dtype x distribution; float32 inputs left out: a round "
                "trip through float32 costs no more than float32 accumulation)")
        if not_sep:
            text += "; not in " + ", ".join(f"{r['mode']}/{r['dtype']}/{r['distribution']}" for r in not_sep)
        lines.append(("info", text))
    return lines


def _flagged_group(fit: dict) -> str:
    text = f"{fit['mode']}/{fit['dtype']}/{fit['distribution']}/{fit['tensor']} {', '.join(fit['flags'])}"
    if fit["over_budget_at"]:
        text += f" at P={', '.join(map(str, fit['over_budget_at']))}"
        if 1 in fit["over_budget_at"]:
            text += " (over budget at P=1 too, where no ring step runs: the block kernel against the peer)"
    return text + f", slope {_f(fit['slope'], 2, sign=True)}"


def worst_cases(doc: dict, n: int = 12) -> list[tuple[dict, str, dict]]:
    rows = [(c, t, m) for c in doc["cases"].values() for t, m in c["tensors"].items()]
    rows.sort(key=lambda r: (-r[2]["budget_ratio"] if math.isfinite(r[2]["budget_ratio"]) else -math.inf,
                             r[0]["mode"], r[0]["dtype"], r[0]["distribution"], r[0]["P"], r[1]))
    return rows[:n]


WORST_HEADERS = ["accumulation", "mode", "dtype", "distribution", "P", "tensor", "max abs error",
                 "peer error", "err / budget", "max ULP", "rel / u", "mean signed", "verdict"]
WORST_SHORT = ["acc", "mode", "dtype", "dist", "P", "tensor", "error", "peer", "err/budget", "rel/u", "verdict"]


def worst_row(c: dict, t: str, m: dict) -> list[str]:
    return [ACC_SHORT.get(c["accumulation"], c["accumulation"]), c["mode"], c["dtype"], c["distribution"],
            str(c["P"]), t, _e(m["max_abs"]), _e(m["peer_max_abs"]), _f(m["budget_ratio"]),
            _f(m["max_ulp"], 1), _f(m["rel_over_u"], 2), _e(m["mean_signed"]),
            "pass" if m["passed"] else "OVER"]


def separation_headers(doc: dict) -> list[str]:
    accs = accumulations(doc)
    return (["mode", "dtype", "distribution"] + [f"flagged: {ACC_SHORT.get(a, a)}" for a in accs]
            + ["separated"] + [f"out slope: {ACC_SHORT.get(a, a)}" for a in accs]
            + [f"out projected P: {ACC_SHORT.get(a, a)}" for a in accs])


def separation_rows(doc: dict) -> list[list[str]]:
    rows = []
    accs = accumulations(doc)
    for r in doc["summary"]["settings"].values():
        cells = [r["mode"], r["dtype"], r["distribution"]]
        for acc in accs:
            flagged = r["flagged"].get(acc, [])
            cells.append(", ".join(flagged) if flagged else "-")
        if r["separated"] is None:
            cells.append("n/a (float32)" if r["dtype"] == "float32" else "n/a")
        else:
            cells.append("yes" if r["separated"] else "no")
        cells += [_f(r["out_slope"].get(a), 2, sign=True) for a in accs]
        cells += [_projected(r["out_projected_budget_P"].get(a)) for a in accs]
        rows.append(cells)
    return rows


def _head_blocks(doc: dict, accs: list[str], sizes: list[int]) -> list[tuple]:
    """The title, the command that repeats the run, and what the sweep covered."""
    spec, meta = doc["spec"], doc.get("meta", {})
    b: list[tuple] = [("h1", "ringcheck drift report")]
    if meta.get("command"):
        b.append(("p", ("Produced by this command: pasted anywhere it runs again from the directory it names, with "
                       "the PYTHONPATH the run needed to import its modules. The same command on the same machine "
                       "writes the same JSON bit for bit, everything but `meta`; check with `ringcheck report "
                       "diff --exact OLD.json NEW.json`.")))
        b.append(("code", meta["command"]))
    shape = (f"batch={spec['batch']}, heads={spec['heads']}/{spec['kv_heads']} (q/kv), "
             f"head_dim={spec['head_dim']}, "
             + (f"tokens per rank={spec['tokens_per_rank']} (seq_len = P x {spec['tokens_per_rank']})"
                if spec["tokens_per_rank"] is not None else f"seq_len={spec['seq_len']} for every P")
             + (f", softmax_scale={spec['softmax_scale']}" if spec["softmax_scale"] is not None else ""))
    b.append(("p", (f"Implementation `{doc['implementation']}`; backends {', '.join(spec['backends'])}; "
                   f"dtypes {', '.join(spec['dtypes'])}; ring sizes {', '.join(map(str, sizes))}; distributions "
                   f"{', '.join(spec['distributions'])}; modes {', '.join(spec['modes'])}; accumulations "
                   f"{', '.join(ACC_LABEL.get(a, a) for a in accs)}; {spec['seeds']} seeds; {shape}.")))
    return b


def _verdict_blocks(doc: dict) -> list[tuple]:
    """The verdict, its figure right under it, and how to read it (folded)."""
    r = doc["rules"]
    return [("h2", "Verdict"), ("list", [text for _, text in verdict_lines(doc)]), ("plots", "error"),
            ("details", "How to read it", [("list", [
                f"Model: {r['fit']}.", f"Expected: {r['expected']}.", f"Diagnosis: {r['diagnosis']}.",
                f"Slope {r['slope']}.", f"Budget {r['budget']}.", f"Bias {r['bias']}.",
                f"Non-finite {r['nonfinite']}.", f"Projected P: {r['projected']}.",
                ("The float32 merge is the ring under test (the exit code follows it); the per-hop "
                 "round trip rounds the running output to the input dtype after every merge and is "
                 "the control that shows what the flags see. For float32 inputs the round trip "
                 "goes through float32 itself and costs no more than the accumulation, so the two "
                 "coincide there up to float32 rounding."),
                f"Metrics {r['metrics']}."])])]


def _separation_blocks(doc: dict, accs: list[str]) -> list[tuple]:
    """Per setting, whether the flags separate the ring from its control (none for an --impl)."""
    if len(accs) <= 1:  # an --impl has no control to separate it from
        return []
    return [("h2", "Separation per setting"),
            ("p", ("Tensors flagged in each setting, per accumulation; separated = the default ring has no "
                   "flag and the control has at least one. Then the fitted slope of `out` per accumulation "
                   "and the ring size where its error is projected to reach the budget: where the flags do "
                   "not separate the two, the slopes may (flat against sqrt-like).")),
            ("table", separation_headers(doc), separation_rows(doc))]


def _slope_blocks(doc: dict, accs: list[str]) -> list[tuple]:
    """The fitted slope of every (setting, tensor, accumulation), with its bounds and flags."""
    headers = ["mode", "dtype", "distribution", "tensor"]
    for a in accs:
        s = ACC_SHORT.get(a, a)
        headers += [f"slope ({s})", f"bounds ({s})", f"max err/budget ({s})", f"projected P ({s})",
                    f"flags ({s})"]
    rows = []
    for backend, mode, dtype, dist in _settings(doc):
        for t in tensor_names(doc):
            row = [mode, dtype, dist, t]
            for a in accs:
                fit = fit_of(doc, backend, mode, dtype, dist, a, t)
                row += ([f"{_slope(fit)} {fit['diagnosis']}", _bounds(fit), _f(fit["max_budget_ratio"]),
                         _projected(fit["projected_budget_P"]), ", ".join(fit["flags"]) or "-"]
                        if fit else ["n/a"] * 5)
            rows.append(row)
        for t, why in doc["summary"].get("not_run", {}).items():
            rows.append([mode, dtype, dist, t] + [why, "", "", "", ""] * len(accs))
    return [("h2", "Slopes of error against ring size"),
            ("p", ("Slope of ln(normwise relative error) on ln(P), P >= 2, ± its standard error; diagnosis; "
                   "its one-sided 99% bounds against the threshold of the output precision and what they "
                   "decide; largest error / budget over P; the projected P where error reaches the budget; "
                   "flags.")),
            ("table", headers, rows),
            ("h2", "Worst cases"),
            ("p", "By error / budget (worst seed), over every case and tensor."),
            ("table", WORST_HEADERS, [worst_row(*w) for w in worst_cases(doc, 15)])]


def _ring_size_blocks(doc: dict, accs: list[str], sizes: list[int]) -> list[tuple]:
    """out's error and every tensor's worst error / budget at each ring size."""
    p_head = [f"P={p}" for p in sizes]
    rel_rows, ratio_rows = [], []
    for backend, mode, dtype, dist in _settings(doc):
        for a in accs:
            cases = [case_of(doc, backend, mode, dtype, dist, a, p) for p in sizes]
            label = [mode, dtype, dist, ACC_SHORT.get(a, a)]
            rel_rows.append(label + [_f(c["tensors"]["out"]["rel_norm"] / unit_roundoff(dtype)) if c else ""
                                     for c in cases])
            ratio_rows.append(label + [_f(max(m["budget_ratio"] for m in c["tensors"].values())) if c else ""
                                       for c in cases])
    label = ["mode", "dtype", "distribution", "accumulation"]
    return [("h2", "Error against ring size"),
            ("p", ("out: normwise relative error in units of u of the dtype (geometric mean over seeds); "
                   "then the largest error / budget over the five tensors (worst seed).")),
            ("h3", "out: relative error / u"), ("table", label + p_head, rel_rows),
            ("h3", "all tensors: max error / budget"), ("table", label + p_head, ratio_rows)]


def _step_blocks(doc: dict, accs: list[str], pmax: int) -> list[tuple]:
    """The running partial output's error after each ring step at the largest P (when recorded)."""
    if not any("steps" in c for c in doc["cases"].values()):
        return []
    steps = sorted({1, 2, pmax} | {2 ** i for i in range(pmax.bit_length()) if 2 ** i <= pmax})
    rows = []
    for backend, mode, dtype, dist in _settings(doc):
        for a in accs:
            c = case_of(doc, backend, mode, dtype, dist, a, pmax)
            if c and "steps" in c:
                rows.append([mode, dtype, dist, ACC_SHORT.get(a, a)]
                            + [_e(c["steps"]["out_rel_norm"][s - 1] / unit_roundoff(dtype)) for s in steps])
    return [("h2", f"Per-step drift at P={pmax}"),
            ("p", ("The running float32 partial output of every rank after ring step s (s shards seen) "
                   "against the float64 attention over the keys seen so far: normwise relative error "
                   "in units of u of the dtype, over all ranks (geometric mean over seeds). The float32 "
                   "merge stays far below one rounding until the final cast; the round trip adds one "
                   "rounding per hop.")),
            ("table", ["mode", "dtype", "distribution", "accumulation"] + [f"s={s}" for s in steps], rows)]


def blocks(doc: dict) -> list[tuple]:
    """The content of the Markdown and HTML reports, as blocks: ("h1" | "h2" | "h3" | "p" |
    "code", text), ("list", items), ("table", headers, rows), ("details", title, blocks: a
    section folded away in the HTML), ("plots", "error" | "detail": the figures of
    `ringcheck.render.plots.error_plots` or `detail_plots`, in the HTML only). In order: the
    command, the sweep, the verdict, the error against ring size, how to read it, the tables,
    the other figures, the run."""
    accs, sizes, meta = accumulations(doc), ring_sizes(doc), doc.get("meta", {})
    b = [*_head_blocks(doc, accs, sizes), *_verdict_blocks(doc), *_separation_blocks(doc, accs),
         *_slope_blocks(doc, accs), *_ring_size_blocks(doc, accs, sizes), *_step_blocks(doc, accs, sizes[-1]),
         ("plots", "detail")]
    if meta:
        b += [("h2", "Run"), ("list", [f"{k}: {v}" for k, v in meta.items() if k != "command"])]
    return b
