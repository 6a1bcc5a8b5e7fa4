"""ms-swift 4.6.0's zig-zag ring (`swift/sequence_parallel/zigzag_ring_attn.py`): the patched copies
of its window (finding 2's second half) and of its backward (finding 4), and the backward's minimal
script (docs/findings/trainers.md).

- **The window**: once it reaches the ring as a (left, right) pair (`window_pair`), every ring block
  is still handed that window as if its query and key rows were one contiguous stretch of the
  sequence. They are not: a rank holds chunks r and 2P-1-r of each document, and the K/V a block
  meets came from another rank; flash-attn's window is relative to the block's own rows, so every
  block but the diagonal one is windowed at the wrong distance (mistral's logits 0.75 off).
  `patch_blocks` keeps its ring as it ships (its schedule, which half meets which at each step,
  its merge) and replaces only its two block kernels, `forward` and `backward` (L182-292), by ones
  handed where their rows lie: the query rows this rank's, the K/V rows those of rank (r - step)
  mod P (its `RingComm` sends to r + 1), each a document's chunks r and 2P-1-r (`_split_packed`,
  `sequence_parallel.py` L487-503) or half of them. The block's mask is the layer's: same document
  and 0 <= query - key <= left. Layers without a window keep ms-swift's own kernels. The step of a
  block is not among the kernel's arguments; its loops call the kernels once per step in step
  order, so the wrapped ring functions count the calls from 0.
- **The backward** (every model its ring runs, window or not): each block's backward is handed the
  block's own output where flash-attn's D = rowsum(dout * out) needs the ring's final output
  (`patch_final_out`), and the first block's lse it hands is a view of the running lse that the
  later steps overwrite in place (`patch_first_block`): dq and dk 0.3 to 0.75 off at P=4.

    python -m benchmarks.findings.ms_swift_ring   # the backward, as shipped and patched, P=4
"""

from __future__ import annotations

import torch

NEG = -1.0e30  # the log-sum-exp of a row the block masks entirely: no weight in ms-swift's merge, no NaN


class Where:
    """The ring call in flight: its group and global cu_seqlens, the steps met so far, and the last
    attention call's logit softcap (0: none; `softcap_from` notes it, the ring is never handed it)."""

    def __init__(self):
        self.group = self.cu = None
        self.forward_step = self.backward_step = 0
        self.softcap = 0.0


class Window(tuple):
    """flash-attn's (left, right) window with the layer's softcap along: the ring keeps its
    `window_size` for the backward (`ctx.window_size`) and hands it to every block, so each block
    meets its own layer's cap, in the backward too."""

    def __new__(cls, pair, softcap: float = 0.0):
        made = super().__new__(cls, pair)
        made.softcap = softcap
        return made


def rows(cu_local: torch.Tensor, rank: int, world: int, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(document, position in the document) of each row of a rank's tensor: every document's chunk
    `rank` then chunk 2P-1-rank (`part` "full"), or the front or back one alone."""
    docs, pos = [], []
    for d, (start, end) in enumerate(zip(cu_local[:-1].tolist(), cu_local[1:].tolist())):
        chunk = (end - start) // 2
        for which, first in (("front", rank * chunk), ("back", (2 * world - 1 - rank) * chunk)):
            if part in ("full", which):
                pos.append(torch.arange(first, first + chunk))
                docs.append(torch.full((chunk,), d))
    return torch.cat(docs), torch.cat(pos)


def block_mask(where: Where, step: int, q_len: int, k_len: int, block: int, left: int) -> torch.Tensor:
    """[q_len, k_len] True where the layer lets a query of the block see a key: the query rows this
    rank's, the key rows rank (r - step) mod P's (half of them where the length is `block`)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(where.group), dist.get_world_size(where.group)
    cu_local = where.cu.cpu() // world
    q_doc, q_pos = rows(cu_local, rank, world, "back" if q_len == block else "full")
    k_doc, k_pos = rows(cu_local, (rank - step) % world, world, "front" if k_len == block else "full")
    if q_doc.numel() != q_len or k_doc.numel() != k_len:
        raise RuntimeError(f"the block's rows ({q_len} queries, {k_len} keys) are not those of cu_seqlens "
                           f"{where.cu.tolist()} at rank {rank} of {world}, step {step}")
    distance = q_pos[:, None] - k_pos[None, :]
    return (q_doc[:, None] == k_doc[None, :]) & (distance >= 0) & ((distance <= left) | (left < 0))


def _scores(q, k, mask, scale, cap: float):
    """Scores [heads, q, k] in float32, the K/V heads repeated to the query heads (GQA), capped as
    cap * tanh(s / cap) where `cap`; and d(capped)/d(s) (1 where no cap)."""
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    slope = torch.ones((), device=s.device)
    if cap:
        t = torch.tanh(s / cap)
        s, slope = cap * t, 1 - t * t
    return s.masked_fill(~mask.to(s.device), float("-inf")), slope


def windowed_forward(where: Where, q, k, v, block: int, scale: float, left: int, cap: float):
    """One block as flash-attn's varlen forward returns it, (out, lse [heads, q]), under the block's mask."""
    mask = block_mask(where, where.forward_step, q.shape[0], k.shape[0], block, left)
    where.forward_step += 1
    s, _ = _scores(q, k, mask, scale, cap)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isinf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None])
    v_rep = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", p, v_rep)
    return out.to(q.dtype), lse.masked_fill(empty, NEG)


