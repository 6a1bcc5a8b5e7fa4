"""A catalogue of deliberately broken ring attentions, written against the `--impl` contract.

Each public function here is an implementation a user could hand to
``ringcheck validate --impl ringcheck.catalogue.mutants:<name>``:

    fn(q, k, v, *, causal, softmax_scale, group) -> (out, lse)

with q this rank's shard (batch, local_seq, heads, head_dim) and k, v (batch, local_seq,
kv_heads, head_dim) in the zig-zag layout. `textbook` is a correct, plain ring (forward and
backward by hand, communication with torch.distributed); every other function is `textbook`
with exactly one real bug class switched on. `validate` must pass `textbook` and fail every
mutant; suites/test_validate.py asserts it. `nondeterministic_sum` is correct too, but not
deterministic (its backward's sums in a random order, as atomic adds give); `nondeterministic_noise`
is not, beyond rounding (`ringcheck.catalogue.nondeterministic`; suites/test_nondeterministic.py).

This module deliberately does not use ringcheck's ring: it stands for someone else's code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ringcheck.ring.layouts import positions

LAYOUT = "zigzag"
BUCKET = 8  # the `drops_remainder` bug works in buckets of this many tokens
TILE = 64  # the tail bugs (`ringcheck.catalogue.length_mutants`) walk a shard in tiles of this many tokens


def tiled(n: int) -> int:
    """How many of a shard's `n` tokens a block kernel with the grid `n // TILE` (not
    `cdiv(n, TILE)`) reaches: all of them in one tile or less, and at a multiple of the tile;
    the ragged last tile is left out otherwise."""
    return n if n <= TILE else n // TILE * TILE


_RECEIVED: dict = {}  # the `stale_workspace` bug's receive workspace, per process, sized by the longest call yet


def _workspace(kv, n: int):
    """The `stale_workspace` bug: the K/V block received into a module-level workspace kept from
    earlier calls (grown, never shrunk) and read to the workspace's length, not the call's: the
    tail past `n` holds an earlier, longer call's keys. (k, v, how many keys were read)."""
    key = (kv[0].shape[0], kv[0].shape[2], kv[0].shape[3], kv[1].shape[3])
    held = _RECEIVED.get(key)
    if held is None or held[0].shape[1] < n:
        held = _RECEIVED[key] = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
    for buffer, t in zip(held, kv):
        buffer[:, :n] = t.float()
    return held[0], held[1], held[0].shape[1]


# ---------------------------------------------------------------- communication

def _exchange(group, tensors, bugs=frozenset(), what="kv"):
    """Send `tensors` (`what`: "kv" or "grad") to the next rank and receive the same shapes from
    the previous one: (requests, received)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    if "group_rank_as_peer" in bugs:  # the group's ranks passed where P2P wants global ones: right on 0..P-1 only
        nxt, prv = (rank + 1) % world, (rank - 1) % world
    requests, received = send_packed(group, tensors, nxt, prv)
    if "kv_twice" in bugs and what == "kv":  # the K/V sent a second time each hop, the copy dropped
        requests = [*requests, *send_packed(group, tensors, nxt, prv)[0]]
    if "waits_each_transfer" in bugs:  # blocks until the transfer is done, before computing
        _wait(requests)
        requests = []
    return requests, received


def send_packed(group, tensors, nxt: int, prv: int):
    """Send `tensors` (one dtype) to global rank `nxt` as one message and receive the same
    shapes from `prv`; returns (requests, received: views of one buffer, valid once waited for).
    One send and one receive per hop, not one per tensor: each point-to-point message costs
    more than a copy of a small tensor."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buffer = torch.empty_like(flat)
    received, at = [], 0
    for t in tensors:
        received.append(buffer[at:at + t.numel()].view(t.shape))
        at += t.numel()
    ops = [dist.P2POp(dist.isend, flat, nxt, group), dist.P2POp(dist.irecv, buffer, prv, group)]
    return dist.batch_isend_irecv(ops), received


def _wait(requests):
    for r in requests:
        r.wait()


# ---------------------------------------------------------------- one block

