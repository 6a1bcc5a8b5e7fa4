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
          k: float, dtype: torch.dtype, locate: Callable[[tuple[int, ...]], str] | None = None,
          floor: float = 0.0) -> TensorVerdict:
    """Judge `got` against `truth` with the budget set by `peer` (both compared to `truth`).

    `dtype` is the dtype `got` is delivered in (its rounding floor is the slack); `floor` is
    an extra slack for float32 rounding the peer does not share (see `backward_floors`);
    `locate` turns an index into words (rank, local row) for the message.
    """
    stats = error_stats(got, truth)
    # where the peer itself is NaN/Inf (fp16 overflow) it sets no budget: leave those out
    peer_diff, peer_bad = abs_error(peer, truth)
    peer_stats = error_stats(peer.masked_fill(peer_bad, 0.0), truth.masked_fill(peer_bad, 0.0))
    slack = rounding_floor(truth, dtype) + floor
    diff, _ = abs_error(got, truth)
    budget = k * peer_stats.max_abs + slack
    over = int((diff > budget).sum())
    passed = over == 0 and stats.nonfinite == 0
    where = locate(stats.worst_index) if (locate is not None and stats.worst_index) else ""
    return TensorVerdict(tensor, passed, stats, peer_stats, k, slack, over, where)


def backward_floors(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, *,
                    scale: float, causal: bool, rows: torch.Tensor | None = None) -> dict[str, float]:
    """float32 rounding floors of a flash-style backward that the naive peer does not share.

    Every flash-style backward (ours, flash-attention's, PyTorch's) forms dS = P (dP - D) with
    D = rowsum(dO * O) computed apart from dP = dO V^T. Both are float32 sums of terms of size
    T_i = sum_d |dO_id O_id| (and |dO_i||v_j|), so dP - D carries ~2 eps T_i of rounding even
    where the exact difference is 0 - a causal row with one key, or a near-tied row, where the
    naive peer (whose softmax backward uses the same dP for both) is exact. Propagated:

        dq floor = 2 eps scale max_i T_i max|k|
        dk floor = 2 eps scale max_i T_i max|q| max_j sum_i P_ij        (dv has no D)

    Negligible next to the peer's error for bf16/fp16; for float32 inputs it is what separates
    a correct flash-style backward from the peer. q, k, dout, out are whole tensors (out the
    float64 truth); with `rows`, dout and out are for those query rows only.
    """
    eps = torch.finfo(torch.float32).eps
    qr = q if rows is None else q[:, rows]
    t = (dout.double().abs() * out.double().abs()).sum(-1).max()
    h = q.shape[2]
    kh = k.double().transpose(1, 2).repeat_interleave(h // k.shape[2], dim=1)
    s = torch.matmul(qr.double().transpose(1, 2), kh.transpose(-1, -2)) * scale
    if causal:
        n, sk = s.shape[-2:]
        pos = torch.arange(n) if rows is None else rows
        s = s.masked_fill(torch.arange(sk)[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    colsum = float(p.sum(-2).max())
    base = 2 * eps * scale * float(t)
    return {"dq": base * float(k.abs().max()), "dk": base * float(q.abs().max()) * colsum}


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

