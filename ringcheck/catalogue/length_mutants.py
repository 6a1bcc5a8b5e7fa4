"""Rings that are right at the lengths ringcheck used to test, and wrong where kernels break: a
shard longer than a tile and not a multiple of it, or a call whose length differs from an
earlier call's. Each is `mutants.textbook` with one bug class switched on:

- ``tail_keys_forward``: the forward's block kernel walks each K/V block in tiles of 64 keys
  with the grid ``n // 64`` (not ``cdiv(n, 64)``): the ragged last key tile is never read;
- ``tail_dkdv_backward``: the same grid in the backward's dK/dV program only: the ragged last
  key tile's dK and dV stay zero;
- ``tail_query_rows``: the same grid over query tiles, forward and backward: the ragged last
  tile's rows are never written (out 0, lse -inf, dq 0);
- ``stale_workspace``: the K/V received from the previous rank goes into a module-level
  workspace kept across calls (grown to the longest call yet, never shrunk), and the block
  kernel reads it to the workspace's length: after a longer call, a shorter one attends over
  the earlier call's keys in the stale tail.

The first three are exact whenever the shard is one tile or less (2, 6, 16, 64 tokens per rank)
or a multiple of it (128, 512): validate's scaled cases and full length before its ragged
shards (66, 130 tokens per rank). The fourth is exact whenever every call of a process has the
length of the first. `ringcheck validate` at its defaults and the plugin at ``--profile ci``
fail each; reports/lengths names the checks that do.

This module stands for someone else's code: it does not use ringcheck's ring.
"""

from __future__ import annotations

from .mutants import TILE, mutant_of

LENGTH_MUTANTS = {
    "tail_keys_forward": f"the forward's key tiles walked with the grid n // {TILE}: the ragged last key tile of a "
                         f"shard longer than a tile is never read",
    "tail_dkdv_backward": f"the backward's dK/dV program over key tiles with the grid n // {TILE}: the ragged last "
                          f"tile's dK and dV stay zero",
    "tail_query_rows": f"the query tiles walked with the grid n // {TILE}, forward and backward: the ragged last "
                       f"tile's rows are never written",
    "stale_workspace": "a receive workspace kept across calls, sized by the longest call yet and read to its own "
                       "length: a shorter call attends over an earlier call's keys",
}

for _name, _doc in LENGTH_MUTANTS.items():
    globals()[_name] = mutant_of(_name, _doc)
