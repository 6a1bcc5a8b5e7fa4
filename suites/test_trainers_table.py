"""The trainers' table (benchmarks/trainers_table.py): its cells from a few made-up rows, the classes
it reads in the diagnosis' words, and the committed page as the script writes it (never stale).
Reads JSON only: no torch, no model."""

import ast
import json

from benchmarks import trainers_table as tt

ROOT = tt.ROOT
PASS = dict.fromkeys(tt.MODEL_CASES, "pass")


def _row(model, glue, verdict, features, cases=None, why="", named=(), size=2, not_run=None):
    row = {"model": model, "glue": glue, "P": size, "verdict": verdict, "why": why, "features": list(features)}
    if cases is not None:
        row.update(cases=cases, named=list(named), not_run=not_run or {})
    return row


def _rows():
    window = ("one_sequence: logits 0.98 off (budget 7.6e-06), loss 0.0027; your logits and gradients equal the model "
              "with the sliding windows removed on layers 0 and 1 (equally: the sliding/chunked masks replaced by "
              "plain causal on layers 0 and 1) (logits to 0.0e+00, gradients to 6.8e-16)")
    return [
        _row("llama", "t", "pass", ["full"], dict(PASS)),
        _row("mistral", "t", "fail", ["sliding", "gqa"], {**PASS, "one_sequence": "fail"}, window,
             ["your logits and gradients equal the model with the sliding windows removed on layers 0 and 1"]),
        _row("gemma2", "t", "not run", ["full", "sliding", "softcap", "gqa"],
             why="GlueRefused: --glue t cannot carry what --model gemma2 hands its attention: layers 0, 1: softcap "
                 "2.0 (the adapter asserts softcap is None) (refused by glue 't' at P=2)"),
        _row("axk2", "t", "not run", ["(ModelRefused)"], why="ModelRefused: axk2: indexed attention"),
    ]


def test_cells_pass_fail_refused_and_not_measured():
    entries = tt.table(_rows(), {"t": ["trainers_t.json"]}, {"mistral": {"kv_heads": [1, 1]}})
    (e,) = entries
    cells = {k: c["text"] for k, c in e["cells"].items()}
    assert e["kind"] == "trainer" and e["models"] == 4 and e["judged"] == 2 and e["left"] == ["axk2 P=2"]
    assert cells["plain"] == "pass (1)" and cells["packed"] == "pass (1)" and cells["loss"] == "pass (1)"
    assert cells["sliding"] == "fail: sliding windows removed (1/1); refused on 1"
    assert cells["gqa"] == cells["sliding"]
    assert cells["kv_lt_p"] == "fail: sliding windows removed (1/1)"   # gemma2's heads are not in the tiny file
    assert cells["softcap"] == "refused (1): layers 0, 1: softcap 2.0 (the adapter asserts softcap is None)"
    assert cells["scale"] == cells["sinks"] == cells["chunks"] == "not measured"
    assert e["cells"]["sliding"]["classes"] == {"mistral": ["sliding windows removed"]}


def test_a_cut_why_falls_back_to_the_rows_classes_and_raised_cases_are_said():
    cut = "packed: logits 1 off (budget 7.6e-06), loss 0.02; " + "x" * tt.WHY_CUT
    rows = [_row("llama", "t", "fail", ["full"], {**PASS, "packed": "fail"}, cut[:tt.WHY_CUT],
                 ["your logits and gradients equal the model with attention across the packed documents' boundaries"]),
            _row("qwen3", "t", "no verdict", ["full"], dict.fromkeys(tt.MODEL_CASES, "not run"),
                 not_run=dict.fromkeys(tt.MODEL_CASES, "the run through --glue t raised: AssertionError: position_ids"))]
    cells = tt.table(rows, {}, {})[0]["cells"]
    assert cells["packed"]["text"] == "fail: packed documents cross (1/1); raised on 1"
    assert cells["plain"]["text"] == "pass (1); raised on 1"
    only = tt.table(rows[1:], {}, {})[0]["cells"]["plain"]["text"]
    assert only == "raised (1): AssertionError: position_ids"


def test_the_classes_words_are_the_diagnosis_own():
    """Every class the table reads is said in these words by ringcheck's diagnosis, and every loss of
    ringcheck.models.losses.LOSSES has its words here (read from the sources: no torch)."""
    text = "".join((ROOT / "ringcheck" / "models" / f).read_text() for f in ("losses.py", "heads.py", "semantics.py"))
    assert [w for _, w, _ in tt.CLASSES if w not in text] == []
    tree = ast.parse((ROOT / "ringcheck" / "models" / "losses.py").read_text())
    losses = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "LOSSES")
    assert set(losses) <= {k for k, _, _ in tt.CLASSES}
    assert tt.classes_of("your logits and gradients equal the model with the sliding windows removed on layer 1 "
                         "(equally: the sliding windows removed where the shard is not longer than the window "
                         "(11 keys per rank at P=2, W = 12), as a glue does) (logits to 0.0e+00)") == [
        "sliding windows removed"]


def test_the_zoo_rows_cases_are_the_tables():
    """MODEL_CASES as the committed zoo rows hold them (the ulysses rows are read by it)."""
    rows = json.loads((tt.OUT / "trainers_deepspeed.json").read_text())["zoo"]
    assert {tuple(r["cases"]) for r in rows if "cases" in r} == {tt.MODEL_CASES}


def test_the_committed_table_is_what_the_script_writes():
    page, data = tt.build()
    assert (tt.OUT / "trainers.md").read_text() == page, "stale: regenerate with python -m benchmarks.trainers_table"
    assert (tt.OUT / "trainers.json").read_text() == tt.dumps(data)
