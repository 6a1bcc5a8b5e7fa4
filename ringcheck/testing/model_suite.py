"""`ringcheck step --model`'s cases on the model and glue under test (``pytest --ring-model NAME
[--ring-glue GLUE]``), one test per case and ring size; see `ringcheck.testing.model_plugin`."""

from __future__ import annotations

import pytest

from ..models.step import MODEL_CASES
from ..render.model_report import finding_lines
from .model_plugin import model_sizes


def pytest_generate_tests(metafunc):
    if "world_size" in metafunc.fixturenames:
        metafunc.parametrize("world_size", model_sizes(metafunc.config), ids=lambda p: f"P{p}")
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", MODEL_CASES)


def test_the_model_through_the_glue_equals_its_own_attention(ring_model_run, world_size, case):
    judged = ring_model_run(world_size)
    row = next(r for r in judged["cases"] if r["case"] == case)
    if row["verdict"] == "not run":
        pytest.skip(f"case {case} at CP={world_size} not run: {row['why']}")
    if row["verdict"] != "pass":
        pytest.fail(f"case {case} at CP={world_size}: logits {row['logits']['error']:.3g} off (budget "
                    f"{row['logits']['budget']:.2g}), loss {row['loss']['error']:.3g} (budget "
                    f"{row['loss']['budget']:.2g}), worst gradient {row['worst_gradient']:.3g} (budget "
                    f"{row['gradient_budget']:.2g}); " + "; ".join(finding_lines({"cases": [row]})), pytrace=False)
