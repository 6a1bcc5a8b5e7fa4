"""Layouts: shard/unshard are exact inverses, and the block plans cover exactly the causal mask."""

import pytest
import torch

from ringcheck import shard, unshard
from ringcheck.ring.layouts import block_plan, positions, work_counts

LAYOUTS = ["contiguous", "zigzag", "striped"]
SIZES = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dim", [1, 2, -1])
def test_shard_unshard_round_trip_is_exact(layout, world_size, dim):
    x = torch.randn(2, 4 * world_size, 4 * world_size, 4 * world_size)
    shards = [shard(x, layout=layout, rank=r, world_size=world_size, dim=dim) for r in range(world_size)]
    assert torch.equal(unshard(shards, layout=layout, dim=dim), x)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", SIZES)
def test_shards_hold_their_positions_and_partition_the_sequence(layout, world_size):
    n = 4 * world_size
    x = torch.arange(n).view(1, n)
    held = []
    for r in range(world_size):
        pos = positions(layout=layout, rank=r, world_size=world_size, seq_len=n)
        assert torch.equal(shard(x, layout=layout, rank=r, world_size=world_size)[0], pos)
        assert torch.all(pos[1:] > pos[:-1]), "local order must follow position order"
        held.append(pos)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(n))


def test_zigzag_rank_holds_chunks_r_and_2p_minus_1_minus_r():
    pos = positions(layout="zigzag", rank=1, world_size=4, seq_len=16)
    assert pos.tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_block_plans_equal_the_mask_from_positions(layout, world_size, causal):
    n_local = 4
    seq = n_local * world_size
    for q_rank in range(world_size):
        qp = positions(layout=layout, rank=q_rank, world_size=world_size, seq_len=seq)
        for kv_rank in range(world_size):
            kp = positions(layout=layout, rank=kv_rank, world_size=world_size, seq_len=seq)
            want = (kp[None, :] <= qp[:, None]) if causal else torch.ones(n_local, n_local, dtype=torch.bool)
            got = torch.zeros(n_local, n_local, dtype=torch.int64)
            for b in block_plan(layout=layout, q_rank=q_rank, kv_rank=kv_rank, world_size=world_size,
                                local_len=n_local, causal=causal):
                rows = torch.arange(n_local)[b.q]
                cols = torch.arange(n_local)[b.kv]
                vis = torch.ones(len(rows), len(cols), dtype=torch.bool)
                if b.mask == "causal":
                    vis = vis.tril(b.diagonal)
                got[rows[:, None], cols[None, :]] += vis.long()
            assert got.max() <= 1, f"{layout} q_rank={q_rank} kv_rank={kv_rank}: a pair computed twice"
            assert torch.equal(got.bool(), want), f"{layout} q_rank={q_rank} kv_rank={kv_rank}: wrong mask"


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_work_counts_total_and_balance(world_size):
    seq = 64 * world_size
    total = seq * (seq + 1) // 2
    counts = {layout: work_counts(layout=layout, world_size=world_size, seq_len=seq, causal=True)
              for layout in LAYOUTS}
    for layout, c in counts.items():
        assert sum(c) == total, layout
    assert max(counts["zigzag"]) == min(counts["zigzag"]), "zigzag must balance causal work exactly"
    # striped: rank r does n(r + 1) more than P n (n - 1) / 2, so within 2 / n of balance
    assert max(counts["striped"]) / (sum(counts["striped"]) / world_size) < 1.05
    assert max(counts["contiguous"]) > 1.5 * min(counts["contiguous"])
    assert work_counts(layout="contiguous", world_size=world_size, seq_len=seq, causal=False) == \
        [seq * seq // world_size] * world_size


def test_bad_layout_inputs_raise_with_the_fix():
    x = torch.zeros(1, 12, 2, 4)
    with pytest.raises(ValueError, match=r"seq_len=12 is not divisible by 2 x world_size=8 .*seq_len=16"):
        shard(x, layout="zigzag", rank=0, world_size=4)
    with pytest.raises(ValueError, match="layout='ring'"):
        shard(x, layout="ring", rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank=5 is outside"):
        shard(x, layout="contiguous", rank=5, world_size=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        shard([1, 2], layout="contiguous", rank=0, world_size=2)
    with pytest.raises(ValueError, match="empty"):
        unshard([], layout="contiguous")
