"""The one online-softmax merge of partial attention results.

A partial result over a set of keys is (out, lse): out the softmax-weighted average of V over
those keys and lse the log-sum-exp of their scores. Partials over disjoint key sets merge
exactly into the partial over their union. The ring keeps its running partial as
(acc, m, l) - m the largest lse seen, l = sum exp(lse_i - m), acc = sum exp(lse_i - m) out_i -
and normalises once at the end (`finish`): out = acc / l, lse = m + log(l). Compared with
renormalising (out, lse) after every block this rounds l and acc relative to 1 instead of
rounding lse at its own magnitude P times, so float32 accumulation stays as accurate as a
single-device softmax.

Every weight is exp(x - m) <= 1 (no overflow however far apart two lse are), and a side with
lse = -inf (no visible key: a fully masked row) gets weight exactly 0 without producing NaN,
also when every side is empty (then out = 0 and lse = -inf).

Shapes: out and acc are (batch, seq, heads, head_dim); lse, m and l are (batch, heads, seq);
everything float32 (float64 throughout for a float64 ring: `working_dtype`).
"""

from __future__ import annotations

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the ring accumulates in for inputs of `dtype`: float32 (bf16, fp16 and fp32 inputs:
    exact up to one final cast), float64 for float64 inputs (`ringcheck step`'s exact arithmetic)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq) -> (batch, seq, heads, 1), to scale rows of out."""
    return x.transpose(1, 2).unsqueeze(-1)


def _check(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).dtype
    for name, t in tensors.items():
        if t.dtype not in (torch.float32, torch.float64) or t.dtype != first:
            raise TypeError(f"merge works in float32 (float64 for a float64 ring), one dtype for every part; {name} "
                            f"is {t.dtype}, {next(iter(tensors))} {first}")


def merge_into(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add the partial (block_out, block_lse) to the running state (acc, m, l)."""
    _check(acc=acc, m=m, l=l, block_out=block_out, block_lse=block_lse)
    if acc.shape != block_out.shape or m.shape != block_lse.shape or l.shape != m.shape:
        raise ValueError(
            f"merge needs matching partials: acc {tuple(acc.shape)} vs block_out {tuple(block_out.shape)}, "
            f"m {tuple(m.shape)}, l {tuple(l.shape)} vs block_lse {tuple(block_lse.shape)}")
    new_m = torch.maximum(m, block_lse)
    safe = new_m.masked_fill(torch.isneginf(new_m), 0.0)  # all-empty rows: weights exp(-inf) = 0
    keep = torch.exp(m - safe)
    add = torch.exp(block_lse - safe)
    return acc * _rows(keep) + block_out * _rows(add), new_m, l * keep + add


def start_state(batch: int, seq: int, heads: int, head_dim: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The running state over no keys (the identity of `merge_into`), in `dtype` (float32, or
    float64 for a float64 ring)."""
    acc = torch.zeros(batch, seq, heads, head_dim, dtype=dtype, device=device)
    m = torch.full((batch, heads, seq), float("-inf"), dtype=dtype, device=device)
    return acc, m, torch.zeros_like(m)


def finish(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
           sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a running state; empty rows give out 0 and lse -inf.

    `sink` (batch, heads, seq) float32: a logit with no value that joins each row's softmax
    denominator here, once (-inf: none, as on padding rows). A row with no visible key but a
    sink has out 0 and lse = the sink."""
    if sink is not None:
        _check(acc=acc, sink=sink)
        new_m = torch.maximum(m, sink)
        safe = new_m.masked_fill(torch.isneginf(new_m), 0.0)
        keep = torch.exp(m - safe)
        acc, m, l = acc * _rows(keep), new_m, l * keep + torch.exp(sink - safe)
    empty = l == 0
    out = acc / _rows(l.masked_fill(empty, 1.0))
    lse = (m + torch.log(l.masked_fill(empty, 1.0))).masked_fill(empty, float("-inf"))
    return out, lse


def state_of(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The running state of a finished partial (out, lse)."""
    _check(out=out, lse=lse)
    return out, lse, (~torch.isneginf(lse)).to(lse.dtype)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials (out, lse) and (block_out, block_lse) into the partial over both."""
    return finish(*merge_into(*state_of(out, lse), block_out, block_lse))
