"""The pytest plugin's part for a training step under test: ``--ring-recipe PKG.MOD:OBJ``.

    pytest --ring-recipe my_pkg.train:recipe                      # local gloo rings, P = 2 and 4
    torchrun --nproc-per-node=4 -m pytest --ring-recipe my_pkg.train:recipe

runs the cases of `ringcheck step` (`ringcheck.step.cases`) as tests, one per case and ring size
(`ringcheck/testing/recipe_suite.py`, collected from the package as --ring-impl's suite is): each
passes when the recipe's step at CP=P equals the same step at CP=1 within the budget, and a
failure names the bug class the figures match. Under torchrun the ring is the whole world and
the verdicts are collective, as every test of the plugin's.
`ringcheck.testing.plugin` calls `add_options` and `configure`; this module holds the fixtures.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ..launch.environment import from_torchrun_env
from . import model_plugin
from .suite_collect import join_run, suite_module

RECIPE_SUITE = Path(__file__).with_name("recipe_suite.py")
SIZES = (2, 4)  # the local rings' sizes (under torchrun: the world's)


def add_options(parser) -> None:
    model_plugin.add_options(parser)  # --ring-model: step --model's cases, beside --ring-recipe's
    group = parser.getgroup("ringcheck recipe under test", "your training step at CP=P against CP=1 (ringcheck step)")
    group.addoption("--ring-recipe", default=None, metavar="PKG.MOD:OBJ",
                    help="run the cases of ringcheck step on this recipe (plain, hf_llama or package.module:object)")
    group.addoption("--ring-recipe-impl", default="ringcheck", metavar="MOD:FN|ADAPTER",
                    help="the ring the recipe's attention goes through (default ringcheck; one that runs only bf16 "
                         "or fp16 is called in bf16 inside the float64 step, with --ring-flash-attn-stand-in on CPU)")


def configure(config) -> None:
    model_plugin.configure(config)
    spec = config.getoption("--ring-recipe")
    if spec is None:
        return
    # start-up time: the contract imports torch, needed only with --ring-recipe
    from ..step.contract import load_recipe

    try:
        load_recipe(spec)
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(f"ringcheck --ring-recipe: {exc}") from None
    config.pluginmanager.register(sys.modules[__name__], "ringcheck-recipe")
    join_run(config, RECIPE_SUITE)


# the module is registered as a plugin (fixtures and hook below) only with --ring-recipe

@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """The suite's test ids from an installed package: its path in the package (as --ring-impl's)."""
    return suite_module(module_path, parent, RECIPE_SUITE)


@pytest.fixture(scope="session")
def ring_recipe_run(request, ring_processes):
    """The session's runs of the recipe, one per ring size (every case at once)."""
    # start-up time: the command's room imports the ring and the launchers
    from ..commands.step import default_cases, narrowed_for, run_step
    from ..harness import ImplOptions
    from ..harness.runner import loaded
    from ..step.cases import CASES
    from ..step.contract import load_recipe
    from ..step.run import StepConfig

    spec, impl = request.config.getoption("--ring-recipe"), request.config.getoption("--ring-recipe-impl")
    stand_in = bool(request.config.getoption("--ring-flash-attn-stand-in"))
    # a ring that runs only bf16 / fp16 (flash-attn's) is called narrower, as `ringcheck step` does
    narrow = narrowed_for(loaded(ImplOptions(impl, stand_in=stand_in)), "float64")
    runs: dict[int, dict] = {}

    def run(world_size: int) -> dict:
        if world_size not in runs:  # the cases the session's selected tests ask for (-k), in the table's order
            asked = {getattr(item, "callspec", None) and item.callspec.params.get("case")
                     for item in request.session.items}
            config = StepConfig(recipe=spec, impl=impl, world_size=world_size, attention_dtype=narrow,
                                flash_attn_stand_in=stand_in)
            runnable = default_cases(load_recipe(spec), loaded(config.impl_options), config)  # the ring's rules
            cases = tuple(c for c in CASES if c in asked and c in runnable) or runnable[:1]
            runs[world_size] = run_step(replace(config, cases=cases), ring_processes)
        return runs[world_size]
    return run


def ring_sizes(config) -> tuple[int, ...]:
    """The ring sizes of the suite: the torchrun world's size, else `SIZES`."""
    env = from_torchrun_env(os.environ)
    return SIZES if env is None else (env.world_size,)
