"""The diagnosis of a failed case: which known bug the step's figures match, from evidence.

ringcheck recomputes the step's loss and gradients on whole sequences (the recipe's `logits` at
CP=1, ringcheck's own cross-entropy in float64) under each known transformation of a correct
step (`TRANSFORMS`: the classes of the public reports), and compares the CP=P run with each:
the one its loss and every gradient equal within the budget is named. Three more candidates
come from the runs' own gradients: the reference's x P and / P, and the sum of the CP ranks'
gradients (a step that never reduced over the CP group). `CONVENTIONS` are the loss conventions
a step may follow legitimately (the same at CP=1 and CP=P); the reference is matched against
them, for the report's convention line (transformers #34191).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..ring.layouts import positions
from ..spec import RingSpec
from .contract import CP, IGNORE, calling, shift_labels

# name -> (class, what it means, a report where it happened)
WORDS = {
    "token_mean": ("correct", "the global token mean over every micro-batch and replica", ""),
    "labels_shifted_in_shards": ("labels / loss", "labels shifted inside each shard: the token at every shard "
                                 "boundary loses its target (or is given a wrong one); pass labels shifted on the "
                                 "whole sequence (transformers: shift_labels)", "transformers #36607, verl #4250"),
    "mean_of_rank_means": ("loss reduction", "the loss reduced as a mean of per-rank means while the ranks hold "
                           "different counts; divide the summed loss by the global count (transformers: "
                           "num_items_in_batch)", "verl #6564, Megatron-LM #673"),
    "pad_tokens_counted": ("padding", "the padding added for the layout counted in the loss's denominator",
                           "TransformerEngine #1930, NeMo-RL #4070"),
    "micro_batches_weighed_equally": ("accumulation", "micro-batches weighed equally (a mean of micro-batch means) "
                                      "instead of by their tokens", "transformers #34191, verl #2855"),
    "local_positions": ("positions / RoPE", "position ids restarting at 0 on every rank instead of the global "
                        "positions sharded with the tokens", "NeMo Automodel #1482, Megatron-LM #1612"),
    "local_attention": ("CP bypassed", "attention local to each rank's shard: the ring is not called (an attention "
                        "backend or adapter bypasses it)", "Megatron-Bridge #2667, pytorch #152261"),
    "grads_times_p": ("gradient sync", "every gradient P times the reference's (scaled twice)",
                      "torchtitan #685, VeOmni #1115"),
    "grads_over_p": ("gradient sync", "every gradient 1/P of the reference's: averaged over the CP group instead "
                     "of summed", "torchtitan #685, slime #1366"),
    "no_cp_reduction": ("gradient sync", "gradients never reduced over the CP group: each rank holds its own "
                        "share (their sum is the reference)", "Megatron-LM #3816, DeepSpeed #5248"),
}
TRANSFORMS = ("labels_shifted_in_shards", "mean_of_rank_means", "pad_tokens_counted", "micro_batches_weighed_equally",
              "local_positions", "local_attention")
CONVENTIONS = ("token_mean", "micro_batches_weighed_equally", "pad_tokens_counted")


class Layout:
    """Where every global position of a padded sequence sits on a ring of P ranks."""

    def __init__(self, layout: str, world_size: int, seq_len: int, cu_seqlens):
        self.padded = -(-seq_len // RingSpec(world_size, layout).chunks) * RingSpec(world_size, layout).chunks
        self.held = [positions(layout=layout, rank=r, world_size=world_size, seq_len=self.padded,
                               cu_seqlens=cu_seqlens) for r in range(world_size)]
        self.owner = torch.empty(self.padded, dtype=torch.int64)
        self.local = torch.empty(self.padded, dtype=torch.int64)
        for r, held in enumerate(self.held):
            self.owner[held] = r
            self.local[held] = torch.arange(len(held))


def shard_targets(labels: torch.Tensor, where: Layout, rolled: bool = False) -> torch.Tensor:
    """The targets a step gives that shards the unshifted labels and then shifts them inside each
    shard: the last token of a shard gets none (`rolled` False) or its shard's first label (True)."""
    n = labels.shape[1]
    padded = F.pad(labels, (0, where.padded - n), value=IGNORE)
    out = torch.full_like(padded, IGNORE)
    for held in where.held:
        held = held.to(labels.device)
        source = held if rolled else held[:-1]
        out[:, source] = padded[:, torch.roll(held, -1)[:len(source)]]
    return out[:, :n]


