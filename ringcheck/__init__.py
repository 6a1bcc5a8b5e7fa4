"""ringcheck: a correctness-and-verification harness for ring attention.

The public API: `ring_attention`, `simulate_ring`, `shard`, `unshard` (from `ringcheck.ring`).
They load on first use, so `ringcheck.spec` (the argument vocabulary the references share)
imports without the ring.

The single-device references are `ringcheck.reference`. Their files are the repository's
top-level ``reference/`` folder (the layout the project was specified with); an install puts
them inside this package (setup.py's package_dir), so nothing is installed under the generic
top-level name ``reference``, which a user's own ``reference/`` package (a common name in ML
code) would shadow: ``python -m pytest`` in such a repository puts it first on sys.path. A
checkout run with PYTHONPATH=<the checkout>, or installed editable, has no such folder in the
package; there `_ReferenceBeside` finds the name.
"""

from __future__ import annotations

import importlib
import sys
from importlib.util import spec_from_file_location
from pathlib import Path
from typing import Any

__all__ = ["ring_attention", "simulate_ring", "shard", "unshard"]
__version__ = "0.1.0"

_PACKAGE = Path(__file__).resolve().parent
_BESIDE = _PACKAGE.parent / "reference"  # in a checkout: the repository's reference/ folder


class _ReferenceBeside:
    """The import finder of `ringcheck.reference` in a checkout: the reference/ folder beside
    this package's own folder, under this package's name (its modules import each other
    relatively, so they work under any name). First on sys.meta_path, so that the reference is
    the one of this very checkout, not another's that an editable install maps (setuptools'
    finder comes after the path)."""

    name = f"{__name__}.reference"

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        if fullname != cls.name:
            return None
        return spec_from_file_location(fullname, _BESIDE / "__init__.py", submodule_search_locations=[str(_BESIDE)])


if not (_PACKAGE / "reference").is_dir() and (_BESIDE / "__init__.py").is_file():
    # once: a second import of this module (entry's pin re-imports the package) replaces the first finder
    sys.meta_path[:] = [_ReferenceBeside, *(f for f in sys.meta_path
                                            if getattr(f, "name", None) != _ReferenceBeside.name)]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".ring", __name__), name)
    raise AttributeError(f"module 'ringcheck' has no attribute {name!r}")
