"""`--glue llamafactory` (issue 62): LLaMA-Factory 0.9.5's v1 ulysses plugin (`apply_sequence_parallel`)
and its `sequence_parallel_loss` (its `padding_and_split_data` inside), as its trainer calls them, over
the flash stand-in in bfloat16. A tiny llama at P=2 passes (one sequence, packed documents, two
micro-batches: its loss and its trainer's scale); the shims are in the report; query heads that P
does not divide are refused before any rank starts (exit 2, one line with the numbers); a planted bug
(LLaMA-Factory's attention handed `position_ids` that never reset, so that packed documents attend to
each other)
fails, named.

The zoo at P=2 and P=4 is reports/models/trainers_llamafactory.md; the findings, with patched copies,
docs/findings/trainers.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("llamafactory") is None:
    pytest.skip("llamafactory not installed: pip install --no-deps llamafactory==0.9.5", allow_module_level=True)
pytest.importorskip("transformers")

from ringcheck.commands.step_model import check_model_before_start, run_model_step
from ringcheck.glues import GlueRefused
from ringcheck.models.step import ModelStepConfig
from ringcheck.trainers.llamafactory import LlamaFactoryUlysses, llamafactory_glue, plugin

ROOT = Path(__file__).resolve().parents[1]


class DropsPositions(LlamaFactoryUlysses):
    """The planted bug: LLaMA-Factory's `new_flash_attn_forward` handed `position_ids` that count on
    over the whole sequence (the rotary positions are the model's, before it), so that its gathered
    `position_ids` never reset: packed documents attend to each other."""

    def apply(self, model) -> None:
        sp = plugin()
        shipped = sp.new_flash_attn_forward

        def counting_on(*args, **kwargs):
            pos, rank = kwargs["position_ids"], torch.distributed.get_rank(kwargs["group"])
            m = pos.shape[-1]
            kwargs["position_ids"] = torch.arange(rank * m, (rank + 1) * m, device=pos.device).expand_as(pos)
            return shipped(*args, **kwargs)

        sp.new_flash_attn_forward = counting_on  # read when apply_sequence_parallel builds its partial
        try:
            super().apply(model)
        finally:
            sp.new_flash_attn_forward = shipped


planted = replace(llamafactory_glue(DropsPositions()), name="suites.test_trainer_llamafactory:planted",
                  describe="planted: LLaMA-Factory's Ulysses attention handed position_ids that never reset")


@pytest.fixture(scope="module")
def gathering_ring(ring_processes):
    """The rings of 2 its loss can gather on. LLaMA-Factory gathers with torch.distributed.nn.all_gather,
    whose backward over gloo raises on a group that does not start at global rank 0 (torch 2.13's,
    benchmarks/findings/torch_gloo.py); under torchrun on a CPU a ring of 2 sits on the world's last ranks."""
    if getattr(ring_processes, "is_torchrun", False) and ring_processes.size != 2 and not torch.cuda.is_available():
        pytest.skip("torchrun on a CPU: a ring of 2 on the world's last ranks, where torch 2.13's gloo all-to-all "
                    "(LLaMA-Factory's loss gather) raises: benchmarks/findings/torch_gloo.py; plain pytest runs it")
    return ring_processes


@pytest.fixture(scope="module")
def judged(gathering_ring):
    return run_model_step(ModelStepConfig(model="llama", glue="llamafactory", world_size=2,
                                          cases=("one_sequence", "packed", "two_micro_batches")), gathering_ring)


def test_llama_passes_through_llamafactorys_ulysses_and_loss(judged):
    assert judged["verdict"] == "pass", judged["why"]
    for row in judged["cases"]:
        assert row["verdict"] == "pass" and row["logits"]["error"] <= row["logits"]["budget"], row
    assert "padding_and_split_data" in judged["glue"]["sharding"]


def test_the_shims_are_in_the_report(judged):
    shims = judged["glue"]["shims"]
    assert len(shims) == 3, shims
    for words in ("ringcheck's flash-attn stand-in", "DistributedInterface singleton",
                  ".to(dist.get_rank())"):
        assert sum(words in s for s in shims) == 1, (words, shims)


def test_heads_that_p_does_not_divide_are_refused_before_any_rank_starts():
    with pytest.raises(GlueRefused, match=r"4 query heads are not divisible by cp_size=3: LLaMA-Factory's "
                                          r"apply_sequence_parallel asserts it \(.*sequence_parallel.py L100\)"):
        check_model_before_start(ModelStepConfig(model="llama", glue="llamafactory", world_size=3))


def test_a_planted_bug_fails_named(gathering_ring):
    got = run_model_step(ModelStepConfig(model="llama", glue="suites.test_trainer_llamafactory:planted",
                                         world_size=2, cases=("packed",)), gathering_ring)
    assert got["verdict"] == "fail", got["why"]
    assert "packed documents" in got["why"], got["why"]


@pytest.mark.cli
def test_the_command_refuses_with_exit_2_in_one_line(tmp_path):
    command = [sys.executable, "-m", "ringcheck", "step", "--model", "llama", "--glue", "llamafactory",
               "--world-size", "3"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("4 query heads are not divisible by cp_size=3") == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
