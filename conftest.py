"""This repository's own suites (suites/), and nothing more: no `pytest_plugins` and no hooks.

The plugin is registered through its `pytest11` entry point, and the suites' defaults (threads,
seeds, the Triton interpreter, torchrun variables) through pyproject's `addopts`
(`-p ringcheck.testing.suite_defaults`). This file sits above the package, so with an editable
install pytest also finds it when another project runs the in-package suite (`ringcheck test`,
`pytest --ring-impl`); there a conftest may not name plugins, and a hook here would change that
project's run. What it holds is collection of this checkout alone: the folders that are not
suites, and the checkout's root as a fixture for the suites that read its files.
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
