"""A raising rank stops the others within seconds, and `--log-dir` keeps every rank's story.

- Local rings: the ranks waiting in our ring for the one that raised see its stop flag and
  report "stopped waiting ... rank 1 raised ..." themselves (not killed after the grace, never
  after the timeout).
- torchrun: the same for a ring on `RingComm`; a rank blocked in an implementation's own
  communication is ended by the watchdog a few seconds after the failure, saying why.
- `--log-dir`: one file per rank with what the task printed, the outcome or the traceback, and
  the ring-step trace (every exchange of `RingComm`: channel, step, source, bytes, seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ringcheck
from ringcheck.launch import LocalRings, RingError
from ringcheck.launch.common import failure_kinds
from ringcheck.ring.comm import STOPPED

TIMEOUT = 30.0  # far above what fail-fast takes, so a pass cannot be the timeout's doing
RING = 3
VICTIM = 1
BIN = Path(sys.executable).parent


def _shards(member):
    g = torch.Generator().manual_seed(member.rank)
    return [torch.randn(1, 8, 2, 8, generator=g).requires_grad_() for _ in range(3)]


def raise_or_ring(member, victim):
    """Rank `victim` raises before the ring; the others run forward and backward through it."""
    print(f"hello from ring rank {member.rank}")
    q, k, v = _shards(member)
    if member.rank == victim:
        raise ValueError("planted: this rank gives up\nwith a second line")
    out = ringcheck.ring_attention(q, k, v, group=member.group, timeout=member.timeout)
    out.sum().backward()
    return "ok"


@pytest.fixture
def local_only(torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings and torchrun worlds: run with plain pytest")


def test_a_raising_rank_stops_the_others_in_a_local_ring(local_only, tmp_path):
    with LocalRings(timeout=TIMEOUT, log_dir=tmp_path) as rings:
        assert rings.run(RING, raise_or_ring, -1) == ["ok"] * RING
        start = time.monotonic()
        with pytest.raises(RingError) as info:
            rings.run(RING, raise_or_ring, VICTIM)
        elapsed = time.monotonic() - start
    error = info.value
    assert "ValueError: planted: this rank gives up" in error.failures[VICTIM]
    for rank in set(range(RING)) - {VICTIM}:  # they answered themselves, before the launcher's grace
        said = error.failures[rank].splitlines()[0]
        assert STOPPED in said and f"rank {VICTIM} (global rank {VICTIM}) raised ValueError: planted" in said, said
    others = ", ".join(str(r) for r in range(RING) if r != VICTIM)
    assert f"raised: {VICTIM}; stopped after the failure: {others}" in str(error).splitlines()[0]
    assert elapsed < TIMEOUT / 2, f"took {elapsed:.1f} s"
    assert error.global_ranks == {r: r for r in range(RING)}


def test_log_dir_keeps_each_rank_output_traceback_and_ring_step_trace(local_only, tmp_path):
    with LocalRings(timeout=TIMEOUT, log_dir=tmp_path) as rings:
        rings.run(RING, raise_or_ring, -1)
        with pytest.raises(RingError):
            rings.run(RING, raise_or_ring, VICTIM)
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(RING)}
    for r, text in logs.items():
        tasks = text.split("=== task ")[1:]
        assert len(tasks) == 2, text
        ok, failed = tasks
        assert f"ring rank {r} (global rank {r}" in ok and f"hello from ring rank {r}" in ok
        assert "outcome after" in ok and ": ok" in ok
        # forward: P - 1 K/V exchanges; backward: P - 1 K/V + P dK/dV exchanges, each a line
        lines = [ln.split() for ln in ok.splitlines() if ln.split()[:1] in (["kv"], ["grad"])]
        assert len([ln for ln in lines if ln[0] == "kv"]) == 2 * (RING - 1), ok
        assert len([ln for ln in lines if ln[0] == "grad"]) == RING, ok
        assert all(int(ln[2]) == (r - 1) % RING and int(ln[4]) > 0 for ln in lines), ok
        assert "Traceback (most recent call last)" in failed and "failed:" in failed
    assert "ValueError: planted: this rank gives up" in logs[VICTIM].split("=== task ")[2]
    assert STOPPED in logs[0].split("=== task ")[2]


def test_a_stopped_rank_is_told_apart_from_the_culprit():
    errors = {0: f"raised RuntimeError: ring rank 0 of 3: {STOPPED} for the 'kv' payload: rank 1 raised X",
              1: "raised ValueError: planted", 2: "no 'kv' payload arrived from rank 1 within the timeout"}
    assert failure_kinds(errors) == {0: "stopped after the failure", 1: "raised", 2: "timed out waiting"}


def _torchrun_validate(impl: str, tmp_path: Path, timeout_s: float):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=3", "-m", "ringcheck", "validate",
           "--impl", f"ringcheck.catalogue.bad_impls:{impl}", "--world-size", "3", "--seq-len", "24", "--heads", "2",
           "--kv-heads", "1", "--head-dim", "8", "--quick", "--distributions", "normal", "--sample-rows", "4",
           "--timeout", str(timeout_s), "--log-dir", str(tmp_path / "logs"), "-q"]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=4 * timeout_s)
    return done, time.monotonic() - start


@pytest.mark.cli
@pytest.mark.parametrize("impl, says", [
    ("raises_on_rank_one_in_our_ring", "raised: 1; stopped after the failure: 0, 2"),
    ("raises_on_rank_one", "this rank was still blocked in the implementation 5 s later"),
])
def test_under_torchrun_a_raising_rank_stops_the_others_within_seconds(local_only, tmp_path, impl, says):
    ring_timeout = 120.0
    done, elapsed = _torchrun_validate(impl, tmp_path, ring_timeout)
    assert done.returncode != 0, done.stdout + done.stderr
    assert says in done.stderr, done.stderr
    assert "rank 1 ran out of patience" in done.stderr
    # start-up of three ranks plus the watchdog's grace: well under one ring timeout
    assert elapsed < ring_timeout / 2, f"took {elapsed:.1f} s\n{done.stderr}"
    assert "rank 1 ran out of patience" in (tmp_path / "logs" / "rank1.log").read_text()
