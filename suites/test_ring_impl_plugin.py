"""`pytest --ring-impl` and `ringcheck test`: the in-package property suite on any ring.

Each test runs pytest (or `ringcheck test`) in a subprocess from an empty directory, as a user
with a plain install would, with a derandomized profile of 2 examples per property
(`tinyprofile`, loaded with ``-p`` after the plugin's own) on rings of 1 and 2 ranks: our ring
passes every property, a public mutant fails with a command that replays its shrunk case
(which fails again), --ring-forward-only reports each backward half as skipped "not run",
and a bad --ring-impl is a usage error before anything runs.

``--noconftest`` in most of them, as in a plain install's run; one runs without it, where this
checkout's root conftest.py (above the package, so an editable install's run from another
project finds it) must leave that run alone.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ringcheck.launch import CLAIMED_BY
from ringcheck.testing.impl_options import impl_config

TINY = """
from hypothesis import settings


def pytest_configure(config):  # after the ringcheck plugin loaded the --profile (tryfirst)
    settings.register_profile("tiny", settings.get_profile(settings.get_current_profile_name()), max_examples=2,
                              derandomize=True, database=None)
    settings.load_profile("tiny")
"""
NO_SHRINK = """
from hypothesis import Phase, settings


def pytest_configure(config):  # after tinyprofile
    settings.register_profile("noshrink", settings.default, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("noshrink")
"""
MUTANT = "ringcheck.catalogue.mutants:dkdv_not_home"  # wrong on every ring of 2 or more


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """An empty directory with the 2-example profile as a plugin module."""
    where = tmp_path_factory.mktemp("user")
    (where / "tinyprofile.py").write_text(TINY)
    return where


def _run(where: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(where)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", CLAIMED_BY):
        env.pop(name, None)  # a user's plain run, also when this suite runs under torchrun
    return subprocess.run([sys.executable, *argv], cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _pytest(where: Path, *argv: str) -> subprocess.CompletedProcess:
    return _run(where, "-m", "pytest", "--noconftest", "-p", "tinyprofile", "-p", "no:cacheprovider", "-rs", *argv)


def _said(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


@pytest.mark.cli
def test_our_ring_passes_every_property_of_the_in_package_suite(user_dir, torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    result = _pytest(user_dir, "--ring-impl", "ringcheck", "--ring-world-sizes", "1,2", "-v")
    assert result.returncode == 0, _said(result)
    assert ("ringcheck implementation under test: ringcheck on local gloo rings, each ring beside a second one "
            "(mesh cp=P,tp=2); ring sizes 1,2") in result.stdout
    passed = re.findall(r"::(test_\w+)\[forward\+backward\] PASSED", result.stdout)
    # the properties of any ring, the variants, and the one of our ring's internals
    for name in ("test_budget_against_float64", "test_ring_size_and_layout_invariance", "test_determinism",
                 "test_packed_documents_equal_separate_documents", "test_sinks_of_minus_infinity_are_no_sinks",
                 "test_distributed_equals_simulated_bit_for_bit"):
        assert name in passed, _said(result)
    assert " failed" not in result.stdout and " skipped" not in result.stdout, _said(result)


@pytest.mark.cli
def test_a_mutant_fails_with_a_command_that_replays_its_shrunk_case(user_dir, torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    result = _pytest(user_dir, "--ring-impl", MUTANT, "--ring-layout", "zigzag", "--ring-world-sizes", "2",
                     "-k", "test_budget_against_float64", "-q")
    assert result.returncode == 1, _said(result)
    assert "1 failed" in result.stdout and "dk FAILED" in result.stdout, _said(result)
    lines = [line.split("reproduce: ", 1)[1] for line in result.stdout.splitlines() if "reproduce: python -m" in line]
    assert lines, _said(result)
    command = shlex.split(lines[-1])
    assert command[:3] == ["python", "-m", "ringcheck.testing.impl_check"] and MUTANT in command, command
    assert "check_budget(Case(" in command[-1] and "layout='zigzag'" in command[-1], command
    replay = _run(user_dir, *command[1:])
    assert replay.returncode == 1 and "FAILED check_budget against --impl " + MUTANT in replay.stdout, _said(replay)


@pytest.mark.cli
def test_ringcheck_test_from_another_project_passes_beside_the_root_conftest(user_dir, torchrun_world, repo_root):
    """With the editable install, pytest finds this checkout's root conftest.py above the
    in-package suite when another project runs `ringcheck test` (no --noconftest): it names no
    plugin and defines no hook (either would break or change that run), and the run passes."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    tree = ast.parse((repo_root / "conftest.py").read_text())
    names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    hooks = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("pytest_")]
    assert "pytest_plugins" not in names and not hooks, (names, hooks)
    result = _run(user_dir, "-m", "ringcheck", "test", "--impl", "ringcheck.catalogue.mutants:textbook",
                  "--forward-only", "--world-sizes", "1,2", "-p", "tinyprofile", "-p", "no:cacheprovider", "-q",
                  "-k", "test_budget_against_float64 or determinism")
    assert result.returncode == 0, _said(result)
    assert re.search(r"\b2 passed", result.stdout), _said(result)


