"""`ringcheck test`: the property suites on an implementation, as a command.

    ringcheck test --impl my_pkg.attn:ring_fn [--layout zigzag] [--forward-only] [pytest args...]
    torchrun --nproc-per-node=8 -m ringcheck test --impl my_pkg.attn:ring_fn

is `pytest --ring-impl my_pkg.attn:ring_fn ...` (the ringcheck pytest plugin collects the
in-package suite, `ringcheck.testing.impl_suite`); every argument it does not name itself goes
to pytest unchanged (``--profile nightly``, ``--ring-timeout 30``, ``-k budget``, ``-x``, test
paths, ...). The exit code is pytest's: 0 every test passed, 1 a test failed, 2-5 pytest's
usage, internal and no-tests codes.
"""

from __future__ import annotations

import argparse

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


def _test(args: argparse.Namespace) -> int:
    # start-up time: pytest is loaded only by this command
    import pytest

    extra = list(getattr(args, "passed_on", []))
    if "--ring-impl" in extra:
        raise UsageError("give the implementation once, as --impl (ringcheck test passes --ring-impl to pytest)")
    return int(pytest.main(pytest_args(args, extra)))


def _add_test(sub) -> None:
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
                   help="ring sizes drawn (pytest --ring-world-sizes; default 1,2,3,4, under torchrun 1..WORLD_SIZE)")
    p.add_argument("--dtypes", default=None, metavar="DTYPE[,DTYPE...]",
                   help="input dtypes drawn (pytest --ring-dtypes; default float32,bfloat16,float16)")
    p.add_argument("--forward-only", dest="forward_only", action="store_true",
                   help="run no backward; backward properties are reported as skipped, not run")
    p.set_defaults(func=_test, passes_on_unknown=True)
