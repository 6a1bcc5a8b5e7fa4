"""`ringcheck test`: the property suites on an implementation, as a command.

    ringcheck test --impl my_pkg.attn:ring_fn [--layout zigzag] [--forward-only] [pytest args...]
    torchrun --nproc-per-node=8 -m ringcheck test --impl my_pkg.attn:ring_fn

is `pytest --ring-impl my_pkg.attn:ring_fn ...` (the ringcheck pytest plugin collects the
in-package suite, `ringcheck.testing.impl_suite`); every argument it does not name itself goes
to pytest unchanged (``--profile nightly``, ``--ring-timeout 30``, ``-k budget``, ``-x``, test
paths, ...). The exit code is pytest's: 0 every test passed, 1 a test failed, 2-5 pytest's
usage, internal and no-tests codes.

pytest runs as ``python -m pytest`` in a fresh interpreter (this process is replaced by it),
not as `pytest.main` here: this process has imported ringcheck already, and pytest marks an
installed plugin's packages for assertion rewriting when it starts, so it would warn
"Module already imported so cannot be rewritten" for each (ringcheck, reference).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..pin import pinned_paths
from .common import UsageError

# our flag -> the plugin's pytest option (the flags mean what validate's mean)
_TO_PYTEST = {"layout": "--ring-layout", "world_sizes": "--ring-world-sizes", "dtypes": "--ring-dtypes"}


def pytest_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The pytest command line of a parsed `ringcheck test`."""
    argv = ["--ring-impl", args.impl]
    for name, option in _TO_PYTEST.items():
        value = getattr(args, name)
        if value is not None:
            argv += [option, value]
    if args.forward_only:
        argv.append("--ring-forward-only")
    return argv + list(extra)


def pytest_environ(environ) -> dict[str, str]:
    """The environment of the pytest process: this one's, with the pin first on PYTHONPATH (a
    directory that holds only this ringcheck: `ringcheck.pin`), so that pytest imports the
    package this command runs from (a folder named ringcheck in the working directory does not
    shadow it, and the folders beside the package do not shadow the user's)."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**environ, "PYTHONPATH": os.pathsep.join(pinned_paths(paths))}


def _test(args: argparse.Namespace) -> int:
    extra = list(getattr(args, "passed_on", []))
    if "--ring-impl" in extra:
        raise UsageError("give the implementation once, as --impl (ringcheck test passes --ring-impl to pytest)")
    argv = [sys.executable, "-m", "pytest", *pytest_args(args, extra)]
    env = pytest_environ(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":  # pytest in this process's place: a torchrun rank stays the process torchrun started
        os.execve(sys.executable, argv, env)
    return subprocess.call(argv, env=env)  # Windows' exec starts another process: wait for pytest as a child


def add_test_command(sub) -> None:
    p = sub.add_parser("test", help="run the property suites on an implementation (pytest --ring-impl)",
                       description="Run ringcheck's property suites (Hypothesis: budget against float64, metamorphic "
                                   "properties, ring-size and layout invariance, determinism, the variants) on an "
                                   "implementation under the --impl contract, on local gloo rings or the torchrun "
                                   "world. Arguments it does not know go to pytest; the exit code is pytest's.",
                       epilog="e.g. ringcheck test --impl my_pkg.attn:ring_fn --layout zigzag --profile nightly -x")
    p.add_argument("--impl", required=True, metavar="MOD:FN|ADAPTER",
                   help="the implementation: package.module:function or a built-in adapter (ringcheck, torch_cp, ...)")
    p.add_argument("--layout", default=None, metavar="LAYOUT[,LAYOUT...]",
                   help="layouts of its shards (pytest --ring-layout; default: what it runs, zigzag for a function "
                        "without a layout= keyword)")
    p.add_argument("--world-sizes", dest="world_sizes", default=None, metavar="P[,P...]",
                   help="ring sizes drawn (pytest --ring-world-sizes; default 1,2,3,4, under torchrun the divisors "
                        "of WORLD_SIZE)")
    p.add_argument("--dtypes", default=None, metavar="DTYPE[,DTYPE...]",
                   help="input dtypes drawn (pytest --ring-dtypes; default float32,bfloat16,float16)")
    p.add_argument("--forward-only", dest="forward_only", action="store_true",
                   help="run no backward; backward properties are reported as skipped, not run")
    p.set_defaults(func=_test, passes_on_unknown=True)
