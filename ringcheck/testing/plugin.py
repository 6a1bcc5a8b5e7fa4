"""The ringcheck pytest plugin: search profiles, distributed runs with collective verdicts,
and the ring fixtures (every rank's task under the device audit with RINGCHECK_DEVICE_AUDIT=1).

Registered under the `pytest11` entry point, so an installed ringcheck brings it to every
pytest run (nothing to copy into a conftest; it imports no torch until a test needs it). Adds:

- ``--profile {ci,nightly,deep}``: the Hypothesis profile of the property suites (`PROFILES`);
- ``--ring-timeout``: the bound on every ring wait and collective of distributed tests;
- under torchrun (its environment read here, once: the edge) every rank runs the same tests in
  the same order, every verdict is collective (a failure on any rank fails it on all, with every
  rank's error), only rank 0 prints, and Hypothesis draws the same examples on every rank;
- fixtures ``search_profile``, ``torchrun_world``, ``ring_pool`` and ``run_on_ring``; ``--ring-impl MOD:FN|ADAPTER`` (with ``--ring-layout``, ``--ring-world-sizes``,
  ``--ring-dtypes``, ``--ring-forward-only``): the property suites on that implementation
  (`ringcheck.testing.impl_suite`, collected from the package: with no test paths given it is
  what runs, with paths it joins them), fixtures ``ring_impl_config``, ``ring_impl``; and
  ``--ring-recipe PKG.MOD:OBJ`` / ``--ring-model NAME``: `ringcheck step`'s cases (`recipe_plugin`).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest
from hypothesis import settings

# torch-free at load (start-up time: every pytest run where ringcheck is installed loads this
# plugin); the judge and the launchers are imported where a test asks for them
from ..launch.environment import audit_requested, from_torchrun_env, launched_rank
from ..launch.start import CHECKPOINT_PRELOAD, start_fork_server_here
from . import impl_promises, recipe_plugin
from .profiles import PROFILES

# ---- Hypothesis profiles (--profile, profiles.PROFILES); under torchrun derandomized, the same on every rank

PROFILE_NAMES = ("ci", "nightly", "deep")


def _register_hypothesis_profiles() -> None:
    for name, profile in PROFILES.items():
        settings.register_profile(name, profile.settings())
        settings.register_profile(f"{name}-torchrun", profile.settings(torchrun=True))


def _add_profile_option(parser) -> None:
    parser.addoption("--profile", choices=PROFILE_NAMES, default="ci",
                     help="depth of the property-based search: ci (default, minutes on 2 CPU "
                          "cores), nightly or deep (more examples, larger shapes)")


def _load_hypothesis_profile(config) -> None:
    _register_hypothesis_profiles()
    name = config.getoption("--profile")
    settings.load_profile(f"{name}-torchrun" if launched_rank(os.environ) else name)


def _profile_header(config) -> str:
    return f"ringcheck search profile: {settings.get_current_profile_name()} (--profile {{ci,nightly,deep}})"


def pytest_report_header(config):
    impl = config.stash.get(_IMPL, None)
    stand_in = config.stash.get(_STAND_IN, None)
    return ([_profile_header(config)] + ([impl.describe()] if impl is not None else [])
            + ([f"flash-attn stand-in: {stand_in}"] if stand_in is not None else []))


@pytest.fixture(scope="session")
def search_profile(pytestconfig):
    """The `ringcheck.testing.strategies.Profile` selected with --profile (its size bounds)."""
    return PROFILES[pytestconfig.getoption("--profile")]


# --- attention variants (ringcheck.judge.variant_options) -------------------------------------

def _add_variant_options(parser) -> None:
    group = parser.getgroup("ringcheck variants", "attention variants for the variant property suites "
                                                  "(default: drawn at random)")
    group.addoption("--documents", default=None, metavar="LEN,LEN,...|random:K",
                    help="packed documents: explicit lengths (with --pad, the sequence) or K seeded random ones")
    group.addoption("--pad", type=int, default=0, metavar="N", help="padding tokens after the last document")
    group.addoption("--window", default=None, metavar="LEFT,RIGHT", help="sliding window (-1: unbounded)")
    group.addoption("--softcap", type=float, default=None, metavar="X", help="logit softcap")
    group.addoption("--sinks", action="store_true", default=False, help="per-head sink logits")
    group.addoption("--head-dim-v", type=int, default=None, metavar="D", help="value head dim")


@pytest.fixture(scope="session")
def variant_options(pytestconfig):
    """The `VariantOptions` given on the command line (--documents, --pad, --window, --softcap,
    --sinks, --head-dim-v; the same meaning as ringcheck drift's flags), None when none is: the
    variant suites then draw their variants."""
    from ..judge.variant_options import VariantOptions, parse_window  # start-up time (above)
    get = pytestconfig.getoption
    try:
        window = get("--window")
        options = VariantOptions(documents=get("--documents"), pad=get("--pad"),
                                 window=None if window is None else parse_window(window),
                                 softcap=get("--softcap"), sinks=get("--sinks"), head_dim_v=get("--head-dim-v"))
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"ringcheck variant options: {exc}") from None
    return options if options.used else None


# --- distributed runs (ringcheck.launch) ------------------------------------------------------
# Plain `pytest suites/`: tests that need ranks get local gloo rings (worker processes kept for
# the session). `torchrun --nproc-per-node=P -m pytest suites/`: every rank runs the same tests
# in the same order; ring tasks run in-process on the torchrun world; every test's verdict is
# collective (a failure on any rank fails it on all, with every rank's error); only rank 0
# prints. The launcher environment is read here, once (the edge).

_WORLD = pytest.StashKey()      # TorchrunWorld or None
_RINGS = pytest.StashKey()      # {timeout: LocalRings}
_QUIET = pytest.StashKey()      # (real stdout, devnull) on ranks other than 0
_STAND_IN = pytest.StashKey()   # what --ring-flash-attn-stand-in did, in words
_AUDIT = pytest.StashKey()      # RINGCHECK_DEVICE_AUDIT: every rank's task under the device audit


def _add_ring_options(parser) -> None:
    group = parser.getgroup("ringcheck")
    group.addoption("--ring-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="bound on every ring wait and collective of distributed tests (default 60)")
    group.addoption("--ring-log-dir", "--log-dir", dest="ring_log_dir", default=None, metavar="DIR",
                    help="each rank's whole story of every ring task (output, traceback, ring-step trace) in "
                         "DIR/rank<G>.log")
    group.addoption("--ring-planted-failure", action="store_true", default=False,
                    help="run the demonstration test that fails on purpose on one rank (it must fail on all)")


def _derandomize_hypothesis() -> None:
    """Every rank must draw the same examples: the current profile (whatever another section
    loaded), derandomized, without a database or deadline."""
    settings.register_profile("ringcheck-torchrun", parent=settings.default, derandomize=True,
                              database=None, deadline=None)
    settings.load_profile("ringcheck-torchrun")


def _configure_ring(config) -> None:
    """Call first in pytest_configure (tryfirst): a quiet rank must swap stdout before the
    terminal reporter takes it."""
    env = from_torchrun_env(os.environ)
    config.stash[_WORLD] = None
    config.stash[_RINGS] = {}
    config.stash[_AUDIT] = audit_requested(os.environ)
    if env is None:
        return
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("under torchrun every rank is already a process; drop pytest-xdist's -n")
    if env.rank != 0:  # the terminal reporter writes to the stdout it finds, for good
        config.stash[_QUIET] = (sys.stdout, open(os.devnull, "w"))
        sys.stdout = config.stash[_QUIET][1]
    _derandomize_hypothesis()
    from ..launch.devices import DEVICE_VARIABLE, DeviceError  # start-up time (above)
    from ..launch.torchrun import TorchrunWorld
    try:  # a device the rank cannot have (more ranks than GPUs): the user's to fix, said without a traceback
        config.stash[_WORLD] = TorchrunWorld(env, timeout=config.getoption("--ring-timeout"), log_dir=config.getoption(
            "--ring-log-dir"), device=os.environ.get(DEVICE_VARIABLE, "auto"), audit=config.stash[_AUDIT])
    except (DeviceError, ValueError) as exc:
        raise pytest.UsageError(f"ringcheck: {exc}") from None


def _stand_in(config) -> bool:
    """--ring-flash-attn-stand-in: install it in this process (the rank, under torchrun);
    `_local_rings` has every worker install it too."""
    if not config.getoption("--ring-flash-attn-stand-in"):
        return False
    # start-up time: the stand-in is imported only when asked for
    from ..flash_stand_in import install

    config.stash[_STAND_IN] = install().describe()
    return True


def _local_rings(config, timeout: float):
    """The session's local rings of one timeout: every pool installs the flash-attn stand-in
    first where asked, and writes each rank's log where asked."""
    setup = None
    if config.stash.get(_STAND_IN, None) is not None:
        from ..adapters.flash import stand_in_task  # only with --ring-flash-attn-stand-in

        setup = stand_in_task
    from ..launch.local import LocalRings  # start-up time (above)
    return LocalRings(timeout=timeout, log_dir=config.getoption("--ring-log-dir"), setup=setup,
                      audit=config.stash.get(_AUDIT, False))


def _unconfigure_ring(config) -> None:
    for rings in config.stash.get(_RINGS, {}).values():
        rings.close()
    world = config.stash.get(_WORLD, None)
    if world is not None:
        world.close()
    quiet = config.stash.get(_QUIET, None)
    if quiet is not None:
        real, devnull = quiet
        if sys.stdout is devnull:
            sys.stdout = real
        devnull.close()


class CollectiveFailure(AssertionError):
    """A test failed on some rank; raised on every rank with every failing rank's error."""


def _failure_text(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "_pytest" not in f.filename
              and "pluggy" not in f.filename]
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}{where}: {exc}"


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    __tracebackhide__ = True
    world = pyfuncitem.config.stash.get(_WORLD, None)
    if world is None:
        return (yield)
    error, mine = None, ("passed", "")
    try:
        result = yield
    except (pytest.skip.Exception, pytest.xfail.Exception) as exc:
        error, mine = exc, ("skipped", "")
    except (Exception, pytest.fail.Exception) as exc:
        error, mine = exc, ("failed", _failure_text(exc))
    everyone = world.all_gather((pyfuncitem.nodeid, *mine))
    ids = {nodeid for nodeid, _, _ in everyone}
    if len(ids) > 1:
        raise CollectiveFailure("ranks disagree on the test being run (they must collect the same tests in "
                                "the same order): " + "; ".join(f"rank {r}: {n}" for r, (n, _, _) in enumerate(everyone)))
    failed: dict[str, list[int]] = {}  # the same words from several ranks are said once
    for r, (_, kind, text) in enumerate(everyone):
        if kind == "failed":
            failed.setdefault(text, []).append(r)
    if failed:
        ranks = sorted(r for rs in failed.values() for r in rs)
        lines = [f"failed on {len(ranks)} of {world.size} ranks: {', '.join(map(str, ranks))}"]
        for text, rs in failed.items():
            who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"
            lines.append(f"{who}: {text}")
        raise CollectiveFailure("\n".join(lines)) from error
    if error is not None:
        raise error
    return result


