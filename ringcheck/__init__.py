"""ringcheck: a correctness-and-verification harness for ring attention."""

from .comm import ring_attention
from .layouts import shard, unshard
from .ring import simulate_ring

__all__ = ["ring_attention", "simulate_ring", "shard", "unshard"]
__version__ = "0.1.0"
