"""The device audit (`ringcheck.launch.audit`): on a CPU, the mistakes a GPU run would raise for.

A tensor made without naming its device lands on the CPU on a GPU machine and raises where it
meets the rank's CUDA tensors; on a CPU nothing shows it. Under the audit it raises here, naming
the line that made it, and code that moves it first (as a GPU needs) passes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringcheck.commands.validate.device import DEVICE_ROW
from ringcheck.harness.call import arrange
from ringcheck.launch.audit import DeviceAuditError, audit_requested, check_handed, device_audit

RANK = "cpu"  # the rank's device: on a CPU, the one the launchers give every rank

HERE = __file__


def _under_audit(fn, *, judge_impl=True):
    q = torch.randn(4, 3).to(RANK)  # the rank's tensor, as a launcher hands it over
    with device_audit(RANK, judge_impl=judge_impl):
        return fn(q.clone())


def _gen():
    return torch.Generator().manual_seed(1)


FLAGGED = {
    "mask from arange": lambda q: q.masked_fill(torch.arange(4)[:, None] > torch.arange(3)[None, :], 0),
    "zeros plus q": lambda q: torch.zeros(4, 3) + q,
    "cat with a CPU generator's draw": lambda q: torch.cat([q, torch.randn(4, 3, generator=_gen())]),
    "a model never moved": lambda q: torch.nn.Linear(3, 2)(q),
    "a copy to the host mixed back": lambda q: q.cpu() + q,
    "a host scalar's product met by a host tensor": lambda q: (q * torch.tensor(2.0)) + torch.zeros(4, 3),
}

PASSING = {
    "mask moved first": lambda q: q.masked_fill((torch.arange(4)[:, None] > torch.arange(3)[None, :]).to(q.device), 0),
    "zeros on q's device": lambda q: torch.zeros(4, 3, device=q.device) + q,
    "draw moved first": lambda q: torch.cat([q, torch.randn(4, 3, generator=_gen()).to(q.device)]),
    "zeros_like": lambda q: torch.zeros_like(q) + q,
    "a 0-dim host scalar": lambda q: q * torch.tensor(2.0),
    "a host scalar's product, then the rank's": lambda q: (q * torch.tensor(2.0)) + q,   # CUDA: on the rank's
    "a host index": lambda q: q[torch.tensor([0, 1])],
    "a host index, then the rank's": lambda q: q[:, torch.tensor([2, 0, 1])] + q,
    "a model moved": lambda q: torch.nn.Linear(3, 2).to(q.device)(q),
    "to(q)": lambda q: torch.ones(4, 3).to(q) + q,
    "new_zeros": lambda q: q.new_zeros(4, 3) + q,
    "a gradient": lambda q: torch.autograd.grad((q.requires_grad_() * 2).sum(), [q])[0] + q,
}


@pytest.mark.parametrize("name", list(FLAGGED))
def test_a_tensor_made_without_a_device_that_meets_the_rank_raises_and_names_its_line(name):
    with pytest.raises(DeviceAuditError) as info:
        _under_audit(FLAGGED[name])
    assert f"{HERE}:" in info.value.created_at, info.value.created_at
    assert "Expected all tensors to be on the same device" in str(info.value)
    assert not info.value.ours  # a test's line is not ringcheck's own code


@pytest.mark.parametrize("name", list(PASSING))
def test_code_that_is_right_on_a_gpu_passes(name):
    _under_audit(PASSING[name])


def test_the_same_code_runs_unaudited():
    for fn in (*FLAGGED.values(), *PASSING.values()):
        fn(torch.randn(4, 3))


def test_a_custom_functions_backward_is_audited():
    class HostGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return torch.zeros(g.shape) + g   # on a GPU: a CPU tensor plus the CUDA gradient

    for run in (lambda y, x: y.backward(), lambda y, x: torch.autograd.grad(y, [x])):
        def fn(q, run=run):
            x = q.requires_grad_()
            run(HostGrad.apply(x).sum(), x)
        with pytest.raises(DeviceAuditError):
            _under_audit(fn)


def test_the_launchers_audit_lets_an_implementations_tensor_pass_and_an_inner_audit_judges_it():
    _under_audit(FLAGGED["zeros plus q"], judge_impl=False)   # not ringcheck's code: the row's to judge

    def inner(q):
        with device_audit(RANK):
            return torch.zeros(4, 3) + q
    with pytest.raises(DeviceAuditError):
        _under_audit(inner, judge_impl=False)


def test_the_kv_strides_layout_draws_its_filler_on_the_rank_device():
    """GPU review defect 1: the filler of the fused K/V buffer was drawn on the CPU and
    concatenated with the rank's k, so every validate on CUDA failed the input-layouts row."""
    def x():
        return torch.randn(2, 4, 2, 8).to(RANK)
    with device_audit(RANK):
        for layout in ("contiguous", "fused_qkv", "kv_strides"):
            arrange(layout, x(), x(), x(), x(), True)
    filler = arrange("kv_strides", x(), x(), x(), x(), False)[4][1][:, :, 2:]   # the fused K/V leaf
    assert torch.equal(filler, torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(7)))


def test_ringcheck_own_code_is_told_apart():
    from ringcheck.ring.layouts import positions

    def fn(q):
        return q[:, :1].T.expand(4, 4) + positions(layout="contiguous", rank=0, world_size=1, seq_len=4)
    with pytest.raises(DeviceAuditError) as info:
        _under_audit(fn, judge_impl=False)
    assert info.value.ours and "ringcheck's own code" in str(info.value)