@pytest.fixture(scope="session")
def torchrun_world(request):
    """The torchrun world (ringcheck.launch.TorchrunWorld), or None under plain pytest."""
    return request.config.stash[_WORLD]


@pytest.fixture(scope="session")
def ring_pool(request):
    """Factory: `ring_pool(world_size, timeout=None)` -> a live local gloo ring of at least
    world_size processes (`LocalRingPool`), kept for the session, restarted after a failure."""
    config = request.config
    rings = config.stash[_RINGS]

    def get(world_size, *, timeout=None):
        if config.stash[_WORLD] is not None:
            pytest.skip("local rings start their own processes: run this test with plain pytest, "
                        "not under torchrun")
        timeout = config.getoption("--ring-timeout") if timeout is None else timeout
        if timeout not in rings:
            rings[timeout] = _local_rings(config, timeout)
        return rings[timeout].pool(world_size)

    return get


@pytest.fixture(scope="session")
def run_on_ring(request):
    """`run_on_ring(world_size, task, *args)` -> [task(member, *args) for every ring rank]:
    on the torchrun world (a sub-group of its last ranks) when launched by torchrun, else on a
    local gloo ring; skips when the ring needs more ranks than the torchrun world has. With
    `exact=True` the ring is a whole world of exactly `world_size` processes (for rings that
    only work over the default world group)."""
    config = request.config
    world = config.stash[_WORLD]

    def run(world_size, task, *args, exact=False):
        __tracebackhide__ = True
        if world is not None:
            if world_size > world.size or (exact and world_size != world.size):
                pytest.skip(f"needs a ring of {'exactly ' if exact else ''}{world_size} ranks; the torchrun "
                            f"world has {world.size} (launch with --nproc-per-node={world_size})")
            return world.run(world_size, task, *args)
        rings = config.stash[_RINGS]
        timeout = config.getoption("--ring-timeout")
        if timeout not in rings:
            rings[timeout] = _local_rings(config, timeout)
        return rings[timeout].run(world_size, task, *args, exact=exact)

    return run


