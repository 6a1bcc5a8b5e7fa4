"""A plain, correct ring attention with the variants, written against the `--impl` contract:

    textbook_varlen(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag",
                    cu_seqlens=None, window=None, softcap=None, sinks=None) -> (out, lse)

q is this rank's shard (batch, local_seq, heads, head_dim), k (batch, local_seq, kv_heads,
head_dim), v (batch, local_seq, kv_heads, v_head_dim), in `layout` (zigzag by default; the
zigzag_docs layout needs `cu_seqlens`). Visibility is computed from each token's global
position: documents (`cu_seqlens`, global; tokens past the last boundary are padding), causal,
then the sliding `window` (left, right). `softcap` caps the scaled scores; `sinks` (heads,) join
each non-padding row's denominator once, after the ring, and their gradient is all-reduced so
that every rank holds the whole sequence's.

It stands for somebody else's code: it does not use ringcheck's ring (loops, merge, backends),
only `positions()` of the layout. `varlen_ring(..., bugs=)` is the same ring with named defects
switched on; `ringcheck.catalogue.variant_mutants` names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringcheck.catalogue.mutants import send_packed
from ringcheck.ring.layouts import positions

NEG_INF = float("-inf")

# the defects `varlen_ring` can switch on (ringcheck.catalogue.variant_mutants documents each)
BUGS = frozenset({
    "window_ignored", "window_off_by_one", "docs_rank_local", "odd_doc_drops_last", "padding_attended",
    "padding_rank_nan", "empty_block_lse_posinf", "merge_nan", "sinks_dropped", "sink_per_step",
    "sinks_no_grad", "dsinks_all_reduced", "softcap_before_scale", "softcap_no_tanh_grad", "sinks_gqa_order",
})


# ---------------------------------------------------------------- communication

def exchange(group, tensors):
    """Send `tensors` to the next rank of `group` and receive the same shapes from the previous
    one; returns (requests, received). A ring of one sends nothing and receives copies."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return [], [t.clone() for t in tensors]
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    return send_packed(group, tensors, nxt, prv)


def wait(requests):
    for r in requests:
        r.wait()


# ---------------------------------------------------------------- the problem

