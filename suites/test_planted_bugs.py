"""Deliberately broken rings: the verdict (or the ring's own home check) must reject each.

Each bug is planted by swapping one piece of the real ring for a wrong one, so these tests
prove that the checks of test_ring.py can fail.
"""

import pytest
import torch

import ringcheck.ring as ring_module
from ringcheck.check import MODES, Case, run_case, simulated_impl
from ringcheck.layouts import Block, block_plan
from ringcheck.spec import AttentionSpec, RingSpec


def _case(mode, world_size=4, dtype="float32", distribution="normal", tokens=4, head_dim=16):
    causal, layout = MODES[mode]
    spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_len=2 * world_size * tokens,
                         head_dim=head_dim, dtype=dtype, causal=causal)
    return Case(spec, RingSpec(world_size, layout), seed=11, distribution=distribution)


def test_the_unbroken_ring_passes_these_cases():
    for case in (_case("bidirectional"), _case("zigzag"),
                 _case("bidirectional", 16, "bfloat16", "near-uniform", 8, 32)):
        verdict = run_case(case)
        assert verdict.passed, verdict.message()


def test_merge_without_rescaling_is_rejected(monkeypatch):
    def merge_without_rescaling(acc, m, l, block_out, block_lse):
        # forgets to rescale by exp(old max - new max): treats every block as if its lse were the max
        add = torch.ones_like(block_lse)
        return acc + block_out * add.transpose(1, 2).unsqueeze(-1), torch.maximum(m, block_lse), l + add

    monkeypatch.setattr(ring_module, "merge_into", merge_without_rescaling)
    verdict = run_case(_case("bidirectional"))
    assert not verdict.passed
    assert not verdict["out"].passed and not verdict["lse"].passed


def test_wrong_causal_offset_in_the_zigzag_diagonal_is_rejected(monkeypatch):
    def off_by_one(**kwargs):
        plan = block_plan(**kwargs)
        if kwargs["q_rank"] == kwargs["kv_rank"]:
            return tuple(Block(b.q, b.kv, b.mask, b.diagonal + 1) for b in plan)  # sees one future token
        return plan

    monkeypatch.setattr(ring_module, "block_plan", off_by_one)
    verdict = run_case(_case("zigzag"))
    assert not verdict.passed
    assert "FAILED" in verdict.message() and "zigzag" in verdict.message()
    assert not verdict["out"].passed and not verdict["dk"].passed


def test_dk_dv_not_sent_home_is_caught_by_the_home_check(monkeypatch):
    real_loop = ring_module.backward_loop

    def keeps_the_last_gradients(config, shard, *args):
        # takes part in every exchange, but keeps its own dK/dV instead of the ones coming home
        loop = real_loop(config, shard, *args)
        message, grad_posts, mine = next(loop), 0, None
        while True:
            if isinstance(message, ring_module.Post) and message.channel == "grad":
                grad_posts, mine = grad_posts + 1, message.payload
            reply = yield message
            if isinstance(message, ring_module.Wait) and message.channel == "grad" \
                    and grad_posts == config.world_size:
                reply = mine
            try:
                message = loop.send(reply)
            except StopIteration as stop:
                return stop.value

    monkeypatch.setattr(ring_module, "backward_loop", keeps_the_last_gradients)
    with pytest.raises(RuntimeError, match=r"gradients for rank \d did not return home"):
        run_case(_case("bidirectional"))


def test_low_precision_partial_output_at_every_hop_is_rejected():
    """A bf16 round trip of the running output at every ring step (accumulate="input"): on
    near-tied rows over same-sign V the roundings add up past the budget at 16 ranks."""
    case = _case("bidirectional", 16, "bfloat16", "near-uniform", 8, 32)
    verdict = run_case(case, impl=simulated_impl(case, accumulate="input"))
    assert not verdict.passed
    assert not verdict["out"].passed
