"""The ring on torch.distributed: bit for bit equal to its simulation, and failures that are
collective and bounded.

Every test body that needs ranks is a module-level task `task(member, *args)` run through the
`run_on_ring` fixture: on local gloo rings under plain pytest, on the torchrun world (in-process)
under `torchrun -m pytest`. Rings smaller than the world are sub-groups of its last ranks, so
ring ranks differ from global ranks.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ringcheck
from ringcheck.judge.check import Results
from ringcheck.judge.inputs import make_inputs
from ringcheck.launch import CLAIMED_BY, RingError, TorchrunEnv, TorchrunWorld
from ringcheck.launch.common import live_groups
from ringcheck.ring import DistributedDriver, Post, ring_attention
from ringcheck.ring.comm import RingComm
from ringcheck.testing.cases import DISTRIBUTED_CASES, DISTRIBUTED_FAULT_CASES, DISTRIBUTED_LSE_CASES
from ringcheck.testing.cases import case as one_case

# largest first: its local ring then serves the smaller ones; make test runs 4, 3 and 1 (even, odd, one),
# 8 and 2 carry the marker thorough (make test-thorough, in CI)
SIZES = [pytest.param(8, marks=pytest.mark.thorough), 4, 3, pytest.param(2, marks=pytest.mark.thorough), 1]
TENSORS = ("out", "lse", "dq", "dk", "dv")


def cases_of_size(table, world_size):
    """The cases of `table` (a dict name -> Case) for a ring of `world_size`, in table order."""
    return [case for case in table.values() if case.ring.world_size == world_size]


def shard_inputs(inputs, *, layout, rank, world_size):
    """This rank's (q, k, v, dout), q, k, v as leaves, sharded the way `simulate_ring` does."""
    q, k, v, dout = (ringcheck.shard(t, layout=layout, rank=rank, world_size=world_size, dim=1)
                     for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    return (*(t.detach().clone().requires_grad_(True) for t in (q, k, v)), dout)


def rank_results(member, case):
    """This rank's shards of out, lse, dq, dk, dv for `case`, through ring_attention."""
    inputs = make_inputs(case.spec, seed=case.seed, distribution=case.distribution, device=member.device)
    q, k, v, dout = shard_inputs(inputs, layout=case.ring.layout, rank=member.rank, world_size=member.world_size)
    out, lse = ring_attention(q, k, v, causal=case.spec.causal, softmax_scale=case.spec.softmax_scale,
                              group=member.group, layout=case.ring.layout, backend=case.backend,
                              return_lse=True, timeout=member.timeout)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return Results(out.detach(), lse.detach(), dq, dk, dv)


def _simulated_shards(case, member, *, lse_weight=None):
    """The simulated ring on the whole inputs, cut to this rank's shards."""
    s, ring = case.spec, case.ring
    inputs = make_inputs(s, seed=case.seed, device=member.device)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    out, lse = ringcheck.simulate_ring(q, k, v, world_size=ring.world_size, causal=s.causal,
                                       layout=ring.layout, return_lse=True)
    outputs, grads = [out], [inputs.dout]
    if lse_weight is not None:
        outputs.append(lse)
        grads.append(lse_weight)
    dq, dk, dv = torch.autograd.grad(outputs, (q, k, v), grads)
    cut = lambda t, dim=1: ringcheck.shard(t, layout=ring.layout, rank=member.rank,  # noqa: E731
                                           world_size=ring.world_size, dim=dim)
    return {"out": cut(out), "lse": cut(lse, 2), "dq": cut(dq), "dk": cut(dk), "dv": cut(dv)}


def _mismatches(case, got, want, member):
    bad = []
    for name in TENSORS:
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            bad.append(f"rank {member.rank}: {case.describe()}: {name} differs from the simulated ring in "
                       f"{int((diff != 0).sum())} of {diff.numel()} elements (max {diff.max().item():.3e})")
    return bad


def bit_for_bit_task(member, cases):
    """Each case through ring_attention on this rank and through the simulated ring on the
    whole inputs; returns the mismatches this rank sees (none expected)."""
    bad = []
    for case in cases:
        r = rank_results(member, case)
        got = dict(zip(TENSORS, (r.out, r.lse, r.dq, r.dk, r.dv)))
        bad += _mismatches(case, got, _simulated_shards(case, member), member)
    return bad


def lse_gradient_task(member, case):
    """A gradient flowing into lse as well as out, through both rings."""
    s, ring = case.spec, case.ring
    inputs = make_inputs(s, seed=case.seed, device=member.device)
    weight = torch.randn(s.batch, s.heads, s.seq_len, generator=torch.Generator().manual_seed(7)).to(member.device)
    q, k, v, dout = shard_inputs(inputs, layout=ring.layout, rank=member.rank, world_size=member.world_size)
    out, lse = ring_attention(q, k, v, causal=s.causal, layout=ring.layout, group=member.group,
                              return_lse=True, timeout=member.timeout)
    my_weight = ringcheck.shard(weight, layout=ring.layout, rank=member.rank, world_size=member.world_size, dim=2)
    dq, dk, dv = torch.autograd.grad([out, lse], (q, k, v), [dout, my_weight])
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    return _mismatches(case, got, _simulated_shards(case, member, lse_weight=weight), member)


@pytest.mark.parametrize("world_size", SIZES)
def test_distributed_equals_simulated_bit_for_bit(run_on_ring, world_size):
    """Every mode, float32 and bfloat16, MHA and GQA: out, lse, dq, dk, dv identical."""
    cases = cases_of_size(DISTRIBUTED_CASES, world_size)
    assert cases, f"DISTRIBUTED_CASES has no case for world_size={world_size}"
    per_rank = run_on_ring(world_size, bit_for_bit_task, cases)
    bad = [line for rank in per_rank for line in rank]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world_size", [4, 3])
def test_gradient_through_lse_equals_simulated_bit_for_bit(run_on_ring, world_size):
    cases = cases_of_size(DISTRIBUTED_LSE_CASES, world_size)
    assert cases, f"DISTRIBUTED_LSE_CASES has no case for world_size={world_size}"
    for case in cases:
        bad = [line for rank in run_on_ring(world_size, lse_gradient_task, case) for line in rank]
        assert not bad, "\n".join(bad)


def ranks_task(member):
    comm = RingComm(member.group, timeout=member.timeout)
    return (member.rank, member.global_rank, dist.get_rank(), comm.global_ranks)


@pytest.mark.parametrize("world_size", [3, 2])
def test_group_ranks_are_converted_to_global_ranks(run_on_ring, world_size):
    got = run_on_ring(world_size, ranks_task)
    assert [g[0] for g in got] == list(range(world_size))
    globals_ = [g[2] for g in got]
    assert [g[1] for g in got] == globals_
    for g in got:
        assert g[3] == globals_, "every rank must see the ring's global ranks in ring order"


def misuse_task(member):
    comm = RingComm(member.group, timeout=member.timeout)
    said = []
    try:
        comm.wait("kv")
    except RuntimeError as exc:
        said.append(str(exc))
    payload = (torch.full((2,), float(member.rank)),)
    comm.post("kv", payload)
    try:
        comm.post("kv", payload)
    except RuntimeError as exc:
        said.append(str(exc))
    (got,) = comm.wait("kv")
    said.append(int(got[0]))

    def loop_leaving_a_post():
        yield Post("grad", payload)
        return "done"

    try:
        DistributedDriver(comm).run([loop_leaving_a_post()])
    except RuntimeError as exc:
        said.append(str(exc))  # (the abandoned exchange still completes: both ranks posted it)
    return said


def test_comm_raises_on_misuse(run_on_ring):
    said = run_on_ring(2, misuse_task)
    for rank, words in enumerate(said):
        assert "wait on channel 'kv' before anything was posted" in words[0]
        assert "two sends in flight on channel 'kv'" in words[1]
        assert words[2] == (rank - 1) % 2
        assert "exchanges still in flight on channels ['grad']" in words[3]


def test_ring_attention_without_a_process_group_says_how_to_launch(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("torch.distributed is initialized under torchrun")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"torchrun --nproc-per-node=<P>"):
        ring_attention(q, q, q)


def test_the_torchrun_environment_is_read_and_checked():
    from ringcheck.launch import CLAIMED_BY, from_torchrun_env

    full = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    env = from_torchrun_env(full)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (1, 4, 1, "10.0.0.1", 29500)
    assert from_torchrun_env({}) is None
    with pytest.raises(RuntimeError, match=r"incomplete: .* are not; launch with `torchrun"):
        from_torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="non-integer"):
        from_torchrun_env({**full, "RANK": "one"})
    with pytest.raises(RuntimeError, match="RANK=4 is outside WORLD_SIZE=4"):
        from_torchrun_env({**full, "RANK": "4"})
    # a subprocess of a rank inherits the variables, but the rank is its parent
    assert from_torchrun_env({**full, CLAIMED_BY: str(os.getpid() + 1)}) is None
    assert from_torchrun_env({**full, CLAIMED_BY: str(os.getpid())}) == env


