"""A transformers `LlamaForCausalLM` step as a new user writes one: the ring registered as an
attention (it finds its CP group as `active_cp()`), labels shifted on the whole sequence and
handed as `shift_labels`, `num_items_in_batch` the global count, gradients summed over the CP
group. It declares no `loss_dtype` and has no `logits` hook.

`recipe` is correct; `sharded` hands the model its shard of the unshifted labels (the model shifts
inside each shard: transformers #36607); `sharded_reentrant` also checkpoints with
`use_reentrant=True`; `no_vocab` has no `vocab_size` (read from `get_input_embeddings()`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from ringcheck.step import active_cp

ATTENTION = "user_ring"


def ring(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return active_cp().attention(q, k, v, softmax_scale=scaling), None


AttentionInterface.register(ATTENTION, ring)


class Recipe:
    vocab_size = 64
    shift_whole = True
    reentrant = None

    def model(self):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation=ATTENTION))
        if self.reentrant is not None:
            model.gradient_checkpointing_enable({"use_reentrant": self.reentrant})
        return model

    def step(self, model, micro_batches, cp):
        total = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
        logged = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            ids, pos = cp.shard(mb["input_ids"]), cp.shard(mb["position_ids"])
            if self.shift_whole:
                shifted = cp.shard(F.pad(mb["labels"][:, 1:], (0, 1), value=-100))
                labels = {"labels": shifted, "shift_labels": shifted}
            else:
                labels = {"labels": cp.shard(mb["labels"])}
            out = model(input_ids=ids, position_ids=pos, num_items_in_batch=total, use_cache=False, **labels)
            out.loss.backward()
            logged += out.loss.detach().double()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp.group)
        dist.all_reduce(logged, group=cp.group)
        return logged


class Sharded(Recipe):
    shift_whole = False


class ShardedReentrant(Sharded):
    reentrant = True


class NoVocab(Recipe):
    vocab_size = None


recipe = Recipe()
sharded = Sharded()
sharded_reentrant = ShardedReentrant()
no_vocab = NoVocab()

