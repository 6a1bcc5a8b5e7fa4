"""Defaults of this repository's own suites, loaded by its pyproject's pytest addopts
(``-p ringcheck.testing.suite_defaults``; not by the installed plugin, so other projects' tests
keep their threads and seeds).

- Triton runs its interpreter on CPU-only machines: Triton chooses interpreter or compiler
  when a kernel is decorated (the first import of `ringcheck.ring.backends.triton_fwd`), so
  this is set when this module loads, before any test imports the kernels.
  Under it, a kernel's calls of other `@triton.jit` functions (our tile helpers, `tl.zeros`)
  skip the interpreter's re-patching of `triton.language` where the launch patched it already
  (`_calls_in_a_grid_skip_repatching`): the interpreter scans the whole language module with
  `inspect.getmembers` on every such call, a third of the Triton suites' time.
  The interpreter's integer-overflow sanitizer is off: it computes a check for every int32 add,
  sub and mul (a quarter of the Triton suites' time) and hands it to an assert that the
  interpreter drops (its debug option is off), so it cannot fire; the `triton_overflow_sanitizer`
  fixture turns it on with its asserts for a test (`_sanitizer_only_with_asserts`).
- Local rings' workers start with what the suites' rings import on first use in every worker
  (`ringcheck.launch.start.preload_in_workers`): PyTorch's context parallel (with torch._dynamo, which
  its backward imports: about 1.3 s a worker) and our Triton kernels; the fork server imports
  them once per session.
- One torch thread per test module, and one seed per test (from its id, the same on every rank).
- What the session imported and collected is frozen out of the garbage collector's walks
  (`gc.freeze` once collection is done, undone at the end so the interpreter's exit frees it):
  torch and the collected items are hundreds of thousands of objects that every full collection
  walked again, 5-8% of the in-process tests' time.
- `--search-examples N` (make test's quick loop): every property searches at most N examples of
  the loaded profile (derandomized under torchrun as before). make test-thorough (CI) selects the
  property tests again (marker hypothesis) at the profile's own count: the quick loop repeats less
  of a search that CI runs whole on every change.
- Under torchrun, every test runs without the launcher's variables: the plugin read them at
  start-up (the edge) and holds the world; a command a test runs, in this process or as a
  subprocess, is then a command of its own (local rings), as a user would start it, not a second
  claim on the launcher's world of this rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import os
import threading
import zlib

import pytest
import torch
from hypothesis import settings

from ..launch.start import preload_in_workers
from ..thirdparty.torch_private import CONTEXT_PARALLEL

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _calls_in_a_grid_skip_repatching() -> None:
    """Under Triton's interpreter, a launch (`GridExecutor.__call__`) patches the language
    modules its kernel sees (`triton.language`, `triton.language.core`) for the whole grid and
    restores them after; a call of another jit function inside the kernel
    (`InterpretedFunction.__call__`) patches them again, which finds nothing left to patch but
    costs a scan of every module member. Here a call inside a launch skips the patching when
    every language module its function sees is patched already; a function that sees another
    one (`tl.zeros` sees `triton.language.core`) patches it once, as before, and the launch
    restores what it patched itself. What runs, and what each call computes, is unchanged."""
    try:
        # optional: only where triton is installed (the Triton suites skip without it)
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    grid_call, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    if getattr(grid_call, "_ringcheck", False):
        return
    state = threading.local()

    @functools.cache  # per jit function: the language modules its globals name do not change
    def languages(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def launch(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set(languages(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    def call(self, *args, **kwargs):
        patched, seen = getattr(state, "patched", None), languages(self.fn)
        if patched is None or not seen <= patched:
            if patched is not None:
                patched |= seen
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # as InterpretedFunction.__call__ reports it
            raise interpreter.InterpreterError(repr(exc)) from exc

    launch._ringcheck = True
    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch, call


def _sanitizer_only_with_asserts() -> None:
    """The interpreter's overflow sanitizer redoes every int32 add, sub and mul in int64 and hands
    the range check to `device_assert`, which drops it unless the interpreter's options say debug;
    Triton 3.9 builds those options once, debug off, so the checks are computed and never
    asserted. Here the sanitizer is on only where its asserts are (debug on: the
    `triton_overflow_sanitizer` fixture turns both on)."""
    from triton.runtime import interpreter  # optional: only where triton is installed

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options,
                                          sanitize_overflow=builder.options.sanitize_overflow and builder.options.debug)


@pytest.fixture
def triton_overflow_sanitizer():
    """Triton's interpreter checks every int32 add, sub and mul of this process's launches during
    the test, and asserts (debug on) that none overflowed."""
    from triton.runtime import interpreter  # optional: only where triton is installed

    builder = interpreter.interpreter_builder
    before = builder.options
    builder.options = dataclasses.replace(before, sanitize_overflow=True, debug=True)
    yield
    builder.options = before


if os.environ.get("TRITON_INTERPRET") == "1":
    _calls_in_a_grid_skip_repatching()
    with contextlib.suppress(ImportError):  # optional: only where triton is installed
        _sanitizer_only_with_asserts()

preload_in_workers("torch._dynamo", CONTEXT_PARALLEL,
                   "ringcheck.ring.backends.triton_backend")


def pytest_addoption(parser):
    parser.addoption("--search-examples", type=int, default=None, metavar="N",
                     help="every property searches at most N examples of the loaded --profile (this repository's "
                          "make test; make test-thorough searches at the profile's own count)")


@pytest.hookimpl(trylast=True)  # after the plugin loaded the --profile (derandomized under torchrun)
def pytest_configure(config):
    cap = config.getoption("--search-examples")
    if cap is None:
        return
    if cap < 1:
        raise pytest.UsageError(f"--search-examples must be >= 1, got {cap}")
    name = settings.get_current_profile_name()
    parent = settings.get_profile(name)
    settings.register_profile(f"{name}-at-most-{cap}", parent=parent, max_examples=min(cap, parent.max_examples))
    settings.load_profile(f"{name}-at-most-{cap}")


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The suites' tensors are tiny: one intra-op thread is 5-20x faster than two on a shared
    2-core machine (measured on the property suites)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# what torchrun exports to each rank (torch.distributed.run): a process with them believes it is a rank
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    for name in [*LAUNCHER_VARIABLES, *(n for n in os.environ if n.startswith("TORCHELASTIC_"))]:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """The same seed for a test on every rank and in every run (from its id)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