@pytest.mark.cli
def test_forward_only_reports_every_backward_half_as_not_run(user_dir, torchrun_world):
    """Through `ringcheck test` (the command form, exit code pytest's), on the textbook ring."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    result = _run(user_dir, "-m", "ringcheck", "test", "--impl", "ringcheck.catalogue.mutants:textbook",
                  "--forward-only", "--world-sizes", "1,2", "--noconftest", "-p", "tinyprofile",
                  "-p", "no:cacheprovider", "-rs", "-v", "-k", "test_budget_against_float64 or causal_prefix or determinism")
    assert result.returncode == 0, _said(result)
    out = result.stdout
    for name in ("test_budget_against_float64", "test_causal_prefix_independence_is_exact", "test_determinism"):
        assert re.search(rf"::{name}\[forward\] PASSED", out), _said(result)
        assert re.search(rf"::{name}\[backward\] SKIPPED", out), _said(result)
    assert re.search(r"SKIPPED \[3\] \S+impl_suite.py: not run: --ring-forward-only", out), _said(result)
    assert not re.search(r"\[backward\] PASSED|\[forward\+backward\]", out), _said(result)
    assert "forward only (backward properties: not run)" in out, _said(result)


@pytest.mark.cli
@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                    reason="ring-flash-attn is not installed (pip install ring-flash-attn==0.1.8)")
def test_cases_an_adapter_refuses_are_drawn_again_or_the_property_skipped(user_dir, torchrun_world):
    """ring_flash_attn:zigzag takes documents on zigzag_docs shards only (validate refuses them on
    zigzag) and runs on flash-attn 2 (no value head dim of its own): the suite drew such cases
    and ran them, and the adapter computed documents as if zigzag_docs (padding 'not inert',
    wrong out) or crashed. Now those cases are drawn again, and a property whose every case is
    refused is skipped with the adapter's reason."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    result = _pytest(user_dir, "--ring-impl", "ring_flash_attn:zigzag", "--ring-flash-attn-stand-in",
                     "--ring-layout", "zigzag,zigzag_docs", "--ring-world-sizes", "2", "--ring-dtypes", "bfloat16",
                     "-v", "-k", "packed_documents or padding_is_inert")
    assert result.returncode == 0, _said(result)
    for name in ("test_packed_documents_equal_separate_documents", "test_padding_is_inert_and_its_rows_are_nan_free"):
        assert re.search(rf"::{name}\[forward\+backward\] PASSED", result.stdout), _said(result)
    refused = _pytest(user_dir, "--ring-impl", "ring_flash_attn:zigzag", "--ring-flash-attn-stand-in",
                      "--ring-layout", "zigzag", "--ring-world-sizes", "2", "--ring-dtypes", "bfloat16", "-v",
                      "-k", "packed_documents")
    assert refused.returncode == 0, _said(refused)
    assert re.search(r"SKIPPED \[1\] \S+impl_suite.py:\d+: every case drawn was refused: --impl ring_flash_attn:zigzag "
                     r"refuses .*pass --layout zigzag_docs", refused.stdout), _said(refused)


@pytest.mark.parametrize("spec, said", [
    ("not_a_module_xyz:ring_fn", "cannot import module 'not_a_module_xyz'"),
    ("ringcheck.catalogue.mutants:no_such_fn", "has no attribute 'no_such_fn'"),
    ("my_ring", "neither a built-in adapter"),
    ("ringcheck.catalogue.mutants:MUTANTS", "is not callable"),
])
def test_a_bad_ring_impl_says_what_to_fix(spec, said):
    with pytest.raises((ValueError, TypeError), match=re.escape(said)):
        impl_config(spec)


def test_bad_ring_options_say_what_to_fix():
    with pytest.raises(ValueError, match=r"unknown layout\(s\) \['diagonal'\]"):
        impl_config("ringcheck", layouts="diagonal")
    with pytest.raises(ValueError, match=r"runs the layouts \['contiguous', 'zigzag'\], not 'striped'"):
        impl_config("torch_cp", layouts="striped")
    with pytest.raises(ValueError, match=r"ring sizes like 1,2,4"):
        impl_config("ringcheck", world_sizes="two")
    with pytest.raises(ValueError, match=r"the torchrun world has 2; launch with --nproc-per-node=4"):
        impl_config("ringcheck", world_sizes="1,4", torchrun_size=2)
    with pytest.raises(ValueError, match=r"unknown dtype\(s\) \['float8'\]"):
        impl_config("ringcheck", dtypes="float8")
    cfg = impl_config("ringcheck.catalogue.mutants:textbook")
    assert cfg.layouts == ("zigzag",) and cfg.world_sizes == (1, 2, 3, 4) and not cfg.forward_only


