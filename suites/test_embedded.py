"""The ring as training embeds it: inside a device mesh, on views of fused projections, at batch
> 1, called twice before a backward, and the sinks gradient under a declared convention.

validate runs the scaled-down cases on a mesh of two interleaved rings (cp=P,tp=2) by default;
the catalogue's embedded mutants (`ringcheck.catalogue.embedded_mutants`) are each right in a
clean room and must fail validate at its defaults, in the row that names their bug class, while
the correct rings pass.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from ringcheck import ring_attention, simulate_ring
from ringcheck.catalogue.embedded_mutants import EMBEDDED_MUTANTS, NEEDS
from ringcheck.cli import EXIT_USAGE, main
from ringcheck.commands.validate import Target, placement, validate
from ringcheck.harness import Mesh
from ringcheck.judge.inputs import make_inputs
from ringcheck.launch import GroupPlan, RingError
from ringcheck.spec import AttentionSpec, RingSpec

EMBEDDED = "ringcheck.catalogue.embedded_mutants"
SMALL = dict(seq_len=256, heads=4, kv_heads=2, head_dim=32, dtype="bfloat16", causal=True, layout="zigzag",
             world_size=4, local_lengths=(2, 6), sample_rows=8, distributions=("normal",),
             ragged_lengths=())  # the ragged rows: suites/test_lengths.py
LAYOUTS_ROW = "input layouts: fused qkv views, k/v strides, non-contiguous dout"
TWO_CALLS_ROW = "two calls before backward"

# the rows each mutant must fail (at least), and the words its failure must say
EXPECTED = {
    "default_group": ("mesh:", "passes alone"),
    "rank_from_wrong_axis": ("mesh:", "passes alone"),
    "group_rank_as_peer": ("mesh:", "raises inside mesh cp=4,tp=2"),
    "q_as_contiguous": (LAYOUTS_ROW, "fused qkv"),
    "v_with_k_strides": (LAYOUTS_ROW, "kv_strides"),
    "dout_as_contiguous": (LAYOUTS_ROW, ""),
    "workspace_state": (TWO_CALLS_ROW, "of two calls"),
    "batch_one_gather": ("forward  normal", "batch 1"),
    "sinks_all_reduced": ("backward normal", "--sinks-grad reduced"),
}


def _failed(rows):
    return {r.check: r for r in rows if r.status == "fail"}


# ---- the mesh -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, groups", [
    ("dp=2,cp=4", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("cp=4,tp=2", [(0, 2, 4, 6), (1, 3, 5, 7)]),
    ("cp=4", [(0, 1, 2, 3)]),
    ("pp=2,cp=2,tp=2", [(0, 2), (1, 3), (4, 6), (5, 7)]),
])
def test_cp_groups_follow_the_device_mesh_order(text, groups):
    mesh = Mesh.parse(text)
    assert list(mesh.groups()) == groups and mesh.cp == len(groups[0]) and mesh.rings == len(groups)
    # the same groups as device_mesh lays them out: the lines along the cp dim of arange(size).reshape(shape)
    laid = torch.arange(mesh.size).reshape(mesh.shape).movedim(mesh.names.index("cp"), -1).reshape(-1, mesh.cp)
    assert [tuple(r) for r in laid.tolist()] == groups
    assert mesh.plan(families=False).groups == tuple(groups) and not mesh.plan(families=False).also
    plan = mesh.plan()  # with the families a gradient reduction needs
    assert dict(plan.also)["mesh"] == (tuple(range(mesh.size)),)
    assert sorted(r for g in dict(plan.also)["replicas"] for r in g) == list(range(mesh.size))


@pytest.mark.parametrize("text, words", [
    ("dp=2", "exactly one dim is the ring: name it cp"),
    ("cp=2,cp=2", "dim names must differ"),
    ("dp=0,cp=2", "dp=0: a dim's size must be an integer >= 1"),
    ("dp=two,cp=2", "'dp=two' is not DIM=N"),
    ("", "--mesh expects DIM=N"),
])
def test_a_bad_mesh_is_refused_with_the_value_and_the_fix(text, words):
    with pytest.raises(ValueError) as info:
        Mesh.parse(text)
    assert words in str(info.value)


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "dp=2,tp=2"], "name it cp"),
    (["--mesh", "cp=3,tp=2", "--seq-len", "256"], "not divisible by 2 x world_size=6"),
    (["--mesh", "cp=2,tp=2", "--world-size", "4"], "has cp=2 but --world-size is 4"),
    (["--mesh", "cp=0"], "an integer >= 1"),
])
def test_validate_refuses_a_bad_mesh_before_any_rank_starts(capsys, argv, words):
    assert main(["validate", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_the_placement_of_a_run():
    target = Target(**SMALL)
    local = placement(target, None)
    assert local.scaled.text == "cp=4,tp=2" and local.full.text == "cp=4" and not local.alone
    one = placement(target, 4)  # a torchrun world with no room for a second ring says so
    assert one.scaled.rings == 1 and one.alone.startswith("one ring only (launch 2P")
    assert placement(target, 8).scaled.text == "cp=4,tp=2"
    with pytest.raises(ValueError, match=r"not a multiple of the ring size .* --nproc-per-node=4 .* "
                                         r"--world-size 2 or 3 or 6 \(a ring size that divides 6\)"):
        placement(target, 6)
    given = Target(**{**SMALL, "mesh": "dp=2,cp=4"})
    assert placement(given, None).full.text == "dp=2,cp=4"
    with pytest.raises(ValueError, match="has 8 ranks but the torchrun world has 4"):
        placement(given, 4)


def place_task(member):
    return (member.rank, member.world_size, member.global_rank, dist.get_rank(member.group), member.group_index,
            member.group_ranks, dist.get_world_size(member.groups["mesh"]))


def test_run_groups_gives_every_rank_its_strided_group(ring_processes):
    mesh = Mesh.parse("cp=2,tp=2")
    first = 0 if ring_processes.size is None else ring_processes.size - mesh.size
    got = ring_processes.run_groups(mesh.plan(first), place_task)
    for g, (ranks, results) in enumerate(zip(mesh.groups(), got)):
        for r, (rank, size, global_rank, group_rank, index, group_ranks, mesh_size) in enumerate(results):
            assert (rank, size, group_rank, index, mesh_size) == (r, 2, r, g, 4)
            assert global_rank == ranks[r] + first and group_ranks == tuple(x + first for x in ranks)


def raises_on_global_three(member):
    if member.global_rank == 3:
        raise ValueError("planted on global rank 3")
    return member.rank


def test_a_failure_inside_a_mesh_names_the_group_and_its_global_ranks(torchrun_world, ring_processes):
    if torchrun_world is not None:
        pytest.skip("the words name local ranks")
    with pytest.raises(RingError) as info:
        ring_processes.run_groups(GroupPlan(((0, 2), (1, 3)), label="mesh cp=2,tp=2"), raises_on_global_three)
    message = str(info.value)
    assert "rank 1 of group 1 (global rank 3) [raised]" in message and "2 rings of mesh cp=2,tp=2" in message
    assert set(info.value.failures) == {3}


# ---- validate at its defaults -------------------------------------------------------------------

# the catalogue's textbook ring: test_validate's correct rings, at this embedding with more lengths and both
# distributions
@pytest.mark.parametrize("impl", [f"{EMBEDDED}:gather_textbook"])
def test_correct_rings_pass_inside_the_default_mesh(ring_processes, impl):
    rows = validate(Target(**{**SMALL, "impl": impl}), ring_processes, recompute=False)
    assert not _failed(rows), [r.detail for r in rows if r.status == "fail"]
    checks = {r.check: r for r in rows}
    assert checks[LAYOUTS_ROW].status == "pass" and checks[TWO_CALLS_ROW].status == "pass"
    mesh = next(r for r in rows if r.check.startswith("mesh:"))
    if ring_processes.size is None:
        assert mesh.status == "pass" and "0,2,4,6 | 1,3,5,7" in mesh.detail


@pytest.mark.parametrize("mutant", list(EMBEDDED_MUTANTS))
def test_every_embedded_mutant_fails_validate_at_its_defaults(ring_processes, impatient_rings, mutant):
    if ring_processes.size is not None and EXPECTED[mutant][0] == "mesh:" and ring_processes.size < 8:
        pytest.skip("a mesh bug needs room for two rings: launch 8 ranks")
    raises = EXPECTED[mutant][1].startswith("raises inside")
    rows = validate(Target(**{**SMALL, **NEEDS.get(mutant, {}), "impl": f"{EMBEDDED}:{mutant}"}),
                    impatient_rings if raises else ring_processes, recompute=False)
    failed = _failed(rows)
    row, words = EXPECTED[mutant]
    hit = [r for check, r in failed.items() if check.startswith(row)]
    assert hit, f"{mutant}: expected a failing {row!r} row, got {list(failed)}"
    assert words in hit[0].detail, hit[0].detail


def test_a_mesh_bug_passes_on_the_mesh_order_it_was_written_for(ring_processes):
    """`dist.get_rank() % world_size` is the ring position on dp x cp (offset groups): right there,
    wrong on the strided cp x tp mesh."""
    if ring_processes.size is not None:
        pytest.skip("explicit meshes of 4 ranks on local rings")
    base = {**SMALL, "world_size": 2, "seq_len": 64, "sample_rows": 4, "impl": f"{EMBEDDED}:rank_from_wrong_axis"}
    assert not _failed(validate(Target(**base, mesh="dp=2,cp=2"), ring_processes, recompute=False))
    assert _failed(validate(Target(**base, mesh="cp=2,tp=2"), ring_processes, recompute=False))


def test_the_report_names_the_mesh_and_the_header_says_it(tmp_path, capsys):
    args = ["validate", "--quick", "--distributions", "normal", "--seq-len", "64", "--world-size", "2",
            "--head-dim", "16", "--report", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "scaled-down cases: mesh cp=2,tp=2: 2 CP groups at once" in out and "full length: mesh cp=2" in out
    doc = json.loads((tmp_path / "validate.json").read_text())
    assert doc["mesh"]["cp_groups"] == [[0, 2], [1, 3]] and doc["mesh"]["full_length"]["text"] == "cp=2"


# ---- the sinks gradient convention --------------------------------------------------------------

def sinks_task(member, inputs, convention):
    q, k, v, dout = (t.chunk(member.world_size, dim=1)[member.rank] for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    sinks = inputs.sinks.detach().clone().requires_grad_(True)
    out = ring_attention(q, k, v, group=member.group, layout="contiguous", sinks=sinks, sinks_grad=convention)
    out.backward(dout)
    return sinks.grad


def test_our_ring_gives_each_rank_its_share_or_the_whole_sinks_gradient(run_on_ring):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=1, seq_len=12, head_dim=8, dtype="float32", sinks="typical")
    inputs = make_inputs(spec, seed=3)
    partial = run_on_ring(3, sinks_task, inputs, "partial")
    reduced = run_on_ring(3, sinks_task, inputs, "reduced")
    total = partial[0] + partial[1] + partial[2]
    assert all(torch.equal(r, reduced[0]) for r in reduced)  # every rank holds the same whole
    assert torch.equal(total, reduced[0])  # the sum in rank order, as the ring adds it
    assert not torch.allclose(partial[0], reduced[0])
    # on whole tensors both conventions give the whole sequence's gradient
    grads = []
    for convention in ("partial", "reduced"):
        s = inputs.sinks.detach().clone().requires_grad_(True)
        out = simulate_ring(inputs.q, inputs.k, inputs.v, world_size=3, sinks=s, sinks_grad=convention)
        out.backward(inputs.dout)
        grads.append(s.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], total)
    with pytest.raises(ValueError, match="sinks_grad must be one of"):
        simulate_ring(inputs.q, inputs.k, inputs.v, world_size=3, sinks=inputs.sinks, sinks_grad="summed")


@pytest.mark.parametrize("convention", ["partial", "reduced"])
def test_our_ring_passes_under_either_declared_convention(ring_processes, convention):
    rows = validate(Target(**{**SMALL, "sinks": True, "sinks_grad": convention, "local_lengths": (2,)}),
                    ring_processes, recompute=False)
    assert not _failed(rows), [r.detail for r in rows if r.status == "fail"]


def test_a_partial_ring_under_reduced_is_told_which_convention_it_follows(ring_processes):
    rows = validate(Target(**{**SMALL, "sinks": True, "sinks_grad": "reduced", "local_lengths": (2,),
                              "impl": "ringcheck.catalogue.variant_textbook:textbook_varlen"}), ring_processes,
                    recompute=False)
    detail = " ".join(r.detail for r in _failed(rows).values())
    assert "the 'partial' convention" in detail and "--sinks-grad partial" in detail


def test_the_sinks_convention_is_on_the_command_line(tmp_path):
    assert Target(**{**SMALL, "sinks": True}).describe().endswith("--sinks-grad partial --sinks") or \
        "--sinks-grad partial" in Target(**{**SMALL, "sinks": True}).describe()
    with pytest.raises(ValueError, match="sinks_grad must be one of"):
        Target(**{**SMALL, "sinks_grad": "both"})
    assert RingSpec(4, "zigzag").world_size == 4


# ---- drift and bench inside a mesh ------------------------------------------------------------

def test_drift_impl_runs_every_ring_inside_the_mesh_and_fails_a_ring_that_mixes_groups(tmp_path, capsys):
    args = ["drift", "--dtypes", "float32", "--ring-sizes", "1,2", "--distributions", "normal", "--modes", "zigzag",
            "--seeds", "1", "--tokens-per-rank", "4", "--head-dim", "8", "--heads", "2", "--kv-heads", "1",
            "--mesh", "cp=2,tp=2", "--forward-only", "--timeout", "30", "-q"]
    main([*args, "--impl", "ringcheck", "--out", str(tmp_path / "ours")])
    out = capsys.readouterr()
    assert "every ring inside mesh cp=2,tp=2" in out.out + out.err and "FAILED" not in out.err
    assert main([*args, "--impl", f"{EMBEDDED}:default_group", "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "FAILED: passes alone" in err and "fails inside mesh cp=" in err and "Likely causes" in err


def test_drift_refuses_a_mesh_whose_ring_is_smaller_than_the_sweep(capsys):
    assert main(["drift", "--impl", "ringcheck", "--ring-sizes", "2,4", "--mesh", "cp=2,tp=2"]) == EXIT_USAGE
    assert "its cp dim is the largest ring of the sweep" in capsys.readouterr().err


def test_bench_times_the_rings_of_a_mesh_at_once(tmp_path):
    from ringcheck.commands.bench import BenchSpec, run_speed
    from ringcheck.launch import LocalRings

    spec = BenchSpec(impls=("ringcheck",), dtypes=("float32",), ring_sizes=(2,), tokens=(32,), heads=1, head_dim=8,
                     modes=("bidirectional",), passes=("fwd",), repeats=1, warmup=0, mesh="cp=2,tp=2")
    with LocalRings(timeout=30) as rings:
        rows = run_speed(spec, rings)
    assert rows and all(r.get("median_s") is not None for r in rows), rows
    with pytest.raises(ValueError, match="exactly one dim is the ring"):
        BenchSpec(mesh="dp=2")
