"""CI runs what it must: every suite that starts a command (ringcheck.cli.main in the test's own
process, or `ringcheck` as a subprocess) is listed in .ci/torchrun-suites, which .ci/run runs
again under torchrun, so a command that mistakes itself for a launched rank cannot come back
unseen (issue 25, item 8)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / ".ci" / "torchrun-suites"
# main imported from the CLI, the CLI module's main called, or the command started as a process
STARTS_A_COMMAND = re.compile(r'from ringcheck\.cli import [^\n#]*\bmain\b|\bcli\.main\(|"-m", "ringcheck"|bin/ringcheck')
OWN_STEP = {"suites/test_distributed.py",  # .ci/run runs it under torchrun on its own, with the planted failure
            "suites/test_ci.py"}           # this file: its pattern, not a command


def _listed() -> list[str]:
    return [line.strip() for line in LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_every_suite_that_starts_a_command_runs_under_torchrun_in_ci():
    starting = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "suites").glob("test_*.py"))
                if STARTS_A_COMMAND.search(p.read_text())} - OWN_STEP
    missing = sorted(starting - set(_listed()))
    assert not missing, f"add {missing} to .ci/torchrun-suites: they start a command, and CI runs those under torchrun"


def test_the_list_names_suites_that_exist():
    listed = _listed()
    gone = [name for name in listed if not (ROOT / name).is_file()]
    assert not gone and len(listed) == len(set(listed)), f".ci/torchrun-suites: missing files {gone}, or a repeat"


def test_ci_runs_the_list_under_torchrun():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"torchrun-suites.*\n.*torchrun --standalone --nproc-per-node=4 -m pytest \"\$\{suites\[@\]\}\"", script), script


def test_ci_runs_the_precision_suites_on_a_second_cpu_kernel():
    """make test runs the machine's best CPU kernels; CI runs the suites whose verdicts rest on
    rounding again on PyTorch's portable ones (issue 34: a verdict that flipped on AVX2)."""
    script = (ROOT / ".ci" / "run").read_text()
    suites = re.search(r"CAPABILITY_SUITES=\(([^)]*)\)", script)
    assert suites and {"suites/test_precision_class.py", "suites/test_budget_rule.py"} <= set(suites.group(1).split())
    assert all((ROOT / name).is_file() for name in suites.group(1).split())
    assert re.search(r'ATEN_CPU_CAPABILITY=default [^\n]*pytest "\$\{CAPABILITY_SUITES\[@\]\}"', script), script


def test_make_test_lints_with_a_pinned_ruff():
    """make test runs ruff check before the suites, with the version the test extra pins."""
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\ntest: "):]
    assert "ruff check ." in target.split("\n\n")[0], target
    assert re.search(r'"ruff==[0-9.]+"', (ROOT / "pyproject.toml").read_text())