@pytest.mark.cli
def test_a_bad_ring_impl_is_a_usage_error_of_pytest_and_of_ringcheck_test(user_dir):
    said = "--ring-impl: --impl not_a_module_xyz:ring_fn: cannot import module 'not_a_module_xyz'"
    result = _run(user_dir, "-m", "ringcheck", "test", "--impl", "not_a_module_xyz:ring_fn", "--noconftest")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR and said in result.stderr, _said(result)
    assert "Traceback" not in result.stderr, _said(result)
    result = _pytest(user_dir, "--ring-world-sizes", "2")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, _said(result)
    assert "--ring-world-sizes need --ring-impl MOD:FN" in result.stderr, _said(result)


@pytest.mark.cli
def test_the_suite_checks_the_ring_under_checkpointing_and_under_compile(user_dir, torchrun_world):
    """The recompute test fails a ring whose backward reads a slot the recompute overwrote (and
    nothing else does), the compile test a ring whose compile-only branch is wrong."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    wrapped = "ringcheck.catalogue.wrapped_mutants"
    result = _pytest(user_dir, "--ring-impl", f"{wrapped}:recompute_slot", "--ring-layout", "zigzag",
                     "--ring-world-sizes", "2", "-v")
    assert result.returncode == 1, _said(result)
    failed = re.findall(r"::(test_\w+)(?:\[[^\]]*\])? FAILED", result.stdout)
    assert failed == ["test_recompute_under_activation_checkpointing"], _said(result)
    assert re.search(r"::test_two_calls_before_one_backward\[forward\+backward\] PASSED", result.stdout)
    assert "under torch.utils.checkpoint(use_reentrant=False), layer 1's dq, dk, dv differ" in result.stdout
    assert "reproduce: python -m ringcheck.testing.impl_check" in result.stdout and "check_recompute(" in result.stdout
    result = _pytest(user_dir, "--ring-impl", f"{wrapped}:compile_path_mask", "--ring-layout", "zigzag",
                     "--ring-world-sizes", "2", "-k", "test_torch_compile_equals_eager", "-v")
    assert result.returncode == 1 and "::test_torch_compile_equals_eager FAILED" in result.stdout, _said(result)
    assert "compiled with aot_eager, call 1's out, lse, dq, dk, dv differ from eager" in result.stdout, _said(result)


@pytest.mark.cli
def test_a_ring_that_is_not_deterministic_is_an_xfail_unless_determinism_is_required(user_dir, torchrun_world):
    """nondeterministic_sum (correct; its float32 sums change in the last bits on every call from 3
    ranks on): test_determinism is an XFAIL naming a case, and the bit-exact properties pass it within
    the two runs' budgets; --ring-require determinism fails it; a ring whose second run is beyond
    rounding (nondeterministic_noise) fails."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    (user_dir / "noshrink.py").write_text(NO_SHRINK)  # the failing runs: no shrinking, which reruns the ring
    argv = ("--ring-world-sizes", "3", "-p", "noshrink", "-rx")
    result = _pytest(user_dir, "--ring-impl", "ringcheck.catalogue.mutants:nondeterministic_sum", *argv,
                     "--ring-dtypes", "float32", "-k", "determinism or negation or prefix")
    assert result.returncode == 0, _said(result)
    assert re.search(r"XFAIL \S*test_determinism\[forward\+backward\] - not deterministic \(reported; "
                     r"--ring-require determinism fails it\)", result.stdout), _said(result)
    assert re.search(r"\b2 passed, \d+ deselected, 1 xfailed", result.stdout), _said(result)
    result = _pytest(user_dir, "--ring-impl", "ringcheck.catalogue.mutants:nondeterministic_sum", *argv,
                     "--ring-dtypes", "float32", "--ring-require", "determinism", "-k", "determinism")
    assert result.returncode == 1 and "not deterministic, and determinism is required" in result.stdout, _said(result)
    result = _pytest(user_dir, "--ring-impl", "ringcheck.catalogue.mutants:nondeterministic_noise", *argv,
                     "--ring-dtypes", "bfloat16", "-k", "determinism")
    # its noise is drawn on every call: the first comparison to see it may be the two runs' (beyond their
    # budgets) or the run inside the mesh against the truth (dq over budget); either fails it
    assert result.returncode == 1 and ("differ by more than the two" in result.stdout
                                       or "dq FAILED" in result.stdout), _said(result)
