"""The public entry points of the ring: `simulate_ring` (whole tensors, P virtual ranks in one
process) and `ring_attention` (this rank's shard, over a `torch.distributed` group)."""

from __future__ import annotations

import torch

from ..spec import (
    DEFAULT_TIMEOUT,
    DOC_LAYOUTS,
    RING_DTYPES,
    RingSpec,
    check_causal,
    check_cu_seqlens,
    check_layout,
    check_qkv,
    check_sinks,
    check_softcap,
    check_softmax_scale,
    check_window,
    require_distributed,
)
from .backends import get_backend
from .comm import RingComm
from .drivers import DistributedDriver, SimulatedDriver
from .function import RingFunction, run_ring
from .layouts import positions as shard_positions
from .layouts import shard, unshard
from .loops import REAL_PARTS, RingConfig, RingParts, StepObserver


def make_config(*, world_size: int, layout: str, causal: bool, softmax_scale: float | None,
                head_dim: int, backend: str, accumulate: str = "float32",
                parts: RingParts = REAL_PARTS, seq_len: int | None = None, cu_seqlens=None,
                window=None, softcap=None, sinks_grad: str = "partial") -> RingConfig:
    """A validated `RingConfig`; an unknown or unavailable backend fails here, before any work.
    `seq_len` (the whole sequence's) is needed to check `cu_seqlens`."""
    check_layout(layout)
    check_causal(causal)
    get_backend(backend)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len)
    if layout in DOC_LAYOUTS and cu is None:
        raise ValueError(f"layout={layout!r} balances each document of a packed sequence: pass its cu_seqlens "
                         f"(global document boundaries), or use layout='zigzag'")
    return RingConfig(world_size=world_size, layout=layout, causal=causal,
                      scale=check_softmax_scale(softmax_scale, head_dim), backend=backend,
                      accumulate=accumulate, parts=parts, cu_seqlens=cu, window=check_window(window),
                      softcap=check_softcap(softcap), sinks_grad=sinks_grad)


def simulate_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int,
                  causal: bool = False, softmax_scale: float | None = None,
                  layout: str = "contiguous", backend: str = "torch", return_lse: bool = False,
                  accumulate: str = "float32", observer: StepObserver | None = None,
                  parts: RingParts = REAL_PARTS, cu_seqlens=None, window=None, softcap=None, sinks=None,
                  sinks_grad: str = "partial"):
    """Ring attention on whole tensors through P virtual ranks in one process.

    q is (batch, seq, heads, head_dim), k (batch, seq, kv_heads, head_dim) and v (batch, seq,
    kv_heads, v_head_dim). Shards the sequence with `layout`, runs every rank's loop, and
    returns the whole output (batch, seq, heads, v_head_dim) (and lse, (batch, heads, seq)
    float32, with `return_lse`); differentiable in q, k, v and sinks. float64 inputs run in
    float64 throughout (lse float64 too) on the torch backends.

    Variants (optional, combinable; see README "Attention variants"): `cu_seqlens` global
    document boundaries of the packed sequence (past the last one: padding), `window=(left,
    right)` (flash-attention's convention, -1 unbounded), `softcap` (scores softcap *
    tanh(s / softcap)), `sinks` (heads,) logits joining every non-padding row's softmax.
    `accumulate` and `observer` are for drift studies (see `RingConfig`, `StepObserver`);
    `parts` is the seam for planted bugs (see `RingParts`). `sinks_grad` is `ring_attention`'s;
    on whole tensors both conventions give the whole sequence's sinks gradient (under
    "partial" the P ranks' shares are summed in rank order, as a framework would).
    """
    check_qkv(q, k, v, what="sequence", dtypes=RING_DTYPES)
    ring = RingSpec(world_size, layout)
    ring.check_seq_len(q.shape[1])
    config = make_config(world_size=world_size, layout=layout, causal=causal,
                         softmax_scale=softmax_scale, head_dim=q.shape[-1], backend=backend,
                         accumulate=accumulate, parts=parts, seq_len=q.shape[1], cu_seqlens=cu_seqlens,
                         window=window, softcap=softcap, sinks_grad=sinks_grad)
    sinks = check_sinks(sinks, q.shape[2], q.device)
    cu = config.cu_seqlens
    pieces = [shard(t, layout=layout, rank=r, world_size=world_size, dim=1, cu_seqlens=cu)
              for t in (q, k, v) for r in range(world_size)]
    results = RingFunction.apply(config, SimulatedDriver(world_size), observer, sinks, *pieces)
    out = unshard(results[:world_size], layout=layout, dim=1, cu_seqlens=cu)
    if not return_lse:
        return out
    return out, unshard(results[world_size:], layout=layout, dim=2, cu_seqlens=cu)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: float | None = None, group=None, layout: str = "contiguous",
                   backend: str = "torch", return_lse: bool = False, timeout: float = DEFAULT_TIMEOUT,
                   cu_seqlens=None, window=None, softcap=None, sinks=None, sinks_grad: str = "partial"):
    """Ring attention over the ranks of `group` (the default world group when None).

    This rank's shard in, this rank's output out: q is (batch, local_seq, heads, head_dim), k
    and v (batch, local_seq, kv_heads, head_dim), holding the tokens that `layout` gives this
    rank's place in the group (see `ringcheck.shard`). Returns this rank's output (and its
    lse, (batch, heads, local_seq) float32, with `return_lse`); differentiable in q, k and v.
    Every rank of the group must call it (and its backward) with the same arguments besides
    the tensors. `timeout` (seconds) bounds every wait on a peer.

    The variants are those of `simulate_ring`; `cu_seqlens` holds the *global* document
    boundaries (the same on every rank). `sinks` is the same (heads,) tensor on every rank;
    its gradient follows `sinks_grad`: "partial" (the default) gives each rank its own rows'
    share, for a framework that reduces replicated gradients over the data x context-parallel
    group itself (Megatron-LM, torchtitan); "reduced" gives every rank the whole sequence's
    (the sum over the group's rows, added in rank order), for one that does not.
    """
    require_distributed("calling ring_attention")
    check_qkv(q, k, v, what="shard", dtypes=RING_DTYPES)
    comm = RingComm(group, timeout=timeout)
    config = make_config(world_size=comm.world_size, layout=layout, causal=causal,
                         softmax_scale=softmax_scale, head_dim=q.shape[-1], backend=backend,
                         seq_len=q.shape[1] * comm.world_size, cu_seqlens=cu_seqlens, window=window,
                         softcap=softcap, sinks_grad=sinks_grad)
    sinks = check_sinks(sinks, q.shape[2], q.device)
    if layout in ("zigzag", *DOC_LAYOUTS) and q.shape[1] % 2:
        raise ValueError(f"a {layout} shard holds two equal chunks, but this shard has {q.shape[1]} tokens; "
                         f"use a sequence length divisible by 2 x world_size={2 * comm.world_size}")
    if config.cu_seqlens is not None:  # the layout's document checks, before any exchange
        RingSpec(comm.world_size, layout).check_seq_len(q.shape[1] * comm.world_size)
        shard_positions(layout=layout, rank=comm.rank, world_size=comm.world_size,
                        seq_len=q.shape[1] * comm.world_size, cu_seqlens=config.cu_seqlens)
    outs, lses = run_ring(config, DistributedDriver(comm), [q], [k], [v], sinks=sinks)
    return (outs[0], lses[0]) if return_lse else outs[0]
