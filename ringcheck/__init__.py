"""ringcheck: a correctness-and-verification harness for ring attention."""

from .layouts import shard, unshard
from .ring import simulate_ring

__all__ = ["ring_attention", "simulate_ring", "shard", "unshard"]
__version__ = "0.1.0"


def ring_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, layout="contiguous",
                   backend="torch", return_lse=False):
    """This rank's shard in, this rank's output out (see `ringcheck.ring`)."""
    raise RuntimeError("ring_attention needs the distributed runner, which is not built yet; "
                       "use ringcheck.simulate_ring on whole tensors")
