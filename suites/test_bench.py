"""Smoke tests of `ringcheck bench` (ringcheck/commands/bench/): a tiny grid, the document's keys,
ratios, errors beside the times, the no-comm driver, zig-zag balance. Never on timings."""

import json

import pytest
import torch

from ringcheck.commands.bench import BENCH_MODES, BenchSpec, add_ratios, run_balance
from ringcheck.commands.bench.tasks import (
    SDPA,
    SIMULATED,
    BenchCase,
    case_inputs,
    case_reference,
    errors,
    merge_errors,
    run_local,
)
from ringcheck.documents import BENCH_SCHEMA, META_KEYS, load
from ringcheck.reference import dense_grads
from ringcheck.ring import NoCommDriver, make_config, run_ring
from ringcheck.ring.layouts import positions, shard, work_counts


def test_ratios_are_to_the_fastest_peer_ring():
    rows = [{"key": "a", "system": "ringcheck", "median_s": 1.0},
            {"key": "a", "system": "torch_cp", "median_s": 2.0},
            {"key": "a", "system": "ring_attention_pytorch", "median_s": 4.0},
            {"key": "a", "system": "sdpa", "median_s": 0.5},           # not a peer ring
            {"key": "a", "system": "ringcheck:simulated", "median_s": 0.1},
            {"key": "b", "system": "ringcheck", "median_s": 3.0},    # no peer ran: fastest overall
            {"key": "b", "system": "torch_cp", "median_s": None}]
    add_ratios(rows)
    assert [r["ratio"] for r in rows[:5]] == [0.5, 1.0, 2.0, 0.25, 0.05]
    assert rows[0]["fastest_peer"] == "torch_cp"
    assert rows[5]["ratio"] == 1.0 and rows[6]["ratio"] is None


@pytest.mark.parametrize("system", [SDPA, SIMULATED])
def test_local_systems_report_errors_against_float64(system):
    case = BenchCase("float32", 2, 64, "causal_balanced", "fwd+bwd", 2, 16, 8, 0)
    got = run_local(system, case, warmup=0, repeats=1)
    assert set(got["errors"]) == {"out", "dq", "dk", "dv"}
    assert all(0 <= e < 1e-4 for e in got["errors"].values()), got["errors"]
    bf16 = run_local(system, BenchCase("bfloat16", 2, 64, "bidirectional", "fwd", 2, 16, 8, 0), 0, 1)
    assert set(bf16["errors"]) == {"out"} and 1e-5 < bf16["errors"]["out"] < 0.1  # rounding seen, not hidden


def test_errors_of_a_shard_match_the_whole():
    case = BenchCase("float32", 2, 32, "causal", "fwd+bwd", 2, 8, 32, 0)
    inputs, rows = case_inputs(case)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    ref = case_reference(case, inputs, rows)
    out, _, dq, dk, dv = (t.float() for t in dense_grads(q, k, v, dout, causal=True))
    whole = errors(ref, out, dq, dk, dv, rows=rows)
    parts = [errors(ref, *(shard(t, layout="zigzag", rank=r, world_size=2, dim=1) for t in (out, dq, dk, dv)),
                          rows=rows, positions=positions(layout="zigzag", rank=r, world_size=2, seq_len=32))
             for r in range(2)]
    assert merge_errors(parts) == pytest.approx(whole, abs=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_no_comm_driver_runs_forward_and_backward(layout):
    p, n = 4, 32
    inputs, _ = case_inputs(BenchCase("float32", p, p * n, "causal", "fwd+bwd", 2, 8, 4, 0))
    q, k, v = inputs.q, inputs.k, inputs.v
    config = make_config(world_size=p, layout=layout, causal=True, softmax_scale=None, head_dim=8, backend="torch")
    for r in range(p):
        qs, ks, vs = (shard(t, layout=layout, rank=r, world_size=p, dim=1).detach().requires_grad_() for t in (q, k, v))
        out = run_ring(config, NoCommDriver(r, p), [qs], [ks], [vs])[0][0]
        out.backward(torch.ones_like(out))  # the dK/dV origin tags come home
        assert torch.isfinite(qs.grad).all() and torch.isfinite(ks.grad).all()


def test_zigzag_balance_within_five_percent():
    for p in range(2, 17):
        counts = work_counts(layout="zigzag", world_size=p, seq_len=2 * p * 64, causal=True)
        assert max(counts) / (sum(counts) / p) <= 1.05, (p, counts)
    spec = BenchSpec(balance_ring_sizes=(2, 16), balance_tokens=256, heads=1, head_dim=8, repeats=1, warmup=0)
    rows = run_balance(spec)
    zig = [r for r in rows if r["layout"] == "zigzag"]
    assert [r["ring_size"] for r in zig] == [2, 16]
    assert all(r["work_max_over_mean"] <= 1.05 for r in zig)
    assert all(r["work_max_over_mean"] > 1.4 for r in rows if r["layout"] == "contiguous")


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="divisible"):
        BenchSpec(ring_sizes=(4,), tokens=(100,))
    with pytest.raises(ValueError, match="--modes"):
        BenchSpec(modes=("sideways",))
    assert BenchSpec().modes == BENCH_MODES


