"""Public recipe mutants: the `plain` recipe with one part of its step written the way a reported
bug wrote it (one per class of the step bugs in the public trackers). `ringcheck step --recipe
ringcheck.catalogue.step_mutants:NAME` must fail each with the diagnosis `EXPECTED[NAME]`
names (suites/test_step.py; reports/step/ holds every mutant's errors beside the correct
recipes').

The accumulation class (micro-batches weighed equally) is the same at CP=1 and CP=P, so no
consistency check can fail it: `micro_batches_weighed_equally` passes the gate and is named by
the convention line instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..recipes.plain import PlainRecipe
from ..step.contract import CP, IGNORE, shift_labels


class LabelsShiftedInShards(PlainRecipe):
    """Shards the unshifted labels and shifts inside each shard (as a model that shifts its own
    labels does with a shard): transformers #36607, #41832; verl #4250; EasyContext #38. The
    count is the sum of the ranks' own counts."""

    def targets(self, labels, cp: CP, cu):
        return shift_labels(cp.shard(cp.pad(labels, IGNORE), cu_seqlens=cu))

    def count(self, micro_batches, cp: CP):
        total = torch.zeros((), dtype=torch.int64)
        for mb in micro_batches:
            total = total + (self.targets(cp.rows(mb["labels"]), cp, mb.get("cu_seqlens")) != IGNORE).sum()
        for group in (cp.group, cp.dp_group):
            dist.all_reduce(total, group=group)
        return total


class LabelsShiftedOlderLogits(LabelsShiftedInShards):
    """The same bug in a recipe written to the older form of the logits hook,
    `logits(model, batch, cp)` (ringcheck tells the forms apart by the parameters' names)."""

    def logits(self, model, batch, cp: CP) -> torch.Tensor:
        n, cu = batch["input_ids"].shape[1], batch.get("cu_seqlens")
        out = model(cp.pad(batch["input_ids"], 0), cp.pad(batch["position_ids"], 0), self.attend(cp, cu))
        return out[:, :n]


class MeanOfRankMeans(PlainRecipe):
    """Each rank's loss the mean over its own counted tokens, then averaged over the ranks:
    verl #6564, #5993; Megatron-LM #673, #1124; ms-swift #10185."""

    def loss(self, logits, targets, total, cp: CP, micro_batches):
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        mine = (targets != IGNORE).sum().clamp_min(1)
        return ce / mine / (cp.size * cp.dp_size * len(micro_batches))


class PadTokensCounted(PlainRecipe):
    """The denominator counts every position after padding to the layout's multiple (pads and
    -100 included): TransformerEngine #1930; NeMo-RL #4070; bionemo #1449."""

    def count(self, micro_batches, cp: CP):
        return torch.tensor(sum(mb["input_ids"].shape[0] * cp.pad(mb["input_ids"], 0).shape[1] for mb in micro_batches))


class GradsAveraged(PlainRecipe):
    """Gradients averaged over the CP group instead of summed: torchtitan #685; slime #1366."""

    @staticmethod
    def scale(size: int) -> float:
        return 1.0 / size

    def reduce_gradients(self, model, cp: CP) -> None:
        super().reduce_gradients(model, cp)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(self.scale(cp.size))


class GradsScaledTwice(GradsAveraged):
    """The CP scaling applied twice (a loss x P for an average the framework does not do):
    VeOmni #1115, #1120; DeepSpeed #5248."""

    @staticmethod
    def scale(size: int) -> float:
        return float(size)


class NoCPReduction(PlainRecipe):
    """Gradients reduced over the data-parallel replicas only, never over the CP group:
    Megatron-LM #3816, PR #7498."""

    def reduce_gradients(self, model, cp: CP) -> None:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp.dp_group)