def windowed_backward(where: Where, dout, q, k, v, out, lse, block: int, bufs, scale: float, left: int,
                      cap: float) -> None:
    """One block's gradients as flash-attn's varlen backward writes them into ms-swift's buffers."""
    mask = block_mask(where, where.backward_step, q.shape[0], k.shape[0], block, left)
    where.backward_step += 1
    groups = q.shape[1] // k.shape[1]
    s, slope = _scores(q, k, mask, scale, cap)
    p = torch.exp(s - lse.float()[..., None])  # masked scores -inf: weight 0
    v_rep = v.float().repeat_interleave(groups, dim=1)
    k_rep = k.float().repeat_interleave(groups, dim=1)
    do = dout.float()
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, v_rep)
    delta = (do * out.float()).sum(-1).transpose(0, 1)  # [heads, q]
    ds = p * (dp - delta[..., None]) * slope
    dq = torch.einsum("hqk,khd->qhd", ds, k_rep) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
    dq_buf, dk_buf, dv_buf = bufs
    dq_buf[:q.shape[0]] = dq.to(dq_buf.dtype)
    dk_buf[:k.shape[0]] = dk.unflatten(1, (k.shape[1], groups)).sum(2).to(dk_buf.dtype)
    dv_buf[:k.shape[0]] = dv.unflatten(1, (v.shape[1], groups)).sum(2).to(dv_buf.dtype)


def patch_blocks(module, where: Where) -> callable:
    """ms-swift's `zigzag_ring_attn` module with its block kernels windowed (and capped) where the
    layer has a window (a softcap, `where.softcap`), the rest as shipped; returns the undo."""
    names = ("forward", "backward", "zigzag_ring_flash_attn_varlen_forward", "zigzag_ring_flash_attn_varlen_backward")
    originals = {n: getattr(module, n) for n in names}

    def ring_call(name, reset, cu_at):
        def call(process_group, *args, **kwargs):  # its cu_seqlens: after q, k, v (and dout, out, lse: backward)
            where.group, where.cu = process_group, args[cu_at]
            setattr(where, reset, 0)
            where.forward_step = 0
            return originals[name](process_group, *args, **kwargs)
        return call

    def forward(q, k, v, causal, cu_seqlens, max_seqlen, block, dropout_p, scale, alibi, window_size):
        cap = getattr(window_size, "softcap", 0.0)
        if window_size[0] < 0 and not cap:
            return originals["forward"](q, k, v, causal, cu_seqlens, max_seqlen, block, dropout_p, scale, alibi,
                                        window_size)
        return windowed_forward(where, q, k, v, block, scale, window_size[0], cap)

    def backward(dout, q, k, v, out, lse, causal, cu_seqlens, max_seqlen, block, dq, dk, dv, dropout_p, scale,
                 alibi, deterministic, window_size):
        cap = getattr(window_size, "softcap", 0.0)
        if window_size[0] < 0 and not cap:
            return originals["backward"](dout, q, k, v, out, lse, causal, cu_seqlens, max_seqlen, block, dq, dk,
                                         dv, dropout_p, scale, alibi, deterministic, window_size)
        return windowed_backward(where, dout, q, k, v, out, lse, block, (dq, dk, dv), scale, window_size[0], cap)

    module.forward, module.backward = forward, backward
    module.zigzag_ring_flash_attn_varlen_forward = ring_call(names[2], "forward_step", 3)
    module.zigzag_ring_flash_attn_varlen_backward = ring_call(names[3], "backward_step", 6)

    def undo():
        for name, value in originals.items():
            setattr(module, name, value)

    return undo


