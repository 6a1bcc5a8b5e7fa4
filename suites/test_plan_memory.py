"""`ringcheck plan`'s attention arithmetic against measurement: our ring's forward and backward
on local gloo rings, the peak bytes of tensor storage each rank holds (`ringcheck.measure.
peak_bytes`), against `ringcheck.plan.call_peak` for the same shapes with the CPU backend's
kernel. Three sizes that differ in the ring size, the local length, the heads and the dtype; the
busiest rank within 10% of the prediction, and no rank above it by more. A planted ring that
keeps every K/V block it receives (exact, the memory of an all-gather) is caught."""

from __future__ import annotations

import pytest
import torch

from ringcheck import ring_attention, shard
from ringcheck.catalogue.planted import MEMORY_PLANTED
from ringcheck.measure import peak_bytes
from ringcheck.plan import Shape, call_peak
from ringcheck.ring.api import make_config
from ringcheck.ring.backends.torch_backend import TorchBackend
from ringcheck.ring.comm import RingComm
from ringcheck.ring.drivers import DistributedDriver
from ringcheck.ring.function import run_ring
from ringcheck.ring.loops import RingParts

BUDGET = 0.10  # the issue's: the prediction within 10% of the measured peak
# (ring size, tokens per rank, heads, kv heads, head dim, dtype, causal, layout)
SIZES = [
    (2, 256, 4, 4, 64, "float32", True, "zigzag"),     # MHA, the ring's last step is its second
    (4, 512, 4, 2, 32, "float32", True, "zigzag"),     # GQA 2:1, a steady step between first and last
    (4, 256, 8, 2, 64, "bfloat16", False, "contiguous"),  # bf16 inputs: float32 copies; every block full
]


def measured_peak_task(member, n, heads, kv_heads, head_dim, dtype, causal, layout, planted=None, tile=None):
    """This rank's peak bytes of one forward and backward of our ring (after one unmeasured call:
    lazy set-up is not the ring's memory); with `planted`, of that ring of `MEMORY_PLANTED`; with
    `tile`, of the ring on the torch backend's plain path (CUDA's) with score tiles of `tile` bytes."""
    world = member.world_size
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    whole = [torch.randn(1, n * world, h, head_dim, generator=gen).to(dt)
             for h in (heads, kv_heads, kv_heads, heads)]
    q, k, v, dout = (shard(t, layout=layout, rank=member.rank, world_size=world, dim=1).contiguous() for t in whole)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def forward_backward():
        if planted is None and tile is None:
            out = ring_attention(q, k, v, causal=causal, group=member.group, layout=layout, timeout=member.timeout)
        else:
            config = make_config(world_size=world, layout=layout, causal=causal, softmax_scale=None,
                                 head_dim=head_dim, backend="torch",
                                 parts=MEMORY_PLANTED[planted] if tile is None else plain_parts(tile))
            driver = DistributedDriver(RingComm(member.group, timeout=member.timeout))
            out = run_ring(config, driver, [q], [k], [v])[0][0]
        out.backward(dout)

    forward_backward()
    q.grad = k.grad = v.grad = None
    return peak_bytes(forward_backward, device="cpu")[0]


def plain_parts(tile: int) -> RingParts:
    return RingParts(backend=TorchBackend(fast=False, row_tile_bytes=tile))


def prediction(world, n, heads, kv_heads, head_dim, dtype, causal, layout, kernel="torch-cpu", tile=None) -> int:
    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    shape = Shape(batch=1, n=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, e=size)
    tiles = {} if tile is None else {"row_tile_bytes": tile}
    return call_peak(shape, layout=layout, causal=causal, world_size=world, kernel=kernel, **tiles)["bytes"]


# the torch backend on CUDA (its plain path, `--kernel torch-cuda`), run here on the CPU with score
# tiles small enough that every block takes several: (size as in SIZES, tile bytes)
PLAIN_SIZES = [
    ((2, 512, 8, 2, 64, "bfloat16", True, "zigzag"), 2**20),      # GQA 4:1, 8 rows a tile of the 512 x 256 blocks
    ((4, 256, 8, 8, 64, "bfloat16", False, "contiguous"), 2**18),  # MHA, every block full, 32 rows a tile
]


@pytest.mark.parametrize("size,tile", PLAIN_SIZES, ids=lambda s: f"P{s[0]}-n{s[1]}-h{s[2]}/{s[3]}" if isinstance(s, tuple) else f"tile{s >> 10}K")
def test_the_torch_cuda_prediction_bounds_the_plain_paths_measured_peak(size, tile, run_on_ring):
    """Issue 59, defect 13: on CUDA the torch backend runs its plain path by tiles of query rows;
    `plan --kernel torch-cuda` counts them. Measured here on the CPU, where logsumexp keeps no
    shifted copy of a tile (CUDA's does): the prediction is above the busiest rank by at most
    that tile and the budget. Untiled, the same blocks would hold more than was measured."""
    world, n, heads, kv_heads, head_dim, dtype, causal, layout = size
    busiest = max(run_on_ring(world, measured_peak_task, *size[1:], None, tile))
    predicted = prediction(*size, kernel="torch-cuda", tile=tile)
    assert busiest <= predicted * (1 + BUDGET) and predicted - tile <= busiest * (1 + BUDGET), (busiest, predicted)
    untiled = prediction(*size, kernel="torch-cuda", tile=2**40)
    assert untiled > busiest * (1 + BUDGET), (untiled, busiest)  # the tiles are what keeps it down


def test_a_ring_that_keeps_every_kv_block_is_caught(run_on_ring):
    """Ring of 8 (first: the larger ring's processes serve the smaller rings after it): from its
    seventh step the planted backward holds 8 K/V blocks where the ring needs 3; the real ring at
    the same size is within the budget."""
    size = (8, 128, 4, 4, 64, "float32", True, "zigzag")
    real = max(run_on_ring(8, measured_peak_task, *size[1:]))
    planted = max(run_on_ring(8, measured_peak_task, *size[1:], "keeps_every_kv_block"))
    predicted = prediction(*size)
    assert abs(real / predicted - 1) <= BUDGET < planted / predicted - 1, (real, planted, predicted)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"P{s[0]}-n{s[1]}-h{s[2]}/{s[3]}-{s[5]}-{s[7]}")
def test_the_attention_prediction_is_within_10_percent_of_the_measured_peak(size, run_on_ring):
    world, n, heads, kv_heads, head_dim, dtype, causal, layout = size
    measured = run_on_ring(world, measured_peak_task, n, heads, kv_heads, head_dim, dtype, causal, layout)
    predicted = prediction(*size)
    busiest = max(measured)
    assert abs(busiest / predicted - 1) <= BUDGET, (
        f"{size}: the busiest rank held {busiest:,} bytes at its peak, plan predicts {predicted:,} "
        f"({busiest / predicted:.3f}x; per rank {measured})")
    assert all(m <= predicted * (1 + BUDGET) for m in measured), (size, measured, predicted)