# --- an implementation under test (--ring-impl) -----------------------------------------------
# `pytest --ring-impl MOD:FN` runs the in-package suite (ringcheck/testing/impl_suite.py) on that
# implementation: on local gloo rings, or on the torchrun world and its sub-groups.

_IMPL = pytest.StashKey()   # ImplConfig or None
IMPL_SUITE = Path(__file__).with_name("impl_suite.py")
# the file part of its test ids wherever it is collected from: its path in the package's directory
SUITE_ID = IMPL_SUITE.relative_to(IMPL_SUITE.parents[2]).as_posix()  # ringcheck/testing/impl_suite.py


def _add_impl_options(parser) -> None:
    group = parser.getgroup("ringcheck implementation under test",
                            "the property suites on another ring (the --impl contract of ringcheck validate)")
    group.addoption("--ring-impl", default=None, metavar="MOD:FN|ADAPTER",
                    help="run the property suites on this implementation (package.module:function, or a built-in "
                         "adapter: ringcheck, torch_cp, ...)")
    group.addoption("--ring-layout", default=None, metavar="LAYOUT[,LAYOUT...]",
                    help="layouts of its shards: contiguous, zigzag, striped, zigzag_docs (default: the adapter's; "
                         "all plain layouts if it takes layout=, else zigzag)")
    group.addoption("--ring-world-sizes", default=None, metavar="P[,P...]",
                    help="ring sizes drawn (default 1,2,3,4; under torchrun the divisors of WORLD_SIZE)")
    group.addoption("--ring-dtypes", default=None, metavar="DTYPE[,DTYPE...]",
                    help="input dtypes drawn (default float32,bfloat16,float16)")
    group.addoption("--ring-forward-only", action="store_true", default=False,
                    help="run no backward: each property checks out and lse, its backward half is skipped as not run")
    group.addoption("--ring-mesh", default=None, metavar="DIM=N,...",
                    help="the device mesh each ring runs inside, outermost dim first, one dim named cp (e.g. dp=2,cp=4 "
                         "or cp=4,tp=2): its other dims replicate every ring size drawn, each CP group on its own data "
                         "(default: cp=P,tp=2, a second interleaved ring, where the processes hold it); under torchrun "
                         "the world must be the mesh")
    group.addoption("--sinks-grad", "--ring-sinks-grad", dest="sinks_grad", default="partial",
                    choices=["partial", "reduced"],
                    help="what each rank's sinks.grad holds: partial (default: its own rows' share, the framework sums "
                         "it) or reduced (the whole sequence's on every rank)")
    group.addoption("--ring-flash-attn-stand-in", action="store_true", default=False,
                    help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in, in "
                         "this process and every rank (rings built on flash-attn, on a CPU runner); said in the header")
    impl_promises.add_options(group)  # --ring-require, --ring-overlap


