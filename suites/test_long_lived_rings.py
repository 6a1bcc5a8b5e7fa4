"""Local rings that live for a session hold only what is in use: a rank keeps the process groups
of its most recently used plans only (`ringcheck.launch.common.PlanGroups`), and `LocalRings`
closes a pool left unused for `idle_close` seconds. Each gloo group holds a polling thread: a
session that kept every group of its rings and meshes, and a pool of every ring size it ran,
spent a tenth of a core and more on them while idle."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from ringcheck.launch import GroupPlan, LocalRingPool, LocalRings
from ringcheck.launch.common import KEEP_PLANS, PlanGroups


def _threads(member) -> int:
    return len(os.listdir("/proc/self/task"))


def _name(member) -> str:
    return member.group.group_name  # a new name for every group made


def _ranks(member) -> tuple[int, int, list[int]]:
    """What the ring sees: its rank, its size and, through an all-gather on it, every member's global rank."""
    got = [None] * member.world_size
    dist.all_gather_object(got, member.global_rank, group=member.group)
    return member.rank, member.world_size, got


def _plans(size: int) -> list[GroupPlan]:
    """Distinct plans on a world of 4: rings of every size, and pairs of interleaved rings."""
    rings = [GroupPlan.ring(size, n) for n in range(1, size + 1)]
    pairs = [GroupPlan(((a, b), (c, d))) for a, b, c, d in ((0, 1, 2, 3), (0, 2, 1, 3), (0, 3, 1, 2))]
    return rings + pairs


@pytest.fixture
def pool(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local ring: run with plain pytest")
    pool = LocalRingPool(4)
    yield pool
    pool.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_the_threads_of_old_plans_go_with_their_groups(pool):
    plans = _plans(4)
    assert len(plans) > KEEP_PLANS + 2
    for plan in plans[:KEEP_PLANS - 1]:
        pool.run_groups(plan, _threads)
    settled = max(pool.run(4, _threads))  # KEEP_PLANS plans made, the ring of 4 the last
    for plan in plans:
        pool.run_groups(plan, _threads)
    after = max(pool.run(4, _threads))
    assert after <= settled, f"{after} threads per rank after {len(plans)} plans, {settled} after {KEEP_PLANS}"


def test_the_least_recently_used_plan_goes_and_comes_back_working(pool):
    plans = _plans(4)[:KEEP_PLANS + 1]
    first = [pool.run_groups(p, _name) for p in plans[:KEEP_PLANS]]
    assert pool.run_groups(plans[0], _name) == first[0]  # kept: the same groups
    pool.run_groups(plans[KEEP_PLANS], _name)            # one more: plans[1], the least recent, goes
    assert pool.run_groups(plans[0], _name) == first[0]
    assert pool.run_groups(plans[2], _name) == first[2]
    remade = pool.run_groups(plans[1], _name)
    assert remade != first[1]
    # the groups made again are whole groups: right ranks, and their collectives reach every member
    assert pool.run_groups(plans[1], _ranks) == [[(0, 2, [2, 3]), (1, 2, [2, 3])]]  # the last two ranks


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep must be >= 1 plan, got 0"):
        PlanGroups(rank=0, timeout=5.0, keep=0)


def test_a_pool_left_idle_is_closed_when_another_is_asked_for(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    with LocalRings(idle_close=0.5) as rings:
        assert rings.run(2, _name) and rings.run(3, _name)
        two, three = rings.pool(2, exact=True), rings.pool(3, exact=True)
        time.sleep(1.0)
        assert rings.run(3, _threads)  # the ring of 3 is asked for: the idle ring of 2 goes, not it
        assert not two.alive and three.alive
        assert rings.run(2, _ranks, exact=True) == [(0, 2, [0, 1]), (1, 2, [0, 1])]  # a new one
        assert rings.pool(2, exact=True) is not two
    with pytest.raises(ValueError, match="idle_close must be a positive number of seconds"):
        LocalRings(idle_close=0)
