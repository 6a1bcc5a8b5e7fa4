"""Moved to `ringcheck.catalogue.mutants` (the catalogue of rings has a room of its own); this name
stays, so `--impl ringcheck.testing.mutants:NAME` and imports from here keep working."""

import sys

from ..catalogue import mutants

sys.modules[__name__] = mutants