def _configure_impl(config) -> None:
    """Read the --ring-* options once; a bad one is a usage error before anything runs."""
    config.stash[_IMPL] = None
    get = config.getoption
    given = {name: get(name) for name in ("--ring-layout", "--ring-world-sizes", "--ring-dtypes", "--ring-mesh")}
    if get("--ring-impl") is None:
        used = [name for name, value in given.items() if value is not None] + (
            ["--ring-forward-only"] if get("--ring-forward-only") else [])
        if used:
            raise pytest.UsageError(f"{', '.join(used)} need --ring-impl MOD:FN (the implementation under test)")
        return
    # start-up time: the ring and the adapters are imported only when an implementation is under test
    from .impl_options import impl_config

    world = config.stash[_WORLD]
    try:
        config.stash[_IMPL] = impl_config(get("--ring-impl"), layouts=given["--ring-layout"],
                                          world_sizes=given["--ring-world-sizes"], dtypes=given["--ring-dtypes"],
                                          forward_only=get("--ring-forward-only"), timeout=get("--ring-timeout"),
                                          torchrun_size=None if world is None else world.size,
                                          stand_in=config.stash.get(_STAND_IN, None) is not None,
                                          mesh=given["--ring-mesh"], sinks_grad=get("sinks_grad"))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise pytest.UsageError(f"ringcheck --ring-impl: {exc}") from None
    if world is None:  # local rings ahead: their fork server, forked now from this clean process
        start_fork_server_here(*CHECKPOINT_PRELOAD)
    suite = str(IMPL_SUITE)
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = [suite]  # no test paths given: the suite on the implementation is the run
        return
    config.args[:] = [_suite_arg(arg, config.invocation_params.dir) for arg in config.args]
    if not any(Path(arg.split("::")[0]).resolve() == IMPL_SUITE.resolve() for arg in config.args):
        config.args.append(suite)


