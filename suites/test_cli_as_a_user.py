"""The command as a new user meets it: run from beside a clone named `ringcheck`, a re-run
command that reproduces the run, a config file with the flags' keys, one error line under
torchrun, and bench refusing to report success without our ring."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ringcheck.cli import main, our_ring_failures, rerun_command
from ringcheck.commands.validate import Target

BIN = Path(sys.executable).parent
SMALL = ["--seq-len", "32", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
         "--distributions", "normal", "--sample-rows", "4"]
USER_RING = "from ringcheck.catalogue.mutants import textbook as fn\n"


def _beside_a_clone(where: Path) -> Path:
    """`where` holding the user's module and a folder named ringcheck (a clone of this
    repository: its root has no __init__.py, so Python would import it as a namespace package
    in place of the installed one)."""
    clone = where / "ringcheck"
    (clone / "ringcheck").mkdir(parents=True)
    (clone / "README.md").write_text("# a clone of ringcheck\n")
    (clone / "ringcheck" / "placeholder.txt").write_text("not the package\n")
    (where / "myring.py").write_text(USER_RING)
    return where


@pytest.fixture
def beside_a_clone(tmp_path):
    return _beside_a_clone(tmp_path)


@pytest.fixture(scope="module")
def console_script_run(tmp_path_factory):
    """The user's ring validated through the console script from beside a clone, with a report
    (its folder, the report's folder, the finished process): run once, read by two tests."""
    where = _beside_a_clone(tmp_path_factory.mktemp("user"))
    report = tmp_path_factory.mktemp("report")
    done = _run([str(BIN / "ringcheck"), "validate", "--impl", "myring:fn", "--quick", *SMALL, "--report",
                 str(report)], where)
    return where, report, done


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RINGCHECK_TORCHRUN_RANK_PID")


def _run(cmd, cwd, *, timeout=300, pythonpath="."):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.cli
@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_validate_from_a_directory_holding_a_folder_named_ringcheck(request, how):
    if how == "console script":
        _, _, done = request.getfixturevalue("console_script_run")
    else:
        where = _beside_a_clone(request.getfixturevalue("tmp_path"))
        done = _run([sys.executable, "-m", "ringcheck", "validate", "--impl", "myring:fn", "--quick", *SMALL], where)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.cli
def test_bench_from_a_directory_holding_a_folder_named_ringcheck(beside_a_clone):
    done = _run([str(BIN / "ringcheck"), "bench", "--quick", "--sections", "speed", "--impl", "ringcheck,sdpa",
                 "--tokens", "64", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--warmup", "0"],
                beside_a_clone)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "n/a" not in done.stdout, done.stdout


def test_bench_never_reports_success_without_our_ring():
    doc = {"speed": [{"system": "ringcheck", "key": "float32/P2/N64/bidirectional/fwd", "median_s": None,
                      "na": "ImportError: cannot import name 'ring_attention'"},
                     {"system": "sdpa", "key": "float32/P2/N64/bidirectional/fwd", "median_s": 0.1}]}
    assert our_ring_failures(doc) == ["ringcheck float32/P2/N64/bidirectional/fwd: ImportError: cannot import "
                                      "name 'ring_attention'"]
    doc["speed"][0].update(median_s=0.2, na=None)
    assert our_ring_failures(doc) == []


def test_the_echoed_command_reproduces_the_run(tmp_path, capsys):
    """Flags, a config file's values and the run's own flags (quick, timeout) all end up in the
    command the terminal and the documents carry; re-running it gives the same target and the
    same verdict."""
    config = tmp_path / "target.toml"
    config.write_text("[validate]\nseq_len = 32\ncausal = false\nquick = true\ntimeout = 30\nheads = 2\n"
                      "kv_heads = 1\nhead_dim = 8\n")
    first = tmp_path / "first"
    code = main(["validate", "--config", str(config), "--world-size", "2", "--layout", "contiguous",
                 "--distributions", "normal", "--sample-rows", "4", "--report", str(first)])
    doc = json.loads((first / "validate.json").read_text())
    command = doc["command"]
    for flag in ("--no-causal", "--quick", "--timeout 30", "--layout contiguous", "--seq-len 32", "--head-dim 8",
                 "--distributions normal", "--sample-rows 4", "--world-size 2"):
        assert flag in command, command
    assert command in capsys.readouterr().out and command in (first / "validate.md").read_text()
    where, _, run = command.partition(" && ")  # where it ran: cd DIR (and the PYTHONPATH it needed)
    assert shlex.split(where) == ["cd", os.getcwd()]
    argv = [word for word in shlex.split(run) if not word.startswith("PYTHONPATH=")]
    assert argv[:2] == ["ringcheck", "validate"]
    second = tmp_path / "second"
    again = main([*argv[1:], "--report", str(second)])
    redo = json.loads((second / "validate.json").read_text())
    def same(c):  # in one process the launcher pinned its package on PYTHONPATH after the first run
        return " ".join(w for w in shlex.split(c) if not w.startswith("PYTHONPATH="))
    assert again == code and redo["target"] == doc["target"] and same(redo["command"]) == same(command)
    assert [(c["check"], c["status"]) for c in redo["checks"]] == [(c["check"], c["status"]) for c in doc["checks"]]


@pytest.mark.cli
def test_the_stored_command_reproduces_the_run_from_the_directory_it_names(console_script_run, tmp_path):
    """A user's ring imported through PYTHONPATH=. in the user's folder: the command stored in the
    report carries the folder and that PYTHONPATH (made absolute), so pasting it anywhere, with
    no PYTHONPATH of one's own, runs the same target to the same verdict."""
    beside_a_clone, report, done = console_script_run
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((report / "validate.json").read_text())
    command = doc["command"]
    assert command.startswith(f"cd {shlex.quote(str(beside_a_clone))} && PYTHONPATH=")
    assert command in (report / "validate.md").read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in TORCHRUN_VARS}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    again = subprocess.run(["bash", "-c", f"{command} --report {shlex.quote(str(tmp_path / 'again'))}"],
                           cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    redo = json.loads((tmp_path / "again" / "validate.json").read_text())
    assert redo["target"] == doc["target"] and redo["command"] == command


def test_the_rerun_command_spells_out_every_setting():
    command = rerun_command(Target(causal=False, local_lengths=(2, 6)), 60.0)
    assert command.startswith("ringcheck validate --seq-len 2048 ") and "--no-causal" in command
    assert "--quick" in command and command.endswith("--timeout 60") and "--softmax-scale" not in command
    assert "--local-lengths 4,8" in rerun_command(Target(local_lengths=(4, 8)), 60.0)
    assert rerun_command(Target(world_size=8), 5.0, torchrun=True).startswith(
        "torchrun --nproc-per-node=8 -m ringcheck validate")


@pytest.mark.parametrize("key, value, message", [("quick", '"yes"', "quick must be true or false"),
                                                  ("timeout", "-1", "timeout must be a positive number"),
                                                  ("colour", '"red"', "unknown key(s) ['colour']")])
def test_a_bad_config_key_exits_2_with_one_line(tmp_path, capsys, key, value, message):
    config = tmp_path / "bad.toml"
    config.write_text(f"{key} = {value}\n")
    assert main(["validate", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.cli
def test_under_torchrun_a_bad_impl_is_said_once(tmp_path):
    done = _run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=3", "-m", "ringcheck", "validate",
                 "--impl", "nosuch:fn"], tmp_path, timeout=200, pythonpath="")
    said = done.stderr.count("ringcheck validate: error: --impl nosuch:fn: cannot import module 'nosuch'")
    assert said == 1, done.stderr
    assert done.returncode == 1  # torchrun's own code for any failed rank
    assert "exitcode: 2" in done.stderr.replace("exitcode  :", "exitcode:").replace("exitcode :", "exitcode:")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.cli
@pytest.mark.parametrize("layout, causal", [("zigzag", "--causal"), ("contiguous", "--no-causal"),
                                            ("contiguous", "--causal")])
def test_the_readme_example_ring_passes_validate_on_every_layout_it_knows(tmp_path, layout, causal):
    """examples/my_ring.py, the module README's "Validate your own ring" shows: one function for
    both layouts (it takes the `layout` keyword), validated as a user runs it."""
    done = _run([str(BIN / "ringcheck"), "validate", "--impl", "my_ring:ring_fn", "--layout", layout, causal,
                 "--quick", "--seq-len", "64", "--world-size", "2", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--sample-rows", "8", "--report", str(tmp_path)],
                tmp_path, pythonpath=str(EXAMPLES))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "validate.json").read_text())
    assert doc["passed"] and f"--layout {layout}" in doc["command"] and causal in doc["command"]
    assert all(c["status"] != "fail" for c in doc["checks"])


def test_report_diff_of_different_settings_warns_and_exact_refuses(tmp_path, capsys):
    committed = Path(__file__).resolve().parents[1] / "reports" / "cpu" / "drift.json"
    doc = json.loads(committed.read_text())
    doc["spec"]["ring_sizes"] = doc["spec"]["ring_sizes"][:3]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    assert main(["report", "diff", "--exact", str(committed), str(other)]) == 2
    err = capsys.readouterr().err
    assert "ring_sizes" in err and len(err.strip().splitlines()) == 1, err
    main(["report", "diff", str(committed), str(other)])
    assert "ring_sizes" in capsys.readouterr().out


def test_a_failing_rank_is_summarised_by_its_exception_type_and_first_line():
    from ringcheck.cli.validate import short_failures
    from ringcheck.launch import RingError

    text = ("raised NotImplementedError: Could not run 'aten::foo' with arguments from the 'CPU' backend.\n"
            "Traceback (most recent call last):\n  ...\nNotImplementedError: Could not run 'aten::foo'\n"
            "PythonDispatcher: registered at /pytorch/build/aten/src/ATen/RegisterCPU.cpp:123")
    summary = short_failures(RingError("task failed on a ring of 2; failing ranks: 0", {0: text}))
    assert "rank 0: raised NotImplementedError: Could not run 'aten::foo' with arguments from the 'CPU'" in summary
    assert "PythonDispatcher" not in summary
