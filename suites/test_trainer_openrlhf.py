"""`--glue openrlhf` (issue 63, item 2): OpenRLHF 0.11.2's setup_ring_attn and unpad_and_slice_tensor
around ring-flash-attn's Hugging Face adapter. A tiny llama at P=2 passes through it (one sequence
and packed documents); a micro-batch of two rows is not judged, with OpenRLHF's packing named; its
gather_and_pad_tensor puts the sliced values back in place (and its all-gather's backward hands
each rank its own slice's gradient); softcap is refused before any rank starts (exit 2).

The zoo at P=2 and P=4 is reports/models/trainers_openrlhf.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if importlib.util.find_spec("openrlhf") is None or importlib.util.find_spec("ring_flash_attn") is None:
    pytest.skip("openrlhf or ring-flash-attn not installed: pip install --no-deps openrlhf==0.11.2 "
                "ring-flash-attn==0.1.8", allow_module_level=True)
pytest.importorskip("transformers")

from ringcheck.commands.step_model import check_model_before_start, run_model_step
from ringcheck.glues import GlueRefused
from ringcheck.models.step import ModelStepConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def judged(ring_processes):
    return run_model_step(ModelStepConfig(model="llama", glue="openrlhf", world_size=2,
                                          cases=("one_sequence", "packed", "batch2")), ring_processes)


def test_llama_passes_through_openrlhfs_ring(judged):
    assert judged["verdict"] == "pass", judged["why"]
    rows = {r["case"]: r for r in judged["cases"]}
    for name in ("one_sequence", "packed"):
        row = rows[name]
        assert row["verdict"] == "pass" and row["logits"]["error"] <= row["logits"]["budget"], row
    assert "unpad_and_slice_tensor" in judged["glue"]["sharding"]
    assert any("setup_ring_attn is given ringcheck's CP group" in s for s in judged["glue"]["shims"])


def test_two_rows_are_not_judged_and_openrlhfs_packing_is_named(judged):
    (row,) = [r for r in judged["cases"] if r["case"] == "batch2"]
    assert row["verdict"] == "not run" and "packs a micro-batch's 2 rows into one sequence" in row["why"], row


def gather_task(member) -> dict:
    """OpenRLHF's unpad_and_slice_tensor on three padded rows, then its gather_and_pad_tensor of the
    slice's values (a float copy, so that its all-gather's backward is measured too)."""
    from ringcheck.trainers.openrlhf import ring_attn_utils
    utils = ring_attn_utils()
    utils.set_ring_attn_group(member.group)
    device = member.device
    lengths = (5, 3, 6)
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths], dtype=torch.int64, device=device)
    values = (torch.arange(18, device=device).view(3, 6) + 1) * mask
    sliced, _, _, pad, indices = utils.unpad_and_slice_tensor(values, mask, member.group)
    leaf = sliced.double().requires_grad_()
    back = utils.gather_and_pad_tensor(leaf, member.group, pad, indices, 3, 6)
    (back * torch.arange(18, device=device, dtype=torch.float64).view(3, 6)).sum().backward()
    return {"sliced": sliced.cpu(), "back": back.detach().cpu(), "values": values.cpu(), "pad": pad,
            "grad": leaf.grad.cpu(), "rank": dist.get_rank(member.group)}


def test_gather_and_pad_tensor_puts_the_slices_back_in_place(ring_processes):
    ranks = ring_processes.run(2, gather_task)
    for out in ranks:
        assert torch.equal(out["back"].long(), out["values"]), out["back"]
        assert out["pad"] == 0 and out["sliced"].shape == (1, 7)
    # the weight of packed token t is its flat index in the (3, 6) rows: each rank gets its own slice's
    flat = torch.tensor([i for i in range(18) if i % 6 < (5, 3, 6)[i // 6]], dtype=torch.float64)
    for out in ranks:
        mine = flat[out["rank"] * 7:(out["rank"] + 1) * 7]
        assert torch.equal(out["grad"].reshape(-1), mine * 2), (out["grad"], mine)  # the sum over 2 ranks


def test_softcap_is_refused_before_any_rank_starts():
    with pytest.raises(GlueRefused, match=r"layers 0, 1, 2: softcap 2.0 \(ring-flash-attn's adapter, which OpenRLHF's setup_ring_attn installs, asserts"):
        check_model_before_start(ModelStepConfig(model="gemma2", glue="openrlhf", world_size=2))


@pytest.mark.cli
def test_the_command_refuses_softcap_with_exit_2(tmp_path):
    command = [sys.executable, "-m", "ringcheck", "step", "--model", "gemma2", "--glue", "openrlhf", "--world-size", "4"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("softcap 2.0") == 1 and "Traceback" not in out.stderr, out.stderr