def test_a_subprocess_of_a_rank_is_not_a_rank():
    """What a rank's subprocess inherits: the launcher's variables and the rank's claim on them
    (this process stands in for the rank; the suites run each test without the launcher's variables)."""
    from ringcheck.launch import CLAIMED_BY

    inherited = {**os.environ, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500", CLAIMED_BY: str(os.getpid())}
    code = "from ringcheck.launch import from_torchrun_env; print(from_torchrun_env())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=inherited)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


# ------------------------------------------------------------------------ collective failures

def planted_wrong_result_task(member, case, planted_rank):
    """A correct ring run of `case`, then one rank's output is made wrong: its check must fail."""
    r = rank_results(member, case)
    got = dict(zip(TENSORS, (r.out, r.lse, r.dq, r.dk, r.dv)))
    if member.rank == planted_rank:
        got["out"] = got["out"].clone()
        got["out"][0, 0, 0, 0] += 1.0
    bad = _mismatches(case, got, _simulated_shards(case, member), member)
    assert not bad, "\n".join(bad)
    return "ok"


def test_a_failure_on_one_rank_fails_every_rank_with_one_message(run_on_ring, torchrun_world):
    case = DISTRIBUTED_FAULT_CASES["wrong_result_p4"]
    start = time.monotonic()
    with pytest.raises(RingError) as info:
        run_on_ring(case.ring.world_size, planted_wrong_result_task, case, 1)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert set(info.value.failures) == {1}
    assert "failing ranks: 1 — raised: 1\n" in message and "rank 1 (global rank" in message
    assert "out differs from the simulated ring in 1 of" in message
    assert elapsed < 30, f"took {elapsed:.1f} s"
    if torchrun_world is not None:  # every rank raised, and all raised the same words
        messages = torchrun_world.all_gather(message)
        assert all(m == messages[0] for m in messages), messages
    # the ring is usable again afterwards (a local ring restarts, a torchrun ring is re-made)
    assert run_on_ring(case.ring.world_size, ranks_task)[0][0] == 0


def raises_before_the_ring_task(member, case, timeout):
    if member.rank == 1:
        raise ValueError("planted: rank 1 fails before its first send")
    q, k, v, _ = shard_inputs(make_inputs(case.spec, seed=case.seed), layout=case.ring.layout, rank=member.rank,
                              world_size=member.world_size)
    return ring_attention(q, k, v, causal=case.spec.causal, layout=case.ring.layout, group=member.group,
                          timeout=timeout).shape


def test_a_rank_that_raises_fails_the_others_in_bounded_time(run_on_ring):
    case, timeout = DISTRIBUTED_FAULT_CASES["raises_p3"], 5.0
    start = time.monotonic()
    with pytest.raises(RingError) as info:
        run_on_ring(case.ring.world_size, raises_before_the_ring_task, case, timeout)
    elapsed = time.monotonic() - start
    assert "rank 1 (global rank" in str(info.value) and "ValueError: planted" in str(info.value)
    assert 1 in info.value.failures
    assert elapsed < timeout + 10, f"took {elapsed:.1f} s"


def everyone_raises_task(member):
    raise ValueError(f"planted: rank {member.rank} fails")


def failed_tasks_then_groups(world, failures: int) -> tuple[int, int]:
    """`failures` failed tasks on a ring of the world's last 2 ranks, every other one with rank 0
    left waiting in the ring (the stop flag ends its wait; its transfer is given up on): the
    process groups this rank holds after the first and after the last."""
    timeout, fault = 5.0, one_case("zigzag", world_size=2)
    counts = []
    for i in range(failures):
        with pytest.raises(RingError, match="planted"):
            if i % 2:
                world.run(2, raises_before_the_ring_task, fault, timeout)
            else:
                world.run(2, everyone_raises_task)
        if i == 0:
            counts.append(live_groups())
    counts.append(live_groups())
    return tuple(counts)


def torchrun_world_task(member, failures: int) -> tuple[int, int]:
    """`failed_tasks_then_groups` on a `TorchrunWorld` made of this local ring's processes (their
    world exists: the torchrun world takes it, as it takes one a user's launcher made)."""
    env = TorchrunEnv(member.global_rank, member.world_size, member.global_rank, "127.0.0.1", 0)
    claimed = os.environ.get(CLAIMED_BY)
    world = TorchrunWorld(env, timeout=5.0, device="cpu")
    try:
        return failed_tasks_then_groups(world, failures)
    finally:
        world.close()
        os.environ.pop(CLAIMED_BY, None) if claimed is None else os.environ.update({CLAIMED_BY: claimed})


def test_a_failed_tasks_groups_are_destroyed_on_every_rank(run_on_ring, torchrun_world):
    """After a failure every rank destroys the plan's groups (before: they were only dropped, and
    each failure left them alive: on NCCL, communicators and GPU memory), so the number of live
    groups after 50 failed tasks is the number after one, on every rank."""
    if torchrun_world is not None:
        if torchrun_world.size < 2:
            pytest.skip("needs a torchrun world of 2 ranks or more")
        counts = [failed_tasks_then_groups(torchrun_world, 50)]
    else:
        counts = run_on_ring(2, torchrun_world_task, 50, exact=True)
    for after_one, after_fifty in counts:
        assert after_fifty == after_one, f"{after_fifty} process groups after 50 failed tasks, {after_one} after one"


def test_planted_failure_demonstration(request, run_on_ring):
    """Fails on purpose (with --ring-planted-failure): under torchrun, on every rank with one
    message naming rank 1; with plain pytest, once, naming rank 1."""
    if not request.config.getoption("--ring-planted-failure"):
        pytest.skip("a demonstration that fails on purpose: select it with --ring-planted-failure")
    case = DISTRIBUTED_FAULT_CASES["wrong_result_p4"]
    run_on_ring(case.ring.world_size, planted_wrong_result_task, case, 1)

