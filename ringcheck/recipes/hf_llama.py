"""The `hf_llama` recipe: Hugging Face transformers' `LlamaForCausalLM` from a tiny `LlamaConfig`
(random init, no download, no tokenizer, grouped-query heads), its training step the way a
context-parallel step with transformers must be written:

- the ring enters the model the way any attention does, by name: `AttentionInterface.register`
  (`ATTENTION`); transformers hands the registered function (batch, heads, seq, head_dim) and
  takes (batch, seq, heads, head_dim) back, and passes the model call's extra keywords on to it
  (`ring_cp`, `ring_cu_seqlens`: the CP group and the documents' global boundaries);
- labels shifted on the whole sequence before sharding, given as `shift_labels` (the model
  would otherwise shift inside the shard and lose the target at every shard boundary), made
  contiguous (`cp.shard` copies: transformers' loss views them flat);
- the loss normalised by the global count, `num_items_in_batch` (counted before sharding over
  every micro-batch and replica), so the sum over shards divides once;
- every gradient summed over the CP group and the data-parallel replicas.

transformers' `ForCausalLMLoss` casts the logits to float32 (`logits.float()`), so even a float64
step computes its loss in float32: the recipe says so (`loss_dtype`), and the budget follows.
Needs the optional extra `hf` (transformers).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from ..step.contract import CHECKPOINTING, CP, active_cp
from ..thirdparty.transformers_private import enable_activation_checkpointing, is_activation_checkpointing
from .plain import PlainRecipe

ATTENTION = "ringcheck_ring"
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def ring_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, ring_cp: CP | None = None,
                   ring_cu_seqlens=None, **kwargs):
    """transformers' attention signature around the ring under test: (B, H, S, D) in, (B, S, H, D)
    out; the CP group is the model call's `ring_cp` (with `ring_cu_seqlens`), else the `cp` of the
    hook ringcheck is calling (`active_cp()`: a logits call's has its batch's documents)."""
    cp = ring_cp if ring_cp is not None else active_cp()
    if cp is None:
        raise ValueError(f"attention {ATTENTION!r} needs the CP group: call the model with ring_cp=cp (and "
                         f"ring_cu_seqlens for packed documents), or inside a hook ringcheck calls")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return cp.attention(q, k, v, softmax_scale=scaling, cu_seqlens=ring_cu_seqlens), None


AttentionInterface.register(ATTENTION, ring_attention)


class HFLlamaRecipe(PlainRecipe):
    """The step of the module's docstring: the plain recipe's with the model's own loss (the
    count, the sharding and the gradient and loss reductions are the plain recipe's)."""

    vocab_size = CONFIG["vocab_size"]
    checkpointing = CHECKPOINTING
    loss_dtype = "float32"

    def model(self) -> torch.nn.Module:
        return LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation=ATTENTION))

    def model_labels(self, labels, cp: CP, cu) -> dict:
        """The labels the model's loss is given: shifted on the whole sequence, then sharded."""
        shifted = self.targets(labels, cp, cu)
        return {"labels": shifted, "shift_labels": shifted}

    def micro_loss(self, model, mb: dict, total, cp: CP, micro_batches) -> torch.Tensor:
        if cp.checkpoint is not None and not is_activation_checkpointing(model):
            enable_activation_checkpointing(model, use_reentrant=cp.checkpoint == "reentrant")
        ids, pos, labels, cu = self.inputs(mb, cp)
        out = model(input_ids=ids, position_ids=pos, num_items_in_batch=total, use_cache=False, ring_cp=cp,
                    ring_cu_seqlens=cu, **self.model_labels(labels, cp, cu))
        return out.loss

    def logits(self, model, input_ids, position_ids) -> torch.Tensor:
        """Whole sequences (the attention finds ringcheck's CP group of one as `active_cp()`)."""
        cp = active_cp()
        out = model(input_ids=cp.pad(input_ids, 0), position_ids=cp.pad(position_ids, 0), use_cache=False)
        return out.logits[:, :input_ids.shape[1]]


recipe = HFLlamaRecipe()
