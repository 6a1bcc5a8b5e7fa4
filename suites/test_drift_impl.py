"""`ringcheck drift --impl`: the drift report of any implementation under the `--impl` contract,
run on real process groups of each ring size (local gloo rings here; the torchrun world's
sub-groups under torchrun). Tiny sizes: the point is the plumbing and the verdicts, not drift."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringcheck.cli import main
from ringcheck.commands.drift import AS_IMPLEMENTED, DriftSpec, ring_implementation, run_drift
from ringcheck.documents import DRIFT_SCHEMA, load
from ringcheck.render.drift_content import blocks, verdict_lines

TINY = {"dtypes": ("bfloat16",), "ring_sizes": (1, 2, 4), "distributions": ("normal",), "modes": ("zigzag",),
            "seeds": 1, "tokens_per_rank": 4, "head_dim": 8, "heads": 2, "kv_heads": 1}
TINY_ARGS = ["--dtypes", "bfloat16", "--ring-sizes", "1,2,4", "--distributions", "normal", "--modes", "zigzag",
             "--seeds", "1", "--tokens-per-rank", "4", "--head-dim", "8", "--heads", "2", "--kv-heads", "1"]
MUTANTS = "ringcheck.catalogue.mutants"


def _key(impl: str, p: int) -> str:
    return f"{impl}/torch/zigzag/bfloat16/normal/acc={AS_IMPLEMENTED}/P={p}"


def test_our_ring_on_process_groups_measures_what_the_simulated_ring_does(ring_processes):
    """`--impl ringcheck` is our ring on real process groups: it computes the simulated ring's
    bits, so every measurement of the report is the simulated ring's, at every ring size."""
    doc = run_drift(DriftSpec(**TINY, accumulations=(AS_IMPLEMENTED,)),
                    implementation=ring_implementation("ringcheck", ring_processes, max_ring_size=ring_processes.size))
    simulated = run_drift(DriftSpec(**TINY, accumulations=("float32",)))
    for p in (1, 2, 4):
        got = doc["cases"][_key("ringcheck", p)]
        want = simulated["cases"][f"simulated/torch/zigzag/bfloat16/normal/acc=float32/P={p}"]
        assert got["tensors"] == want["tensors"], p
        assert "steps" not in got  # the per-step observer is the simulated ring's alone
    assert doc["implementation"] == "ringcheck" and doc["summary"]["under_test"] == AS_IMPLEMENTED
    # ring sizes 1, 2, 4: no slope can be fitted, so no verdict (and no flag either)
    assert doc["summary"]["verdict"] == "no verdict" and doc["summary"]["accumulations"][AS_IMPLEMENTED]["flagged"] == 0
    assert doc["summary"]["not_run"] == {}
    assert {f["tensor"] for f in doc["fits"].values()} == {"out", "lse", "dq", "dk", "dv"}


def test_a_planted_external_ring_is_flagged_and_a_correct_one_is_not(ring_processes):
    """A mutant of the contract (`merge_no_rescale`: no max rescaling in the merge) is over
    budget from the first merge (P = 2; P = 1 runs none); the textbook ring it was cut from is
    not flagged. Forward only: the backward is reported as not run, never as a pass."""
    spec = DriftSpec(**dict(TINY, dtypes=("float32",)), accumulations=(AS_IMPLEMENTED,))
    docs = {name: run_drift(spec, implementation=ring_implementation(f"{MUTANTS}:{name}", ring_processes,
                                                                       forward_only=True,
                                                                       max_ring_size=ring_processes.size))
            for name in ("merge_no_rescale", "textbook")}
    bad, good = docs["merge_no_rescale"], docs["textbook"]
    fit = bad["fits"][f"{MUTANTS}:merge_no_rescale/torch/zigzag/float32/normal/acc={AS_IMPLEMENTED}/out"]
    assert "budget" in fit["flags"] and fit["over_budget_at"] == [2, 4]
    assert bad["summary"]["verdict"] == "flagged" and not bad["summary"]["passed"]
    assert good["summary"]["verdict"] == "no verdict"  # unflagged, but ring sizes 1, 2, 4 fit no slope
    assert not any(f["flags"] for f in good["fits"].values())
    for doc in docs.values():
        assert doc["summary"]["not_run"] == {t: "not run (--forward-only)" for t in ("dq", "dk", "dv")}
        assert all(set(c["tensors"]) == {"out", "lse"} for c in doc["cases"].values())
        assert {f["tensor"] for f in doc["fits"].values()} == {"out", "lse"}
    lines = [text for _, text in verdict_lines(good)]
    assert "dq: not run (--forward-only); no verdict on it (not a pass)" in lines
    slope_table = next(b for b in blocks(good) if b[0] == "table" and any(h.startswith("bounds") for h in b[1]))
    assert ["zigzag", "float32", "normal", "dk", "not run (--forward-only)"] == slope_table[2][-2][:5]


