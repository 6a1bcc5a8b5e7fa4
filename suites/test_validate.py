"""`ringcheck validate`: it passes correct rings, fails every mutant of the catalogue, and
turns every way an implementation can break the contract into a clear usage error.

The ring runs on the `ring_processes` fixture (local gloo rings under plain pytest, the
torchrun world under torchrun), so these tests run the real distributed validate.
"""

import json
import math
import shlex
import subprocess
import sys
from html import escape
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ringcheck.adapters import Impl, load_impl
from ringcheck.catalogue.mutants import MUTANTS
from ringcheck.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from ringcheck.commands.validate import CheckRow, Target, report_dict, validate
from ringcheck.commands.validate.steps import LAYOUTS_ROW, TWO_CALLS_ROW
from ringcheck.commands.validate.target import RAGGED_LENGTHS
from ringcheck.documents import META_KEYS, VALIDATE_SCHEMA, dumps, load, loads, meta
from ringcheck.judge.check import token_owners
from ringcheck.judge.verdict import judge
from ringcheck.launch import LocalRings, RingError
from ringcheck.render.files import write_validate_reports
from ringcheck.render.html import validate_html
from ringcheck.render.markdown import tensor_words, validate_markdown
from ringcheck.render.terminal import print_check_rows
from ringcheck.spec import RingSpec

ROOT = Path(__file__).resolve().parent.parent

# a small target of the catalogue's family: causal zig-zag, GQA, bf16, 4 ranks
SMALL = dict(seq_len=256, heads=4, kv_heads=2, head_dim=32, dtype="bfloat16", causal=True,
             layout="zigzag", world_size=4, local_lengths=(2, 6, 16), sample_rows=8,
             distributions=("normal", "sink"), ragged_lengths=())  # the ragged rows: suites/test_lengths.py

# what each mutant needs to show itself (everything else: SMALL, on the normal distribution alone: every
# mutant fails there but the overflowing merge, which needs the sink's large logits; the two distributions
# together caught most of them twice over, in twice the time)
SPECIAL = {
    "merge_overflow": dict(distributions=("sink",)),
    # a bf16 round trip per hop stays within 2x the naive bf16 peer on causal rings of 4; it
    # shows on bidirectional near-tied rows over same-sign V with long local blocks at 8 ranks
    "low_precision_partial": dict(causal=False, world_size=8, local_lengths=(64,), seq_len=512,
                                  distributions=("near-uniform",)),
}


def _rows(ring_processes, **changes):
    return validate(Target(**{**SMALL, **changes}), ring_processes, recompute=False)


def _failed(rows):
    return [r.check for r in rows if r.status == "fail"]


@pytest.mark.parametrize("impl", ["ringcheck", "ringcheck.catalogue.mutants:textbook"])
def test_correct_rings_pass(ring_processes, impl):
    rows = _rows(ring_processes, impl=impl, ragged_lengths=RAGGED_LENGTHS)
    assert not _failed(rows), "\n".join(f"{r.check}: {r.detail}" for r in rows if r.status == "fail")
    checks = [r.check for r in rows]
    assert "ragged shards (66, 130 tokens per rank)" in checks
    assert any(c.startswith("forward  full length 256") for c in checks)
    assert "determinism (two runs, same bits)" in checks and "no NaN/Inf" in checks
    # at the default embedding (suites/test_embedded.py runs its own gather ring there): the views and the two
    # calls judged and passed, and the mesh's two rings placed as the mesh says
    rows = {r.check: r for r in rows}
    assert rows[LAYOUTS_ROW].status == "pass" and rows[TWO_CALLS_ROW].status == "pass"
    mesh = next(r for r in rows.values() if r.check.startswith("mesh:"))
    if ring_processes.size is None:
        assert mesh.status == "pass" and "0,2,4,6 | 1,3,5,7" in mesh.detail


@pytest.mark.parametrize("changes", [dict(world_size=1), dict(head_dim_v=16, world_size=2)], ids=["ring of one",
                                                                                            "value head dim"])
