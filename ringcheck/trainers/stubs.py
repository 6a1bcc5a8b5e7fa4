"""Stub modules for what a trainer's modules import at module level and its glue never calls
(ms-swift's `swift/utils` imports modelscope, datasets, pandas, ...): answered only where the real
package is not installed, and only while the trainer's modules import. Each name a stub gives is a
class, so that isinstance and subclassing work at import; calling one raises, naming the fix."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from contextlib import contextmanager


class _Stub(type):
    """A name of a stubbed module: a class (so that isinstance and subclassing work at import), its
    attributes stubs too; calling it raises, naming the fix."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {"__qualname__": f"{cls.__qualname__}.{name}", "fix": cls.fix})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} is ringcheck's stub for ms-swift's glue, which was not expected to "
                           f"call it; install the real package ({cls.fix} and its dependencies)")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {"__qualname__": f"{self.__name__}.{name}", "fix": self.fix})


def _ms_logger():
    """modelscope.utils.logger.get_logger, the one stub called at import (swift/utils/logger.py L131)."""
    logger = logging.getLogger("modelscope")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str], fix: str):
        self.names, self.fix, self.made = names, fix, []

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name, "ringcheck's stub for ms-swift's glue")
        module.fix = self.fix
        module.__path__ = []
        if spec.name == "modelscope.utils.logger":
            module.get_logger = _ms_logger
        self.made.append(spec.name)
        return module

    def exec_module(self, module):
        pass


@contextmanager
def stubs(names, fix: str):
    """The modules of `names` that are not installed answered by stubs while a trainer's modules
    import, then forgotten (their names would make `find_spec` see an installed package); `fix`: what
    a stub that is called says to install."""
    finder = _StubFinder({n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None}, fix)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in finder.made:
            sys.modules.pop(name, None)
