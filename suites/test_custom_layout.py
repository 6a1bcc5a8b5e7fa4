"""Custom layouts (`--layout package.module:FN`): checked to partition the sequence, then
followed by sharding, the references, our ring's block plan, the work accounting and validate.

Proof that the references follow the custom positions: a ring that assumes zig-zag shards (the
textbook ring) passes validate on zig-zag written as a custom layout and fails on a custom
layout that moves the tokens, while our ring passes on it.
"""

from __future__ import annotations

import pytest
import torch

from ringcheck.cli import main
from ringcheck.judge.check import Case, run_case
from ringcheck.ring.layouts import positions, shard, unshard, work_counts
from ringcheck.spec import AttentionSpec, RingSpec, check_layout

EXAMPLES = "ringcheck.catalogue.custom_layouts"
SMALL = ["--seq-len", "32", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
         "--distributions", "normal", "--sample-rows", "4", "--quick", "-q"]


@pytest.mark.parametrize("world_size, seq_len", [(1, 4), (2, 8), (4, 32), (8, 64)])
def test_a_custom_copy_of_zigzag_shards_and_counts_like_zigzag(world_size, seq_len):
    x = torch.randn(2, seq_len, 3)
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size, seq_len=seq_len)
        assert torch.equal(positions(layout=f"{EXAMPLES}:zigzag_again", **kw), positions(layout="zigzag", **kw))
    parts = [shard(x, layout=f"{EXAMPLES}:zigzag_again", rank=r, world_size=world_size) for r in range(world_size)]
    assert torch.equal(unshard(parts, layout=f"{EXAMPLES}:zigzag_again"), x)
    for causal in (False, True):
        assert work_counts(layout=f"{EXAMPLES}:zigzag_again", world_size=world_size, seq_len=seq_len,
                           causal=causal) == work_counts(layout="zigzag", world_size=world_size, seq_len=seq_len,
                                                         causal=causal)


@pytest.mark.parametrize("name", ["reversed_blocks", "ulysses_zigzag"])
def test_shard_then_unshard_is_the_identity_and_counts_are_exact(name):
    layout, p, n = f"{EXAMPLES}:{name}", 4, 32
    x = torch.randn(1, n, 2)
    parts = [shard(x, layout=layout, rank=r, world_size=p) for r in range(p)]
    assert torch.equal(unshard(parts, layout=layout), x)
    # causal: query at global position i sees i + 1 keys
    expected = [int((positions(layout=layout, rank=r, world_size=p, seq_len=n) + 1).sum()) for r in range(p)]
    assert work_counts(layout=layout, world_size=p, seq_len=n, causal=True) == expected


@pytest.mark.parametrize("name", ["zigzag_again", "reversed_blocks", "ulysses_zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_our_ring_on_a_custom_layout_meets_the_budget(name, causal):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=32, head_dim=8, dtype="bfloat16", causal=causal)
    verdict = run_case(Case(spec, RingSpec(4, f"{EXAMPLES}:{name}")))
    assert verdict.passed, verdict.summary()


@pytest.mark.parametrize("layout, says", [
    (f"{EXAMPLES}:overlapping", "ranks 0 and 1 both hold positions [0, 1, 2, 3]; the ranks must partition"),
    (f"{EXAMPLES}:uneven", "gives rank 0 5 positions; a ring of 4 over seq_len=16 needs 4 per rank"),
    (f"{EXAMPLES}:floats", "it must return a 1-D integer tensor of global positions"),
    (f"{EXAMPLES}:nosuch", "has no attribute 'nosuch'"),
    ("no_such_module_anywhere:fn", "cannot import module 'no_such_module_anywhere'"),
])
def test_a_layout_that_does_not_partition_the_sequence_is_a_clear_error(layout, says):
    with pytest.raises(ValueError) as info:
        positions(layout=layout, rank=0, world_size=4, seq_len=16)
    assert says in str(info.value), str(info.value)


def test_a_malformed_layout_name_is_refused():
    with pytest.raises(ValueError, match="neither a built-in layout nor `package.module:function`"):
        check_layout("my layout:fn")


def test_validate_refuses_a_broken_custom_layout_before_any_rank_starts(capsys):
    assert main(["validate", "--layout", f"{EXAMPLES}:overlapping", *SMALL]) == 2
    assert "the ranks must partition the sequence" in capsys.readouterr().err


def test_validate_follows_a_custom_layout(torchrun_world, capsys):
    if torchrun_world is not None:
        pytest.skip("starts its own local ring: plain pytest")
    moved = f"{EXAMPLES}:reversed_blocks"
    assert main(["validate", "--layout", moved, *SMALL]) == 0, capsys.readouterr().out
    # a ring that assumes zig-zag shards is right on zig-zag spelled as a custom layout, and
    # wrong once the tokens move
    textbook = ["--impl", "ringcheck.catalogue.mutants:textbook"]
    assert main(["validate", "--layout", f"{EXAMPLES}:zigzag_again", *textbook, *SMALL]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main(["validate", "--layout", moved, *textbook, *SMALL]) == 1
    assert "FAILED" in capsys.readouterr().out