@dataclass(frozen=True)
class Problem:
    """Everything but the tensors: the ring, the mask, the score options and the defects."""

    causal: bool
    scale: float
    group: object
    layout: str
    cu_seqlens: tuple[int, ...] | None
    window: tuple[int, int]
    softcap: float | None
    kv_heads: int
    device: torch.device
    bugs: frozenset = frozenset()

    def positions(self, rank: int, world: int, n: int) -> torch.Tensor:
        """Global positions of the tokens `rank` holds, in local order."""
        cu = None if self.cu_seqlens is None else torch.tensor(self.cu_seqlens)
        return positions(layout=self.layout, rank=rank, world_size=world, seq_len=n * world, cu_seqlens=cu)

    def documents(self, pos: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each token at `pos`: its document index, and whether it is a real token (False:
        padding past the last document)."""
        if self.cu_seqlens is None:
            return torch.zeros_like(pos), torch.ones_like(pos, dtype=torch.bool)
        cu = list(self.cu_seqlens)
        if "padding_attended" in self.bugs and cu[-1] < seq_len:  # the padding tail as one more document
            cu.append(seq_len)
        bounds = torch.tensor(cu)
        doc = torch.searchsorted(bounds, pos, right=True)
        real = pos < cu[-1]
        if "odd_doc_drops_last" in self.bugs:  # each document's length rounded down to even
            start, end = bounds[(doc - 1).clamp(0, len(cu) - 1)], bounds[doc.clamp(0, len(cu) - 1)]
            real &= ~(((end - start) % 2 == 1) & (pos == end - 1))
        return doc, real

    def visible(self, qpos, kpos, qdoc, kdoc) -> torch.Tensor:
        """(queries, keys) bool: which keys each query sees. qdoc, kdoc: (document, real) pairs."""
        i, j = qpos[:, None], kpos[None, :]
        seen = (qdoc[0][:, None] == kdoc[0][None, :]) & qdoc[1][:, None] & kdoc[1][None, :]
        if self.causal:
            seen &= j <= i
        left, right = self.window
        if "window_ignored" in self.bugs:  # the window never reaches the mask: plain (causal) attention
            left, right = -1, -1
        if left >= 0:
            if "window_off_by_one" in self.bugs:  # `left` read as the window's size, self included
                seen &= j > i - left
            else:
                seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        return seen

    def scores(self, q, k, mask):
        """Masked (b, h, nq, nk) float32 scores and tanh of the capped ones (None without a cap)."""
        mask = mask.to(q.device)
        s = torch.einsum("bqhd,bkhd->bhqk", q, expand(k, q.shape[2]))
        t = None
        if self.softcap is None:
            s = s * self.scale
        elif "softcap_before_scale" in self.bugs:  # softcap * tanh(q.k / softcap) * scale
            t = torch.tanh(s / self.softcap)
            s = self.softcap * t * self.scale
        else:
            t = torch.tanh(s * self.scale / self.softcap)
            s = self.softcap * t
        return s.masked_fill(~mask, NEG_INF), t

    def sink_logits(self, sinks, real, batch, heads) -> torch.Tensor:
        """(b, h, n) sink logit of every row: sinks[h] on real rows, -inf on padding (and
        everywhere without sinks: a sink that adds nothing)."""
        if sinks is None or "sinks_dropped" in self.bugs:
            return torch.full((batch, heads, len(real)), NEG_INF, device=self.device)
        s = sinks.detach().float()
        if "sinks_gqa_order" in self.bugs:
            s = s[gqa_permutation(len(s), self.kv_heads)]
        col = s[None, :, None].expand(batch, len(s), len(real))
        return col.masked_fill(~real[None, None, :].to(col.device), NEG_INF)

    def tokens(self, world: int, n: int):
        """Every rank's global positions and its tokens' (document, real) pairs."""
        pos = [self.positions(r, world, n) for r in range(world)]
        # where documents are looked up: global positions, or (the bug) the rank's local indices
        doc_pos = [torch.arange(n)] * world if "docs_rank_local" in self.bugs else pos
        return pos, [self.documents(p, n * world) for p in doc_pos]


def expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads for the query heads: query head h uses K/V head h // (heads // kv_heads)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def gqa_permutation(heads: int, kv_heads: int) -> torch.Tensor:
    """The `(g h)` head order read as `(h g)`: head h gets the entry of head (h % kv) * group + h // kv."""
    h = torch.arange(heads)
    return (h % kv_heads) * (heads // kv_heads) + h // kv_heads


def safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf replaced by 0, to subtract from scores without -inf - -inf = NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def rows(x: torch.Tensor) -> torch.Tensor:
    """(b, h, n) -> (b, n, h, 1): a per-row factor for a (b, n, h, d) tensor."""
    return x.transpose(1, 2).unsqueeze(-1)


def merge(out, lse, block_out, block_lse, bugs):
    """The online softmax: two normalised partials and their lse -> one."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = new_lse if "merge_nan" in bugs else safe(new_lse)  # the guard for two empty partials
    return out * rows(torch.exp(lse - ref)) + block_out * rows(torch.exp(block_lse - ref)), new_lse


def add_sink(out, lse, sink, bugs):
    """One more column with logit `sink` and no value joins the denominator."""
    new_lse = torch.logaddexp(lse, sink)
    if "padding_rank_nan" in bugs:  # normalised as exp(lse) / exp(lse_total): 0/0 where no key is seen
        return out * rows(torch.exp(lse) / torch.exp(new_lse)), new_lse
    return out * rows(torch.exp(lse - safe(new_lse))), new_lse


# ---------------------------------------------------------------- the ring

class VarlenRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, pb: Problem):
        group = pb.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        b, n, h, _ = q.shape
        pos, docs = pb.tokens(world, n)
        sink = pb.sink_logits(sinks, docs[rank][1], b, h)
        out = torch.zeros(b, n, h, v.shape[-1], device=q.device)
        lse = torch.full((b, h, n), NEG_INF, device=q.device)
        kv = [k, v]
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                requests, incoming = exchange(group, kv)
            mask = pb.visible(pos[rank], pos[src], docs[rank], docs[src])
            s, _ = pb.scores(q, kv[0], mask)
            block_lse = torch.logsumexp(s, -1)  # -inf on rows that see no key of this block
            if "empty_block_lse_posinf" in pb.bugs:  # flash-attention's +inf for a row with no key
                block_lse = block_lse.masked_fill(torch.isneginf(block_lse), float("inf"))
            p = torch.exp(s - safe(block_lse).unsqueeze(-1))
            block_out = torch.einsum("bhqk,bkhd->bqhd", p, expand(kv[1], h))
            if "sink_per_step" in pb.bugs:  # the sink joins every block
                block_out, block_lse = add_sink(block_out, block_lse, sink, pb.bugs)
            out, lse = merge(out, lse, block_out, block_lse, pb.bugs)
            if step < world - 1:
                wait(requests)
                kv = incoming
        if "sink_per_step" not in pb.bugs:  # the sink joins once, at the end
            out, lse = add_sink(out, lse, sink, pb.bugs)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.pb, ctx.dtype = pb, dtype
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return out.to(dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        pb = ctx.pb
        group = pb.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        b, n, h, d = q.shape
        kvh, group_size = k.shape[2], h // k.shape[2]
        pos, docs = pb.tokens(world, n)
        dout = dout.float()
        delta = (dout * out).sum(-1).transpose(1, 2)  # D = rowsum(dO * O), (b, h, n)
        if dlse is not None:
            delta = delta - dlse
        dq = torch.zeros_like(q)
        kv = [k, v]
        dkv = [torch.zeros_like(k), torch.zeros_like(v)]  # the accumulators of the visiting K/V
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                kv_requests, kv_incoming = exchange(group, kv)
            mask = pb.visible(pos[rank], pos[src], docs[rank], docs[src])
            s, t = pb.scores(q, kv[0], mask)
            p = torch.exp(s - safe(lse).unsqueeze(-1))
            dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
            dp = torch.einsum("bqhd,bkhd->bhqk", dout, expand(kv[1], h))
            ds = p * (dp - delta.unsqueeze(-1))
            if t is not None and "softcap_no_tanh_grad" not in pb.bugs:
                ds = ds * (1 - t * t)
            dq += torch.einsum("bhqk,bkhd->bqhd", ds, expand(kv[0], h)) * pb.scale
            dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * pb.scale
            dkv[0] = dkv[0] + dk.view(b, n, kvh, group_size, d).sum(3)
            dkv[1] = dkv[1] + dv.view(b, n, kvh, group_size, -1).sum(3)
            # the accumulators follow their K/V around the ring; the last hop brings them home
            grad_requests, grad_incoming = exchange(group, dkv)
            if step < world - 1:
                wait(kv_requests)
                kv = kv_incoming
            wait(grad_requests)
            dkv = grad_incoming
        dt = ctx.dtype
        return dq.to(dt), dkv[0].to(dt), dkv[1].to(dt), sink_grad(pb, ctx.sinks_dtype, sink, lse, delta, world), None


def sink_grad(pb: Problem, dtype, sink, lse, delta, world):
    """dsinks[h] = -sum over batch and this rank's rows of exp(sink - lse) * D: the "partial"
    convention, the framework sums it over the group (None without sinks)."""
    if dtype is None or "sinks_no_grad" in pb.bugs:
        return None
    p_sink = torch.exp(sink - safe(lse))  # 0 on padding rows (sink -inf)
    if "sink_per_step" in pb.bugs:
        p_sink = p_sink * world
    partial = -(p_sink * delta).sum((0, 2))
    grad = partial
    if "sinks_gqa_order" in pb.bugs:  # the gradient of the sink each head actually used
        grad = torch.empty_like(partial)
        grad[gqa_permutation(len(partial), pb.kv_heads)] = partial
    if "dsinks_all_reduced" in pb.bugs:  # every rank gets the whole sequence's gradient: the other convention
        dist.all_reduce(grad, group=pb.group)
    return grad.to(dtype)


def varlen_ring(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None, window=None,
                softcap=None, sinks=None, bugs=frozenset()):
    """The ring with the defects `bugs` (a subset of BUGS) switched on; returns (out, lse)."""
    unknown = set(bugs) - BUGS
    if unknown:
        raise ValueError(f"unknown bugs {sorted(unknown)}; choose from {sorted(BUGS)}")
    group = group if group is not None else dist.group.WORLD
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cu = None if cu_seqlens is None else tuple(int(x) for x in torch.as_tensor(cu_seqlens).tolist())
    pb = Problem(causal=causal, scale=float(scale), group=group, layout=layout, cu_seqlens=cu,
                 window=tuple(window) if window is not None else (-1, -1),
                 softcap=None if softcap is None else float(softcap), kv_heads=k.shape[2], device=q.device,
                 bugs=frozenset(bugs))
    return VarlenRing.apply(q, k, v, sinks, pb)


def textbook_varlen(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None, window=None,
                    softcap=None, sinks=None):
    """A correct ring with documents, padding, windows, softcap, sinks and MLA head dims: the
    control that every check must pass."""
    return varlen_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                       cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks)