def test_bench_command_writes_json(tmp_path, ring_pool, monkeypatch):
    from ringcheck import cli
    from ringcheck.cli import bench as bench_command

    pool = ring_pool(2)
    monkeypatch.setattr(bench_command, "LocalRings", lambda **kw: _Borrowed(pool))
    path = tmp_path / "bench.json"
    code = cli.main(["bench", "--impl", "ringcheck,torch_cp,sdpa", "--dtypes", "float32", "--ring-sizes", "2",
                     "--tokens", "64", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0",
                     "--modes", "bidirectional,causal", "--sections", "speed,overlap", "--json", str(path)])
    assert code == 0
    doc = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"JSON literal {name}"))
    assert list(doc) == ["schema", "schema_version", "spec", "speed", "overlap", "meta"]
    doc = load(path, schema=BENCH_SCHEMA)
    assert list(doc["meta"])[:len(META_KEYS)] == list(META_KEYS)
    assert " ringcheck bench --impl" in doc["meta"]["command"]  # after where it ran: cd DIR && [PYTHONPATH=..]
    assert {"machine", "cpu", "torch", "load_1_5_15", "worker_threads", "parent_threads"} <= set(doc["meta"])
    speed = {(r["mode"], r["passes"], r["system"]): r for r in doc["speed"]}
    assert len(speed) == 2 * 2 * 3
    ours = speed[("bidirectional", "fwd+bwd", "ringcheck")]
    assert ours["median_s"] > 0 and ours["fastest_peer"] == "torch_cp"
    assert ours["ratio"] == pytest.approx(ours["median_s"] / speed[("bidirectional", "fwd+bwd", "torch_cp")]["median_s"])
    assert set(ours["errors"]) == {"out", "dq", "dk", "dv"} and max(ours["errors"].values()) < 1e-4
    cp_causal = speed[("causal", "fwd", "torch_cp")]  # contiguous causal, without load balancing
    assert cp_causal["median_s"] > 0 and max(cp_causal["errors"].values()) < 1e-4
    held = [h for r in doc["overlap"] for h in r["held"]]  # every system, both delays: shares in [0, 1]
    assert {r["system"] for r in doc["overlap"]} == {"ringcheck", "torch_cp"} and len(held) == 2 * len(doc["overlap"])
    assert all(0.0 <= h["hidden"] <= 1.0 and h["delay_s"]["forward"] > 0 for h in held)


class _Borrowed:
    """The session's ring pool as a `LocalRings` that does not close it."""

    def __init__(self, pool):
        self.pool = pool

    def run(self, ring_size, task, *args):
        return self.pool.run(ring_size, task, *args)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