def _weights(name: str, batches: list[dict], layouts: list[Layout], P: int, dp: int, targets: list[torch.Tensor]):
    """Per micro-batch the per-token weights (R, N) of the loss under the transformation `name`."""
    valid = [t != IGNORE for t in targets]
    total = sum(int(v.sum()) for v in valid)
    M = len(batches)
    out = []
    for v, where, _mb in zip(valid, layouts, batches):
        w = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
        if name in ("token_mean", "labels_shifted_in_shards", "local_positions", "local_attention"):
            w[v] = 1.0 / max(total, 1)
        elif name == "micro_batches_weighed_equally":
            w[v] = 1.0 / (M * max(int(v.sum()), 1))
        elif name == "pad_tokens_counted":
            w[v] = 1.0 / sum(b["input_ids"].shape[0] * lay.padded for b, lay in zip(batches, layouts))
        elif name == "mean_of_rank_means":
            rows = v.shape[0] // dp
            owner = where.owner[:v.shape[1]].to(v.device)
            for d in range(dp):
                for r in range(P):
                    cell = v[d * rows:(d + 1) * rows] & (owner == r)
                    w[d * rows:(d + 1) * rows][cell] = 1.0 / (P * M * dp * max(int(cell.sum()), 1))
        else:
            raise ValueError(f"unknown transformation {name!r}")
        out.append(w)
    return out


def _logits(recipe, model, mb: dict, cp: CP, name: str, where: Layout) -> torch.Tensor | None:
    """The logits of a micro-batch under `name` (None where the transformation is not defined:
    positions and local attention on packed documents)."""
    ids, pos, cu = mb["input_ids"], mb["position_ids"], mb.get("cu_seqlens")
    n = ids.shape[1]
    if name == "local_positions":
        if cu is not None:
            return None
        local = where.local[:n].to(pos.device).expand_as(pos).clone()
        return recipe.logits(model, {"input_ids": ids, "position_ids": local, "cu_seqlens": None}, cp)
    if name == "local_attention":
        if cu is not None:
            return None
        parts = []
        z = None
        for held in where.held:
            idx = held[held < n].to(ids.device)
            if len(idx) == 0:
                continue
            part = recipe.logits(model, {"input_ids": ids[:, idx], "position_ids": pos[:, idx], "cu_seqlens": None}, cp)
            if z is None:
                z = part.new_zeros(ids.shape[0], n, part.shape[-1])
            parts.append((idx, part))
        for idx, part in parts:
            z = z.index_copy(1, idx, part)
        return z
    return recipe.logits(model, mb, cp)


def candidates(recipe, build: Callable[[], torch.nn.Module], batches: list[dict], cp: CP, *, P: int, layout: str,
               dp: int, names=TRANSFORMS + ("token_mean",)) -> dict[str, Any]:
    """Each transformation's loss and gradients, computed on whole sequences with `cp` of size one."""
    layouts = [Layout(layout, P, mb["input_ids"].shape[1], mb.get("cu_seqlens")) for mb in batches]
    out = {}
    for name in names:
        model = build()
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for p in params.values():
            p.grad = None
        if name == "labels_shifted_in_shards":
            targets = [shard_targets(mb["labels"], lay) for mb, lay in zip(batches, layouts)]
        else:
            targets = [shift_labels(mb["labels"]) for mb in batches]
        weights = _weights(name, batches, layouts, P, dp, targets)
        loss = 0.0
        for mb, lay, t, w in zip(batches, layouts, targets, weights):
            z = _logits(recipe, model, mb, cp, name, lay)
            if z is None:
                loss = None
                break
            ce = F.cross_entropy(z.double().flatten(0, 1), t.clamp_min(0).flatten(), reduction="none")
            part = (ce * w.flatten()).sum()
            backward(part, replace(cp, cu_seqlens=mb.get("cu_seqlens")))
            loss += float(part.detach())
        if loss is None:
            continue
        changed = sum(int((t != shift_labels(mb["labels"])).sum()) for t, mb in zip(targets, batches))
        out[name] = {"loss": loss, "changed": changed,
                     "grads": {n: None if p.grad is None else p.grad.detach().cpu() for n, p in params.items()}}
        if name == "labels_shifted_in_shards":  # its count: the targets it keeps, or the whole sequence's
            kept, whole = (sum(int((t != IGNORE).sum()) for t in ts) for ts in
                           (targets, [shift_labels(mb["labels"]) for mb in batches]))
            out[name]["scales"] = (1.0, kept / max(whole, 1))
    return out


def backward(part: torch.Tensor, cp: CP) -> None:
    """`part.backward()` with `cp` active, its gradients accumulating into the parameters' (a
    micro-batch at a time, as a step accumulates them): `torch.autograd.grad` refuses a model that
    checkpoints with `use_reentrant=True` (its own choice, whatever case runs), and that model's
    recomputation in backward finds its ring as `active_cp()` (the micro-batch's documents) as in
    the forward."""
    with calling(cp):
        part.backward()


