"""The torch backend's plain path by tiles of query rows (issue 59, defect 13): on CUDA the
`torch` backend takes its plain path (the fused kernels it uses on the CPU are CPU-only), and a
long block's whole float32 scores do not fit on a GPU (16384 x 8192 at 32 heads: 16 GiB a
tensor, four of them in the old backward). The plain path now holds at most three tiles of
`ROW_TILE_BYTES`; a block that fits in one tile runs as before, bit for bit. Shown here on the
CPU with the plain path, which is the same code."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringcheck.measure import peak_bytes
from ringcheck.plan.ring import ROW_TILE_BYTES as PLAN_ROW_TILE_BYTES
from ringcheck.ring.backends import row_delta
from ringcheck.ring.backends.torch_backend import ROW_TILE_BYTES, TorchBackend, row_tiles

MiB = 2**20


def _block(dtype, sq, sk, heads, kv_heads, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, s, h, w, generator=gen).to(dtype)
                     for s, h, w in ((sq, heads, d), (sk, kv_heads, d), (sk, kv_heads, dv), (sq, heads, dv)))
    return q, k, v, dout


def _run(backend, q, k, v, dout, **kw):
    out, lse = backend.forward(q, k, v, **kw)
    return (out, lse, *backend.backward(q, k, v, dout, lse, row_delta(out, dout), **kw))


def test_row_tiles_cover_the_rows_with_at_least_one_row_a_tile():
    assert row_tiles(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert row_tiles(10, 4, 1) == [(r, r + 1) for r in range(10)]      # a row wider than the tile: one row
    assert row_tiles(10, 4, 10**9) == [(0, 10)] and row_tiles(0, 4) == [(0, 0)]
    assert ROW_TILE_BYTES == PLAN_ROW_TILE_BYTES                        # plan counts the backend's tile


MASKS = [("full", 0, 0, None), ("causal", 0, 0, None), ("causal", -1, 0, None), ("causal", 5, 0, 5.0),
         ("band", 3, -6, None), ("band", 3, -6, 5.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(37, 37, 4, 2, 16, 16), (24, 50, 3, 3, 24, 8), (50, 24, 4, 1, 16, 16)],
                         ids=["square-gqa", "wide-mla", "tall-mqa"])
def test_row_tiles_agree_with_the_whole_block_within_rounding(dtype, shape):
    """One row a tile and seven rows a tile against one tile: every mask (a tile's mask is the
    block's moved by its first row), softcap, GQA and d_v != d; out, lse and dq within a few
    float32 roundings (a matmul's bits depend on its row count), dK/dV (sums over the tiles) too."""
    q, k, v, dout = _block(dtype, *shape)
    heads, sk = shape[2], shape[1]
    row = heads * sk * (8 if dtype == torch.float64 else 4)
    rounding = 1e-13 if dtype == torch.float64 else 2e-6
    for (mask, diagonal, lower, softcap), rows in itertools.product(MASKS, (1, 7)):
        kw = dict(scale=shape[4] ** -0.5, mask=mask, diagonal=diagonal, lower=lower, softcap=softcap)
        whole = _run(TorchBackend(fast=False), q, k, v, dout, **kw)
        tiled = _run(TorchBackend(fast=False, row_tile_bytes=rows * row), q, k, v, dout, **kw)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tiled, whole):
            assert torch.equal(torch.isneginf(a), torch.isneginf(b)), (name, mask, rows)
            finite = torch.isfinite(b)
            err = float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0
            assert err <= rounding * max(1.0, float(b[finite].abs().max())), (name, mask, diagonal, softcap, rows, err)


def test_a_block_that_fits_in_one_tile_runs_as_one():
    """The tile changes nothing where a block fits: the same bits with the default tile and an
    enormous one."""
    q, k, v, dout = _block(torch.bfloat16, 40, 40, 4, 2, 16, 16)
    kw = dict(scale=0.25, mask="band", diagonal=2, lower=-9, softcap=7.0)
    for a, b in zip(_run(TorchBackend(fast=False), q, k, v, dout, **kw),
                    _run(TorchBackend(fast=False, row_tile_bytes=2**50), q, k, v, dout, **kw)):
        assert torch.equal(a, b)


def test_a_long_block_holds_at_most_three_score_tiles():
    """A block whose whole float32 scores take 256 MiB (4 heads, 4096 x 4096): with the default
    tile (128 MiB) its forward and its backward hold at most three tiles beyond inputs of a few
    MiB. Before the tiles, the backward held s, p, dP, dP - delta and dS whole: 1.25 GiB."""
    q, k, v, dout = _block(torch.float32, 4096, 4096, 4, 4, 16, 16)
    backend = TorchBackend(fast=False)
    kw = dict(scale=0.25, mask="causal", diagonal=0)
    forward, (out, lse) = peak_bytes(lambda: backend.forward(q, k, v, **kw), device="cpu")
    delta = row_delta(out, dout)
    backward, _ = peak_bytes(lambda: backend.backward(q, k, v, dout, lse, delta, **kw), device="cpu")
    others = 16 * MiB  # q, k, v, dout and the outputs: 1 MiB each
    assert 1 * q.shape[1] * 4 * 4096 * 4 == 2 * ROW_TILE_BYTES  # the block is two tiles
    assert forward <= 3 * ROW_TILE_BYTES + others and backward <= 3 * ROW_TILE_BYTES + others, (forward, backward)
