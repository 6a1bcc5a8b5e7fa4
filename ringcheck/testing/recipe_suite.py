"""`ringcheck step`'s cases on the recipe under test (``pytest --ring-recipe PKG.MOD:OBJ``), one
test per case and ring size; see `ringcheck.testing.recipe_plugin`."""

from __future__ import annotations

import pytest

from ..render.step_report import diagnosis_lines
from ..step.cases import case_names
from ..step.contract import load_recipe
from .recipe_plugin import ring_sizes


def pytest_generate_tests(metafunc):
    if "world_size" in metafunc.fixturenames:
        metafunc.parametrize("world_size", ring_sizes(metafunc.config), ids=lambda p: f"P{p}")
    if "case" in metafunc.fixturenames:
        recipe = load_recipe(metafunc.config.getoption("--ring-recipe"))
        metafunc.parametrize("case", case_names(None, recipe.checkpointing, recipe.evaluate is not None))


def test_the_step_at_cp_p_equals_cp_1(ring_recipe_run, world_size, case):
    judged = ring_recipe_run(world_size)
    row = next((r for r in judged["cases"] if r["case"] == case), None)
    if row is None:
        pytest.skip(f"--ring-recipe-impl cannot run the {case} case (its rules: ringcheck step --cases {case} says why)")
    if row["verdict"] == "not run":
        pytest.skip(f"the step cannot run the {case} case at CP={world_size}: {row['why']}; fix: {row['fix']}")
    if row["verdict"] != "pass":
        doc = {"cases": [row], "convention": None, "data": None}
        pytest.fail(f"case {case} at CP={world_size}: loss {row['loss']['error']:.3g} off (budget "
                    f"{row['loss']['budget']:.2g}), worst gradient {row['worst_gradient']:.3g} (budget "
                    f"{row['gradient_budget']:.2g}); " + "; ".join(diagnosis_lines(doc)), pytrace=False)


def test_the_loader_gives_a_cp_group_one_batch(ring_recipe_run, world_size):
    data = ring_recipe_run(world_size)["data"]
    if data is None:
        pytest.skip("the recipe has no loader hook")
    assert data["verdict"] == "pass", data["words"]
