"""Ring attention, forward and backward, as one `torch.autograd.Function`.

Every rank keeps its queries; the K/V shards travel around the ring (rank r sends to r+1 and
receives from r-1), so at step s rank r holds the K/V of rank (r - s) mod P. Each step's
blocks (see `layouts.block_plan`) are merged into a float32 running (out, lse) and the output
is cast to the input dtype once, at the end. In the backward, dK/dV accumulators (float32)
travel with their K/V and take one more hop at the end to return home, where their origin tag
is checked; each hop of the accumulators overlaps the next step's block computation (they
are waited for only when that step's contributions are added).

The per-rank loops are generators: they yield `Post` (start sending a payload to the next
rank and receiving from the previous one, on a named channel) and `Wait` (the payload that
arrived on a channel). A driver answers them:

- `SimulatedDriver` runs all P virtual ranks in one process, in lockstep, handing each the
  payload its predecessor posted;
- the distributed driver (`ringcheck.comm`) runs one rank over `torch.distributed`.

So the simulated and the distributed ring execute the same per-rank code, operation for
operation, and must agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from .backends import BlockBackend, get_backend, row_delta
from .layouts import block_plan
from .merge import finish, merge_into, start_state
from .spec import DTYPES, LAYOUTS, RingSpec, default_scale

ACCUMULATIONS = ("float32", "input")


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

    def __post_init__(self) -> None:
        RingSpec(self.world_size, self.layout)
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
    return block_plan(layout=config.layout, q_rank=shard.rank, kv_rank=src,
                      world_size=config.world_size, local_len=local_len, causal=config.causal)


# observer(rank, step, src_rank, out, lse): called after every ring step of the forward with
# the running partial (float32, this rank's rows), for per-step drift studies; None in normal use
StepObserver = Callable[[int, int, int, torch.Tensor, torch.Tensor], None]


def forward_loop(config: RingConfig, shard: RankShard, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, backend: BlockBackend, observer: StepObserver | None = None) -> RankLoop:
    """One rank's forward; returns (out in q's dtype, lse float32, out float32)."""
    b, n, h, d = q.shape
    acc, m, l = start_state(b, n, h, d, device=q.device)
    kv = (k, v)
    for step in range(config.world_size):
        last = step == config.world_size - 1
        if not last:
            yield Post("kv", kv)  # in flight while this step computes
        for block in _plan(config, shard, shard.source(step), n):
            block_out, block_lse = backend.forward(
                q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv],
                scale=config.scale, mask=block.mask, diagonal=block.diagonal)
            rows = block.q
            a, mm, ll = merge_into(acc[:, rows], m[:, :, rows], l[:, :, rows], block_out, block_lse)
            if config.accumulate == "input":  # the partial output takes a trip through q's dtype
                out_rows, _ = finish(a, mm, ll)
                a = out_rows.to(q.dtype).float() * ll.transpose(1, 2).unsqueeze(-1)
            acc[:, rows], m[:, :, rows], l[:, :, rows] = a, mm, ll
        if observer is not None:
            observer(shard.rank, step, shard.source(step), *finish(acc, m, l))
        if not last:
            kv = yield Wait("kv")
    out, lse = finish(acc, m, l)
    return out.to(q.dtype), lse, out


def backward_loop(config: RingConfig, shard: RankShard, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  dlse: torch.Tensor | None, backend: BlockBackend) -> RankLoop:
    """One rank's backward; returns (dq, dk, dv) in the input dtype.

    `out` and `lse` are this rank's merged float32 results. A gradient flowing into lse
    enters as dS = P (dP - delta + dlse), so it folds into delta.
    """
    n = q.shape[1]
    delta = row_delta(out, dout)
    if dlse is not None:
        delta = delta - dlse
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    origin = torch.tensor([shard.rank], dtype=torch.int64, device=q.device)
    kv = (k, v)
    grads = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
             torch.zeros(v.shape, dtype=torch.float32, device=v.device), origin)
    for step in range(config.world_size):
        last = step == config.world_size - 1
        src = shard.source(step)
        if not last:
            yield Post("kv", kv)
        contributions = []
        for block in _plan(config, shard, src, n):
            dq_b, dk_b, dv_b = backend.backward(
                q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv], dout[:, block.q],
                lse[:, :, block.q].contiguous(), delta[:, :, block.q].contiguous(),
                scale=config.scale, mask=block.mask, diagonal=block.diagonal)
            dq[:, block.q] += dq_b
            contributions.append((block.kv, dk_b, dv_b))
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
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class SimulatedDriver:
    """Runs the per-rank loops of all P virtual ranks in one process, in lockstep."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.local_ranks = list(range(world_size))

    def run(self, loops: list[RankLoop]) -> list[Any]:
        if len(loops) != self.world_size:
            raise ValueError(f"the simulated ring has {self.world_size} ranks, got {len(loops)} loops")
        results: list[Any] = [None] * self.world_size
        done = [False] * self.world_size
        messages: list[Any] = [None] * self.world_size
        replies: list[Any] = [None] * self.world_size
        posted: dict[str, list] = {}
        while True:
            for r, loop in enumerate(loops):
                if done[r]:
                    continue
                try:
                    messages[r] = loop.send(replies[r])
                except StopIteration as stop:
                    done[r], results[r], messages[r] = True, stop.value, None
            if all(done):
                return results
            if any(done):
                raise RuntimeError(
                    f"ranks {[r for r in range(self.world_size) if done[r]]} finished while ranks "
                    f"{[r for r in range(self.world_size) if not done[r]]} still expect ring steps")
            kinds = {(type(m).__name__, m.channel) for m in messages}
            if len(kinds) != 1:
                raise RuntimeError("ranks disagree on the next ring operation: "
                                   + ", ".join(f"rank {r}: {m}" for r, m in enumerate(messages)))
            first = messages[0]
            if isinstance(first, Post):
                if first.channel in posted:
                    raise RuntimeError(f"two sends in flight on channel {first.channel!r}: wait before posting again")
                posted[first.channel] = [m.payload for m in messages]
                replies = [None] * self.world_size
            elif isinstance(first, Wait):
                if first.channel not in posted:
                    raise RuntimeError(f"wait on channel {first.channel!r} before anything was sent on it")
                sent = posted.pop(first.channel)
                replies = [sent[(r - 1) % self.world_size] for r in range(self.world_size)]
            else:
                raise TypeError(f"a ring loop yielded {first!r}; expected Post or Wait")


