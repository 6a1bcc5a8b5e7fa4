"""One rank's ring attention, forward and backward, as generators.

Every rank keeps its queries; the K/V shards travel around the ring (rank r sends to r+1 and
receives from r-1), so at step s rank r holds the K/V of rank (r - s) mod P. Each step's
blocks (see `layouts.block_plan`) are merged into a float32 running (out, lse) and the output
is cast to the input dtype once, at the end (float64 inputs: float64 throughout,
`ringcheck.ring.merge.working_dtype`). In the backward, dK/dV accumulators (float32)
travel with their K/V and take one more hop at the end to return home, where their origin tag
is checked; each hop of the accumulators overlaps the next step's block computation (they
are waited for only when that step's contributions are added).

The loops are generators: they yield `Post` (start sending a payload to the next rank and
receiving from the previous one, on a named channel) and `Wait` (the payload that arrived on
a channel). A driver (`drivers.py`) answers them, so the simulated and the distributed ring
execute the same per-rank code, operation for operation, and must agree bit for bit.

The pieces a loop is made of (the block plan, the merge, the loops themselves) are named in
`RingParts`, carried by `RingConfig.parts`: that is the one seam through which tests plant a
bug in an otherwise correct ring (see `ringcheck.catalogue.planted`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..spec import RingSpec
from .backends import BlockBackend, row_delta
from .layouts import block_plan, positions
from .merge import finish, merge_into, start_state, working_dtype

ACCUMULATIONS = ("float32", "input")
SINKS_GRAD = ("partial", "reduced")  # who sums the sinks' gradient: the framework, or the ring


def check_sinks_grad(sinks_grad: object) -> str:
    if sinks_grad not in SINKS_GRAD:
        raise ValueError(f"sinks_grad must be one of {list(SINKS_GRAD)}, got {sinks_grad!r} (partial: each rank's "
                         f"own rows' share, the framework reduces it; reduced: the ring all-reduces it)")
    return sinks_grad


@dataclass(frozen=True)
class Post:
    """Start sending `payload` (a tuple of tensors) to the next rank on `channel`."""

    channel: str
    payload: tuple


@dataclass(frozen=True)
class Wait:
    """Wait for the payload the previous rank posted on `channel`."""

    channel: str


RankLoop = Generator[Any, Any, Any]


# observer(rank, step, src_rank, out, lse): called after every ring step of the forward with
# the running partial (float32, this rank's rows), for per-step drift studies; None in normal use
StepObserver = Callable[[int, int, int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class RingParts:
    """The replaceable pieces of the ring; the defaults are the real ones.

    ``plan(**block_plan kwargs) -> tuple[Block]``, ``merge(acc, m, l, block_out, block_lse)
    -> (acc, m, l)``, the per-rank loops (``forward_loop``/``backward_loop`` with this
    module's signatures) and a block backend instance. A test that swaps one for a wrong one plants a bug through this
    seam instead of patching module attributes.
    """

    plan: Callable[..., tuple] = block_plan
    merge: Callable[..., tuple] = merge_into
    forward_loop: Callable[..., Any] | None = None   # None: `forward_loop` below
    backward_loop: Callable[..., Any] | None = None  # None: `backward_loop` below
    backend: BlockBackend | None = None              # None: the backend `RingConfig.backend` names

    def replace(self, **changes) -> RingParts:
        return replace(self, **changes)

    @property
    def forward(self) -> Callable[..., Any]:
        return self.forward_loop or forward_loop

    @property
    def backward(self) -> Callable[..., Any]:
        return self.backward_loop or backward_loop


REAL_PARTS = RingParts()


@dataclass(frozen=True)
class RingConfig:
    """Everything the per-rank loop needs besides the tensors."""

    world_size: int
    layout: str = "contiguous"
    causal: bool = False
    scale: float = 1.0
    backend: str = "torch"
    # "float32": the running output stays float32 (the default, exact up to one final cast);
    # "input": it is rounded to the input dtype after every merge, as rings that keep their
    # partial output in bf16 do. For drift studies only.
    accumulate: str = "float32"
    parts: RingParts = field(default=REAL_PARTS, compare=False)
    # attention variants (validated by the entry points): global document boundaries of the
    # packed sequence, a sliding window (left, right) (-1: unbounded), a logit softcap
    cu_seqlens: tuple[int, ...] | None = None
    window: tuple[int, int] = (-1, -1)
    softcap: float | None = None
    # the sinks gradient each rank returns: "partial", its own rows' share (the framework sums
    # it, as Megatron-LM and torchtitan do); "reduced", the whole ring's (summed on the ring)
    sinks_grad: str = "partial"

    def __post_init__(self) -> None:
        RingSpec(self.world_size, self.layout)
        check_sinks_grad(self.sinks_grad)
        if self.accumulate not in ACCUMULATIONS:
            raise ValueError(f"accumulate={self.accumulate!r} is unknown; choose one of {list(ACCUMULATIONS)}")


@dataclass(frozen=True)
class RankShard:
    """One rank's place in the ring (after attention-gym's RingShard)."""

    rank: int
    world_size: int

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def source(self, step: int) -> int:
        """The rank whose K/V this rank holds at `step`."""
        return (self.rank - step) % self.world_size


def _plan(config: RingConfig, shard: RankShard, src: int, local_len: int):
    return config.parts.plan(layout=config.layout, q_rank=shard.rank, kv_rank=src, world_size=config.world_size,
                             local_len=local_len, causal=config.causal, cu_seqlens=config.cu_seqlens,
                             window=config.window)


def _kernel_args(config: RingConfig, block) -> dict:
    """The backend keywords of one block; `lower` and `softcap` only where they apply, so a
    backend written for plain attention still takes plain blocks."""
    args = {"scale": config.scale, "mask": block.mask, "diagonal": block.diagonal}
    if block.mask == "band":
        args["lower"] = block.lower
    if config.softcap is not None:
        args["softcap"] = config.softcap
    return args


def sink_rows(config: RingConfig, shard: RankShard, sinks: torch.Tensor | None, batch: int,
              local_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Each of this rank's rows' sink logit (batch, heads, local_len) in the working `dtype`
    (float32; float64 for a float64 ring): sinks[h], and -inf on padding rows (past the last
    document), which get no sink. None without sinks."""
    if sinks is None:
        return None
    rows = sinks.detach().to(dtype).view(1, -1, 1).expand(batch, -1, local_len)
    if config.cu_seqlens is None:
        return rows.contiguous()
    pos = positions(layout=config.layout, rank=shard.rank, world_size=config.world_size,
                    seq_len=local_len * config.world_size, cu_seqlens=config.cu_seqlens).to(sinks.device)
    return rows.masked_fill((pos >= config.cu_seqlens[-1]).view(1, 1, -1), float("-inf"))


