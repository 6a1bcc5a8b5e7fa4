"""CI runs what it must: every suite that starts a command (ringcheck.cli.main in the test's own
process, or `ringcheck` as a subprocess) is listed in .ci/torchrun-suites, which .ci/run runs
again under torchrun, so a command that mistakes itself for a launched rank cannot come back
unseen (issue 25, item 8)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


# ---------------------------------------------------------------- the end-to-end command tests (issue 37, item 7)

# tests that start a process which is not a ringcheck command or pytest: they stay in make test
NOT_A_COMMAND = {
    "test_a_subprocess_of_a_rank_is_not_a_rank": "python -c: what a rank's subprocess inherits",
    "test_the_site_builds_strictly": "mkdocs build",
    "test_cpu_tensors_with_compiled_kernels_raise_with_the_fix": "python -c: a Triton kernel without the interpreter",
    "test_kernels_compile_for_an_h100_without_one": "python -c: Triton compiles for sm_90",
    "test_variant_kernels_compile_for_an_h100_without_one": "python -c: Triton compiles for sm_90",
    "test_every_tile_address_is_computed_in_int64": "python -c: Triton compiles for sm_90",
}


def _process_starters(tree) -> set[str]:
    """Module-level functions (tests, fixtures, helpers) that start a process, directly or through
    another such function or a fixture of that name."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def called(node) -> set[str]:
        names = set()
        for x in ast.walk(node):
            if isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and isinstance(x.func.value, ast.Name):
                names.add(f"{x.func.value.id}.{x.func.attr}")
            elif isinstance(x, ast.Call) and isinstance(x.func, ast.Name):
                names.add(x.func.id)
        return names

    starters: set[str] = set()
    while True:
        more = {name for name, node in defs.items() if name not in starters and (
            any(c.startswith("subprocess.") for c in called(node)) or called(node) & starters
            or {a.arg for a in node.args.args} & starters)}
        if not more:
            return starters
        starters |= more


def _marked_cli(node) -> bool:
    return any(ast.unparse(d) == "pytest.mark.cli" for d in node.decorator_list)


def test_every_test_that_starts_a_command_is_marked_cli():
    """make test leaves out the tests that start ringcheck or pytest in a process of their own
    (marker cli) and make test-cli runs them: a new one left unmarked would slow the default run;
    a marked test that starts nothing would be left out of it for no reason."""
    unmarked, needless, seen = [], [], set()
    for path in sorted((ROOT / "suites").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        starters = _process_starters(tree)
        seen |= starters & set(NOT_A_COMMAND)
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            starts = node.name in starters and node.name not in NOT_A_COMMAND
            if starts and not _marked_cli(node):
                unmarked.append(f"{path.name}::{node.name}")
            if _marked_cli(node) and not starts:
                needless.append(f"{path.name}::{node.name}")
    assert not unmarked, f"mark these @pytest.mark.cli (they start a process: make test-cli runs them): {unmarked}"
    assert not needless, f"these are marked cli but start no command: {needless}"
    assert seen == set(NOT_A_COMMAND), f"NOT_A_COMMAND names tests that start no process: {set(NOT_A_COMMAND) - seen}"


def test_each_command_test_runs_once_in_ci():
    """make test deselects the cli tests and the thorough cases, make test-cli selects the cli tests,
    make test-thorough the thorough ones and the property tests at their whole search, but no cli test; .ci/run runs the three targets and deselects
    the cli tests under torchrun (where they start their own worlds and would skip or repeat)."""
    makefile = (ROOT / "Makefile").read_text()
    test, test_cli, thorough = (makefile[makefile.index(f"\n{target}: "):].split("\n\n")[0]
                                for target in ("test", "test-cli", "test-thorough"))
    assert '-m "not cli and not thorough"' in test and re.search(r"pytest suites .*-m cli\b", test_cli), (test, test_cli)
    # make test caps the search (--search-examples): test-thorough runs every property again at the profile's count
    assert '-m "(thorough or hypothesis) and not cli"' in thorough and "--search-examples" not in thorough, thorough
    script = (ROOT / ".ci" / "run").read_text()
    for target in ("test", "test-cli", "test-thorough"):
        assert re.search(rf"^make {target}$", script, re.M), (target, script)
    for line in script.splitlines():
        if "torchrun" in line and "-m pytest" in line and "planted" not in line and "test_distributed" not in line:
            assert '-m "not cli"' in line, line


# ---------------------------------------------------------------- the transformers users have (issue 62, item 4)


def test_ci_runs_the_model_suites_on_the_oldest_transformers_the_hf_extra_allows():
    """The hf extra's lower bound is what the environment `oldest` pins, and CI's last stage runs that
    environment's check (the --model suites and step --model llama); make test runs them on 5.23."""
    from benchmarks.trainer_envs import ENVS, MODEL_SUITES

    hf = re.search(r'^hf = \["transformers>=([0-9.]+),<([0-9.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert hf, "pyproject.toml's hf extra must be a range transformers>=A,<B"
    oldest = {e.name: e for e in ENVS}["oldest"]
    assert oldest.transformers == f"transformers=={hf.group(1)}.0", (oldest, hf.group(1))
    assert all((ROOT / s).is_file() for s in MODEL_SUITES) and len({e.name for e in ENVS}) == len(ENVS)
    stages = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert "benchmarks.trainer_envs --env oldest" in stages[-1], stages[-1]


def test_the_trainer_envs_count_a_junit_report():
    from benchmarks.trainer_envs import junit_counts

    xml = '<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" tests="10" time="1.0">'
    assert junit_counts(xml) == "4 passed, 3 failed, 3 skipped" and junit_counts("") == "no result"


def test_the_quick_loops_search_cap_caps_the_loaded_profile_and_refuses_nonsense():
    """make test's `--search-examples N`: the loaded profile (whatever it is, derandomized under torchrun)
    with at most N examples; a profile below N keeps its own count; N < 1 is a usage error."""
    from types import SimpleNamespace

    from hypothesis import settings

    from ringcheck.testing import suite_defaults

    before = settings.get_current_profile_name()
    parent = settings.get_profile(before)
    try:
        for cap in (3, parent.max_examples + 5):
            settings.load_profile(before)
            suite_defaults.pytest_configure(SimpleNamespace(getoption=lambda name, cap=cap: cap))
            now = settings.get_profile(settings.get_current_profile_name())
            assert now.max_examples == min(cap, parent.max_examples), (cap, now)
            assert now.derandomize == parent.derandomize and now.database == parent.database
        with pytest.raises(pytest.UsageError, match="--search-examples must be >= 1, got 0"):
            suite_defaults.pytest_configure(SimpleNamespace(getoption=lambda name: 0))
    finally:
        settings.load_profile(before)
