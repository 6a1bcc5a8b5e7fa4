"""The ring engine: layouts -> per-rank loops (generators) -> a driver answers their
Post/Wait (simulated, distributed, no-comm) -> the autograd Function -> the public API."""

from .api import make_config, ring_attention, simulate_ring
from .drivers import DistributedDriver, Driver, NoCommDriver, SimulatedDriver
from .function import RingFunction, run_ring
from .layouts import shard, unshard
from .loops import REAL_PARTS, Post, RankShard, RingConfig, RingParts, Wait

__all__ = ["Driver", "DistributedDriver", "NoCommDriver", "Post", "REAL_PARTS", "RankShard", "RingConfig",
           "RingFunction", "RingParts", "SimulatedDriver", "Wait", "make_config", "ring_attention", "run_ring",
           "shard", "simulate_ring", "unshard"]