def _sum_over_cp(ranks: list[dict]) -> dict[str, torch.Tensor | None]:
    """The sum of the first CP group's ranks' gradients (what a step that never reduced over CP
    would have had to reduce)."""
    group = [r for r in ranks if r["where"][0] == 0]
    names = group[0]["grads"]
    return {n: None if any(r["grads"][n] is None for r in group) else sum(r["grads"][n] for r in group) for n in names}


def match(ranks: list[dict], ref: dict, cands: dict[str, Any], *, P: int, loss_budget: float, grad_budget: float,
          evaluate: bool, relative, per: dict[str, tuple[float, float | None]] | None = None) -> list[dict[str, Any]]:
    """Every candidate's distance to the CP=P run (rank 0 of its first group), nearest first;
    `matches` where the loss and every gradient are within the budgets (`per`: each judged
    parameter's own budget and the whole gradient's norm where its error is a part of the whole,
    None where relative to itself: `judge_case`'s rows; a parameter not in it is not judged)."""
    user = ranks[0]

    def gradients(want: dict, f: float = 1.0) -> tuple[float, float]:
        return _gradient_ratio(user["grads"], want, f, grad_budget, per, relative)

    pool = {n: c for n, c in cands.items() if n != "token_mean"}
    if not evaluate:
        for name, f in (("grads_times_p", P), ("grads_over_p", 1 / P)):
            pool[name] = {"loss": None, "grads": {n: None if g is None else g * f for n, g in ref["grads"].items()}}
    rows = []
    for name, c in pool.items():
        scaled = []
        for f in c.get("scales", (1.0,)):  # a candidate whose count (its loss's denominator) may be either
            loss_err = None if c["loss"] is None else relative(user["loss"], c["loss"] * f)
            grad = (None, None) if evaluate else gradients(c["grads"], f)
            scaled.append(_row(name, loss_err, grad, loss_budget))
        rows.append(min(scaled, key=lambda r: (not r["matches"], max(r["loss_ratio"] or 0, r["gradient_ratio"] or 0))))
        if c.get("changed"):
            rows[-1]["words"] += f" ({c['changed']} targets at shard boundaries lost or wrong in this case)"
    if not evaluate and P > 1:
        summed = _sum_over_cp(ranks)
        grad = _gradient_ratio(summed, ref["grads"], 1.0, grad_budget, per, relative)
        rows.append(_row("no_cp_reduction", None, grad, loss_budget))
    rows = [r for r in rows if r["loss_error"] is not None or r["gradient_error"] is not None]
    return sorted(rows, key=lambda r: (not r["matches"], max(r["loss_ratio"] or 0, r["gradient_ratio"] or 0)))


def _gradient_ratio(got: dict, want: dict, f: float, budget: float, per: dict | None, relative) -> tuple[float, float]:
    """(the worst gradient error, the worst error in its parameter's budget) of `got` against `want`
    times `f`: every parameter against `budget` relative to itself, or as `per` says."""
    err, ratio = 0.0, 0.0
    for n, g in want.items():
        if g is None or (per is not None and n not in per):
            continue
        mine, whole = (budget, None) if per is None else per[n]
        a = got.get(n)
        e = (math.inf if a is None else relative(a, g * f) if whole is None else
             float((a.double() - g.double() * f).norm()) / whole)
        err, ratio = max(err, e), max(ratio, e / mine)
    return err, ratio


def _row(name, loss_err, grad: tuple[float | None, float | None], loss_budget) -> dict[str, Any]:
    lr = None if loss_err is None else loss_err / loss_budget
    grad_err, gr = grad
    ok = all(x is None or x <= 1 for x in (lr, gr)) and (lr is not None or gr is not None)
    cls, words, reports = WORDS[name]
    return {"name": name, "class": cls, "words": words, "reports": reports, "loss_error": loss_err,
            "gradient_error": grad_err, "loss_ratio": lr, "gradient_ratio": gr, "matches": ok}


def convention(ref: dict, cands: dict[str, Any], *, loss_budget: float, relative) -> dict[str, Any]:
    """Which loss convention the reference step follows (informative: the same at CP=1 and CP=P)."""
    rows = [_row(n, relative(ref["loss"], cands[n]["loss"]), (None, None), loss_budget) for n in CONVENTIONS
            if n in cands]
    found = next((r for r in rows if r["matches"]), None)
    return {"follows": None if found is None else found["name"], "rows": rows,
            "words": ("the loss is none of the known conventions" if found is None else
                      WORDS[found["name"]][1] + ("" if found["name"] == "token_mean" else
                                                 " (not the global token mean: transformers #34191)"))}
