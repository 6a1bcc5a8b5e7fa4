"""The trainers' table (issue 63): one row per glue, one column per attention feature, each cell
read from the zoos' rows under reports/models/; writes reports/models/trainers.md and trainers.json.

    .venv/bin/python -m benchmarks.trainers_table          # the table, from the committed JSONs (stdlib, < 1 s)
    .venv/bin/python -m benchmarks.trainers_table --tiny   # first: each model's tiny heads (transformers, ~1 min)

Its rows: every glue of every `reports/models/*.json` that holds zoo rows (`model`, `glue`, `P`,
`verdict`, `cases`, `why`, `named`, `not_run`, `features`, as `benchmarks.models_zoo_run.run_one`
writes them: the trainers' `trainers_*.json` and the reference glues' zoos), and the correct glue
of `ulysses_glue.json` (its rows hold a count of cases and the failed ones). Its columns: `COLUMNS`,
each a set of rows (the model's features, P against its K/V heads) and a set of cases. A cell: pass
when every measured model passed the column's cases, fail with the classes the diagnosis named and
on how many models, refused with the glue's reason, or not measured: never more than the rows say.
The K/V heads are no field of a zoo row: `--tiny` writes each model's tiny heads per layer
(`ringcheck.models.tiny.tiny_model`) to reports/models/tiny_heads.json, which the table reads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "reports" / "models"
NAME = "trainers"
TINY = "tiny_heads"
COMMAND = "python -m benchmarks.trainers_table"
# the cases every `step --model` run judges (ringcheck.models.step.MODEL_CASES), as the zoos' rows hold them
MODEL_CASES = ("one_sequence", "packed", "uneven", "batch2", "two_micro_batches", "not_divisible",
               "checkpoint_non_reentrant", "shard_shorter_than_window", "shard_equal_to_window",
               "shard_longer_than_window")
REGIME = ("shard_shorter_than_window", "shard_equal_to_window", "shard_longer_than_window")
# the features a column of their own judges, or that change the attention's heads: a "plain" model has none
PLAIN_WITHOUT = ("sliding", "chunked", "sinks", "softcap", "scaling", "gqa", "v_head_dim")
# files whose rows are ringcheck's own glue beside its catalogue's planted mutants: the glues taken from them
ROWS_GLUES = {"ulysses_glue.json": ("ulysses",)}
WHY_CUT = 600  # run_one keeps the first 600 characters of a run's why: a segment reaching it may be cut


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    cases: tuple[str, ...]
    rows: str  # the rows it reads, in words (the page's definitions)

    def takes(self, features: set[str], kv_heads: int | None, size: int) -> bool:
        """Whether a row of a model with `features` (its fewest K/V heads `kv_heads`) at P=`size` is measured."""
        if self.key in ("plain", "packed", "loss"):
            return not features & set(PLAIN_WITHOUT)
        if self.key == "kv_lt_p":
            return kv_heads is not None and kv_heads < size
        return {"gqa": "gqa", "sliding": "sliding", "softcap": "softcap", "scale": "scaling", "sinks": "sinks",
                "chunks": "chunked"}[self.key] in features


PLAIN = "models with none of " + ", ".join(PLAIN_WITHOUT) + " (every layer full causal, one K/V head a query head)"
COLUMNS = (
    Column("plain", "plain causal", ("one_sequence",), PLAIN),
    Column("gqa", "GQA", ("one_sequence",), "models with the feature gqa (fewer K/V heads than query heads)"),
    Column("kv_lt_p", "kv_heads < P", ("one_sequence",),
           "rows whose tiny model has fewer K/V heads than P on some layer (tiny_heads.json)"),
    Column("packed", "packed documents", ("packed",), PLAIN),
    Column("sliding", "sliding window", ("one_sequence", *REGIME), "models with the feature sliding"),
    Column("softcap", "softcap", ("one_sequence",), "models with the feature softcap"),
    Column("scale", "scale", ("one_sequence",), "models with the feature scaling (a scale other than head_dim^-0.5)"),
    Column("sinks", "sinks", ("one_sequence",), "models with the feature sinks"),
    Column("chunks", "chunks", ("one_sequence", *REGIME), "models with the feature chunked"),
    Column("loss", "loss normaliser", ("uneven", "batch2", "two_micro_batches"), PLAIN),
)
# the classes of ringcheck's diagnosis (ringcheck.models.losses.LOSSES, ringcheck.models.heads.ULYSSES_LOSSES)
# by the words its summary says them in, the longer first where one holds another
CLASSES = (
    ("window_dropped_short_shard", "the sliding windows removed where the shard is not longer than the window",
     "sliding windows removed where the shard is short"),
    ("chunk_dropped_short_shard", "the chunked attention removed where the shard is not longer",
     "chunks removed where the shard is short"),
    ("window_dropped", "the sliding windows removed", "sliding windows removed"),
    ("window_wider", "the sliding windows one token wider", "sliding windows one token wider"),
    ("window_narrower", "the sliding windows one token narrower", "sliding windows one token narrower"),
    ("mask_plain_causal", "the sliding/chunked masks replaced by plain causal", "masks replaced by plain causal"),
    ("sinks_dropped", "the attention sinks (s_aux) dropped", "sinks dropped"),
    ("softcap_dropped", "the attention logit softcap dropped", "softcap dropped"),
    ("scale_default", "the scale head_dim^-0.5", "the default scale instead of the model's"),
    ("documents_crossed", "attention across the packed documents' boundaries", "packed documents cross"),
    ("kv_heads_regrouped", "query heads meeting the wrong K/V head", "query heads meet the wrong K/V heads"),
    ("heads_permuted", "head groups returned to the wrong heads", "head groups returned to the wrong heads"),
    ("sinks_misrouted", "the sinks taken from other heads", "sinks taken from other heads"),
    ("local_positions", "the rotary position ids local to each rank's shard", "rotary positions local to a shard"),
    ("labels_shifted_in_shards", "the labels shifted inside each rank's shard", "labels shifted inside shards"),
    ("labels_rolled_in_shards", "the labels rolled inside each rank's shard", "labels rolled inside shards"),
    ("no_known_loss", "match none of the known losses of semantics", "no known loss matches"),
    ("no_diagnosis", "no diagnosis by semantics", "not diagnosable (the recomputation does not reproduce the model)"),
    ("native", "equal the native model", "equal to the native model at the diagnosis' tolerance (no semantic lost)"),
    ("token_index", "this model's figures change when other tokens come before",
     "figures depend on the token's index in the forward"),
)
SEGMENT = re.compile(r"(?:^|; )([a-z][a-z0-9_]*): logits \S+ off \(budget \S+\), loss \S+; ")


def _drop_groups(text: str, opener: str) -> str:
    """`text` without each balanced group that starts with `opener` (e.g. "(equally: "): another reading of
    the same computation, not a second class."""
    while (i := text.find(opener)) >= 0:
        depth, j = 0, i
        for j in range(i, len(text)):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
        text = text[:i] + text[j + 1:]
    return text


def classes_of(text: str) -> list[str]:
    """The classes a diagnosis' words name, in `CLASSES`' words (a text naming none: its first words)."""
    text = _drop_groups(text, "(equally: ")
    text = re.sub(r"; the nearest is .*?(?=; your |$)", "", text)
    found = []
    for _, words, label in CLASSES:
        if words in text:
            found.append(label)
            text = text.replace(words, "")
    return found or ([f"unclassified: {text.strip()[:80]}"] if text.strip() else ["no semantic named"])


def case_texts(why: str) -> dict[str, str]:
    """Each failed case's diagnosis in a row's why, where its segment is whole (not cut at `WHY_CUT`)."""
    marks = list(SEGMENT.finditer(why))
    out = {}
    for i, m in enumerate(marks):
        last = i + 1 == len(marks)
        if not last or len(why) < WHY_CUT:
            out[m.group(1)] = why[m.end():marks[i + 1].start() if not last else len(why)]
    return out


def _short(text: str, n: int = 140) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 1] + "…"


GLUE_TAIL = " (refused by glue '"
REFUSAL_CUT = 300  # run_one keeps the first 300 characters of a refusal's message


def _uncut(reason: str, cut: bool) -> str:
    """A reason without ringcheck's "(refused by glue ...)" tail; where run_one cut it, without the clause or
    parenthesis it cut through either (so one cause cut in two places reads as one), and "…" said."""
    reason = re.sub(r" \(refused by glue '[^)]*\)", "", reason)
    if not cut:
        return reason
    i = reason.rfind(" (")
    if i >= 0 and (GLUE_TAIL.startswith(reason[i:]) or reason[i:].startswith(GLUE_TAIL)):
        return reason[:i]  # the cut took only the tail: the reason is whole
    while reason.count("(") > reason.count(")") and " (" in reason:
        reason = reason[:reason.rfind(" (")]
    return (reason[:reason.rfind("; ") + 1] if "; " in reason else reason) + " …"


def refusal(row: dict) -> str | None:
    """The glue's one-line reason where it refused the model before any rank (else None)."""
    why = row.get("why", "")
    if row["verdict"].startswith("refused") or row["verdict"] == "not run" and why.startswith("GlueRefused"):
        cut = len(why) - len("GlueRefused: ") >= REFUSAL_CUT
        return _uncut(why.split("hands its attention: ", 1)[-1], cut)
    return None


