"""The budget policy: is a computed tensor as close to the truth as the peer allows?

Per tensor (out, lse, dq, dk, dv): error <= k x peer error + slack (flash-attention's rule),
where error and peer error are max abs errors against float64, k comes from `Budget` (2 for
the forward, 3 for the backward) and slack is the rounding floor of the output dtype.
Non-finite values never pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .metrics import ErrorStats, abs_error, error_stats, rounding_floor
from .spec import Budget

TENSORS = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class TensorVerdict:
    tensor: str
    passed: bool
    stats: ErrorStats
    peer: ErrorStats
    k: float
    slack: float
    over_budget: int
    where: str = ""

    @property
    def error(self) -> float:
        return self.stats.max_abs

    @property
    def peer_error(self) -> float:
        return self.peer.max_abs

    @property
    def budget(self) -> float:
        return self.k * self.peer.max_abs + self.slack

    def describe(self) -> str:
        s = self.stats
        loc = f" ({self.where})" if self.where else ""
        head = "ok" if self.passed else "FAILED"
        text = (f"{self.tensor} {head}: max abs error {s.max_abs:.3e} at index {list(s.worst_index)}{loc}; "
                f"budget {self.budget:.3e} = {self.k:g} x peer error {self.peer_error:.3e} + slack {self.slack:.3e}")
        if not self.passed:
            pct = 100.0 * self.over_budget / max(s.numel, 1)
            text += f"; {self.over_budget} of {s.numel} elements ({pct:.2f}%) over budget"
            if s.nonfinite:
                text += f"; {s.nonfinite} NaN/Inf where the truth is finite"
        return text


def judge(tensor: str, got: torch.Tensor, truth: torch.Tensor, peer: torch.Tensor, *,
          k: float, dtype: torch.dtype, locate: Callable[[tuple[int, ...]], str] | None = None) -> TensorVerdict:
    """Judge `got` against `truth` with the budget set by `peer` (both compared to `truth`).

    `dtype` is the dtype `got` is delivered in (its rounding floor is the slack); `locate`
    turns an index into words (rank, local row) for the message.
    """
    stats = error_stats(got, truth)
    # where the peer itself is NaN/Inf (fp16 overflow) it sets no budget: leave those out
    peer_diff, peer_bad = abs_error(peer, truth)
    peer_stats = error_stats(peer.masked_fill(peer_bad, 0.0), truth.masked_fill(peer_bad, 0.0))
    slack = rounding_floor(truth, dtype)
    diff, _ = abs_error(got, truth)
    budget = k * peer_stats.max_abs + slack
    over = int((diff > budget).sum())
    passed = over == 0 and stats.nonfinite == 0
    where = locate(stats.worst_index) if (locate is not None and stats.worst_index) else ""
    return TensorVerdict(tensor, passed, stats, peer_stats, k, slack, over, where)


@dataclass
class Verdict:
    """The verdicts of one case, with the words that name the case."""

    case: str
    tensors: list[TensorVerdict] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # short columns for tables

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    @property
    def failures(self) -> list[TensorVerdict]:
        return [t for t in self.tensors if not t.passed]

    def __getitem__(self, tensor: str) -> TensorVerdict:
        for t in self.tensors:
            if t.tensor == tensor:
                return t
        raise KeyError(f"no verdict for tensor {tensor!r}; have {[t.tensor for t in self.tensors]}")

    def message(self) -> str:
        lines = [f"{self.case}: {'passed' if self.passed else 'FAILED'}"]
        lines += ["  " + t.describe() for t in (self.failures or self.tensors)]
        return "\n".join(lines)

