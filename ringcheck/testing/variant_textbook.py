"""Moved to `ringcheck.catalogue.variant_textbook` (the catalogue of rings has a room of its own); this name
stays, so `--impl ringcheck.testing.variant_textbook:NAME` and imports from here keep working."""

import sys

from ..catalogue import variant_textbook

sys.modules[__name__] = variant_textbook