class _RingFunction(torch.autograd.Function):
    """Ring attention over the ranks a driver runs locally (all P simulated, or one).

    Inputs are the local ranks' q shards, then k shards, then v shards; outputs are their
    outputs then their lse."""

    @staticmethod
    def forward(ctx, config: RingConfig, driver, observer, *tensors):
        backend = get_backend(config.backend)
        m = len(driver.local_ranks)
        qs, ks, vs = tensors[:m], tensors[m:2 * m], tensors[2 * m:]
        results = driver.run([
            forward_loop(config, RankShard(r, config.world_size), q, k, v, backend, observer)
            for r, q, k, v in zip(driver.local_ranks, qs, ks, vs)])
        outs = [res[0] for res in results]
        lses = [res[1] for res in results]
        ctx.config, ctx.driver, ctx.m = config, driver, m
        ctx.save_for_backward(*qs, *ks, *vs, *[res[2] for res in results], *lses)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        config, driver, m = ctx.config, ctx.driver, ctx.m
        backend = get_backend(config.backend)
        saved = ctx.saved_tensors
        qs, ks, vs = saved[:m], saved[m:2 * m], saved[2 * m:3 * m]
        outs32, lses = saved[3 * m:4 * m], saved[4 * m:]
        douts, dlses = grads[:m], grads[m:]
        results = driver.run([
            backward_loop(config, RankShard(r, config.world_size), q, k, v, o, l,
                          torch.zeros_like(q) if do is None else do, dl, backend)
            for r, q, k, v, o, l, do, dl in zip(driver.local_ranks, qs, ks, vs, outs32, lses, douts, dlses)])
        dqs = [res[0] for res in results]
        dks = [res[1] for res in results]
        dvs = [res[2] for res in results]
        return (None, None, None, *dqs, *dks, *dvs)


def check_qkv(q: Any, k: Any, v: Any, *, what: str = "shard") -> None:
    """Raise TypeError/ValueError unless q, k, v form one valid attention input."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES.values():
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, {what} length and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads={q.shape[2]} (q) is not divisible by kv_heads={k.shape[2]} (k, v)")


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return default_scale(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return float(softmax_scale)


def make_config(*, world_size: int, layout: str, causal: bool, softmax_scale: float | None,
                head_dim: int, backend: str, accumulate: str = "float32") -> RingConfig:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {list(LAYOUTS)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    get_backend(backend)  # unknown or unavailable backends fail here, before any work
    return RingConfig(world_size=world_size, layout=layout, causal=causal,
                      scale=_scale(softmax_scale, head_dim), backend=backend, accumulate=accumulate)


def simulate_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int,
                  causal: bool = False, softmax_scale: float | None = None,
                  layout: str = "contiguous", backend: str = "torch", return_lse: bool = False,
                  accumulate: str = "float32", observer: StepObserver | None = None):
    """Ring attention on whole tensors through P virtual ranks in one process.

    q is (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim). Shards the
    sequence with `layout`, runs every rank's loop, and returns the whole output (and lse,
    (batch, heads, seq) float32, with `return_lse`); differentiable in q, k and v.
    `accumulate` and `observer` are for drift studies (see `RingConfig`, `StepObserver`).
    """
    from .layouts import shard, unshard

    check_qkv(q, k, v, what="sequence")
    ring = RingSpec(world_size, layout)
    ring.check_seq_len(q.shape[1])
    config = make_config(world_size=world_size, layout=layout, causal=causal,
                         softmax_scale=softmax_scale, head_dim=q.shape[-1], backend=backend,
                         accumulate=accumulate)
    parts = [shard(t, layout=layout, rank=r, world_size=world_size, dim=1)
             for t in (q, k, v) for r in range(world_size)]
    results = _RingFunction.apply(config, SimulatedDriver(world_size), observer, *parts)
    out = unshard(results[:world_size], layout=layout, dim=1)
    if not return_lse:
        return out
    return out, unshard(results[world_size:], layout=layout, dim=2)


def run_ring(config: RingConfig, driver, qs, ks, vs, observer: StepObserver | None = None):
    """Run `_RingFunction` for the local ranks of `driver`; returns (outs, lses) lists."""
    m = len(driver.local_ranks)
    results = _RingFunction.apply(config, driver, observer, *qs, *ks, *vs)
    return list(results[:m]), list(results[m:])
