"""This repository's own suites (suites/), and nothing more: no `pytest_plugins` and no hooks.

The plugin is registered through its `pytest11` entry point, and the suites' defaults (threads,
seeds, the Triton interpreter, torchrun variables) through pyproject's `addopts`
(`-p ringcheck.testing.suite_defaults`). This file sits above the package, so with an editable
install pytest also finds it when another project runs the in-package suite (`ringcheck test`,
`pytest --ring-impl`); there a conftest may not name plugins, and a hook here would change that
project's run. What it holds is collection of this checkout alone: the folders that are not
suites, the checkout's root as a fixture for the suites that read its files, and the suites'
rings of a short grace (`impatient_rings`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# programs and what they write, never tests (pytest run from the root with no path collects suites/ only,
# by testpaths; these keep a `pytest .` or `pytest benchmarks/x.py` from importing them as tests)
collect_ignore = ["benchmarks", "examples", "reports", "docs"]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of this checkout (the folder of pyproject.toml)."""
    return ROOT


@pytest.fixture(scope="module")
def impatient_rings(ring_processes):
    """Local rings whose other ranks get half a second, not the launcher's 2 s, to report after a first
    failure, for the suites' rings that raise on one rank while the others stay blocked in the ring's own
    collectives (a validate waits out the grace twice: the case, then its plain call alone); under
    torchrun, its world."""
    if ring_processes.size is not None:
        yield ring_processes
        return
    from ringcheck.launch import LocalRings  # the suites' fixture; this file imports nothing of ringcheck at load

    with LocalRings(grace=0.5) as rings:
        yield rings
