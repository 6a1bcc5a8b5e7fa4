"""ringcheck: a correctness-and-verification harness for ring attention."""

from .ring import ring_attention, shard, simulate_ring, unshard

__all__ = ["ring_attention", "simulate_ring", "shard", "unshard"]
__version__ = "0.1.0"