class CPBypassed(PlainRecipe):
    """Attention local to the shard (an attention backend that never calls the ring):
    Megatron-Bridge #2667; pytorch #152261; axolotl #3608."""

    def attend(self, cp: CP, cu):
        def attend(qs, ks, vs, sinks):
            return [F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True).transpose(1, 2)
                    for q, k, v in zip(qs, ks, vs)]
        return attend


class LocalPositions(PlainRecipe):
    """Position ids restarting at 0 on every rank (RoPE of the local index): NeMo Automodel #1482;
    Megatron-LM #1612; torchtune #2879."""

    def positions(self, position_ids, cp: CP, cu):
        local = cp.shard(cp.pad(position_ids, 0), cu_seqlens=cu)
        return torch.arange(local.shape[1], device=local.device).expand_as(local).clone()


class MicroBatchesWeighedEqually(PlainRecipe):
    """Each micro-batch normalised by its own count, the micro-batches averaged: transformers
    #34191; verl #2855; NeMo #12210 (CP-consistent: named by the convention line)."""

    def loss(self, logits, targets, total, cp: CP, micro_batches):
        mine = (targets != IGNORE).sum()
        for group in (cp.group, cp.dp_group):
            dist.all_reduce(mine, group=group)
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return ce / mine / len(micro_batches)


class SamplerSeededByGlobalRank(PlainRecipe):
    """The data sampler seeded by the global rank: the ranks of one CP group get different
    batches (LlamaFactory #10559; axolotl #3920; 360-LLaMA-Factory #82)."""

    def loader(self, cp: CP, seed: int) -> list[dict]:
        return super().loader(replace(cp, dp_rank=cp.global_rank), seed)


class NoPadding(PlainRecipe):
    """Shards whatever length it is given: a length no 2 x P divides has no verdict (exit 2)."""

    def step(self, model, micro_batches, cp: CP, *, backward: bool = True):
        n = micro_batches[0]["input_ids"].shape[1]
        if n % cp.multiple:
            raise ValueError(f"this recipe does not pad: {n} tokens are not a multiple of {cp.multiple}")
        return super().step(model, micro_batches, cp, backward=backward)


class ModelNotAModule(PlainRecipe):
    """Breaks the contract: model() returns the parameters, not a torch.nn.Module (no verdict)."""

    def model(self):
        return dict(super().model().named_parameters())


class LossNotAScalar(PlainRecipe):
    """Breaks the contract: step returns every token's loss, not the loss one would log (no verdict)."""

    def step(self, model, micro_batches, cp: CP, *, backward: bool = True):
        super().step(model, micro_batches, cp, backward=backward)
        return torch.zeros(3)


labels_shifted_in_shards = LabelsShiftedInShards()
labels_shifted_older_logits = LabelsShiftedOlderLogits()
mean_of_rank_means = MeanOfRankMeans()
pad_tokens_counted = PadTokensCounted()
grads_averaged = GradsAveraged()
grads_scaled_twice = GradsScaledTwice()
no_cp_reduction = NoCPReduction()
cp_bypassed = CPBypassed()
local_positions = LocalPositions()
micro_batches_weighed_equally = MicroBatchesWeighedEqually()
no_padding = NoPadding()
model_not_a_module = ModelNotAModule()
loss_not_a_scalar = LossNotAScalar()
sampler_seeded_by_global_rank = SamplerSeededByGlobalRank()

# mutant -> (a case where it fails, the diagnosis named)
EXPECTED = {
    "labels_shifted_in_shards": ("one_sequence", "labels_shifted_in_shards"),
    "mean_of_rank_means": ("uneven", "mean_of_rank_means"),
    "pad_tokens_counted": ("not_divisible", "pad_tokens_counted"),
    "grads_averaged": ("one_sequence", "grads_over_p"),
    "grads_scaled_twice": ("one_sequence", "grads_times_p"),
    "no_cp_reduction": ("one_sequence", "no_cp_reduction"),
    "cp_bypassed": ("one_sequence", "local_attention"),
    "local_positions": ("one_sequence", "local_positions"),
}
