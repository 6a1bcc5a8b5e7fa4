"""Defaults of this repository's own suites, loaded by its pyproject's pytest addopts
(``-p ringcheck.testing.suite_defaults``; not by the installed plugin, so other projects' tests
keep their threads and seeds).

- Triton runs its interpreter on CPU-only machines: Triton chooses interpreter or compiler
  when a kernel is decorated (the first import of `ringcheck.ring.backends.triton_fwd`), so
  this is set when this module loads, before any test imports the kernels.
- One torch thread per test module, and one seed per test (from its id, the same on every rank).
- Under torchrun, every test runs without the launcher's variables: the plugin read them at
  start-up (the edge) and holds the world; a command a test runs, in this process or as a
  subprocess, is then a command of its own (local rings), as a user would start it, not a second
  claim on the launcher's world of this rank.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
