"""`--glue ulysses`: ringcheck's own Ulysses glue (DeepSpeed-Ulysses' scheme, written here) under the
glue contract, the correct one the catalogue's Ulysses mutants (`ringcheck.catalogue.ulysses_mutants`)
each break in one place.

Each rank holds a contiguous shard of the sequence for every head. Per layer:

1. all-to-all, sequence -> heads: rank r sends head group g (query heads g H/P .. (g + 1) H/P - 1)
   of its shard to rank g and receives its own head group of every shard: the whole sequence, in
   order, for H/P query heads;
2. K/V heads: with kv_heads K divisible by P, rank g receives K/V heads g K/P .. (g + 1) K/P - 1,
   which are exactly the ones its query heads use (query head h meets K/V head h // (H/K)); with
   K < P (P divisible by K) every K/V head is first replicated P/K times (`repeat_interleave`, as
   DeepSpeed's `UlyssesSPAttentionHF` does), so that rank g receives K/V head g // (P/K), the one
   its query heads use;
3. the attention over the whole sequence for those heads with every semantic of the layer, read
   as ringcheck's ring glue reads it (`RingcheckGlue.ring_options`: scaling, sliding window,
   chunks, softcap, documents through the global cu_seqlens of `prepare`), computed by ringcheck's
   own attention on one rank (`simulate_ring` with world_size 1; float64 in, float64 throughout);
   the sinks of its own query heads (`s_aux[g H/P:(g + 1) H/P]`, whose gradient each rank holds
   for its heads only: summed over the group, as the step does, the whole gradient);
4. all-to-all back, heads -> sequence: head group g of the rank's shard comes home from rank g.

llama4's attention temperature (computed from the shard's local index before the call) is made
global as ringcheck's ring glue makes it. A model whose query heads are not divisible by P, or whose
K/V heads and P divide neither way, is refused before any rank starts, with the numbers
(`refuses_ring`; exit 2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ring.api import simulate_ring
from .contract import Glue
from .ours import RingcheckGlue, refuses, refuses_calls


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` over `group` along dim 0 of (P, ...) (chunk j goes to rank j, chunk j
    of the result came from rank j), differentiable: its backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange(grad, ctx.group), None


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """The all-to-all itself, on contiguous memory (a permuted view's `empty_like` keeps its strides,
    which the collective would read as contiguous)."""
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, local_seq, heads, dim) of this rank's shard -> (batch, P local_seq, heads / P, dim):
    the whole sequence for this rank's head group."""
    world = dist.get_world_size(group)
    b, n, h, d = x.shape
    chunks = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4)
    got = AllToAll.apply(chunks, group)                     # chunk j: rank j's shard, this rank's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def sequence_from_heads(y: torch.Tensor, group, order=None) -> torch.Tensor:
    """(batch, seq, heads / P, dim) of this rank's head group -> (batch, seq / P, heads, dim) of its
    shard. `order[g]`: the rank whose head group lands on head group g (identity when None)."""
    world = dist.get_world_size(group)
    b, seq, h, d = y.shape
    chunks = y.reshape(b, world, seq // world, h, d).permute(1, 0, 2, 3, 4)
    got = AllToAll.apply(chunks, group)                     # chunk j: this rank's shard, rank j's heads
    if order is not None:
        got = got[list(order)]
    return got.permute(1, 2, 0, 3, 4).reshape(b, seq // world, world * h, d)


class UlyssesGlue(RingcheckGlue):
    """The state of one installed Ulysses glue on one rank (contiguous shards). `kv_heads`,
    `rank_sinks` and `head_order` are the three places where a Ulysses glue regroups heads; the
    catalogue's mutants override one each."""

    def __init__(self, name: str | None = None):
        super().__init__("contiguous", name=name or "ringcheck_ulysses")

    def kv_heads(self, kv: torch.Tensor, heads: int, world: int) -> torch.Tensor:
        """K or V (batch, seq, K, dim) made ready for the all-to-all: K/V heads fewer than the ranks
        replicated so that rank g receives the one its query heads use."""
        k = kv.shape[2]
        return kv.repeat_interleave(world // k, dim=2) if k < world else kv

    def rank_sinks(self, sinks: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This rank's query heads' sinks."""
        n = sinks.shape[0] // world
        return sinks[rank * n:(rank + 1) * n]

    def head_order(self, world: int):
        """The rank whose head group comes home as head group g (None: rank g's)."""
        return None

    def attend(self, q, k, v, options: dict):
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        heads = q.shape[2]
        if heads % world or (k.shape[2] % world and world % k.shape[2]):
            raise ValueError(f"glue {self.name}: {heads} query heads and {k.shape[2]} K/V heads cannot be split over "
                             f"P={world} ranks (query heads divisible by P; K/V heads divisible by P or P by them)")
        sinks = options.pop("sinks", None)
        qh, kh, vh = (heads_from_sequence(t, group) for t in (q, self.kv_heads(k, heads, world),
                                                                self.kv_heads(v, heads, world)))
        out = simulate_ring(qh, kh, vh, world_size=1, causal=True, sinks_grad="partial",
                            sinks=None if sinks is None else self.rank_sinks(sinks, rank, world), **options)
        return sequence_from_heads(out, group, self.head_order(world))


def refuses_ring(tiny, world_size: int) -> list[str]:
    """What the Ulysses glue cannot split at P=`world_size`: one line per head layout whose query
    heads are not divisible by P, or whose K/V heads and P divide neither way, naming its layers
    (with the numbers and the fix)."""
    found: dict[str, list[int]] = {}
    for layer in tiny.layers:
        h, k = layer.heads, layer.kv_heads
        if h % world_size:
            why = (f"{h} query heads are not divisible by P={world_size} (Ulysses gives each rank H/P whole heads); "
                   f"run a --world-size that divides {h}")
        elif k % world_size and world_size % k:
            why = (f"{k} K/V heads and P={world_size} divide neither way (Ulysses splits K/V heads over the ranks or "
                   f"replicates them P/K times); run a --world-size that {k} divides or that divides {k}")
        else:
            continue
        found.setdefault(why, []).append(layer.index)
    return [f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: {why}" for why, ix in found.items()]


def ulysses_glue() -> Glue:
    """The built-in glue `ulysses`."""
    state = UlyssesGlue()
    return Glue(name="ulysses", install=state.install, layout="contiguous", prepare=state.prepare,
                describe="ringcheck's Ulysses glue: all-to-all sequence -> heads over the CP group, ringcheck's "
                         "attention over the whole sequence for H/P heads (scaling, sliding windows, chunks, sinks "
                         "of its own heads, softcap, documents), all-to-all back; K/V heads fewer than P replicated",
                refuses=refuses, refuses_calls=refuses_calls, refuses_ring=refuses_ring)