def _suite_arg(arg: str, invocation_dir: Path) -> str:
    """A test id of the suite as a failure names it (``ringcheck/testing/impl_suite.py::test_x``)
    selects that test wherever the package is installed: its file part becomes the suite's path."""
    path, sep, rest = arg.partition("::")
    if path == SUITE_ID and not (invocation_dir / path).exists():
        return str(IMPL_SUITE) + sep + rest
    return arg


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """The suite collected from outside the rootdir (an installed ringcheck, run from the user's
    project) gets `SUITE_ID` as the file part of its test ids. pytest names a file outside the
    rootdir by its path relative to the command-line argument that named it, here the file
    itself: an empty part (``::test_budget_against_float64[...]``). Under the rootdir (this
    checkout) pytest's own id, the path from there, stands."""
    if module_path.resolve() != IMPL_SUITE.resolve() or module_path.is_relative_to(parent.config.rootpath):
        return None
    return pytest.Module.from_parent(parent, path=module_path, nodeid=SUITE_ID)


@pytest.fixture(scope="session")
def ring_impl_config(request):
    """The `ringcheck.testing.impl_options.ImplConfig` of --ring-impl, or None without it."""
    return request.config.stash[_IMPL]


@pytest.fixture(scope="session")
def ring_processes(request):
    """The processes of this session's distributed tests: the torchrun world under torchrun,
    else the local gloo rings of the default --ring-timeout (`ringcheck.launch.LocalRings`:
    `run`, `run_groups`), kept for the session."""
    config = request.config
    if (world := config.stash[_WORLD]) is not None:
        return world
    rings = config.stash[_RINGS]
    timeout = config.getoption("--ring-timeout")
    if timeout not in rings:
        rings[timeout] = _local_rings(config, timeout)
    return rings[timeout]


@pytest.fixture(scope="session")
def ring_impl(request, ring_impl_config, ring_processes):
    """The implementation under test (--ring-impl) as the `impl` of the property bodies
    (`ringcheck.testing.impl_runner.RingImpl`), on the torchrun world or local gloo rings."""
    if ring_impl_config is None:
        pytest.skip("pass --ring-impl MOD:FN (the implementation under test)")
    # start-up time: the runner imports the adapters and the ring
    from .impl_runner import ring_impl as make

    cfg = ring_impl_config
    return make(cfg.spec, ring_processes, forward_only=cfg.forward_only, stand_in=cfg.stand_in,
                sinks_grad=cfg.sinks_grad, mesh=cfg.mesh)


# ---- the hooks ---------------------------------------------------------------

def pytest_addoption(parser):
    _add_profile_option(parser)
    _add_ring_options(parser)
    _add_variant_options(parser)
    _add_impl_options(parser)
    recipe_plugin.add_options(parser)


@pytest.hookimpl(tryfirst=True)  # the ring section must act before the terminal reporter exists
def pytest_configure(config):
    _load_hypothesis_profile(config)
    _configure_ring(config)  # after the profile: under torchrun it derandomizes the loaded one
    _stand_in(config)        # before any implementation is loaded
    _configure_impl(config)  # after the ring: it needs the torchrun world's size
    recipe_plugin.configure(config)


def pytest_unconfigure(config):
    _unconfigure_ring(config)
