"""Moved to `ringcheck.catalogue.variant_mutants` (the catalogue of rings has a room of its own); this name
stays, so `--impl ringcheck.testing.variant_mutants:NAME` and imports from here keep working."""

import sys

from ..catalogue import variant_mutants

sys.modules[__name__] = variant_mutants
