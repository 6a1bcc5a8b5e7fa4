"""The `ringcheck` command's entry point (the console script and `python -m ringcheck`).

Before anything else it makes sure that the package this file belongs to is the `ringcheck`
every later import gets, here and in the worker processes a local ring starts. A folder named
`ringcheck` in the working directory or on PYTHONPATH (typically a clone of this repository
beside the user's own code) is otherwise imported in its place: a namespace package without
the API, so the command would end in an ImportError traceback and its workers could not
start. Where the package cannot be pinned, the command exits 2 naming the folder that shadows
it. The pin is a directory that holds only this package (`ringcheck.pin`), so that the
user's own packages named like the folders beside it (`reference`, `suites`, `examples`) stay
the user's. Only the standard library is imported here, before the pin. A command that starts local
rings starts their fork server as a fork of this process once it has imported what the
workers need (`ringcheck.launch.start`), so torch is imported once per command, not twice.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from .pin import PACKAGE, pinned_paths  # standard library only, as this module before the pin


class ShadowedPackage(RuntimeError):
    """Another `ringcheck` is imported in place of this one and could not be set aside."""


def _ours(module) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve().parent == PACKAGE


def _where(module) -> str:
    paths = list(getattr(module, "__path__", []) or [])
    return ", ".join(str(Path(p).resolve()) for p in paths) or str(getattr(module, "__file__", "?"))


def pin_package() -> None:
    """Put the pin first on sys.path (a directory that holds only this `ringcheck`, not the
    checkout or site-packages beside it: `ringcheck.pin`; worker processes inherit it through
    the launcher) and, if another `ringcheck` was imported already, import this one instead."""
    sys.path[:] = pinned_paths(sys.path)
    loaded = sys.modules.get("ringcheck")
    if loaded is None or _ours(loaded):
        return
    shadow = _where(loaded)
    for name in [m for m in sys.modules if m == "ringcheck" or m.startswith("ringcheck.")]:
        if name != __name__:
            del sys.modules[name]
    importlib.invalidate_caches()
    module = importlib.import_module("ringcheck")
    if not _ours(module):
        raise ShadowedPackage(
            f"the folder {shadow} shadows the installed ringcheck package ({PACKAGE}): rename or move it, "
            f"or run from a directory that does not contain a folder named 'ringcheck'")


def main(argv: list[str] | None = None) -> int:
    try:
        pin_package()
    except ShadowedPackage as exc:
        print(f"ringcheck: error: {exc}", file=sys.stderr)
        return 2
    # after the pin: this package's modules, whatever shadowed it
    from .cli import main as cli_main
    from .launch.start import COMMAND_PRELOAD, rings_ahead, start_fork_server_here

    args = sys.argv[1:] if argv is None else list(argv)
    if rings_ahead(args, os.environ):
        start_fork_server_here(*COMMAND_PRELOAD.get(args[0], ()))
    return cli_main(argv)
