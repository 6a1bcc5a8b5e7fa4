"""Moved to `ringcheck.catalogue.precision_mutants` (the catalogue of rings has a room of its own); this name
stays, so `--impl ringcheck.testing.precision_mutants:NAME` and imports from here keep working."""

import sys

from ..catalogue import precision_mutants

sys.modules[__name__] = precision_mutants
