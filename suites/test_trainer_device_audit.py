"""The trainers' glues under the device audit (`ringcheck.launch.audit`, `RINGCHECK_DEVICE_AUDIT=1`):
one glue per trainer runs a step of a tiny llama at P=2 (one case, no truth: only where its tensors
live is judged here) with every tensor that meets the rank's tensors judged, its trainer's code
included, and raises nothing. Planted mistakes are caught, naming the line that made the tensor:
a glue that hands the step the CPU slices a trainer's loader makes by design (DeepSpeed's
`UlyssesSPDataLoaderAdapter` keeps them on the CPU and its trainer moves them: the glue must), and
a glue whose attention makes its mask without naming the device. Each trainer's row skips, in one
line, where its package is not installed (`.ci/run` installs them all).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from ringcheck.glues.ours import RingcheckGlue
from ringcheck.launch.audit import device_audit
from ringcheck.models.step import ModelStepConfig, model_step_task

CASE = ("one_sequence",)
# one glue per trainer: (--glue, the package its trainer ships, the pip line of .ci/run)
TRAINERS = {
    "deepspeed_ulysses": ("deepspeed", "pip install deepspeed==0.19.8"),
    "verl": ("verl", "pip install --no-deps verl==0.9.1 tensordict==0.10.0 omegaconf antlr4-python3-runtime==4.9.3 "
                     "cloudpickle orjson pyvers"),
    "llamafactory": ("llamafactory", "pip install --no-deps llamafactory==0.9.5"),
    "ms_swift": ("swift", "pip install --no-deps ms-swift==4.6.0 accelerate==1.16.0 peft==0.20.0"),
    "axolotl": ("ringmaster", "pip install --no-deps axolotl-ringmaster==0.2.7"),
    "openrlhf": ("openrlhf", "pip install --no-deps openrlhf==0.11.2 ring-flash-attn==0.1.8"),
}


def _installed(glue: str):
    package, fix = TRAINERS[glue]
    return pytest.param(glue, marks=pytest.mark.skipif(importlib.util.find_spec(package) is None,
                                                       reason=f"{package} not installed: {fix}"))


def audited_task(member, glue: str, judge_impl: bool, as_ringchecks: bool = False, model: str = "llama") -> dict:
    """One rank of the step through `glue` under the audit; what each case raised. `as_ringchecks`:
    the planted `CpuShards.shard` taken for a glue of ringcheck's own (its module's name)."""
    config = ModelStepConfig(model=model, glue=glue, world_size=dist.get_world_size(member.group), cases=CASE)
    module = CpuShards.shard.__module__
    if as_ringchecks:
        CpuShards.shard.__module__ = "ringcheck.trainers.planted"
    try:
        with device_audit(member.device, judge_impl=judge_impl):
            return model_step_task(member, config, CASE)["errors"]
    finally:
        CpuShards.shard.__module__ = module


def _errors(ring_processes, glue: str, judge_impl: bool, as_ringchecks: bool = False, model: str = "llama") -> dict:
    config = ModelStepConfig(model=model, glue=glue, world_size=2, cases=CASE)
    first = 0 if ring_processes.size is None else ring_processes.size - config.mesh_spec.size
    groups = ring_processes.run_groups(config.mesh_spec.plan(first, families=True), audited_task, glue, judge_impl,
                                       as_ringchecks, model)
    return {name: why for group in groups for errors in group for name, why in errors.items()}


@pytest.mark.parametrize("glue", [_installed(g) for g in TRAINERS])
def test_each_trainers_glue_runs_clean_under_the_audit(ring_processes, glue):
    """Every tensor judged, the trainer's own code too (`judge_impl`): none made on the host meets
    the rank's tensors (a finding of the trainer's would be docs/findings/trainers.md's)."""
    assert _errors(ring_processes, glue, judge_impl=True) == {}


@pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason=f"ms-swift not installed: {TRAINERS['ms_swift'][1]}")
def test_ms_swifts_ring_runs_clean_under_the_audit(ring_processes, tmp_path):
    """ms-swift's zig-zag ring (`ms_swift_ring`: one K/V head at P=2), which every model of the zoo with
    fewer K/V heads than ranks crashes before it runs (their sliding windows, docs/findings/trainers.md):
    mistral without its window runs it through."""
    from transformers import MistralConfig

    MistralConfig(sliding_window=None).to_json_file(tmp_path / "config.json")
    assert _errors(ring_processes, "ms_swift_ring", judge_impl=True, model=str(tmp_path / "config.json")) == {}


@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                    reason="ring-flash-attn not installed: pip install ring-flash-attn==0.1.8")
def test_ring_flash_attns_glue_hands_its_kernels_the_boundaries_on_the_device(ring_processes):
    """`--glue ring_flash_attn` (OpenRLHF's and axolotl 0.19's ring under it) hands the adapter's
    update_ring_flash_attn_params the global boundaries it is given as a list: made on the host, they
    reached the varlen kernels, which take them on the device only (flash-attn's CHECK_DEVICE)."""
    assert _errors(ring_processes, "ring_flash_attn", judge_impl=True) == {}


class CpuShards(RingcheckGlue):
    """The planted mistake: ringcheck's glue sharding the batch itself, its slices moved to the CPU
    as a trainer's loader keeps them (DeepSpeed's, ulysses_sp.py L724) and never moved back."""

    layout, describe = "contiguous", "ringcheck's glue, its shards left on the CPU (planted)"

    def __init__(self):
        super().__init__("contiguous", name="planted_cpu_shards")

    def shard(self, batch: dict, group) -> dict:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n = batch["input_ids"].shape[1] // world
        mine = slice(rank * n, (rank + 1) * n)
        labels = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
        return {"input_ids": batch["input_ids"][:, mine].cpu(), "position_ids": batch["position_ids"][:, mine].cpu(),
                "labels": labels[:, mine].cpu(), "positions": torch.arange(rank * n, (rank + 1) * n)}


cpu_shards = CpuShards()


class HostMask(RingcheckGlue):
    """The planted mistake: ringcheck's glue whose attention scales the query by a factor made
    with torch.ones and no device, as a trainer's attention wrapper making its mask would."""

    layout, describe = "contiguous", "ringcheck's glue, a host tensor in its attention (planted)"

    def __init__(self):
        super().__init__("contiguous", name="planted_host_mask")

    def attend(self, q, k, v, options: dict):
        return super().attend(q * torch.ones(q.shape[-1], dtype=q.dtype), k, v, options)


host_mask = HostMask()


@pytest.mark.parametrize("planted, line", [("cpu_shards", "cpu() at"), ("host_mask", "torch.ones without a device at")])
def test_a_planted_device_mistake_in_a_glue_is_caught_naming_its_line(ring_processes, planted, line):
    errors = _errors(ring_processes, f"{__name__}:{planted}", judge_impl=True)
    assert set(errors) == set(CASE), errors
    why = errors[CASE[0]]
    assert why.startswith("DeviceAuditError: device audit") and "Expected all tensors" in why, why
    assert line in why and "test_trainer_device_audit.py:" in why, why


def test_a_glue_of_ringcheck_that_hands_back_host_tensors_is_ringchecks_defect(ring_processes):
    """The same planted glue, as if it were ringcheck's own: the launchers' audit (which judges
    ringcheck's code alone) raises, and says whose defect it is; as the user's, it lets it pass
    (the trainers' own code hands back host tensors by design: the glue that calls it moves them)."""
    errors = _errors(ring_processes, f"{__name__}:cpu_shards", judge_impl=False, as_ringchecks=True)
    assert "ringcheck's own code" in errors.get(CASE[0], ""), errors
    assert _errors(ring_processes, f"{__name__}:cpu_shards", judge_impl=False) == {}
