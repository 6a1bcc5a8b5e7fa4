"""How local rings' worker processes start (standard library only, so the command's entry and
the pytest plugin can ask it before torch is imported): the fork server, what it imports once
for every worker it forks (`WORKER_PRELOAD`), the package pin the workers inherit through
PYTHONPATH, and the environment as this process found it before that pin (`environ_as_started`).

`ringcheck.entry` (the command) and the pytest plugin start the fork server as a fork of their
own process once it has imported what the workers need (`start_fork_server_here`);
`ringcheck.launch.local` takes its start method from `worker_context`.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import sys
import threading

from ..pin import pin_directory, pinned_paths

_PYTHONPATH_AT_START = os.environ.get("PYTHONPATH")  # before the workers' pin is added (only this module adds it)


def environ_as_started(environ) -> dict:
    """`environ` with PYTHONPATH as this process found it, before the pin of the workers' start
    method added the package's directory (what a re-run command must carry is the user's)."""
    started = dict(environ)
    if _PYTHONPATH_AT_START is None:
        started.pop("PYTHONPATH", None)
    else:
        started["PYTHONPATH"] = _PYTHONPATH_AT_START
    return started


# what the fork server imports once, so that every worker it forks starts with it: the harness a
# rank runs (with the references, and mpmath under them), and what torch.autograd.grad imports on
# its first call (torch.fx.experimental.symbolic_shapes, with sympy: about 1.5 s a process)
WORKER_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "ringcheck.launch.local",
                  "ringcheck.harness.runner"]


def preload_in_workers(*names: str) -> None:
    """Modules every local ring worker should start with: the fork server imports them once
    (before it starts: call this early), instead of each worker on its first use."""
    WORKER_PRELOAD.extend(n for n in names if n not in WORKER_PRELOAD)


# commands that start local rings of worker processes (outside torchrun)
RING_COMMANDS = ("validate", "drift", "bench", "train", "step")
# what one command's workers import besides: torch._dynamo, about 1 s a process, imported on first
# use by validate's recompute row (torch.utils.checkpoint's non-reentrant path; the pytest
# plugin's recompute test too: `CHECKPOINT_PRELOAD`) and by the TorchDispatchMode of
# ringcheck.measure's instruments (validate's memory and communication rows, bench)
CHECKPOINT_PRELOAD = ("torch._dynamo",)
COMMAND_PRELOAD = {"validate": CHECKPOINT_PRELOAD, "bench": CHECKPOINT_PRELOAD}


def _pin_package_for_workers() -> None:
    """Workers import the ringcheck this process imported. They start with their working
    directory first on sys.path, where a folder named `ringcheck` (a clone of the repository
    beside the user's code) would shadow the package; so the pin goes first on the PYTHONPATH
    they inherit: a directory that holds only this package (`ringcheck.pin`), not the checkout
    or site-packages around it, whose other folders would shadow the user's packages of the same
    names. The launcher is an edge: this is its one write to the environment."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths[:1] != [pin_directory()]:
        os.environ["PYTHONPATH"] = os.pathsep.join(pinned_paths(paths))


def worker_context():
    """The start method of local rings' workers: forkserver where there is one (a server process
    imports torch once and forks every worker from that clean, single-threaded state, so a pool
    (re)starts in a fraction of a second instead of a torch import per process); spawn
    elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _pin_package_for_workers()  # before the fork server starts: it and the workers keep its environment
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


def rings_ahead(argv: list[str], environ) -> bool:
    """Whether this command will start local rings (not under a launcher: torchrun's ranks are
    the processes) on a platform with a fork server."""
    return bool(argv) and argv[0] in RING_COMMANDS and "RANK" not in environ and \
        "forkserver" in multiprocessing.get_all_start_methods()


def _fork_exec_passfds(path, args, passfds):
    """`multiprocessing.util.spawnv_passfds` for the fork server, by fork instead of exec: the
    child is this process (the preload imported already) and runs the server's `-c` program,
    with every file descriptor closed but the standard ones and `passfds` (as exec would)."""
    program = args[args.index("-c") + 1]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        keep = {0, 1, 2, *map(int, passfds)}
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        # the parent forked while holding the server's lock (ensure_running): a fresh one here
        multiprocessing.forkserver._forkserver._lock = threading.Lock()
        exec(program, {"__name__": "__mp_forkserver__"})
        code = 0
    except SystemExit as exc:  # the server's way out: every client (the parent) is gone
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        import traceback  # only in a fork server that failed

        traceback.print_exc()
    finally:
        os._exit(code)


FORKABLE_THREADS = 2  # threads of a process that imported torch and started nothing: its own, and torch's


def _forkable() -> bool:
    """Whether this process is a safe parent for the fork server: Linux (elsewhere a process
    that imported torch is no safe parent to fork), and no thread but its own Python thread
    and the one torch starts at import (a fork copies whatever locks other threads hold)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/task"):
        return False
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) <= FORKABLE_THREADS


def start_fork_server_here(*also: str) -> None:
    """Start local rings' fork server now: as a fork of this process once it has imported what
    every worker imports (what the server would import in a fresh interpreter: torch, once
    more), where this process is a safe parent (`_forkable`); else as multiprocessing starts
    it. The modules `also` only the workers need (`preload_in_workers`): the server imports
    them itself, while this process goes on. Call it at start-up, before anything computes or
    starts a thread; nothing when the server runs already."""
    preload_in_workers(*also)
    worker_context()
    if not _forkable():
        multiprocessing.forkserver.ensure_running()
        return
    for name in (n for n in WORKER_PRELOAD if n not in also):
        try:
            importlib.import_module(name)
        except ImportError:  # as the fork server's preload: a worker that needs it says so
            pass
    spawn, multiprocessing.util.spawnv_passfds = multiprocessing.util.spawnv_passfds, _fork_exec_passfds
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawn
