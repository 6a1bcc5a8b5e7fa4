"""Faults on a local gloo ring: a rank that raises, is SIGKILLed mid-ring, or never sends.

Each ends with a RingError that names the rank, within a bound set by the (short) timeout, with
every process of the failed ring gone; the next task gets a fresh ring. Plain pytest only: these
kill and stall processes, which under torchrun would take the launcher's world down.
"""

import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import ringcheck
from ringcheck.launch import LocalRings, RingError
from ringcheck.ring import RingConfig, run_ring

TIMEOUT = 3.0  # the ring's: short, and still above the grace, so that "within the timeout" means something
GRACE = 1.0    # what the other ranks get to report after a first failure (the launcher's default: 2 s)
RING = 3
VICTIM = 1


def _shards(member):
    g = torch.Generator().manual_seed(member.rank)
    return [torch.randn(1, 8, 2, 8, generator=g) for _ in range(3)]


def _kill_at_step(rank: int, step: int):
    def observer(r, s, src, out, lse):
        if r == rank and s == step:
            os.kill(os.getpid(), signal.SIGKILL)
    return observer


def ring_task(member, fault):
    """A forward and backward through ring_attention, with `fault` planted on VICTIM."""
    from ringcheck.ring import DistributedDriver
    from ringcheck.ring.comm import RingComm

    q, k, v = (t.requires_grad_() for t in _shards(member))
    if member.rank == VICTIM and fault == "raise":
        raise ValueError("planted: this rank gives up before its first send")
    if member.rank == VICTIM and fault == "abort":  # a native crash: a message on fd 2, then SIGABRT
        os.write(2, b"terminate called after throwing an instance of 'planted::Error'\n")
        os.abort()
    if member.rank == VICTIM and fault == "never-send":
        time.sleep(3600)  # stuck: never posts, never answers
    if fault == "sigkill":  # dies after computing ring step 1, with the next K/V exchange in flight
        config = RingConfig(world_size=member.world_size, scale=8 ** -0.5)
        driver = DistributedDriver(RingComm(member.group, timeout=member.timeout))
        (out,), _ = run_ring(config, driver, [q], [k], [v], observer=_kill_at_step(VICTIM, 1))
    else:
        out = ringcheck.ring_attention(q, k, v, group=member.group, timeout=member.timeout)
    out.sum().backward()
    return "ok"


def _children():
    return {p.pid for p in multiprocessing.active_children()}


def _gone(pid):
    """No such process, or only its zombie (exited; waiting for whoever reaps orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@pytest.fixture
def rings(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("fault injection kills and stalls processes: run it with plain pytest (it starts "
                    "its own local rings), not under torchrun")
    with LocalRings(timeout=TIMEOUT, grace=GRACE) as rings:
        yield rings


def _fails_cleanly(rings, fault, says, bound):
    """Run `fault` on a warm ring: a RingError naming VICTIM within `bound` seconds, every
    process of the failed ring gone, and a fresh ring for the next task. Returns the error."""
    pool = rings.pool(RING)
    assert rings.run(RING, ring_task, "none") == ["ok"] * RING
    pids = pool.pids
    start = time.monotonic()
    with pytest.raises(RingError) as info:
        rings.run(RING, ring_task, fault)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert VICTIM in info.value.failures, message
    assert f"rank {VICTIM} (global rank" in message and says in message, message
    assert elapsed < bound, f"{fault}: the ring took {elapsed:.1f} s to fail (bound {bound} s)\n{message}"
    assert not pool.alive
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    assert not (set(pids) & _children())
    assert rings.run(RING, ring_task, "none") == ["ok"] * RING
    assert rings.pool(RING) is not pool
    return info.value


def test_a_rank_that_raises(rings):
    # reported at once; the others, stuck waiting for it, are stopped after the grace
    error = _fails_cleanly(rings, "raise", "ValueError: planted", bound=TIMEOUT)
    others = ", ".join(str(r) for r in range(RING) if r != VICTIM)
    assert f"raised: {VICTIM}; stopped after the failure: {others}" in str(error).splitlines()[0], str(error)


def test_a_rank_killed_mid_ring(rings):
    # the worker's sentinel fires at once; its neighbours see the connection close
    _fails_cleanly(rings, "sigkill", "died during the task: killed by SIGKILL", bound=TIMEOUT)


def test_a_rank_that_aborts_is_named_with_its_last_words(rings, tmp_path):
    # a native crash (SIGABRT): the culprit is named apart from the peers that lost their
    # connection to it, and the message (and its rank's log) quotes what it wrote to stderr,
    # with its Python stack
    rings.log_dir = str(tmp_path)  # before the first pool starts
    error = _fails_cleanly(rings, "abort", "died during the task: killed by SIGABRT", bound=TIMEOUT)
    log = (tmp_path / f"rank{VICTIM}.log").read_text()
    assert "died during the task: killed by SIGABRT" in log and "planted::Error" in log, log
    assert str(error).splitlines()[0].endswith(f"died: {VICTIM}") or f"died: {VICTIM};" in str(error), str(error)
    last_words = error.failures[VICTIM]
    assert "terminate called after throwing an instance of 'planted::Error'" in last_words, last_words
    assert "ring_task" in last_words, last_words  # faulthandler's stack names the task's frame


def test_a_rank_that_never_sends(rings):
    """Its neighbours time out naming it; it is stopped after the grace. Both neighbours wait
    out the same timeout: the first to give up stops the other, which may then read "stopped
    after the failure" (under load either one is first: the test once assumed the receiver)."""
    nxt, prv = (VICTIM + 1) % RING, (VICTIM - 1) % RING
    said = {nxt: f"no 'kv' payload arrived from rank {VICTIM}",
            prv: f"rank {VICTIM} (global rank {VICTIM}) did not take the 'kv' payload"}
    error = _fails_cleanly(rings, "never-send", f"rank {VICTIM} (global rank {VICTIM})", bound=TIMEOUT + 6)
    timed_out = sorted(r for r in (nxt, prv) if said[r] in error.failures[r])
    assert timed_out, str(error)
    for r in set((nxt, prv)) - set(timed_out):
        assert "stopped waiting" in error.failures[r] and said[timed_out[0]] in error.failures[r], str(error)
    assert "did not answer within the grace" in error.failures[VICTIM]
    # the headline names the culprit apart from the ranks that only waited for it
    headline = str(error).splitlines()[0]
    assert f"never answered: {VICTIM}; timed out waiting: {', '.join(map(str, timed_out))}" in headline, headline
    assert f"rank {VICTIM} (global rank {VICTIM}) [never answered]" in str(error)


def own_group_task(member):
    """A trainer's own group, made as trainers make theirs (no timeout given); rank 0 waits for a
    message rank 1 never sends."""
    import torch.distributed as dist

    group = dist.new_group()
    if member.rank == 0:
        dist.recv(torch.zeros(4), src=1, group=group)
    return "ok"


def test_a_trainers_own_group_waits_no_longer_than_the_ring(rings):
    """c10d gives a group made without a timeout 30 min (gloo): a trainer's stalled ring was a 30-min
    hang (ms-swift's ring after a raised case, 2026-12-07). The ranks bound new groups by the ring's
    timeout, so the wait fails in it, naming the rank."""
    rings.pool(2)  # started before the clock
    start = time.monotonic()
    with pytest.raises(RingError) as info:
        rings.run(2, own_group_task)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT + 6, f"the stalled wait took {elapsed:.1f} s (the ring's timeout is {TIMEOUT} s)"
    assert 0 in info.value.failures and "imed out" in info.value.failures[0], str(info.value)


