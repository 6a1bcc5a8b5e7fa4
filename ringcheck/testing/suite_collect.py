"""How an in-package suite joins a pytest run (--ring-recipe's and --ring-model's): the run's
arguments, and its test ids when it is collected from an installed package."""

from __future__ import annotations

from pathlib import Path

import pytest


def join_run(config, suite: Path) -> None:
    """With no test paths given `suite` is what runs; with paths it joins them."""
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = [str(suite)]
    elif str(suite) not in config.args:
        config.args.append(str(suite))


def suite_module(module_path, parent, suite: Path):
    """The suite's module with its path in the package as test ids (as --ring-impl's), or None for
    any other module (and for the suite inside the run's own root)."""
    if module_path.resolve() != suite.resolve() or module_path.is_relative_to(parent.config.rootpath):
        return None
    return pytest.Module.from_parent(parent, path=module_path, nodeid=f"ringcheck/testing/{suite.name}")