def test_the_textbook_ring_is_right_on_a_ring_of_one_and_with_a_value_head_dim_of_its_own(ring_processes, changes):
    """Found by `ringcheck test --impl ringcheck.catalogue.mutants:textbook` at its default ring sizes
    1,2,3,4: on one rank its backward sent dK and dV to itself (gloo: "Pair is not connected"), and a
    v head dim other than q's broke its shapes. The control ring must be right wherever it runs."""
    rows = _rows(ring_processes, impl="ringcheck.catalogue.mutants:textbook", distributions=("normal",),
                 local_lengths=(2, 6), **changes)
    assert not _failed(rows), "\n".join(f"{r.check}: {r.detail}" for r in rows if r.status == "fail")


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_every_mutant_fails(ring_processes, torchrun_world, mutant):
    ring = SPECIAL.get(mutant, {}).get("world_size", 4)
    if torchrun_world is not None and torchrun_world.size % ring:
        pytest.skip(f"{mutant} shows on a ring of {ring}: launch a multiple of {ring} ranks")
    # on its ring alone (locally; a torchrun world places it itself): the default embedding runs the same
    # cases again on a second ring (cp=P,tp=2), and group handling is test_embedded's catalogue
    alone = {"mesh": f"cp={ring}"} if torchrun_world is None else {}
    rows = _rows(ring_processes, impl=f"ringcheck.catalogue.mutants:{mutant}", **alone,
                 **{"distributions": ("normal",), **SPECIAL.get(mutant, {})})
    failed = _failed(rows)
    assert failed, f"validate passed the mutant {mutant!r} ({MUTANTS[mutant]})"
    if mutant in ("block_lse_backward", "stale_kv_backward", "dkdv_not_home", "scale_twice_backward"):
        assert all(c.startswith(("backward", "precision backward")) for c in failed), \
            f"{mutant}: the forward is right, got {failed}"


def _table(rows, **options) -> str:
    console = Console(width=160, record=True)
    print_check_rows(rows, all(r.passed for r in rows), console, **options)
    return console.export_text()


def test_a_backward_mutant_says_which_tensors_failed_and_on_which_ranks(ring_processes):
    """dK/dV not returned home: out, lse and dq are right, dk and dv wrong; every row, the
    JSON document, the table and the Markdown say so per tensor, with the failing ranks."""
    rows = _rows(ring_processes, impl="ringcheck.catalogue.mutants:dkdv_not_home", distributions=("normal",))
    forward = [r for r in rows if r.check.startswith("forward")]
    backward = [r for r in rows if r.check.startswith("backward")]
    assert len(forward) == len(backward) == 2  # scaled and full length
    for r in forward:
        assert r.status == "pass" and list(r.tensors) == ["out", "lse"] and not r.failing_ranks
        assert all(t["passed"] for t in r.tensors.values())
    for r in backward:
        assert r.status == "fail" and list(r.tensors) == ["dq", "dk", "dv"], r.tensors
        assert r.tensors["dq"]["passed"] and not r.tensors["dq"]["ranks"]
        for name in ("dk", "dv"):
            assert not r.tensors[name]["passed"] and r.tensors[name]["ratio"] > 1
            assert set(r.tensors[name]["ranks"]) <= {0, 1, 2, 3} and r.tensors[name]["ranks"]
        assert r.failing_ranks == sorted(set(r.tensors["dk"]["ranks"]) | set(r.tensors["dv"]["ranks"]))
        assert "over budget; worst: d" in r.detail and "rank " in r.detail  # the worst element, located
    doc = loads(dumps(report_dict(Target(**SMALL), rows)), schema=VALIDATE_SCHEMA)
    checks = {c["check"]: c for c in doc["checks"]}
    for r in backward:
        assert checks[r.check]["tensors"]["dk"]["passed"] is False and checks[r.check]["tensors"]["dq"]["passed"]
        assert checks[r.check]["failing_ranks"] == r.failing_ranks
    ranks = ",".join(map(str, backward[0].failing_ranks))
    for text in (_table(rows), _table(rows, compact=False), validate_markdown(doc)):
        assert "out ok  lse ok" in text and "dq ok  dk " in text and ranks in text
        assert "dk ok" not in text and "dv ok" not in text
    compact = _table(rows).splitlines()
    table_end = next(i for i, line in enumerate(compact) if "per tensor: ok" in line)
    assert table_end < len(rows) + 8  # one line per row
    assert any(line.startswith("FAIL backward") for line in compact[table_end:])  # detail after the table


def test_failing_ranks_are_the_owners_of_the_wrong_elements():
    """judge() maps the elements over budget back to ranks through the layout."""
    ring = RingSpec(4, "zigzag")
    owner, _ = token_owners(32, ring)
    truth = torch.randn(1, 32, 2, 8, dtype=torch.float64)
    got = truth.clone()
    got[0, 5, 1, 3] += 1.0     # token 5: rank 1 of 4 under zig-zag (chunks of 4 tokens)
    got[0, 30, 0, 0] = math.nan  # token 30: rank 0 (its second chunk)
    verdict = judge("dk", got, truth, truth, k=3, dtype=torch.float32, owner=(1, owner))
    assert not verdict.passed and (int(owner[5]), int(owner[30])) == (1, 0) and verdict.failing_ranks == (0, 1)
    assert judge("dk", truth, truth, truth, k=3, dtype=torch.float32, owner=(1, owner)).failing_ranks == ()