def raised(row: dict) -> str | None:
    """Where the glue's code raised in cases of the row: in which, and the first case's exception (else None)."""
    said = {c: w for c, w in (row.get("not_run") or {}).items() if w.startswith("the run through --glue ")}
    if not said:
        return None
    where = "every case" if len(said) == len(MODEL_CASES) else ", ".join(said)
    first = re.sub(r"^the run through --glue \S+ raised: ", "", next(iter(said.values())))
    more = " (other cases: other messages)" if len(set(said.values())) > 1 else ""
    return f"raised in {where}: {first}{more}"


def judge(row: dict, column: Column) -> tuple[str, list[str]]:
    """One row under one column: ("pass", the column's cases not run), ("fail", the classes named),
    ("refused", [reason]), ("raised", [the exception a case raised in the glue]), or ("none", [])."""
    reason = refusal(row)
    if reason is not None:
        return "refused", [reason]
    cases = row.get("cases") if isinstance(row.get("cases"), dict) else {}
    verdicts = {c: cases[c] for c in column.cases if c in cases}
    failed = [c for c, v in verdicts.items() if v == "fail"]
    if failed:
        texts = case_texts(row.get("why", ""))
        named = sorted({k for c in failed if c in texts for k in classes_of(texts[c])})
        if any(c not in texts for c in failed):  # cut from the why: the row's classes, every failed case's
            named = sorted(set(named) | {k for n in (row.get("named") or [""]) for k in classes_of(n)})
        return "fail", named
    if "pass" in verdicts.values():
        return "pass", [c for c, v in verdicts.items() if v != "pass"]
    if verdicts:
        said = (row.get("not_run") or {}).get(next(iter(verdicts)), "")
        return "raised", [re.sub(r"^the run through --glue \S+ raised: ", "", said) or "not run"]
    return "none", []


