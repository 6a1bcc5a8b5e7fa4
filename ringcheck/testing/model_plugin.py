"""The pytest plugin's part for a transformers model through a glue: ``--ring-model NAME [--ring-glue GLUE]``.

    pytest --ring-model qwen3                                     # local gloo rings, P = 2 and 4
    pytest --ring-model ./config.json --ring-glue my_pkg.cp:glue
    torchrun --nproc-per-node=4 -m pytest --ring-model gpt_oss

runs the cases of `ringcheck step --model` as tests, one per case and ring size
(`ringcheck/testing/model_suite.py`, collected from the package as --ring-recipe's suite is):
each passes when the tiny model through the glue at CP=P equals the model's own eager attention
at CP=1 within the budget; a failure names the lost semantic and the layers (`diagnose`), a case
the glue cannot run is skipped with its reason. A model or glue refused before any rank starts
(`ModelRefused`, `GlueRefused`) is a usage error naming the layer and the feature.
`ringcheck.testing.plugin` calls `add_options` and `configure`; this module holds the fixture.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ..launch.environment import from_torchrun_env
from .suite_collect import join_run, suite_module

MODEL_SUITE = Path(__file__).with_name("model_suite.py")
SIZES = (2, 4)  # the local rings' sizes (under torchrun: the world's)


def add_options(parser) -> None:
    group = parser.getgroup("ringcheck model under test", "a transformers model through a glue at CP=P against its "
                                                          "own attention at CP=1 (ringcheck step --model)")
    group.addoption("--ring-model", default=None, metavar="NAME",
                    help="run the cases of ringcheck step --model on this model (a transformers model_type or a "
                         "config.json path)")
    group.addoption("--ring-glue", default="ringcheck", metavar="GLUE",
                    help="the glue under test (default ringcheck; ring_flash_attn; PKG.MOD:OBJ)")


def configure(config) -> None:
    name = config.getoption("--ring-model")
    if name is None:
        return
    # start-up time: the model's run imports torch and transformers, needed only with --ring-model
    from ..commands.step_model import check_model_before_start
    from ..models.step import ModelStepConfig

    try:
        check_model_before_start(ModelStepConfig(model=name, glue=config.getoption("--ring-glue")))
    except (ValueError, TypeError, ImportError) as exc:
        raise pytest.UsageError(f"ringcheck --ring-model {name}: {exc}") from None
    config.pluginmanager.register(sys.modules[__name__], "ringcheck-model")
    join_run(config, MODEL_SUITE)


# the module is registered as a plugin (fixture and hook below) only with --ring-model

@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """The suite's test ids from an installed package: its path in the package (as --ring-recipe's)."""
    return suite_module(module_path, parent, MODEL_SUITE)


@pytest.fixture(scope="session")
def ring_model_run(request, ring_processes):
    """The session's runs of the model, one per ring size (the cases the selected tests ask for)."""
    # start-up time: the command's room imports the model, the glue and the launchers
    from ..commands.step_model import run_model_step
    from ..models.step import MODEL_CASES, ModelStepConfig

    name, glue = request.config.getoption("--ring-model"), request.config.getoption("--ring-glue")
    runs: dict[int, dict] = {}

    def run(world_size: int) -> dict:
        if world_size not in runs:
            asked = {getattr(item, "callspec", None) and item.callspec.params.get("case")
                     for item in request.session.items}
            cases = tuple(c for c in MODEL_CASES if c in asked) or MODEL_CASES[:1]
            runs[world_size] = run_model_step(ModelStepConfig(model=name, glue=glue, world_size=world_size,
                                                              cases=cases), ring_processes)
        return runs[world_size]
    return run


def model_sizes(config) -> tuple[int, ...]:
    """The ring sizes of the suite: the torchrun world's size, else `SIZES`."""
    env = from_torchrun_env(os.environ)
    return SIZES if env is None else (env.world_size,)