def _recorder(kind):
    """An implementation with or without the `layout` keyword (or with **kwargs) that records
    the optional keywords it was called with."""
    calls = []

    def base(q, k, v, *, causal, softmax_scale, group=None):
        calls.append({})

    def named(q, k, v, *, causal, softmax_scale, group=None, layout):
        calls.append({"layout": layout})

    def kwargs(q, k, v, *, causal, softmax_scale, group=None, **options):
        calls.append(options)

    return {"base": base, "named": named, "kwargs": kwargs}[kind], calls


@pytest.mark.parametrize("kind, expected", [("base", {}), ("named", {"layout": "striped"}),
                                            ("kwargs", {"layout": "striped"})])
def test_layout_is_passed_only_to_implementations_that_accept_it(kind, expected):
    fn, calls = _recorder(kind)
    Impl(kind, fn).call(None, None, None, causal=True, softmax_scale=0.5, group=None, layout="striped")
    assert calls == [expected]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_one_function_serves_every_layout_through_the_layout_keyword(ring_processes, layout):
    """layout_aware requires `layout` (TypeError without it) and is exact only with the right one."""
    assert load_impl("ringcheck.catalogue.bad_impls:layout_aware", layout=layout).fn
    rows = _rows(ring_processes, impl="ringcheck.catalogue.bad_impls:layout_aware", layout=layout,
                 distributions=("normal",), local_lengths=(2, 6))
    assert not _failed(rows), [r.detail for r in rows if r.status == "fail"]


def test_an_implementation_without_lse_is_checked_on_out_and_gradients(ring_processes):
    rows = _rows(ring_processes, impl="ringcheck.catalogue.bad_impls:only_out", distributions=("normal",))
    assert not _failed(rows)
    shape_row = next(r for r in rows if r.check == "output shape and dtype")
    assert "no lse returned" in shape_row.detail


@pytest.mark.parametrize("impl, words", [
    ("ringcheck.catalogue.bad_impls:wrong_shape", "returned out of shape"),
    ("ringcheck.catalogue.bad_impls:wrong_dtype", "dtype torch.float64"),
    ("ringcheck.catalogue.bad_impls:no_gradient_to_k", "no gradient flows to k"),
    ("ringcheck.catalogue.bad_impls:raises_on_rank_one", "rank 1 ran out of patience"),
])
def test_contract_breaches_are_reported_with_the_rank(impatient_rings, torchrun_world, impl, words):
    # on the ring alone (locally): a breach is the ring's, and a failing ring's diagnosis starts fresh
    # processes for each of its runs (the embedding's eight instead of four)
    alone = {"mesh": "cp=4"} if torchrun_world is None else {}
    with pytest.raises(RingError) as info:
        _rows(impatient_rings, impl=impl, distributions=("normal",), local_lengths=(2,), **alone)
    assert words in str(info.value)


