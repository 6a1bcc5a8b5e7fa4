"""`python -m ringcheck`: the same entry as the `ringcheck` command (see `ringcheck.entry`)."""

import sys

from .entry import main

sys.exit(main())
