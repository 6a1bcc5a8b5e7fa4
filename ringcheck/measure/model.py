"""What a ring must hold and move, per rank: the yardsticks of the memory and communication rows.

Memory (`ideal_bytes`). A ring attention's promise is that a rank holds O(N/P): its own shards
and a constant number of blocks of the same size, whatever the ring size. The ideal peak of
one forward and backward on a rank with n = N/P tokens is the tensors it cannot do without,
all live at the backward's peak:

- its inputs q, k, v and the gradient arriving at out, dout;
- its outputs out and lse (float32), kept for the backward;
- the K/V blocks in flight: the one it computes on and the one arriving (2 blocks of k and v);
- the backward's dq, dk, dv, and the dK/dV partial sums in flight (2 blocks, float32: summing P
  partials in a 16-bit dtype would round each one).

It leaves out a block's own working memory (a flash kernel's tiles, a plain kernel's n x n
scores): that grows with (N/P)^2 at most and never with P. The forward alone (an inference
ring) needs the first three lines.

Communication (`minimum_traffic`). A ring passes K/V blocks to its next rank; a block must
travel as far as the furthest rank that sees one of its keys: `hops` ring steps (P - 1 for
full or causal attention in every layout, where the last rank sees the first; fewer when a
window or the documents keep every query within a few ranks). Per rank, the minimum is:

- forward: `hops` K/V blocks sent and received, in the input dtype;
- backward: `hops` K/V blocks again (a ring that holds O(N/P) cannot have kept them) and
  `hops` blocks of dK/dV partial sums on their way home, in float32 (as above).

A ring that adds its own contribution first sends its dK/dV one hop more (P instead of P - 1):
the backward's ratio is then P / (P - 1) on that part, 1.67 at P = 2 in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ring.layouts import block_plan
from ..spec import AttentionSpec, RingSpec

PARTIAL_SUM_BYTES = 4  # float32: the dK/dV partial sums


@dataclass(frozen=True)
class Shapes:
    """Bytes of one rank's tensors at `local` tokens per rank."""

    q: int
    k: int
    v: int
    out: int
    lse: int

    @property
    def kv(self) -> int:
        return self.k + self.v

    @classmethod
    def of(cls, spec: AttentionSpec, world_size: int) -> Shapes:
        n = spec.seq_len // world_size
        e = spec.torch_dtype.itemsize
        b, h, kvh, d, dv = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.dv
        return cls(q=b * n * h * d * e, k=b * n * kvh * d * e, v=b * n * kvh * dv * e, out=b * n * h * dv * e,
                   lse=b * h * n * 4)

    def partial_sums(self, dtype_bytes: int) -> int:
        """The bytes of one block of dK/dV in float32."""
        return self.kv * PARTIAL_SUM_BYTES // dtype_bytes


def ideal_bytes(spec: AttentionSpec, world_size: int, *, backward: bool = True) -> dict[str, int]:
    """The ideal peak of one rank (see the module's docstring), by part, and its "total"."""
    s = Shapes.of(spec, world_size)
    parts = {"inputs q, k, v": s.q + s.kv, "out and lse": s.out + s.lse, "K/V in flight (2 blocks)": 2 * s.kv}
    if backward:
        parts["dout"] = s.out
        parts["dq, dk, dv"] = s.q + s.kv
        parts["dK/dV partial sums in flight (2 blocks, float32)"] = 2 * s.partial_sums(spec.torch_dtype.itemsize)
    parts["total"] = sum(parts.values())
    return parts


def hops(spec: AttentionSpec, ring: RingSpec) -> int:
    """The furthest ring distance (r - s mod P) at which rank r's queries see a key of rank s."""
    p, n = ring.world_size, spec.seq_len // ring.world_size
    far = 0
    for r in range(p):
        for s in range(p):
            distance = (r - s) % p
            if distance > far and block_plan(layout=ring.layout, q_rank=r, kv_rank=s, world_size=p, local_len=n,
                                             causal=spec.causal, cu_seqlens=spec.variant.cu_seqlens,
                                             window=spec.variant.window):
                far = distance
    return far


def minimum_traffic(spec: AttentionSpec, ring: RingSpec, *, backward: bool = True) -> dict[str, int]:
    """The bytes a rank must send (and receive) per phase (see the module's docstring)."""
    s, far = Shapes.of(spec, ring.world_size), hops(spec, ring)
    found = {"forward": far * s.kv}
    if backward:
        found["backward"] = far * (s.kv + s.partial_sums(spec.torch_dtype.itemsize))
    return found
