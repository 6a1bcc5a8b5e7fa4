"""The `plain` recipe: ringcheck's own small Llama (`ringcheck.train.model`), its training step
written out in plain torch, the way a context-parallel step must do it:

1. count the targets of the whole global batch once, before sharding (every micro-batch, every
   data-parallel replica): the loss is their token mean;
2. per micro-batch: this replica's rows, labels shifted on the *global* sequence (so the token
   at every shard boundary keeps its target), then padded to the layout's multiple and sharded
   with the tokens and the global positions;
3. the forward with attention through the ring (`cp.attention`, the documents' global
   boundaries), the cross-entropy *summed* over this rank's targets over the global count,
   backward per micro-batch (gradient accumulation);
4. every gradient summed over the CP group and the data-parallel replicas, and the logged
   loss summed the same way.

Each part is a method, so the catalogue's mutants (`ringcheck.catalogue.step_mutants`) replace
exactly one of them, as the reported bugs did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..step.contract import CHECKPOINTING, CP, IGNORE, active_cp, shift_labels
from ..train.config import TrainConfig
from ..train.model import decoder, init_parameters, parameter_shapes, rms_norm

CONFIG = TrainConfig(world_size=1, layers=2, heads=4, kv_heads=2, head_dim=8, seq_len=64, batch=1)


@dataclass(frozen=True)
class Piece:
    tokens: torch.Tensor  # (b, n)
    rope: torch.Tensor    # (b, n) positions


class _Holder(torch.nn.Module):
    """A layer's parameters under train's names (layers.<i>.wq, ...)."""


class SmallLlama(torch.nn.Module):
    """`ringcheck.train.model`'s decoder as a module: parameters named and initialised as train's."""

    def __init__(self, config: TrainConfig = CONFIG):
        super().__init__()
        self.config = config
        init = init_parameters(config)
        self.layers = torch.nn.ModuleList(_Holder() for _ in range(config.layers))
        for name in parameter_shapes(config):
            head, _, rest = name.partition(".")
            if head == "layers":
                index, _, leaf = rest.partition(".")
                self.layers[int(index)].register_parameter(leaf, torch.nn.Parameter(init[name]))
            else:
                self.register_parameter(name, torch.nn.Parameter(init[name]))

    def forward(self, input_ids, position_ids, attend, mode: str | None = None) -> torch.Tensor:
        params = dict(self.named_parameters())
        call = None
        if mode is not None:
            def call(fn, *xs):
                return checkpoint(fn, *xs, use_reentrant=mode == "reentrant")
        (x,) = decoder(params, [Piece(input_ids, position_ids)], attend, self.config, input_ids.device,
                       params["embed"].dtype, call)
        return rms_norm(x, params["norm"]) @ params["lm_head"]


class PlainRecipe:
    """The correct step; see the module's docstring."""

    vocab_size = CONFIG.vocab
    checkpointing = CHECKPOINTING

    def model(self) -> torch.nn.Module:
        return SmallLlama()

    # ---- the parts of the step (a mutant replaces one)

    def count(self, micro_batches, cp: CP) -> torch.Tensor:
        """The global number of counted targets: every micro-batch, every replica's rows."""
        return sum(((shift_labels(mb["labels"]) != IGNORE).sum() for mb in micro_batches), torch.zeros((),
                                                                                                 dtype=torch.int64))

    def targets(self, labels, cp: CP, cu) -> torch.Tensor:
        """Shift on the global sequence, then pad and shard."""
        return cp.shard(cp.pad(shift_labels(labels), IGNORE), cu_seqlens=cu)

    def positions(self, position_ids, cp: CP, cu) -> torch.Tensor:
        return cp.shard(cp.pad(position_ids, 0), cu_seqlens=cu)

    def attend(self, cp: CP, cu):
        def attend(qs, ks, vs, sinks):
            return [cp.attention(q, k, v, cu_seqlens=cu) for q, k, v in zip(qs, ks, vs)]
        return attend

    def loss(self, logits, targets, total, cp: CP, micro_batches) -> torch.Tensor:
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return ce / total

    def reduce_gradients(self, model, cp: CP) -> None:
        params = [p for p in model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        for group in (cp.group, cp.dp_group):
            dist.all_reduce(flat, group=group)
        at = 0
        for p in params:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()

    def reduce_loss(self, loss, cp: CP) -> torch.Tensor:
        for group in (cp.group, cp.dp_group):
            dist.all_reduce(loss, group=group)
        return loss

    # ---- the hooks of the contract

    def inputs(self, mb: dict, cp: CP):
        """This rank's token ids and positions (this replica's rows, padded, sharded), the
        replica's labels (whole sequences, unshifted) and the documents' global boundaries."""
        ids, labels, pos = (cp.rows(mb[k]) for k in ("input_ids", "labels", "position_ids"))
        cu = mb.get("cu_seqlens")
        return cp.shard(cp.pad(ids, 0), cu_seqlens=cu), self.positions(pos, cp, cu), labels, cu

    def micro_loss(self, model, mb: dict, total, cp: CP, micro_batches) -> torch.Tensor:
        """One micro-batch's share of the loss on this rank."""
        ids, pos, labels, cu = self.inputs(mb, cp)
        logits = model(ids, pos, self.attend(cp, cu), cp.checkpoint)
        return self.loss(logits, self.targets(labels, cp, cu), total, cp, micro_batches)

    def step(self, model, micro_batches, cp: CP, *, backward: bool = True) -> torch.Tensor:
        total = self.count(micro_batches, cp)
        logged = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            loss = self.micro_loss(model, mb, total, cp, micro_batches)
            if backward:
                loss.backward()
            logged = logged + loss.detach().double()
        if backward:
            self.reduce_gradients(model, cp)
        return self.reduce_loss(logged, cp)

    def evaluate(self, model, micro_batches, cp: CP) -> torch.Tensor:
        return self.step(model, micro_batches, cp, backward=False)

    def loader(self, cp: CP, seed: int) -> list[dict]:
        """The batches this rank's data pipeline gives it: a sampler seeded by the data-parallel
        rank, so the ranks of a CP group share a batch and the replicas differ."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + cp.dp_rank)
        ids = torch.randint(0, self.vocab_size, (1, 64), generator=gen)
        return [{"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(64).view(1, 64)}]

    def logits(self, model, input_ids, position_ids) -> torch.Tensor:
        """Whole sequences: (B, N, vocab). ringcheck calls it on a CP group of one, which the
        attention finds as `active_cp()` (its `cu_seqlens`: the batch's documents)."""
        cp = active_cp()
        out = model(cp.pad(input_ids, 0), cp.pad(position_ids, 0), self.attend(cp, cp.cu_seqlens))
        return out[:, :input_ids.shape[1]]


recipe = PlainRecipe()
