"""`ringcheck validate --forward-only`: an inference ring gets forward verdicts, and its
backward rows say "not run" (never "pass"); a forward bug still fails; without the flag a
ring that has no backward is a broken contract that names the flag."""

from __future__ import annotations

import json

import pytest

from ringcheck.cli import main

SMALL = ["--seq-len", "32", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
         "--distributions", "normal", "--sample-rows", "4", "--quick", "-q"]
INFERENCE = ["--impl", "ringcheck.catalogue.bad_impls:inference_only"]


@pytest.fixture
def local_only(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local ring: plain pytest")


def test_a_ring_without_backward_needs_the_flag(local_only, capsys):
    assert main(["validate", *INFERENCE, *SMALL]) == 2
    err = capsys.readouterr().err
    assert "returned an out with no autograd graph" in err and "pass --forward-only" in err, err


def test_forward_only_judges_the_forward_and_never_passes_the_backward(local_only, tmp_path, capsys):
    assert main(["validate", *INFERENCE, *SMALL, "--forward-only", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASSED (forward only)" in out and "backward checks not run" in out, out
    doc = json.loads((tmp_path / "validate.json").read_text())
    status = {c["check"]: c["status"] for c in doc["checks"]}
    backward = [name for name in status if "backward" in name]  # scaled, precision, full length, two calls
    assert len(backward) == 4 and all(status[name] == "not run" for name in backward), status
    assert all(status[name] == "pass" for name in status if name.startswith("forward")), status
    assert doc["passed"] and doc["target"]["forward_only"] and "--forward-only" in doc["command"]


def test_forward_only_still_fails_a_forward_bug(local_only, capsys):
    assert main(["validate", "--impl", "ringcheck.catalogue.mutants:merge_no_rescale", *SMALL, "--forward-only",
                 "--distributions", "wide"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "not run" in out
