"""One dependency's door: its installed version, read once, and the private names reached
through it (looked up on each call: a dictionary lookup and an attribute or two), each either found or refused with one line that names the version and the fix."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Any

REQUIRED = object()  # `reach` without a fallback: a moved name raises SurfaceMoved


class SurfaceMoved(RuntimeError):
    """A dependency's private name that ringcheck calls is not where this ringcheck knows it."""


class Door:
    """The private surface of `package` that ringcheck knows for the versions `supported`
    (e.g. "2.3–2.13"); `fix` is what to do when it has moved (e.g. "pin torch<=2.13")."""

    def __init__(self, package: str, supported: str, fix: str):
        self.package, self.supported, self.fix = package, supported, fix
        self.installed: str | None = None  # the installed version, read on first use

    def forget(self) -> None:
        """Read the installed version again (after a test has faked it)."""
        self.installed = None

    def version(self) -> str:
        """The installed version of the package, read once."""
        if self.installed is None:
            try:
                self.installed = importlib.metadata.version(self.package)
            except importlib.metadata.PackageNotFoundError:  # imported from a checkout: ask the module
                module = importlib.import_module(self.package.replace("-", "_"))
                self.installed = str(getattr(module, "__version__", "(version unknown)"))
        return self.installed

    def moved(self, name: str, supported: str | None = None, fix: str | None = None) -> SurfaceMoved:
        """The one-line error of `name` gone from the installed version."""
        return SurfaceMoved(f"{self.package} {self.version()} moved {name}: ringcheck supports {self.package} "
                            f"{supported or self.supported} here; {fix or self.fix} or upgrade ringcheck")

    def reach(self, module: str, attr: str = "", *, fallback: Any = REQUIRED, supported: str | None = None,
              fix: str | None = None) -> Any:
        """`module`'s attribute path `attr` (the module itself for ""); where it has moved, `fallback`
        if one is given, else SurfaceMoved. A package that is not installed at all raises its
        ImportError as it comes (the callers say how to install what is optional)."""
        try:  # on every call, so that what a test (or the flash-attn stand-in) puts in place is what is reached
            found = sys.modules.get(module) or importlib.import_module(module)
            for part in filter(None, attr.split(".")):
                found = getattr(found, part)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] == module.split(".")[0] and "." not in exc.name:
                raise  # the dependency itself is missing, not a name inside it
            if fallback is not REQUIRED:
                return fallback
            raise self.moved(f"{module}.{attr}".rstrip("."), supported, fix) from exc
        except (ImportError, AttributeError) as exc:
            if fallback is not REQUIRED:
                return fallback
            raise self.moved(f"{module}.{attr}".rstrip("."), supported, fix) from exc
        return found
