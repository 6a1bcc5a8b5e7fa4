"""The step's side of the trainer hooks of the glue contract (`ringcheck.glues.contract.Glue`): a
glue's own sharding (`shard`), its own forward and loss (`forward_loss`), and the step's loss with a
glue's gather of the per-token losses (`gather`); each checks what the glue returned and says what
to fix. `ringcheck.models.step.correct_step` calls them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..glues.contract import GLUE_LOSS_KEYS, GLUE_SHARD_KEYS
from ..launch.audit import check_handed
from ..step.contract import IGNORE


def pad_rows(x: torch.Tensor, padded: int, value) -> torch.Tensor:
    """Rows (rows, n) padded to `padded` columns with `value`."""
    return F.pad(x, (0, padded - x.shape[1]), value=value)


def pad_positions(pos: torch.Tensor, padded: int) -> torch.Tensor:
    """Position ids padded by continuing the last document's count (the padding is after every
    real token: under a causal mask no real token sees it)."""
    extra = padded - pos.shape[1]
    if not extra:
        return pos
    tail = pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)
    return torch.cat([pos, tail], dim=1)


def glue_sharded(shard, ids, labels, pos, cu, padded: int, group) -> tuple[torch.Tensor, ...]:
    """A glue's own sharding (`Glue.shard`, a trainer's): the rank's (input_ids, position_ids,
    targets, global positions held), from the padded global rows it was given, checked."""
    got = shard({"input_ids": pad_rows(ids, padded, 0), "labels": pad_rows(labels, padded, IGNORE),
                 "position_ids": pad_positions(pos, padded), "cu_seqlens": cu}, group)
    missing = [k for k in GLUE_SHARD_KEYS if not isinstance(got, dict) or k not in got]
    if missing:
        raise TypeError(f"the glue's shard(batch, group) returned no {', '.join(missing)}: it must return a dict of "
                        f"{', '.join(GLUE_SHARD_KEYS)} (docs/reference/glue-contract.md)")
    check_handed({k: got[k] for k in ("input_ids", "position_ids", "labels")}, by="the glue's shard(batch, group)",
                 fn=shard)   # under RINGCHECK_DEVICE_AUDIT: a trainer's loader may hand back host tensors
    held = torch.as_tensor(got["positions"], dtype=torch.int64).reshape(-1)
    out = [got[k].contiguous() for k in ("input_ids", "position_ids", "labels")]
    if any(t.shape != (ids.shape[0], held.numel()) for t in out):
        raise ValueError(f"the glue's shard(batch, group) returned input_ids, position_ids, labels of shapes "
                         f"{[tuple(t.shape) for t in out]} for {held.numel()} positions: each must be (rows, positions)")
    return (*out, held)


def glue_loss(loss_of, model, ids, labels, pos, mb: dict, total, group) -> tuple[torch.Tensor, ...]:
    """A trainer's own loss (`Glue.forward_loss`: it shards the batch and runs the model): the rank's
    share of the loss, its logits and the global positions it held, checked."""
    cu = mb.get("cu_seqlens")
    got = loss_of(model, {"input_ids": ids, "labels": labels, "position_ids": pos, "total": total,
                          "cu_seqlens": None if cu is None else [int(x) for x in cu]}, group)
    missing = [k for k in GLUE_LOSS_KEYS if not isinstance(got, dict) or k not in got]
    if missing:
        raise TypeError(f"the glue's forward_loss(model, batch, group) returned no {', '.join(missing)}: it must return a dict "
                        f"of {', '.join(GLUE_LOSS_KEYS)} (docs/reference/glue-contract.md)")
    check_handed({k: got[k] for k in ("loss", "logits")}, by="the glue's forward_loss(model, batch, group)", fn=loss_of)
    held = torch.as_tensor(got["positions"], dtype=torch.int64).reshape(-1)
    if got["logits"].shape[:2] != (ids.shape[0], held.numel()) or got["loss"].numel() != 1:
        raise ValueError(f"the glue's forward_loss(model, batch, group) returned logits of shape {tuple(got['logits'].shape)} "
                         f"for {held.numel()} positions and a loss of {got['loss'].numel()} elements: the logits must "
                         f"be (rows, positions, vocab), the loss one number")
    return got["loss"].reshape(()), got["logits"], held


def step_loss(logits: torch.Tensor, targets: torch.Tensor, total: torch.Tensor, gather=None, group=None):
    """ringcheck's cross-entropy over the rank's targets divided by the global count, in float64 from
    the logits, as the truth's (native_step): a glue run in bfloat16 rounds its logits, not its loss.
    With a glue's `gather` (`Glue.gather`, a trainer's), the per-token losses are gathered into the
    whole row's first and summed there, the same loss on every rank of the group."""
    flat = logits.to(torch.float64).flatten(0, 1)
    if gather is None:
        return F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="sum") / total
    each = F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="none").view(targets.shape)
    return gather(each, group).sum() / total