# --- the rows ------------------------------------------------------------------------------------------------


def _from_rows_file(name: str, data: dict) -> list[dict]:
    """ulysses_glue.json's rows of its correct glue, as zoo rows: a run of every case (`cases` the count of
    MODEL_CASES) passed each case but the `failed` ones; a row of fewer cases says too little and is left."""
    out = []
    for r in data.get("rows") or []:
        if r.get("glue") not in ROWS_GLUES.get(name, ()):
            continue
        row = {k: r[k] for k in ("model", "glue", "P", "verdict", "why") if k in r}
        if r["verdict"] in ("pass", "fail") and r.get("cases") == len(MODEL_CASES):
            row["cases"] = {c: "fail" if c in r.get("failed", []) else "pass" for c in MODEL_CASES}
            row["named"] = list(r.get("named") or [])
        elif not r["verdict"].startswith("refused"):
            continue
        out.append(row)
    return out


def load_rows(folder: Path = OUT) -> tuple[list[dict], dict[str, list[str]]]:
    """Every zoo row under `folder` (the trainers' files first), one per (model, glue, P): the first file's,
    in that order; and each glue's files."""
    files = sorted(folder.glob("trainers_*.json")) + sorted(
        p for p in folder.glob("*.json") if not p.name.startswith("trainers") and p.stem != TINY)
    rows, seen, sources = [], set(), {}
    for path in files:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); regenerate it with the command it names, or remove it") from e
        if not isinstance(data, dict):
            continue
        found = [r for r in data.get("zoo") or [] if isinstance(r, dict) and {"model", "glue", "P", "verdict"} <= set(r)]
        found += _from_rows_file(path.name, data)
        for r in found:
            key = (r["model"], r["glue"], r["P"])
            if "glue_mutants" in r["glue"] or key in seen:
                continue
            seen.add(key)
            rows.append(r)
            sources.setdefault(r["glue"], [])
            if path.name not in sources[r["glue"]]:
                sources[r["glue"]].append(path.name)
    return rows, sources