def test_drift_impl_command_writes_the_report_of_that_implementation(tmp_path, capsys):
    """The issue's run: two ring sizes P >= 2 judge no slope, so the command says NO VERDICT,
    names the flags that would judge it and exits 2 (it printed PASS and exited 0). With a
    third ring size it judges some groups and counts both kinds in the headline."""
    # ring sizes from 2: the textbook ring's backward sends dK/dV home even on a ring of one,
    # which gloo refuses (a send to itself)
    argv = [*TINY_ARGS[:2], "--ring-sizes", "2,4", *TINY_ARGS[4:]]
    assert main(["drift", "--impl", f"{MUTANTS}:textbook", *argv, "--out", str(tmp_path)]) == 2
    doc = load(tmp_path / "drift.json", schema=DRIFT_SCHEMA)
    assert doc["implementation"] == f"{MUTANTS}:textbook" and doc["spec"]["accumulations"] == [AS_IMPLEMENTED]
    assert sorted({c["P"] for c in doc["cases"].values()}) == [2, 4]
    assert f" ringcheck drift --impl {MUTANTS}:textbook" in doc["meta"]["command"]
    assert doc["summary"]["verdict"] == "no verdict" and doc["summary"]["to_judge"]["ring_sizes"] == [2, 4, 8]
    page = (tmp_path / "drift.html").read_text()
    assert page.count("data:image/png;base64,") == 2  # error against P, fitted slopes (no per-step drift)
    assert "Separation per setting" not in page  # one ring, no control to separate it from
    out = capsys.readouterr().out
    assert "PASS" not in out and out.startswith(
        "NO VERDICT: the ring under test (as implemented) raises no flag, but none of its 5 groups"), out
    assert "this sweep has 2 (2, 4)" in out and out.rstrip().endswith("run again with --ring-sizes 2,4,8 --seeds 3")
    # P = 3 rather than 8: a third ring size at the cost of three processes
    argv = [*TINY_ARGS[:2], "--ring-sizes", "2,3,4", *TINY_ARGS[4:]]
    code = main(["drift", "--impl", f"{MUTANTS}:textbook", *argv, "--out", str(tmp_path / "three")])
    under = load(tmp_path / "three" / "drift.json", schema=DRIFT_SCHEMA)["summary"]["accumulations"][AS_IMPLEMENTED]
    out = capsys.readouterr().out
    assert code == 0 and under["flagged"] == 0 and under["judged"] >= 1, out
    weak = f"; {under['too_weak']} too weak to judge" if under["too_weak"] else ""
    group = "group" if under["judged"] == 1 else "groups"
    assert out.startswith(f"PASS: the ring under test (as implemented) raises no flag in {under['judged']} judged "
                          f"{group} (mode x dtype x distribution x tensor){weak}; "), out


@pytest.mark.parametrize("argv, match", [
    (["--forward-only"], "--forward-only is for an --impl"),
    (["--flash-attn-stand-in"], "--flash-attn-stand-in is for an --impl"),
    (["--impl", "no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
    (["--impl", f"{MUTANTS}:textbook", "--accumulate", "input"], "drop --accumulate"),
    pytest.param(["--impl", "ring_attention_pytorch", "--modes", "zigzag"], "runs the layouts",
                 marks=pytest.mark.skipif(importlib.util.find_spec("ring_attention_pytorch") is None,
                                          reason="ring-attention-pytorch is not installed (pip install -e '.[peers]')")),
    (["--impl", f"{MUTANTS}:textbook", "--window", "4,0"], "does not accept the variant keyword"),
])
def test_drift_impl_refuses_what_it_cannot_run_before_any_rank_starts(argv, match, capsys):
    assert main(["drift", *argv, "--ring-sizes", "1,2", "--out", "/nonexistent/never-written"]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.cli
def test_under_torchrun_the_simulated_sweep_is_run_and_written_once(torchrun_world, tmp_path):
    """The simulated ring needs no ranks: under torchrun rank 0 runs and writes it, the other
    ranks leave at once (they used to repeat the whole sweep and overwrite the report)."""
    if torchrun_world is not None:
        pytest.skip("starts its own torchrun world: plain pytest")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                           "ringcheck", "drift", "--dtypes", "bfloat16", "--ring-sizes", "1,2,4,8", "--distributions",
                           "normal", "--modes", "causal", "--seeds", "3", "--out", str(tmp_path / "out"), "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("wrote ") == 1, done.stdout
    load(tmp_path / "out" / "drift.json", schema=DRIFT_SCHEMA)
