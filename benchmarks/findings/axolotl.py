"""axolotl-ringmaster 0.2.7 (axolotl 0.21's context parallelism): the planted bug its suite must
catch, and the findings' minimal scripts and patched copies (docs/findings/trainers.md).

`planted_local_positions` is `--glue axolotl` with one bug planted in its sharding: every rank's
`position_ids` restart at 0 (rotary positions local to the shard). ringcheck must fail it, named
(`local_positions`); suites/test_trainer_axolotl.py holds that.

    --glue benchmarks.findings.axolotl:planted_local_positions
"""

from __future__ import annotations

import torch

from ringcheck.trainers.axolotl import CORES, Ringmaster


class PlantedLocalPositions:
    """`--glue axolotl` whose shard hands every rank `position_ids` restarting at 0 (the bug)."""

    layout = "contiguous"
    dtype = CORES["sdpa"][1]
    describe = "axolotl-ringmaster over sdpa with rotary positions local to each shard (a planted bug)"

    def __init__(self):
        self.glue = Ringmaster("sdpa")
        self.install, self.configure, self.uninstall = self.glue.install, self.glue.configure, self.glue.uninstall

    def shard(self, batch: dict, group) -> dict:
        out = self.glue.shard(batch, group)
        pos = out["position_ids"]
        local = torch.arange(pos.shape[1], dtype=pos.dtype, device=pos.device).expand_as(pos)
        return {**out, "position_ids": local}


planted_local_positions = PlantedLocalPositions()
