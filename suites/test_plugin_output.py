"""What a user of the in-package suite (`pytest --ring-impl`, `ringcheck test`) reads.

A failure shows the shrunk case and the `reproduce:` line that replays it against the
implementation, and nothing meant for ringcheck's own developers: no Hypothesis
`@reproduce_failure` blob (a user cannot decorate a test of the package), no "Explanation" of
lines in ringcheck's files, no `PytestAssertRewriteWarning` from `ringcheck test`. A ring
invariance failure names both rings and the one off from float64. The suite's test ids have a
file part (``ringcheck/testing/impl_suite.py::...``) also when it is collected from outside the
rootdir, and such an id selects its test from any directory.

The runs are subprocesses from an empty directory (``--noconftest``: this checkout's root
conftest sits above the package), with a clean environment (no torchrun variables: a user's
plain run, also when this suite runs under torchrun).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringcheck.judge.check import Case, simulated_impl
from ringcheck.spec import AttentionSpec, RingSpec
from ringcheck.testing.plugin import IMPL_SUITE, SUITE_ID
from ringcheck.testing.properties import check_ring_invariance

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RINGCHECK_TORCHRUN_RANK_PID")
MUTANT = "ringcheck.catalogue.mutants:dkdv_not_home"  # dK and dV wrong on every ring of 2 or more, right at P=1


def _clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name not in TORCHRUN_VARS and not name.startswith("TORCHELASTIC_")}


def _run(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _said(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def invariance_failure(tmp_path_factory, torchrun_world) -> subprocess.CompletedProcess:
    """The ring size invariance property of the in-package suite on a mutant wrong at P > 1 only,
    rings of 1 and 2 (it fails on every case: one of its two rings is wrong)."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    return _run("-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "--ring-impl", MUTANT,
                "--ring-world-sizes", "1,2", "--ring-dtypes", "float32", "-k", "test_ring_size_and_layout_invariance",
                "-x", cwd=tmp_path_factory.mktemp("user"))


@pytest.mark.cli
def test_a_failure_shows_the_shrunk_case_and_its_replay_and_nothing_for_our_developers(invariance_failure):
    result, out = invariance_failure, invariance_failure.stdout
    assert result.returncode == 1 and "1 failed" in out, _said(result)
    assert "Draw 1 (case): Case(spec=AttentionSpec(batch=1," in out, _said(result)  # the shrunk case
    assert re.search(r"Draw 2 \(other ring\): \(\d, 'zigzag'\)", out), _said(result)
    assert re.search(r"reproduce: python -m ringcheck\.testing\.impl_check --impl \S+dkdv_not_home .*"
                     r"\"check_ring_invariance\(Case\(", out), _said(result)
    for noise in ("@reproduce_failure", "Explanation:", "These lines were always and only run by failing test cases"):
        assert noise not in out + result.stderr, _said(result)


@pytest.mark.cli
def test_a_ring_invariance_failure_names_both_rings_and_the_one_off_from_float64(invariance_failure):
    out = invariance_failure.stdout
    both = re.search(r"check_ring_invariance failed for P=(\d) zigzag vs P=(\d) zigzag, (?:bidirectional|causal) ", out)
    assert both and {both.group(1), both.group(2)} == {"1", "2"}, _said(invariance_failure)
    assert re.search(r"d[kv] of P=\d zigzag and of P=\d zigzag differ by more than the two budgets", out), \
        _said(invariance_failure)
    # the mutant is right on one rank: the ring of 2 is the one off
    assert re.search(r"against float64, P=2 zigzag is further off: max \|error\| \S+ \(over its budget\), \S+x "
                     r"P=1 zigzag's \S+ \(within its budget\)", out), _said(invariance_failure)


def _dk_doubled_beyond_one_rank(case: Case):
    """Our simulated ring, with dK doubled on rings of 2 or more (out, lse, dq, dv untouched)."""
    ring = simulated_impl(case)
    if case.ring.world_size == 1:
        return ring
    return lambda q, k, v: ring(q, 2 * k - k.detach(), v)  # the value of k, twice its gradient


@pytest.mark.parametrize("first, other", [(1, 2), (2, 1)])
def test_which_ring_is_off_does_not_depend_on_which_is_drawn_first(first, other):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=8, head_dim=4, dtype="float32", causal=True)
    case = Case(spec, RingSpec(first, "zigzag"), seed=3)
    with pytest.raises(AssertionError) as failed:
        check_ring_invariance(case, other, "zigzag", impl=_dk_doubled_beyond_one_rank)
    said = str(failed.value)
    assert said.startswith(f"check_ring_invariance failed for P={first} zigzag vs P={other} zigzag, causal float32 "
                           f"batch=1 heads=2/1 seq=8 d=4 dist=normal seed=3"), said
    assert f"dk of P={first} zigzag and of P={other} zigzag differ by more than the two budgets" in said, said
    assert "against float64, P=2 zigzag is further off" in said and "P=1 zigzag's" in said, said
    assert f"world_size={other}, layout='zigzag')" in said, said  # the reproduce line


def _collected(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if "::test_" in line]


@pytest.mark.cli
def test_test_ids_have_a_file_part_outside_the_rootdir(tmp_path):
    result = _run("-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "--collect-only", "-q",
                  "--ring-impl", "ringcheck.catalogue.mutants:textbook", cwd=tmp_path)  # rootdir: the empty directory
    ids = _collected(result)
    assert result.returncode == 0 and len(ids) > 10, _said(result)
    assert all(i.startswith("ringcheck/testing/impl_suite.py::test_") for i in ids), _said(result)
    assert "ringcheck/testing/impl_suite.py::test_budget_against_float64[forward+backward]" in ids, _said(result)
    # the ids a run in this checkout gives (pytest's own: the path from the rootdir)
    assert SUITE_ID == IMPL_SUITE.resolve().relative_to(ROOT).as_posix()


@pytest.mark.cli
def test_ringcheck_test_starts_pytest_without_assert_rewrite_warnings(tmp_path):
    """`ringcheck test` used to call pytest.main in its own process, where ringcheck and reference
    were imported already: pytest warned it could not rewrite them. It now starts pytest afresh.
    The test is selected by its id as a failure names it, from a directory without that file."""
    result = _run("-m", "ringcheck", "test", "--impl", "ringcheck.catalogue.mutants:textbook", "--noconftest",
                  "-p", "no:cacheprovider", "--collect-only", "-q", "ringcheck/testing/impl_suite.py::test_determinism",
                  cwd=tmp_path)
    assert result.returncode == 0, _said(result)
    assert _collected(result) == ["ringcheck/testing/impl_suite.py::test_determinism[forward+backward]"], _said(result)
    for warned in ("PytestAssertRewriteWarning", "Module already imported so cannot be rewritten"):
        assert warned not in result.stdout + result.stderr, _said(result)


@pytest.mark.cli
def test_a_project_that_does_not_test_a_ring_pays_no_torch_import(tmp_path):
    """The plugin loads in every pytest run where ringcheck is installed: it imports no torch
    until a test asks for a ring, so another project's suite starts as fast as without it."""
    (tmp_path / "test_other.py").write_text("import sys\n\n\ndef test_no_torch_yet():\n"
                                            "    assert 'torch' not in sys.modules, 'the plugin imported torch'\n")
    result = _run("-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "--profile", "ci",
                  "test_other.py", cwd=tmp_path)  # --profile: the plugin is loaded (it adds that option)
    assert result.returncode == 0 and "1 passed" in result.stdout, _said(result)