def test_what_a_glue_hands_the_step_is_judged_where_it_is_handed():
    """`check_handed`: a host tensor a glue's hook returns (a trainer's loader keeps its shards on the
    CPU by design) raises where the glue hands it over, naming where it was made; a glue of
    ringcheck's own is ringcheck's defect, judged by the launchers' audit too."""
    def users_shard():
        pass

    def check(q, fn=users_shard):
        check_handed({"input_ids": q, "labels": q.cpu()}, by="the glue's shard", fn=fn)
    with pytest.raises(DeviceAuditError) as info:
        _under_audit(check)
    assert "labels made on the host (cpu() at" in str(info.value) and not info.value.ours
    _under_audit(check, judge_impl=False)   # the user's glue: not the launchers' audit's to judge
    with pytest.raises(DeviceAuditError, match="ringcheck's own code"):
        _under_audit(lambda q: check(q, fn=check_handed), judge_impl=False)
    _under_audit(lambda q: check_handed({"input_ids": q, "n": torch.tensor(3)}, by="the glue's shard", fn=check_handed))
    check(torch.randn(4, 3))   # no audit: nothing judged


def test_the_environment_variable():
    assert audit_requested({"RINGCHECK_DEVICE_AUDIT": "1"}) and audit_requested({"RINGCHECK_DEVICE_AUDIT": "on"})
    assert not audit_requested({}) and not audit_requested({"RINGCHECK_DEVICE_AUDIT": "0"})


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RINGCHECK_TORCHRUN_RANK_PID")


@pytest.mark.cli
def test_a_users_ring_whose_mask_is_made_without_a_device_fails_the_device_row_alone(tmp_path):
    """examples/my_ring.py with its causal mask left where torch.arange makes it (no
    `.to(q.device)`): exact on a CPU, a crash on a GPU. validate fails the `device placement` row
    alone, naming the ring's own line; with the audit on for every row, the verdicts are the same."""
    source = (EXAMPLES / "my_ring.py").read_text()
    broken = source.replace("positions(layout, rank, world, n).to(q.device)", "positions(layout, rank, world, n)")
    broken = broken.replace("for r in range(world)]).to(q.device)", "for r in range(world)])")
    assert broken != source
    (tmp_path / "host_ring.py").write_text(broken)
    line = next(i for i, text in enumerate(broken.splitlines(), 1) if "torch.arange(rank * half" in text)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "RINGCHECK_DEVICE_AUDIT"}
    env["PYTHONPATH"] = str(tmp_path)
    args = [sys.executable, "-m", "ringcheck", "validate", "--impl", "host_ring:ring_fn", "--quick",
            "--seq-len", "64", "--world-size", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--sample-rows", "8"]
    for audit in ("0", "1"):
        report = tmp_path / f"audit{audit}"
        done = subprocess.run([*args, "--report", str(report)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env={**env, "RINGCHECK_DEVICE_AUDIT": audit})
        assert done.returncode == 1, done.stdout + done.stderr
        doc = json.loads((report / "validate.json").read_text())
        failed = [c for c in doc["checks"] if c["status"] == "fail"]
        assert [c["check"] for c in failed] == [DEVICE_ROW], failed
        assert f"host_ring.py:{line}" in failed[0]["detail"], failed[0]["detail"]


def test_the_simulation_beside_a_torchrun_world_runs_on_its_device():
    """GPU review defect 2: `check_distributed_equals_simulated` simulated on the CPU what the
    ranks ran on their GPU (the CPU's fused kernel against cuBLAS: other bits for a correct
    ring). The simulation now runs where the ranks ran: `RingImpl.device`."""
    from types import SimpleNamespace

    from ringcheck.testing.impl_runner import RingImpl

    def impl(processes):
        return RingImpl("ringcheck", SimpleNamespace(processes=processes))
    assert impl(SimpleNamespace(device="cuda:3")).device == torch.device("cuda:3")
    assert impl(SimpleNamespace(size=None)).device == torch.device("cpu")   # local rings


def test_the_tiny_models_probe_forward_is_the_hosts_by_design():
    """`models.tiny._forward_runs` (does the scaled config run at all?) runs on the CPU by design, and
    a rank's task makes its tiny model under the audit: transformers' `.to(x.device)` of a host x is
    taken for the rank's there, and the mix it meets raised inside the probe, which said "does not
    run" and changed the tiny model's head_dim wherever the audit judged every tensor."""
    pytest.importorskip("transformers")
    from ringcheck.models import tiny

    config = tiny.tiny_model("llama").config
    with device_audit(RANK, judge_impl=True):
        assert tiny._forward_runs(config)


def test_the_flash_stand_ins_varlen_kernels_take_their_boundaries_on_the_device_only():
    """flash-attn's varlen kernels check cu_seqlens_q.is_cuda() (flash_api.cpp, CHECK_DEVICE); the
    stand-in reads the boundaries with .tolist(), so a host tensor never met the rank's: under the
    audit the stand-in judges them where they are handed, as the real kernel does."""
    from ringcheck.flash_stand_in.interface import flash_attn_varlen_func

    def run(q, cu):
        x = q.new_zeros(8, 2, 4, dtype=torch.bfloat16)
        return flash_attn_varlen_func(x, x, x, cu, cu, 8, 8, causal=True)

    with pytest.raises(DeviceAuditError, match="cu_seqlens_q made on the host .* must be on CUDA") as info:
        _under_audit(lambda q: run(q, torch.tensor([0, 3, 8], dtype=torch.int32)))
    assert f"{HERE}:" in info.value.created_at and not info.value.ours
    _under_audit(lambda q: run(q, torch.tensor([0, 3, 8], dtype=torch.int32, device=q.device)))
