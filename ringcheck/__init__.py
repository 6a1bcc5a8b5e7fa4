"""ringcheck: a correctness-and-verification harness for ring attention.

The public API: `ring_attention`, `simulate_ring`, `shard`, `unshard` (from `ringcheck.ring`).
They load on first use, so `ringcheck.spec` (the argument vocabulary the references share)
imports without the ring.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ring_attention", "simulate_ring", "shard", "unshard"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".ring", __name__), name)
    raise AttributeError(f"module 'ringcheck' has no attribute {name!r}")