def load_tiny(folder: Path = OUT) -> dict[str, dict]:
    path = folder / f"{TINY}.json"
    return json.loads(path.read_text()).get("models", {}) if path.exists() else {}


def model_facts(row: dict, tiny: dict[str, dict]) -> tuple[set[str], int | None]:
    """A row's model features (the row's own, else tiny_heads.json's) and its fewest K/V heads (None: unknown)."""
    t = tiny.get(row["model"]) or {}
    features = row.get("features") if row.get("features") is not None else t.get("features", [])
    kv = t.get("kv_heads") or []
    return set(features), (min(kv) if kv else None)


def built_tiny(feats: list[str]) -> bool:
    """Whether the zoo built the model tiny (a feature "(ModelRefused)" or "(ValueError)" says it did not)."""
    return bool(feats) and not any(f.startswith("(") for f in feats)


# --- the cells -----------------------------------------------------------------------------------------------

ORDER = {"fail": 0, "pass": 1, "refused": 2, "raised": 3}


def plain_reason(reason: str) -> str:
    """A reason with the model's own class names said generally, so one cause over many models is one."""
    reason = re.sub(r"\b[A-Z]\w*Config\b", "<Model>Config", reason)
    return re.sub(r"\b[A-Z]\w*ForCausalLM\b", "<Model>ForCausalLM", reason)


def _top(reasons: list[str]) -> str:
    """The most common reason (ties: the first in sorted order), and how many others there were."""
    counts = Counter(plain_reason(r) for r in reasons)
    best = min(counts, key=lambda r: (-counts[r], r))
    others = len(counts) - 1
    return _short(best, 120) + (f" (and {others} other reason{'s' * (others > 1)})" if others else "")


def cell(rows: list[dict], column: Column, tiny: dict[str, dict]) -> dict:
    """One glue's rows under one column, model by model (a model fails where any of its rows fails, passes
    where one passed and none failed, else it was refused or raised): the state, the text, the evidence."""
    models: dict[str, dict] = {}
    for r in rows:
        feats, kv = model_facts(r, tiny)
        if not built_tiny(sorted(feats)) or not column.takes(feats, kv, r["P"]):
            continue
        state, detail = judge(r, column)
        if state == "none":
            continue
        m = models.setdefault(r["model"], {"state": state, "details": {}})
        if ORDER[state] < ORDER[m["state"]]:
            m["state"] = state
        m["details"].setdefault(state, []).append(detail)
    by = {s: sorted(k for k, m in models.items() if m["state"] == s) for s in ORDER}
    judged = len(by["fail"]) + len(by["pass"])
    named = Counter(c for k in by["fail"] for c in sorted({c for d in models[k]["details"]["fail"] for c in d}))
    if by["fail"]:
        text = "fail: " + "; ".join(f"{c} ({named[c]}/{judged})" for c in sorted(named, key=lambda c: (-named[c], c)))
    elif by["pass"]:
        common = set.intersection(*(set(d) for k in by["pass"] for d in models[k]["details"]["pass"]))
        text = f"pass ({judged})" + (f" ({', '.join(sorted(common))} not run)" if common else "")
    else:
        text = ""
    for state in ("refused", "raised"):
        if by[state]:
            reasons = [d[0] for k in by[state] for d in models[k]["details"][state]]
            text += (f"; {state} on {len(by[state])}" if text else
                     f"{state} ({len(by[state])}): {_top(reasons)}")
    return {"state": next((s for s in ORDER if by[s]), "not measured"), "text": text or "not measured",
            "models": {s: by[s] for s in ORDER if by[s]},
            "classes": {k: sorted({c for d in models[k]["details"]["fail"] for c in d}) for k in by["fail"]}}


