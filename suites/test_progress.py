"""Progress of long runs: on a terminal only, never with --quiet, never in a report; validate's
notes travel from rank 0 of a local ring (a worker process) to the parent."""

from __future__ import annotations

import json
from io import StringIO

from rich.console import Console

from ringcheck import cli
from ringcheck.commands.validate import Target, validate, validate_steps
from ringcheck.launch import LocalRings, ProgressFile, relay
from ringcheck.render.terminal import drift_progress, progress

SMALL = ["--seq-len", "32", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
         "--distributions", "normal", "--sample-rows", "4", "--quick"]


def _terminal() -> tuple[Console, StringIO]:
    out = StringIO()
    return Console(force_terminal=True, file=out, width=120), out


def test_progress_shows_done_of_total_and_the_current_step():
    console, out = _terminal()
    with progress(3, console, label="validating") as advance:
        advance("normal, 2 tokens per rank")
        advance("full length 8192")
    text = out.getvalue()  # the last frame, drawn as the bar stops (then erased: transient)
    assert "1/3" in text and "full length 8192" in text and "validating" in text


def test_progress_disabled_prints_nothing():
    console, out = _terminal()
    with progress(3, console, enabled=False) as advance:
        advance("normal, 2 tokens per rank")
    with drift_progress(2, console, enabled=False) as advance:
        advance("case seed=0")
    assert out.getvalue() == ""


def test_spinner_without_a_total_shows_the_case():
    console, out = _terminal()
    with progress(None, console, label="benchmarking") as advance:
        advance("speed P2 float32")
    assert "speed P2 float32" in out.getvalue() and "benchmarking" in out.getvalue()


def test_relay_delivers_every_line_and_survives_a_broken_file(tmp_path):
    got: list[str] = []
    with relay(got.append, interval=0.01) as channel:
        channel("first  step\nsplit")
        channel("second")
    assert got == ["first step split", "second"]
    ProgressFile(str(tmp_path / "missing" / "file.txt"))("no such folder: ignored")  # never raises


def test_validate_notes_reach_the_command_that_drives_the_ring():
    target = Target(seq_len=32, world_size=2, heads=2, kv_heads=1, head_dim=8, distributions=("normal",),
                    sample_rows=4, local_lengths=(2, 6))
    got: list[str] = []
    with LocalRings(timeout=60) as rings:
        rows = validate(target, rings, progress=got.append)
    assert all(r.passed for r in rows)
    assert len(got) == validate_steps(target) == 10  # 2 scaled cases, 3 ragged calls (130, 66, 130), 5 more
    assert got[:2] == ["normal, 2 tokens per rank", "normal, 6 tokens per rank"]
    assert got[2:5] == [f"ragged shards: {n} tokens per rank, 1 distribution(s)" for n in (130, 66, 130)]
    assert "full length 32" in got and "determinism" in got and "recompute under activation checkpointing" in got
    assert "device placement" in got


def test_validate_off_a_terminal_prints_no_progress(capsys, tmp_path):
    code = cli.main(["validate", *SMALL, "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    note = "normal, 2 tokens per rank"  # a progress note (the ragged rows' names say "tokens per rank" too)
    assert "validating" not in out and note not in out and "determinism (two" in out
    doc = json.loads((tmp_path / "validate.json").read_text())
    assert "validating" not in json.dumps(doc) and note not in (tmp_path / "validate.md").read_text()


def test_quiet_is_a_flag_of_every_long_command():
    parser = cli.build_parser()
    for command in (["validate"], ["drift"], ["bench"]):
        assert parser.parse_args([*command, "-q"]).quiet and parser.parse_args([*command, "--quiet"]).quiet
        assert not parser.parse_args(command).quiet