def test_an_implementation_that_never_returns_times_out_naming_the_rank(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("a rank that never returns cannot be stopped in-process under torchrun")
    target = Target(**{**SMALL, "impl": "ringcheck.catalogue.bad_impls:never_returns_on_rank_zero",
                       "distributions": ("normal",), "local_lengths": (2,), "mesh": "cp=4"})  # the ring alone
    # the others time out in 1 s and rank 0 is stopped after half a second's grace, twice (the case, then its
    # plain call alone to name the call that hangs): rank 0 never answers whatever the load
    with LocalRings(timeout=1, grace=0.5) as rings, pytest.raises(RingError) as info:
        validate(target, rings, recompute=False)
    assert "rank 0" in str(info.value)


@pytest.mark.parametrize("argv, words", [
    (["--impl", "no_such_module:fn"], "cannot import module 'no_such_module'"),
    (["--impl", "ringcheck.catalogue.bad_impls:NOT_CALLABLE"], "is not callable"),
    (["--impl", "ringcheck.catalogue.bad_impls:wrong_signature"], "the contract is fn(q, k, v, *, causal, softmax_scale, group)"),
    (["--impl", "ringcheck.catalogue.bad_impls:missing"], "has no attribute 'missing'"),
    (["--impl", "torch_cp", "--layout", "striped"], "runs the layouts"),
    (["--impl", "torch_cp", "--head-dim-v", "32"], "needs q, k and v of one head size"),
    (["--seq-len", "1001"], "seq_len=1001 is not divisible by 2 x world_size=8"),
    (["--heads", "4", "--kv-heads", "3"], "heads=4 is not divisible by kv_heads=3"),
    (["--config", "/nonexistent.toml"], "no such file"),
    (["--world-size", "0"], "world_size must be >= 1"),
    (["--seq-len", "512", "--sample-rows", "1000"],
     "sample_rows=1000 is more than the seq_len=512 query rows of the target; pass --sample-rows 512"),
])
def test_bad_input_exits_2_with_a_message_and_no_traceback(capsys, argv, words):
    assert main(["validate", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_config_file_holds_the_target(tmp_path, capsys):
    config = tmp_path / "target.toml"
    config.write_text('[validate]\nseq_len = 1004\nlayout = "zigzag"\nworld_size = 4\n')
    assert main(["validate", "--config", str(config)]) == EXIT_USAGE
    assert "seq_len=1004" in capsys.readouterr().err
    config.write_text('[validate]\nsequence = 1000\n')
    assert main(["validate", "--config", str(config)]) == EXIT_USAGE
    assert "unknown key(s) ['sequence']" in capsys.readouterr().err


def _no_literal(name):
    raise AssertionError(f"non-standard JSON literal {name}")


def test_report_with_an_infinite_error_is_strict_json():
    rows = [CheckRow("forward normal", "fail", math.inf, 1e-3, "out FAILED"),
            CheckRow("backward normal", "fail", math.nan, 1e-3, "dq FAILED | NaN"),
            CheckRow("no NaN/Inf", "pass")]
    report = report_dict(Target(), rows, meta=meta("ringcheck validate", elapsed_s=1.0))
    assert list(report) == ["schema", "schema_version", "passed", "flagged", "target", "variants", "command", "mesh",
                            "checks", "meta"]
    assert report["schema"] == VALIDATE_SCHEMA and not report["passed"]
    text = dumps(report)
    strict = json.loads(text, parse_constant=_no_literal)
    assert strict["checks"][0]["error"] == "inf" and strict["checks"][1]["error"] == "nan"
    back = loads(text, schema=VALIDATE_SCHEMA)
    assert back["checks"][0]["error"] == math.inf and math.isnan(back["checks"][1]["error"])
    assert back["checks"][2] == report["checks"][2] and back["target"]["local_lengths"] == [2, 6, 16]
    md = validate_markdown(back)
    assert md.startswith("# ringcheck validate: FAILED") and "| inf |" in md and "dq FAILED \\| NaN" in md


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "ringcheck", "validate", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.cli
def test_cli_exit_codes_and_report(tmp_path):
    """End to end in a fresh process: a passing run writes its report; a mutant exits 1 and
    names the failing check; a contract breach at run time exits 2 without a traceback. (A small
    target on a ring of 2: what is checked here is the command, its exit codes and its files.)"""
    small = ["--seq-len", "64", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
             "--sample-rows", "4", "--quick"]
    done = _cli(*small, "--report", str(tmp_path))
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    report = json.loads((tmp_path / "validate.json").read_text(), parse_constant=_no_literal)
    assert list(report)[:2] == ["schema", "schema_version"]
    report = load(tmp_path / "validate.json", schema=VALIDATE_SCHEMA)
    assert report["passed"] and report["schema_version"] == 2
    assert list(report["meta"]) == list(META_KEYS) and report["meta"]["command"].startswith(f"cd {shlex.quote(str(ROOT))} && ")
    assert " ringcheck validate --seq-len 64 " in report["meta"]["command"]  # after the directory and PYTHONPATH
    assert (tmp_path / "validate.md").read_text().startswith("# ringcheck validate: PASSED")

    assert (tmp_path / "validate.html").read_text().count("data:image/png;base64,") == 1

    failing = tmp_path / "failing"
    done = _cli(*small, "--distributions", "normal", "--impl", "ringcheck.catalogue.mutants:diagonal_off_by_one",
                "--report", str(failing))  # one distribution: the mutant is off on every one
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "forward" in done.stdout and "validate.html" in done.stdout
    report, page = load(failing / "validate.json", schema=VALIDATE_SCHEMA), (failing / "validate.html").read_text()
    assert "ringcheck validate: FAILED" in page and escape(report["command"]) in page
    assert all(escape(c["check"]) in page for c in report["checks"])
    assert any(c["status"] == "fail" and tensor_words(c["tensors"]).split("  ")[0] in page for c in report["checks"])

    done = _cli(*small, "--distributions", "normal", "--impl", "ringcheck.catalogue.bad_impls:wrong_shape",
                "--timeout", "20")
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "returned out of shape" in done.stderr and "Traceback" not in done.stderr


def test_pytorch_context_parallel_ring_passes(ring_processes):
    rows = _rows(ring_processes, impl="torch_cp", distributions=("normal",))
    assert not _failed(rows), [r.detail for r in rows if r.status == "fail"]


def test_pytorch_context_parallel_causal_without_load_balancing_passes(ring_processes):
    # contiguous causal shards: torch_cp runs with enable_load_balance off
    rows = _rows(ring_processes, impl="torch_cp", layout="contiguous", causal=True, distributions=("normal",))
    assert not _failed(rows), [r.detail for r in rows if r.status == "fail"]


def test_ring_attention_pytorch_as_shipped(ring_processes):
    """What the README reports for ring-attention-pytorch 0.5.20 on CPU: bf16 does not run,
    float32 has an exact forward and wrong dk/dv."""
    pytest.importorskip("ring_attention_pytorch", reason="pip install ring-attention-pytorch==0.5.20")
    with pytest.raises(RingError, match="expected scalar type Float but found BFloat16"):
        _rows(ring_processes, impl="ring_attention_pytorch", layout="contiguous", causal=False,
              distributions=("normal",), local_lengths=(2,))
    rows = _rows(ring_processes, impl="ring_attention_pytorch", layout="contiguous", causal=False,
                 dtype="float32", distributions=("normal",))
    failed = _failed(rows)
    assert failed and all(c.startswith(("backward", "precision backward")) for c in failed), failed
    assert all(" dk " in r.detail or " dv " in r.detail or "dk FAILED" in r.detail or "dv FAILED" in r.detail
               for r in rows if r.status == "fail")


def _hand_made_report() -> dict:
    """A validate document written by hand (no ring): a passing forward, a backward failing in
    dk on ranks 1 and 3 and with an infinite dv, a row without tensors, an information row."""
    rows = [CheckRow("forward  normal (local 2,6)", "pass", 2e-3, 1e-2, "out ok: error 2.000e-03",
                     tensors={"out": {"passed": True, "ratio": 0.2, "ranks": []},
                              "lse": {"passed": True, "ratio": 0.0, "ranks": []}}),
            CheckRow("backward normal (local 2,6)", "fail", 1.5, 1e-2, "dk FAILED: error 1.500e+00 <at> [rank 1]",
                     tensors={"dq": {"passed": True, "ratio": 0.5, "ranks": []},
                              "dk": {"passed": False, "ratio": 150.0, "ranks": [1, 3]},
                              "dv": {"passed": False, "ratio": math.inf, "ranks": [3]}},
                     failing_ranks=[1, 3]),
            CheckRow("no NaN/Inf", "pass", detail="every output finite"),
            CheckRow("per-rank work balance (max / mean)", "info", 1.0, None, "scores per rank [8, 8]")]
    report = report_dict(Target(**SMALL), rows, meta=meta("ringcheck validate --quick", elapsed_s=1.0))
    report["command"] = "ringcheck validate --quick --seq-len 256"
    return loads(dumps(report), schema=VALIDATE_SCHEMA)


def test_html_report_of_a_hand_made_document(tmp_path):
    """validate.html beside the JSON and Markdown: the verdict with its counts, the command,
    every check (also those without tensors, which the plot leaves out), the per-tensor verdicts
    of the failing row, its failing ranks, the escaped detail, the plot as an embedded PNG."""
    doc = _hand_made_report()
    paths = write_validate_reports(doc, tmp_path)
    assert set(paths) == {"json", "md", "html"} and paths["html"] == tmp_path / "validate.html"
    page = paths["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and page == validate_html(doc)
    assert "ringcheck validate: FAILED" in page and "1 of 4 checks failed" in page
    assert "ringcheck validate --quick --seq-len 256" in page
    assert all(escape(c["check"]) in page for c in doc["checks"])
    assert "dk 150x" in page and "dv inf" in page and "dq ok" in page and ">1,3<" in page
    assert "&lt;at&gt; [rank 1]" in page and "<at>" not in page
    assert page.count("data:image/png;base64,") == 1 and "src='http" not in page

    doc["checks"] = [c for c in doc["checks"] if not c["tensors"]]
    doc["passed"] = True
    page = validate_html(doc)
    assert "ringcheck validate: PASSED" in page and "data:image/png" not in page