def patch_final_out(module) -> callable:
    """ms-swift's ring backward with each block's gradient taken against the attention's final output
    (flash-attn's D = rowsum(dout * out) with the `out` the whole ring produced), where it hands each
    block's backward that block's own output (`zigzag_ring_attn.py` L546, L558, L563): the gradient through
    the block's log-sum-exp, which its merge's backward computes (`grad_block_lse`, L317) and never uses, is
    then carried, since the block's weight times D of the final output is that gradient's term.
    Returns the undo."""
    import torch.distributed as dist

    names = ("backward", "zigzag_ring_flash_attn_varlen_backward")
    originals = {n: getattr(module, n) for n in names}
    held = {}

    def ring_backward(process_group, dout, q, k, v, out, softmax_lse, cu_seqlens, *args, **kwargs):
        held["out"] = out.squeeze(0) if out.shape[0] == 1 else out  # as its squeeze_batch
        held["back"] = module.get_half_index(cu_seqlens // dist.get_world_size(process_group), front=False)
        return originals[names[1]](process_group, dout, q, k, v, out, softmax_lse, cu_seqlens, *args, **kwargs)

    def backward(dout, q, k, v, out, lse, causal, cu_seqlens, max_seqlen, block, *rest):
        final = held["out"] if q.shape[0] != block else held["out"][held["back"]]  # the back half: its q1
        return originals["backward"](dout, q, k, v, final, lse, causal, cu_seqlens, max_seqlen, block, *rest)

    module.backward, module.zigzag_ring_flash_attn_varlen_backward = backward, ring_backward

    def undo():
        for name, value in originals.items():
            setattr(module, name, value)

    return undo


def patch_first_block(module) -> callable:
    """ms-swift's merge `update_out_and_lse` (L86-117) with its first block's output and lse copied:
    as shipped the running lse is a view of the first block's (and the running output the block's
    own tensor where it is float32 already), so the in-place half updates of the steps after the
    rank's (`fout[half_index1], flse[half_index1] = ...`, L489) overwrite the first block's lse that
    its backward then hands the first block (L526). Returns the undo."""
    original = module.update_out_and_lse

    def update_out_and_lse(out, lse, block_out, block_lse):
        new_out, new_lse, sig = original(out, lse, block_out, block_lse)
        if out is None:
            return new_out.clone(), new_lse.clone(), sig
        return new_out, new_lse, sig

    module.update_out_and_lse = update_out_and_lse

    def undo():
        module.update_out_and_lse = original

    return undo


def softcap_from(attention, where: Where):
    """The model's attention function (ms-swift's `local_flash_attn`, as registered) that notes the
    layer's `softcap` for `window_pair` to hand the ring (as a `Window`): its ring call (`sequence_parallel.py` L209-219) hands
    the ring no softcap, and the ring's blocks call flash-attn with softcap 0.0
    (`zigzag_ring_attn.py` L125-126)."""
    def attend(*args, **kwargs):
        where.softcap = float(kwargs.get("softcap") or 0.0)
        return attention(*args, **kwargs)

    return attend


def patch_ring(module, where: Where) -> callable:
    """Every patch of ms-swift's ring here, on its `zigzag_ring_attn` module: the windowed (and
    capped) blocks, the first block kept apart, the final output in each block's backward; returns
    the undo."""
    undos = [patch_blocks(module, where), patch_first_block(module), patch_final_out(module)]

    def undo():
        for one in reversed(undos):
            one()

    return undo


# ------------------------------------------------------------------ the minimal script of the backward
P, N, HEADS, KV_HEADS, DIM = 4, 32, 4, 1, 8


def _dense(q, k, v):
    """Causal attention on one process, float64, the K/V heads repeated (the truth)."""
    i = torch.arange(q.shape[0])
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(HEADS // KV_HEADS, 1)) * DIM ** -0.5
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(HEADS // KV_HEADS, 1))


def _rank(rank: int, port: int, patched: bool, out) -> None:
    """One rank: ms-swift's `zigzag_ring_flash_attn_varlen_func` (flash-attn stand-in, bfloat16) on
    its zig-zag chunks of one sequence, forward and backward; the relative error of its output and
    of dq, dk, dv against `_dense`'s on the same rows."""
    import torch.distributed as dist

    from ringcheck.flash_stand_in import install
    from ringcheck.trainers.ms_swift import swift

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    install()
    swift()
    import swift.sequence_parallel.zigzag_ring_attn as ring

    if patched:
        patch_first_block(ring)
        patch_final_out(ring)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn(N, HEADS, DIM, generator=g, dtype=torch.float64)
    chunk = N // (2 * P)
    mine = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * P - 1 - rank) * chunk, (2 * P - rank) * chunk)])  # its _split_packed
    local = [t[mine].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    o = ring.zigzag_ring_flash_attn_varlen_func(*(t[None] for t in local), torch.tensor([0, N], dtype=torch.int32), N,
                                                softmax_scale=DIM ** -0.5, causal=True, group=dist.group.WORLD)
    o[0].backward(dout[mine].to(torch.bfloat16))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    truth = _dense(*whole)
    truth.backward(dout)

    def rel(a, b):
        return float((a.detach().double() - b).norm() / b.norm())

    out.put((rank, rel(o[0], truth.detach()[mine]),
             *(rel(x.grad, t.grad[mine]) for x, t in zip(local, whole))))


def minimal() -> None:
    """ms-swift's ring backward at P=4 (one sequence of 32 tokens, 4 query heads, 1 K/V head,
    bfloat16 on the flash-attn stand-in), as shipped and patched: each rank's errors."""
    from benchmarks.findings.ranks import run_ranks

    for patched in (False, True):
        for rank, *errors in sorted(run_ranks(_rank, P, patched, results=P, timeout=600)):
            print(f"{'patched' if patched else 'as shipped':10s} rank {rank}: out {errors[0]:.1e}, dq {errors[1]:.1e}, "
                  f"dk {errors[2]:.1e}, dv {errors[3]:.1e} (relative, against float64)", flush=True)


if __name__ == "__main__":
    minimal()
