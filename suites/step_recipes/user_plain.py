"""A plain-torch decoder and its context-parallel step, as a new user writes one: it pads nothing
(the user's loader hands it lengths the ring divides), its attention goes through `cp.attention`.

`recipe` is correct; `float32_loss` computes its loss on float32 logits and does not say so;
`reentrant` checkpoints every block with `use_reentrant=True` (the model's
own choice, not a case's); `labels_in_shards_reentrant` adds a bug (labels shifted inside each
shard) so that ringcheck's diagnosis has to run through the reentrant checkpoints (and
`labels_in_shards_logits_raise`, whose logits hook raises, so that it cannot); `no_vocab` has
no `vocab_size` (ringcheck reads it from the model's first `nn.Embedding`); `key_bias` gives each
attention a key bias (its gradient analytically zero: softmax ignores a per-row constant) and
`key_bias_layer_averaged` adds a bug to it (block 1's gradients averaged over the CP group where
the others are summed: halved at CP=2), `key_bias_grads_averaged` averages every gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringcheck.step import active_cp


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, key_bias: bool = False):
        super().__init__()
        self.heads = heads
        self.key_bias = nn.Parameter(0.1 * torch.randn(dim)) if key_bias else None
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, cp):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        k = k if self.key_bias is None else k + self.key_bias.view(self.heads, d // self.heads)
        x = x + self.out(cp.attention(q, k, v).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, reentrant: bool = False,
                 key_bias: bool = False):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.places = nn.Embedding(128, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, key_bias) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.reentrant = reentrant

    def forward(self, ids, pos, cp):
        x = self.tokens(ids) + self.places(pos)
        for block in self.blocks:
            if self.reentrant and torch.is_grad_enabled():
                x = checkpoint(block, x, cp, use_reentrant=True)
            else:
                x = block(x, cp)
        return self.head(x)


def all_reduce_grads(model, cp) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp.group)


class Recipe:
    vocab_size = 50
    reentrant = False
    key_bias = False
    loss_in = None  # the dtype the logits are cast to for the loss (None: the model's)

    def model(self):
        return Decoder(reentrant=self.reentrant, key_bias=self.key_bias)

    def step(self, model, micro_batches, cp):
        total = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
        logged = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            targets = F.pad(mb["labels"][:, 1:], (0, 1), value=-100)  # shifted on the whole sequence
            ids, pos, targets = (cp.shard(t) for t in (mb["input_ids"], mb["position_ids"], targets))
            logits = model(ids, pos, cp)
            logits = logits if self.loss_in is None else logits.to(self.loss_in)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / total
            loss.backward()
            logged += loss.detach().double()
        all_reduce_grads(model, cp)
        dist.all_reduce(logged, group=cp.group)
        return logged

    def logits(self, model, input_ids, position_ids):
        return model(input_ids, position_ids, active_cp())


class Float32Loss(Recipe):
    """The cross-entropy on float32 logits (as many steps cast them for the loss), no loss_dtype."""

    loss_in = torch.float32


class Reentrant(Recipe):
    reentrant = True


class LabelsInShardsReentrant(Reentrant):
    def step(self, model, micro_batches, cp):
        (mb,) = micro_batches
        ids, pos, labels = (cp.shard(mb[k]) for k in ("input_ids", "position_ids", "labels"))
        total = (labels[:, 1:] != -100).sum()  # the targets left in the shards, counted over the group
        dist.all_reduce(total, group=cp.group)
        logits = model(ids, pos, cp)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                               reduction="sum") / total
        loss.backward()
        all_reduce_grads(model, cp)
        loss = loss.detach().double()
        dist.all_reduce(loss, group=cp.group)
        return loss


class LabelsInShardsLogitsRaise(LabelsInShardsReentrant):
    """A logits hook that cannot run on whole sequences (it wants the step's shards)."""

    def logits(self, model, input_ids, position_ids):
        raise RuntimeError("this model runs on shards only")


class KeyBias(Recipe):
    key_bias = True


class KeyBiasLayerAveraged(KeyBias):
    """Block 1's gradients averaged over the CP group (a parameter group reduced with AVG), the
    rest summed: at CP=2 that layer's gradients are halved, the loss is right."""

    averaged = "blocks.1."  # the parameters whose gradients are averaged (a prefix of their names)

    def step(self, model, micro_batches, cp):
        logged = super().step(model, micro_batches, cp)
        for name, p in model.named_parameters():
            if p.grad is not None and name.startswith(self.averaged):
                p.grad.div_(cp.size)
        return logged


class KeyBiasGradsAveraged(KeyBiasLayerAveraged):
    """Every gradient averaged over the CP group (grads_over_p), on the model with key biases."""

    averaged = ""


class NoVocab:
    """`Recipe` without `vocab_size` (and without a logits hook): only model() and step()."""

    model = Recipe.model
    step = Recipe.step
    reentrant = False
    key_bias = False
    loss_in = None


recipe = Recipe()
float32_loss = Float32Loss()
reentrant = Reentrant()
labels_in_shards_reentrant = LabelsInShardsReentrant()
labels_in_shards_logits_raise = LabelsInShardsLogitsRaise()
no_vocab = NoVocab()
key_bias = KeyBias()
key_bias_layer_averaged = KeyBiasLayerAveraged()
key_bias_grads_averaged = KeyBiasGradsAveraged()