def _visible(rank, src, world, n, causal, bugs, device):
    """(n, n) bool mask on `device` of which keys of rank `src` the queries of `rank` see (None: all)."""
    if not causal:
        return None
    seq = n * world
    if "contiguous_mask_on_zigzag" in bugs:  # treats zig-zag shards as if they were contiguous
        if src < rank:
            return None
        m = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return m if src == rank else torch.zeros_like(m)
    qpos = positions(layout=LAYOUT, rank=rank, world_size=world, seq_len=seq).to(device)
    kpos = positions(layout=LAYOUT, rank=src, world_size=world, seq_len=seq).to(device)
    shift = 1 if ("diagonal_off_by_one" in bugs and src == rank) else 0
    mask = kpos[None, :] <= qpos[:, None] + shift
    if "mask_on_default_device" in bugs:  # the mask made again without a device: the CPU, beside a GPU's scores
        return torch.tensor(mask.tolist())
    return mask


def _kv_heads(x, heads, bugs):
    """Repeat K/V heads for the query heads: head h uses K/V head h // group."""
    kvh = x.shape[2]
    if "gqa_modulo" in bugs:  # h % kv_heads: the other common convention, wrong for this layout
        return x.repeat(1, 1, heads // kvh, 1)
    return x.repeat_interleave(heads // kvh, dim=2)


def _scores(q, k, mask, scale, bugs):
    s = torch.einsum("bqhd,bkhd->bhqk", q, _kv_heads(k, q.shape[2], bugs)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if "drops_remainder" in bugs:  # keys past the last whole bucket are never looked at
        keep = (k.shape[1] // BUCKET) * BUCKET
        s[..., keep:] = float("-inf")
    return s


def _merge(out, lse, block_out, block_lse, bugs):
    if "merge_no_rescale" in bugs:  # adds the new block as if both maxima were equal
        new_lse = torch.logaddexp(lse, block_lse)
        return out + block_out * torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1), new_lse
    if "merge_overflow" in bugs:  # out = (out + r out_b) / (1 + r) with r = exp(block_lse - lse) unguarded
        first = torch.isneginf(lse)
        r = torch.exp(block_lse - lse.masked_fill(first, 0.0))
        new_out = (out + r.transpose(1, 2).unsqueeze(-1) * block_out) / (1 + r).transpose(1, 2).unsqueeze(-1)
        new_out = torch.where(first.transpose(1, 2).unsqueeze(-1), block_out, new_out)
        return new_out, torch.where(first, block_lse, lse + torch.log1p(r))
    new_lse = torch.logaddexp(lse, block_lse)
    safe = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


# ---------------------------------------------------------------- the ring

def _as_contiguous(t):
    """`t`'s memory read as if it were contiguous (a kernel that ignores the strides it is given)."""
    strides = [1] * t.dim()
    for i in range(t.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * t.shape[i + 1]
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


_WORKSPACE: dict = {}  # the `workspace_state` bug keeps its backward's tensors here, not on ctx
_SLOTS: dict = {"calls": 0}  # the `recompute_slot` bug: two slots for out and the lse, taken in turn by each forward


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, bugs):
        if "q_as_contiguous" in bugs:  # reads q's memory as if q were its own contiguous tensor
            q = _as_contiguous(q)
        if "v_with_k_strides" in bugs:  # builds its V tile with K's strides
            v = torch.as_strided(v, v.shape, k.stride(), v.storage_offset())
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if "rank_from_wrong_axis" in bugs:  # its place in the ring from the global rank (right for one mesh order)
            rank = dist.get_rank() % world
        dtype = q.dtype
        kv = [k, v]  # on the wire in the input dtype; computed on in float32 (the same values)
        q, k, v = q.float(), k.float(), v.float()
        b, n, h, _ = q.shape
        out = torch.zeros(b, n, h, v.shape[-1], device=q.device)  # v may have a head dim of its own
        lse = torch.full((b, h, n), float("-inf"), device=q.device)
        block_lses = []
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                requests, incoming = _exchange(group, kv, bugs)
            keys, values, mask = kv[0].float(), kv[1].float(), _visible(rank, src, world, n, causal, bugs, q.device)
            if "stale_workspace" in bugs and step > 0:  # reads the workspace to its length, stale tail and all
                keys, values, held = _workspace(kv, n)
                if held > n:
                    mask = torch.cat([torch.ones(n, n, dtype=torch.bool, device=q.device) if mask is None else mask,
                                      torch.ones(n, held - n, dtype=torch.bool, device=q.device)], dim=1)
            s = _scores(q, keys, mask, scale, bugs)
            if "tail_keys_forward" in bugs:  # the key tiles' grid is n // TILE: the ragged last tile never read
                s[..., tiled(n):] = float("-inf")
            block_lse = torch.logsumexp(s, -1)
            p = torch.exp(s - block_lse.masked_fill(torch.isneginf(block_lse), 0.0).unsqueeze(-1))
            block_out = torch.einsum("bhqk,bkhd->bqhd", p, _kv_heads(values, h, bugs))
            if "tail_query_rows" in bugs:  # the query tiles' grid is n // TILE: the ragged last tile never written
                block_out[:, tiled(n):] = 0.0
                block_lse[..., tiled(n):] = float("-inf")
            out, lse = _merge(out, lse, block_out, block_lse, bugs)
            if "low_precision_partial" in bugs:  # partial output kept in the input dtype
                out = out.to(dtype).float()
            block_lses.append(block_lse)
            if step < world - 1:
                if "stale_receive_buffer" in bugs and step == 0:
                    kv = [t.clone() for t in kv]  # read before the receive completed: old contents
                    _wait(requests)
                else:
                    _wait(requests)
                    kv = incoming
        if "workspace_state" in bugs:  # one module-level workspace (saves memory), not the autograd context
            _WORKSPACE["saved"] = (q, k, v, out, lse, *block_lses)
        elif "recompute_slot" in bugs:  # q, k, v on the context; out and the lse in one of two slots (two layers
            ctx.slot = _SLOTS["calls"] % 2  # in flight keep theirs), the slot noted on the context
            _SLOTS["calls"] += 1
            _SLOTS[ctx.slot] = (out, lse, *block_lses)
            ctx.save_for_backward(q, k, v)
        else:
            ctx.save_for_backward(q, k, v, out, lse, *block_lses)
        ctx.causal, ctx.scale, ctx.group, ctx.bugs, ctx.dtype, ctx.rank = causal, scale, group, bugs, dtype, rank
        return out.to(dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        bugs = ctx.bugs
        if "recompute_slot" in bugs:  # reading q, k, v first: a checkpoint's recompute runs here, taking a slot
            (q, k, v), (out, lse, *block_lses) = ctx.saved_tensors, _SLOTS[ctx.slot]
        else:
            q, k, v, out, lse, *block_lses = _WORKSPACE["saved"] if "workspace_state" in bugs else ctx.saved_tensors
        causal, scale, group = ctx.causal, ctx.scale, ctx.group
        rank, world = ctx.rank, dist.get_world_size(group)
        b, n, h, d = q.shape
        if "dout_as_contiguous" in bugs:  # reads the gradient of out as if it were contiguous
            dout = _as_contiguous(dout)
        dout = dout.float()
        delta = (dout * out).sum(-1).transpose(1, 2)  # (b, h, n)
        if dlse is not None:
            delta = delta - dlse
        group_size = h // k.shape[2]
        dq = torch.zeros_like(q)
        kv = [k.to(ctx.dtype), v.to(ctx.dtype)]  # on the wire in the input dtype (exact: they were)
        dkv = [torch.zeros_like(k), torch.zeros_like(v)]
        bwd_scale = scale * scale if "scale_twice_backward" in bugs else scale
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                kv_requests, kv_incoming = _exchange(group, kv, bugs)
            k_s, v_s = ([k, v] if "stale_kv_backward" in bugs else [t.float() for t in kv])
            s = _scores(q, k_s, _visible(rank, src, world, n, causal, bugs, q.device), scale, bugs)
            row_lse = block_lses[step] if "block_lse_backward" in bugs else lse
            p = torch.exp(s - row_lse.masked_fill(torch.isneginf(row_lse), 0.0).unsqueeze(-1))
            if "tail_query_rows" in bugs:  # the backward's query tiles: the same grid, the tail rows never read
                p[..., tiled(n):, :] = 0.0
            kk, vv = _kv_heads(k_s, h, bugs), _kv_heads(v_s, h, bugs)
            dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
            dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
            ds = p * (dp - delta.unsqueeze(-1))
            dq += torch.einsum("bhqk,bkhd->bqhd", ds, kk) * bwd_scale
            dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * bwd_scale
            kvh = k.shape[2]
            if "gqa_modulo" in bugs:
                dk = dk.view(b, n, group_size, kvh, d).sum(2)
                dv = dv.view(b, n, group_size, kvh, dv.shape[-1]).sum(2)
            else:
                dk = dk.view(b, n, kvh, group_size, d).sum(3)
                dv = dv.view(b, n, kvh, group_size, dv.shape[-1]).sum(3)
            if "tail_dkdv_backward" in bugs:  # the dK/dV program's grid over key tiles is n // TILE
                dk[:, tiled(n):], dv[:, tiled(n):] = 0.0, 0.0
            dkv = [dkv[0] + dk, dkv[1] + dv]
            last = step == world - 1
            if last and "dkdv_not_home" in bugs:
                break  # the accumulators of rank + 1 never make their last hop
            if world == 1:
                break  # a ring of one: the accumulators are home (gloo sends nothing to its own rank)
            grad_requests, grad_incoming = _exchange(group, dkv, bugs, "grad")
            if not last:
                _wait(kv_requests)
                kv = kv_incoming
            _wait(grad_requests)
            dkv = grad_incoming
        if "nondeterministic_dq" in bugs:  # as a GPU kernel's atomic adds, whose order varies: other float32
            # roundings in every run (a random value added and taken away again: <= 2^-23 of dq in float32,
            # <= 2^-16 in a narrower dtype, so that some of its roundings change too)
            noise = torch.rand(dq.shape, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "big")))
            noise = noise.to(dq.device)
            noise = noise * dq.abs() * (1 if ctx.dtype == torch.float32 else 256)
            dq = (dq + noise) - noise
        dt = ctx.dtype
        return dq.to(dt), dkv[0].to(dt), dkv[1].to(dt), None, None, None, None


def _ring(q, k, v, causal, softmax_scale, group, bugs=frozenset()):
    group = group if group is not None and "default_group" not in bugs else dist.group.WORLD  # the bug: group lost
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _Ring.apply(q, k, v, causal, scale, group, frozenset(bugs))


def textbook(q, k, v, *, causal, softmax_scale, group=None):
    """A correct ring: the control that validate must pass."""
    return _ring(q, k, v, causal, softmax_scale, group)


def mutant_of(bug: str, doc: str):
    """The textbook ring with `bug` switched on, named after it, under the `--impl` contract."""
    def impl(q, k, v, *, causal, softmax_scale, group=None):
        return _ring(q, k, v, causal, softmax_scale, group, {bug})
    impl.__name__ = impl.__qualname__ = bug
    impl.__doc__ = doc
    return impl


MUTANTS = {
    "merge_no_rescale": "merge without max rescaling",
    "merge_overflow": "merge that overflows when block_lse - lse is large",
    "block_lse_backward": "per-block lse used in backward instead of the merged one",
    "stale_kv_backward": "backward reusing the first step's K/V",
    "dkdv_not_home": "dK/dV not returned home",
    "diagonal_off_by_one": "zig-zag diagonal mask off by one",
    "contiguous_mask_on_zigzag": "contiguous causal mask on a zig-zag shard",
    "drops_remainder": "a dropped last token when the length does not divide the bucket",
    "gqa_modulo": "GQA head mapping wrong (h % kv_heads instead of h // group)",
    "low_precision_partial": "low-precision partial output at every hop",
    "scale_twice_backward": "softmax scale applied twice in backward",
    "stale_receive_buffer": "a stale receive buffer (no wait before use)",
    "mask_on_default_device": "the causal mask made without a device (exact on a CPU, a crash on a GPU)",
}

for _name, _doc in MUTANTS.items():
    globals()[_name] = mutant_of(_name, _doc)

# every public catalogue of the `--impl` contract: module -> the dict naming its implementations
# (`--impl <module>:<name>`); this module's bug classes, the variants', and the precision class's
# (a tensor rounded through a narrower dtype: `narrow_<tensor>_<dtype>`)
CATALOGUES = {
    "ringcheck.catalogue.mutants": "MUTANTS",
    "ringcheck.catalogue.variant_mutants": "VARIANT_MUTANTS",
    "ringcheck.catalogue.precision_mutants": "PRECISION_MUTANTS",
    "ringcheck.catalogue.embedded_mutants": "EMBEDDED_MUTANTS",
    "ringcheck.catalogue.wrapped_mutants": "WRAPPED_MUTANTS",
    "ringcheck.catalogue.promise_mutants": "PROMISE_MUTANTS",
    "ringcheck.catalogue.length_mutants": "LENGTH_MUTANTS",
}


# ---------------------------------------------------------------- rings that do not give the same bits twice
# (as GPU kernels with atomic adds: `ringcheck.catalogue.nondeterministic` says how, and how much)

from .nondeterministic import add_at_random, first_and_last, generator, noisy, spread  # noqa: E402

MUTANTS["nondeterministic_noise"] = "dq off by up to 100x the output dtype's rounding, at random on each call"


class _RandomOrderRing(torch.autograd.Function):
    """The textbook ring's forward; a backward that sums over the ring steps in a random order."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group):
        return _Ring.forward(ctx, q, k, v, causal, scale, group, frozenset())

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *_ = ctx.saved_tensors
        rank, world, gen, size, none = ctx.rank, dist.get_world_size(ctx.group), generator(), spread(ctx.dtype), set()
        b, n, h, d = q.shape
        dout = dout.float()
        delta = (dout * out).sum(-1).transpose(1, 2) - (0 if dlse is None else dlse)
        kvh = k.shape[2]
        dq, kv, dkv = [torch.zeros_like(q)] * 2, [k.to(ctx.dtype), v.to(ctx.dtype)], [torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(world):
            if step < world - 1:
                kv_requests, kv_incoming = _exchange(ctx.group, kv)
            k_s, v_s = (t.float() for t in kv)
            s = _scores(q, k_s, _visible(rank, (rank - step) % world, world, n, ctx.causal, none, q.device), ctx.scale, none)
            p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
            ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, _kv_heads(v_s, h, none)) - delta.unsqueeze(-1))
            add_at_random(dq, torch.einsum("bhqk,bkhd->bqhd", ds, _kv_heads(k_s, h, none)) * ctx.scale, size, gen)
            dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q) * ctx.scale).view(b, n, kvh, h // kvh, d).sum(3)
            dv = torch.einsum("bhqk,bqhd->bkhd", p, dout).view(b, n, kvh, h // kvh, -1).sum(3)
            if step == 0:  # this rank's own keys: part of its term as the sums set out, the rest when home
                (dk, last_k), (dv, last_v) = first_and_last(dk, size, gen), first_and_last(dv, size, gen)
            dkv = [dkv[0] + dk, dkv[1] + dv]
            if world == 1:
                break  # a ring of one: the accumulators are home
            grad_requests, grad_incoming = _exchange(ctx.group, dkv, what="grad")
            if step < world - 1:
                _wait(kv_requests)
                kv = kv_incoming
            _wait(grad_requests)
            dkv = grad_incoming
        dt = ctx.dtype
        return (dq[0] + dq[1]).to(dt), (dkv[0] + last_k).to(dt), (dkv[1] + last_v).to(dt), None, None, None


class _NoisyRing(_RandomOrderRing):
    """The textbook ring (its forward, as `_RandomOrderRing`'s), its dq off by up to 100 roundings
    at random on each call (`noisy`)."""

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, *_ = _Ring.backward(ctx, dout, dlse)
        return noisy(dq, ctx.dtype), dk, dv, None, None, None


def nondeterministic_sum(q, k, v, *, causal, softmax_scale, group=None):
    """A correct ring that is not deterministic: the textbook ring whose backward sums dq and
    dK/dV over the ring steps in a random order on each call (as atomic adds do)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _RandomOrderRing.apply(q, k, v, causal, scale, group if group is not None else dist.group.WORLD)


def nondeterministic_noise(q, k, v, *, causal, softmax_scale, group=None):
    """The textbook ring with dq off by up to 100x the output dtype's rounding, at random on each call."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _NoisyRing.apply(q, k, v, causal, scale, group if group is not None else dist.group.WORLD)
