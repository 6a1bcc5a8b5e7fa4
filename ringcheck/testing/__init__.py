"""The installable test kit. The rings it tests against (the public mutants, the bad
implementations, the textbook rings) are in `ringcheck.catalogue`.

Its modules, by what they hold (a prefix names the group; the paths stay where users' commands
see them: ``-p ringcheck.testing.plugin``, the test ids ``ringcheck/testing/impl_suite.py::...``
and ``ringcheck/testing/recipe_suite.py::...``, and the ``reproduce:`` lines that import
``ringcheck.testing.impl_check``):

- the pytest plugin: `plugin` (options, fixtures, collective verdicts under torchrun, the
  ``pytest11`` entry point), `profiles` (the search profiles: example counts bound to sizes);
- what the property suites draw: `strategies`, `variant_strategies` (Hypothesis strategies of
  specs, never tensors) and the named case tables `cases`, `variant_cases`;
- the property bodies, parametrised by the implementation: `properties`, `variant_properties`,
  `embedded_properties` (views of fused projections, two calls before one backward);
- the in-package suite on any ring (``pytest --ring-impl``): `impl_suite` (the tests),
  `impl_options` (what it runs, parsed once), `impl_runner` (an implementation on process groups
  as the properties' ``impl``), `impl_check` (the replay of one failing case);
- the in-package suite on a training step (``pytest --ring-recipe``): `recipe_plugin` (its
  options and collection), `recipe_suite` (the tests);
- this repository's own suites' defaults: `suite_defaults` (pyproject's addopts, never the
  installed plugin).
"""