def unsettled_task(member, settle: bool):
    """Two runs on a trainer's group, as two cases of `step --model`: the first posts its K/V exchange
    (batch_isend_irecv, as a ring does before it computes the block) and raises; the second exchanges
    again. What the second receives, and what settling the first's requests said."""
    import torch.distributed as dist

    from ringcheck.launch.in_flight import InFlight

    group, peer = dist.new_group(), 1 - member.rank

    def exchange(value: float):
        sent, got = torch.full((4,), value + member.rank), torch.zeros(4)
        return got, dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer, group),
                                            dist.P2POp(dist.irecv, got, peer, group)])

    def first_case():
        exchange(10.0)  # posted; the block's computation then raises, and the requests go with the stack
        raise ValueError("planted: the block cannot be computed")

    left = "not settled"
    with InFlight() as flight:
        try:
            first_case()
        except ValueError:
            if settle:
                left = flight.settle(member.timeout)
        flight.clear()
        got, requests = exchange(20.0)
        for request in requests:
            request.wait()
    return got.tolist(), left


def test_a_raise_with_messages_in_flight_is_settled_before_the_next_run(rings):
    """The requests a raise leaves in flight, waited for, complete (both ranks posted them): the next run
    receives its own data. Dropped, the next run waits on a channel out of step (ms-swift's ring after a
    raised case, 2026-12-07: every later case timed out)."""
    assert rings.run(2, unsettled_task, True) == [([21.0] * 4, None), ([20.0] * 4, None)]
    try:
        dropped = rings.run(2, unsettled_task, False)
    except RingError as error:  # the channel out of step: a timeout
        assert "imed out" in str(error), str(error)
    else:  # or, worse, the last run's data read as this one's
        assert dropped != [([21.0] * 4, "not settled"), ([20.0] * 4, "not settled")], dropped


def one_sided_task(member):
    """Rank 0 posts a receive its peer never sends, and raises: settling it says what did not complete."""
    import torch.distributed as dist

    from ringcheck.launch.in_flight import InFlight

    group = dist.new_group()
    with InFlight() as flight:
        if member.rank == 0:
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), 1, group)])
        return flight.settle(1.0)


def test_messages_that_never_complete_are_said_not_waited_for_forever(rings):
    left, peer = rings.run(2, one_sided_task)
    assert peer is None and left.startswith("1 of the 1 point-to-point requests it left in flight did not complete "
                                            "(RuntimeError: "), left


def test_a_retired_pool_is_replaced_by_fresh_processes():
    """`retire(size)`: a run left its groups out of step (step --model after an unsettled raise), so the
    pool of that size closes, its processes gone; the next task of that size starts new ones, and a
    pool of another size is kept."""
    with LocalRings(timeout=TIMEOUT) as rings:
        two, one = rings.pool(2, exact=True).pids, rings.pool(1, exact=True).pids
        rings.retire(2)
        assert all(_gone(pid) for pid in two)
        assert rings.run(2, ring_task, "none", exact=True) == ["ok", "ok"]
        assert not set(rings.pool(2, exact=True).pids) & set(two) and rings.pool(1, exact=True).pids == one


@pytest.mark.parametrize("why", ["ValueError: planted", "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:129] "
                                                         "Timed out waiting 120000ms for send operation to complete"])
def test_step_model_retires_a_ring_whose_groups_a_case_left_unusable(why):
    """A case raised inside the glue with its messages in flight that never completed (the later cases
    not run), or in a gloo operation that timed out (gloo closes the pair for good): the ring's
    processes are retired, so that the next run (a zoo's next row) is not failed by the closed pair
    (ms-swift's zoo: 21 rows at P=4 failed at once after one timeout). A plain raise keeps them."""
    pytest.importorskip("transformers")
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.models.step import NOT_RUN_AFTER, ModelStepConfig, spoils_groups

    class Processes:  # the ring's replies as a rank reports them; the truth never asked (every case raised)
        size, timeout, retired = None, TIMEOUT, []

        def run_groups(self, plan, task, config, names, **kw):
            errors = {"one_sequence": why, "packed": f"{NOT_RUN_AFTER}one_sequence raised ..."}
            errors = {name: errors[name] for name in names}
            spoiled = any(spoils_groups(why) for why in errors.values())  # as the rank's _cases_task says it
            return [[{"cp_rank": r, "dp_rank": 0, "attn_implementation": "sdpa", "cases": {}, "errors": errors,
                      "spoiled": spoiled} for r in range(2)]]

        def retire(self, size):
            self.retired.append(size)

    processes = Processes()
    judged = run_model_step(ModelStepConfig(model="llama", world_size=2, cases=("one_sequence", "packed")), processes)
    assert judged["verdict"] == "no verdict" and processes.retired == [2], judged["why"]
    processes.retired = []
    judged = run_model_step(ModelStepConfig(model="llama", world_size=2, cases=("one_sequence",)), processes)
    assert processes.retired == ([2] if "Timed out" in why else []), judged["why"]