def forward_loop(config: RingConfig, shard: RankShard, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, backend: BlockBackend, observer: StepObserver | None = None,
                 sinks: torch.Tensor | None = None) -> RankLoop:
    """One rank's forward; returns (out in q's dtype, lse float32, out float32). `sinks`
    (heads,) join every row's softmax once, in the final normalisation (`merge.finish`)."""
    b, n, h, _ = q.shape
    work = working_dtype(q.dtype)
    acc, m, l = start_state(b, n, h, v.shape[-1], device=q.device, dtype=work)
    sink = sink_rows(config, shard, sinks, b, n, work)
    kv = (k, v)
    for step in range(config.world_size):
        last = step == config.world_size - 1
        if not last:
            yield Post("kv", kv)  # in flight while this step computes
        for block in _plan(config, shard, shard.source(step), n):
            block_out, block_lse = backend.forward(
                q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv], **_kernel_args(config, block))
            rows = block.q
            a, mm, ll = config.parts.merge(acc[:, rows], m[:, :, rows], l[:, :, rows], block_out, block_lse)
            if config.accumulate == "input":  # the partial output takes a trip through q's dtype
                out_rows, _ = finish(a, mm, ll)
                a = out_rows.to(q.dtype).to(work) * ll.transpose(1, 2).unsqueeze(-1)
            acc[:, rows], m[:, :, rows], l[:, :, rows] = a, mm, ll
        if observer is not None:
            observer(shard.rank, step, shard.source(step), *finish(acc, m, l, sink))
        if not last:
            kv = yield Wait("kv")
    out, lse = finish(acc, m, l, sink)
    return out.to(q.dtype), lse, out


