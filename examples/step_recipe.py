"""A user's training step wrapped as a `ringcheck step` recipe (docs/how-to/step.md).

The step is written as many context-parallel steps with transformers first are: each rank takes
its shard of the batch, hands the model its shard of the labels, and sums the gradients over
the CP group. It has a bug (the model shifts the labels inside the shard); run

    ringcheck step --recipe examples.step_recipe:recipe --world-size 4

from the repository root to see it named.
"""

from __future__ import annotations

import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from ringcheck.recipes.hf_llama import ATTENTION  # registers the ring under test as a transformers attention


class Recipe:
    vocab_size = 64
    loss_dtype = "float32"  # transformers' loss casts the logits to float32

    def model(self):
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            attn_implementation=ATTENTION))

    def step(self, model, micro_batches, cp):
        (batch,) = micro_batches
        ids, labels, pos = (cp.shard(batch[k]) for k in ("input_ids", "labels", "position_ids"))
        # the count of this rank's targets, summed over the CP group: the loss's denominator
        count = (labels[:, 1:] != -100).sum()
        dist.all_reduce(count, group=cp.group)
        out = model(input_ids=ids, position_ids=pos, labels=labels, num_items_in_batch=count, use_cache=False,
                    ring_cp=cp)
        out.loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=cp.group)
        loss = out.loss.detach().double()
        dist.all_reduce(loss, group=cp.group)
        return loss

    def logits(self, model, input_ids, position_ids):
        """Whole sequences at CP=1 (ringcheck's own loss and the diagnosis need them); the ring
        finds ringcheck's CP group of one by itself (`ringcheck.step.active_cp()`)."""
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


recipe = Recipe()