def refusals(rows: list[dict]) -> dict[str, list[str]]:
    """Each reason a glue refused a model for (said generally), or raised for in a case, with its models (P)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        reason = refusal(r) or raised(r)
        if reason is not None:
            out.setdefault(plain_reason(reason), []).append(f"{r['model']} P={r['P']}")
    return {k: out[k] for k in sorted(out)}


def table(rows: list[dict], sources: dict[str, list[str]], tiny: dict[str, dict]) -> list[dict]:
    """One entry per glue (the trainers' first, each in the order its rows came): its cells and its counts."""
    out = []
    for glue in dict.fromkeys(r["glue"] for r in rows):
        mine = [r for r in rows if r["glue"] == glue]
        files = sources.get(glue, [])
        left = [f"{r['model']} P={r['P']}" for r in mine if not built_tiny(sorted(model_facts(r, tiny)[0]))
                or r["verdict"] == "not run" and refusal(r) is None]
        out.append({"glue": glue, "kind": "trainer" if any(f.startswith("trainers_") for f in files) else "reference",
                    "sources": files, "sizes": sorted({r["P"] for r in mine}),
                    "models": len({r["model"] for r in mine}),
                    "judged": len({r["model"] for r in mine if r["verdict"] in ("pass", "fail")}),
                    "left": left, "refused": refusals(mine), "cells": {c.key: cell(mine, c, tiny) for c in COLUMNS}})
    return out


# --- the page ------------------------------------------------------------------------------------------------

HOW_TO_READ = (
    "One row per glue: the trainers' glues as they ship (from `trainers_*.json`, written by "
    "`benchmarks.trainer_zoo`), then the reference glues of the other zoos (ringcheck's own, ring-flash-attn's). "
    "One column per feature: the rows it reads and the cases it judges are below the table. A cell is "
    "**pass** when every model measured passed every judged case of the column at every P run (the count is of "
    "models); **fail** names the classes ringcheck's diagnosis named on the failed cases (the lost semantic, in "
    "words; a class of another feature of the same models is said as it is) with how many of the measured "
    "models named each (`k/n models`); **refused** gives the glue's one-line reason where it refused the model "
    "before any rank (on how many models, the most common reason), **raised in the run** the exception its code "
    "raised in every case of the column; **not measured** means no row of that glue has a model with the "
    "feature: no run said anything, so the table says nothing. Where a failed case's diagnosis was cut from the "
    "row's `why` (600 characters), the classes are the whole row's (every failed case's). Models ringcheck does "
    "not build tiny, and runs that did not complete, are counted nowhere (listed at the end).")


def markdown(entries: list[dict]) -> str:
    out = ["# The trainers' table: what each glue carries, feature by feature", "",
           f"Regenerate: `{COMMAND}` (reads `reports/models/*.json`; `{COMMAND} --tiny` first where a zoo adds "
           f"models: their K/V heads, for the kv_heads < P column)", "", HOW_TO_READ, "",
           "| glue | P | models (judged) | " + " | ".join(c.title for c in COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
    for e in entries:
        name = f"`{e['glue']}`" + (" (reference)" if e["kind"] == "reference" else "")
        cells = [_short(e["cells"][c.key]["text"], 400) for c in COLUMNS]
        out.append(f"| {name} | {','.join(map(str, e['sizes']))} | {e['models']} ({e['judged']}) | "
                   + " | ".join(f"**{t}**" if t.startswith("fail") else t for t in cells) + " |")
    out += ["", "## Refused and raised, glue by glue (each reason once, with its models)", ""]
    for e in entries:
        if e["refused"]:
            out.append(f"- `{e['glue']}`:")
            out += [f"  - {_short(r, 300)} ({', '.join(ms)})" for r, ms in e["refused"].items()]
    out += ["", "## The columns", "", "| column | rows read | cases judged |", "|---|---|---|"]
    out += [f"| {c.title} | {c.rows} | {', '.join(c.cases)} |" for c in COLUMNS]
    out += ["", "A model's features are the zoo row's `features` (`ringcheck.models.zoo.features` of its tiny model); "
            "its K/V heads those of `reports/models/tiny_heads.json`. The cases are `ringcheck step --model`'s "
            "(`ringcheck.models.step.MODEL_CASES`); not_divisible and checkpoint_non_reentrant are in no column.",
            "", "## Where the rows come from, and what was left out", ""]
    for e in entries:
        left = f"; left out ({len(e['left'])} runs: a model not built tiny, or a run that did not complete): {', '.join(e['left'])}" if e["left"] else ""
        out.append(f"- `{e['glue']}`: {', '.join(e['sources'])}{left}")
    return "\n".join(out) + "\n"


def build(folder: Path = OUT) -> tuple[str, dict]:
    """The page and its JSON from the zoos' rows under `folder`."""
    rows, sources = load_rows(folder)
    if not rows:
        raise ValueError(f"no zoo rows under {folder}: run a zoo first (python -m benchmarks.trainer_zoo --glue "
                         f"NAME --name trainers_NAME), or give the folder that holds them (--folder)")
    entries = table(rows, sources, load_tiny(folder))
    columns = [{"key": c.key, "title": c.title, "rows": c.rows, "cases": list(c.cases)} for c in COLUMNS]
    return markdown(entries), {"command": COMMAND, "columns": columns, "glues": entries}


def tiny_heads(models: list[str]) -> dict[str, dict]:
    """Each model's tiny heads and K/V heads per layer and its features (transformers: the slow part)."""
    from ringcheck.models.tiny import tiny_model
    from ringcheck.models.zoo import features

    out = {}
    for name in models:
        try:
            tiny = tiny_model(name)
            out[name] = {"heads": [x.heads for x in tiny.layers], "kv_heads": [x.kv_heads for x in tiny.layers],
                         "features": list(features(tiny))}
        except Exception as exc:  # the zoo says why; here the heads are only unknown
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        print(f"{name:24s} {out[name]}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", default=str(OUT), help="where the zoos' JSONs are, and the table is written")
    p.add_argument("--tiny", action="store_true", help="first write tiny_heads.json: every model of the rows, built "
                                                        "tiny (imports transformers; about a minute)")
    p.add_argument("--check", action="store_true", help="write nothing: exit 1 if the committed page is stale")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if args.tiny:
        import transformers

        models = sorted({r["model"] for r in load_rows(folder)[0]})
        heads = {"command": f"{COMMAND} --tiny", "transformers": transformers.__version__, "models": tiny_heads(models)}
        (folder / f"{TINY}.json").write_text(json.dumps(heads, indent=1, sort_keys=True) + "\n")
    page, data = build(folder)
    md, js = folder / f"{NAME}.md", folder / f"{NAME}.json"
    if args.check:
        stale = [p.name for p, t in ((md, page), (js, dumps(data))) if not p.exists() or p.read_text() != t]
        print(f"stale: {', '.join(stale)}; regenerate with {COMMAND}" if stale else "up to date")
        return 1 if stale else 0
    md.write_text(page)
    js.write_text(dumps(data))
    print(f"wrote {md} and {js}")
    return 0


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.exit(main())