def backward_loop(config: RingConfig, shard: RankShard, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  dlse: torch.Tensor | None, backend: BlockBackend,
                  sinks: torch.Tensor | None = None) -> RankLoop:
    """One rank's backward; returns (dq, dk, dv) in the input dtype, and dsinks (heads,)
    float32: this rank's rows' share under ``sinks_grad="partial"``, the whole ring's under
    ``"reduced"`` (None without sinks).

    `out` and `lse` are this rank's merged float32 results (lse includes the sink). A
    gradient flowing into lse enters as dS = P (dP - delta + dlse), so it folds into delta;
    the sink is a column with no value, so its dS is -exp(sink - lse) delta, summed over this
    rank's rows, and under "reduced" over the rows of every rank (their partials travel the ring
    once and are added in rank order, the same sum on every rank and in the simulated ring).
    """
    n = q.shape[1]
    delta = row_delta(out, dout)
    if dlse is not None:
        delta = delta - dlse
    work = working_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    origin = torch.tensor([shard.rank], dtype=torch.int64, device=q.device)
    kv = (k, v)
    grads = (torch.zeros(k.shape, dtype=work, device=k.device),
             torch.zeros(v.shape, dtype=work, device=v.device), origin)
    for step in range(config.world_size):
        last = step == config.world_size - 1
        src = shard.source(step)
        if not last:
            yield Post("kv", kv)
        contributions = []
        for block in _plan(config, shard, src, n):
            dq_b, dk_b, dv_b = backend.backward(
                q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv], dout[:, block.q],
                lse[:, :, block.q].contiguous(), delta[:, :, block.q].contiguous(), **_kernel_args(config, block))
            dq[:, block.q] += dq_b
            contributions.append((block.kv, dk_b, dv_b))
            del dq_b, dk_b, dv_b  # no block's outputs outlive their use into the next block's kernel call
        if step > 0:
            # the accumulators of `src` were posted by the previous rank a step ago: their
            # transfer overlapped this step's compute, and only now are they needed
            grads = yield Wait("grad")
        if int(grads[2]) != src:
            raise RuntimeError(
                f"rank {shard.rank}, ring step {step}: expected the dK/dV accumulators of rank "
                f"{src} with its K/V, received those of rank {int(grads[2])}")
        dk_acc, dv_acc, tag = grads
        for rows, dk_b, dv_b in contributions:
            dk_acc[:, rows] += dk_b
            dv_acc[:, rows] += dv_b
        contributions = dk_b = dv_b = None  # nor into the next step's
        # the accumulators move on with their K/V; after the last step they go home
        yield Post("grad", (dk_acc, dv_acc, tag))
        if not last:
            kv = yield Wait("kv")
    grads = yield Wait("grad")
    dk_acc, dv_acc, tag = grads
    if int(tag) != shard.rank:
        raise RuntimeError(
            f"gradients for rank {shard.rank} did not return home: after {config.world_size} "
            f"steps it holds the dK/dV of rank {int(tag)}")
    dsinks = None
    sink = sink_rows(config, shard, sinks, q.shape[0], n, work)
    if sink is not None:
        weight = torch.exp(sink - lse.masked_fill(torch.isneginf(lse), 0.0)).masked_fill(torch.isneginf(sink), 0.0)
        dsinks = -(weight * delta).sum((0, 2))
        if config.sinks_grad == "reduced":
            dsinks = yield from _sum_over_ring(config, shard, dsinks)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), dsinks


def _sum_over_ring(config: RingConfig, shard: RankShard, mine: torch.Tensor) -> RankLoop:
    """The sum over every rank of a small per-rank tensor, added in rank order: each partial
    travels P - 1 hops on the "sum" channel with its origin."""
    partials = {shard.rank: mine}
    payload = (mine, torch.tensor([shard.rank], dtype=torch.int64, device=mine.device))
    for _ in range(config.world_size - 1):
        yield Post("sum", payload)
        payload = yield Wait("sum")
        partials[int(payload[1])] = payload[0]
    if sorted(partials) != list(range(config.world_size)):
        raise RuntimeError(f"rank {shard.rank}: the ring sum received the partials of ranks {sorted(partials)}, "
                           f"expected every rank 0..{config.world_size - 1}")
    return sum_in_rank_order([partials[r] for r in range(config.world_size)])


def sum_in_rank_order(parts) -> torch.Tensor:
    """The sum of every rank's share of a small tensor, added in ring-rank order: the one order
    of the ring's own sum, the simulated ring's and a harness that sums "partial" shares."""
    total = torch.zeros_like(parts[0])
    for part in parts:
        total = total + part
    return total