def test_closing_leaves_no_process_behind():
    with LocalRings(timeout=TIMEOUT) as rings:
        pids = rings.pool(2).pids
        assert rings.run(2, ring_task, "none") == ["ok", "ok"]
    assert all(_gone(pid) for pid in pids)
    assert not (set(pids) & _children())


PARENT = """
import time
from ringcheck.launch import LocalRings

if __name__ == "__main__":
    pool = LocalRings(timeout=5).pool(2)
    print(*pool.pids, flush=True)
    time.sleep(600)
"""


@pytest.mark.cli
def test_a_killed_parent_leaves_no_worker_behind(tmp_path, torchrun_world):
    """The parent SIGKILLed (no chance to clean up): its idle workers see their pipe close
    and leave."""
    if torchrun_world is not None:
        pytest.skip("starts and kills processes: plain pytest only")
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the parent did not start its ring within 120 s"
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), f"workers left behind: {[p for p in pids if not _gone(p)]}"


RECORDING_RING = """
import os
from ringcheck.catalogue.mutants import textbook

def fn(q, k, v, *, causal, softmax_scale, group=None):
    '''The textbook ring, which first writes down its process and its parent (the fork server).'''
    parent = os.getppid()
    with open(os.path.join(os.path.dirname(__file__), f"worker-{os.getpid()}.txt"), "w") as f:
        f.write(f"{parent}\\n" + open(f"/proc/{parent}/cmdline", "rb").read().decode().replace("\\0", " "))
    return textbook(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)
"""


TINY_PROFILE = """
from hypothesis import settings

def pytest_configure(config):
    settings.register_profile("tiny", settings.get_profile(settings.get_current_profile_name()), max_examples=1,
                              derandomize=True, database=None)
    settings.load_profile("tiny")
"""
SMALL_VALIDATE = ["--quick", "--seq-len", "16", "--world-size", "2", "--heads", "1", "--kv-heads", "1", "--head-dim", "8",
                  "--distributions", "normal", "--sample-rows", "2"]


@pytest.mark.cli
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is forked on Linux only")
@pytest.mark.parametrize("argv, parent", [
    (["-m", "ringcheck", "validate", "--impl", "recording:fn", *SMALL_VALIDATE], "-m ringcheck validate --impl recording:fn"),
    (["-m", "pytest", "--noconftest", "-p", "tiny", "-p", "no:cacheprovider", "--ring-impl", "recording:fn",
      "--ring-world-sizes", "2", "--ring-dtypes", "float32", "--ring-forward-only", "-k", "test_determinism"],
     "-m pytest --noconftest -p tiny"),
], ids=["ringcheck validate", "pytest --ring-impl"])
def test_the_fork_server_is_forked_from_the_command_and_leaves_with_it(tmp_path, torchrun_world, argv, parent):
    """`ringcheck validate` and `pytest --ring-impl` import torch once: their workers' fork server
    is a fork of the command's own process (its command line, not a second interpreter's), and
    it is gone with the command."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: plain pytest only")
    (tmp_path / "recording.py").write_text(RECORDING_RING)
    (tmp_path / "tiny.py").write_text(TINY_PROFILE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [p.read_text().split("\n", 1) for p in tmp_path.glob("worker-*.txt")]
    assert records, "no worker ran the ring"
    servers = {int(pid) for pid, _ in records}
    assert all(parent in cmdline for _, cmdline in records), records[0][1]
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in servers), f"fork server left behind: {servers}"
