"""Defaults of this repository's own suites, loaded by its pyproject's pytest addopts
(``-p ringcheck.testing.suite_defaults``; not by the installed plugin, so other projects' tests
keep their threads and seeds).

- Triton runs its interpreter on CPU-only machines: Triton chooses interpreter or compiler
  when a kernel is decorated (the first import of `ringcheck.ring.backends.triton_fwd`), so
  this is set when this module loads, before any test imports the kernels.
- One torch thread per test module, and one seed per test (from its id, the same on every rank).
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


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """The same seed for a test on every rank and in every run (from its id)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
