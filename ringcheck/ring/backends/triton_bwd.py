"""Triton backward kernels of one ring block: the row statistic D, then dK/dV, then dQ.

Laid out like the backward half of Triton's fused-attention tutorial: the preprocess kernel,
the dK/dV inner loop and kernel, the dQ inner loop and kernel, then the launchers.

The ring's backward differs from a single-device backward in one way: the softmax
statistics are the *merged* ones of the whole ring. A block's probabilities are
``P = exp(scale q k^T - lse)`` with ``lse`` the merged log-sum-exp of the query row over every
K/V chunk, and ``dS = P (dP - D)`` with ``D = rowsum(dO * O)`` of the merged output (minus
any gradient flowing into lse, which the ring folds into D). So these kernels take lse and D
as inputs and recompute nothing of the forward but the block's scores.

    dV = P^T dO        dP = dO V^T        dS = P (dP - D)
    dQ = scale dS K    dK = scale dS^T Q

Rows with lse = -inf (no visible key anywhere in the ring) get P = 0, hence zero gradients.
Grouped-query attention: a dK/dV program owns one K/V head and loops over the query heads of
its group, so dK and dV are summed in registers, without atomics, in a fixed order (the
result does not depend on scheduling). Masks, padding and the `DOT_FP32` switch are those of
`triton_fwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fwd import _load_tile, _mm, head_dim_pad, is_interpreted

# ---------------------------------------------------------------------------------------------
# preprocess: D = rowsum(dO * O)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess(O, DO, Delta,
                         stride_ob, stride_os, stride_oh, stride_od,
                         stride_dob, stride_dos, stride_doh, stride_dod,
                         stride_db, stride_dh, stride_ds,
                         heads, seq,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    off_bh = tl.program_id(1)
    off_b = (off_bh // heads).to(tl.int64)
    off_h = (off_bh % heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_tile(O + off_b * stride_ob + off_h * stride_oh, offs_m, offs_d, stride_os, stride_od,
                   seq, HEAD_DIM).to(tl.float32)
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_d, stride_dos, stride_dod,
                    seq, HEAD_DIM).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(Delta + off_b * stride_db + off_h * stride_dh + offs_m * stride_ds, delta, mask=offs_m < seq)


@triton.jit
def _load_row_stats(Lse, Delta, offs_m, stride_ls, stride_ds, sq):
    """lse in log2 units (0 for rows that see no key, so that exp2 gives 0, not NaN) and D."""
    m_ok = offs_m < sq
    lse = tl.load(Lse + offs_m * stride_ls, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.44269504)  # 1/ln(2): exp(x) = exp2(x / ln 2)
    delta = tl.load(Delta + offs_m * stride_ds, mask=m_ok, other=0.0)
    return lse2, delta


# ---------------------------------------------------------------------------------------------
# dK, dV: one program per (K/V tile, batch x K/V head), looping over query tiles
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, Lse, Delta,
                         stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                         offs_n, offs_d, lo, hi, sq, sk, diagonal, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ON_BAND: tl.constexpr,
                         DOT_FP32: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
        do = _load_tile(DO, offs_m, offs_d, stride_dos, stride_dod, sq, HEAD_DIM)
        lse2, delta = _load_row_stats(Lse, Delta, offs_m, stride_ls, stride_ds, sq)
        # transposed scores: keys along rows, queries along columns
        qkT = _mm(k, tl.trans(q), DOT_FP32) * qk_scale                 # (BLOCK_N, BLOCK_M)
        visible = (offs_n[:, None] < sk) & (offs_m[None, :] < sq)
        if ON_BAND:
            visible = visible & (offs_n[:, None] <= offs_m[None, :] + diagonal)
        pT = tl.math.exp2(tl.where(visible, qkT - lse2[None, :], float("-inf")))  # 0 where masked
        dv += _mm(pT, do, DOT_FP32)
        dpT = _mm(v, tl.trans(do), DOT_FP32)
        dsT = pT * (dpT - delta[None, :])
        dk += _mm(dsT, q, DOT_FP32)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, sm_scale, diagonal,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_dob, stride_dos, stride_doh, stride_dod,
                   stride_lb, stride_lh, stride_ls,
                   stride_db, stride_dh, stride_ds,
                   stride_dkb, stride_dks, stride_dkh, stride_dkd,
                   stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                   kv_heads, group, sq, sk,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr):
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    start_n = tl.program_id(0)
    off_bkv = tl.program_id(1)
    off_b = (off_bkv // kv_heads).to(tl.int64)
    off_kvh = off_bkv % kv_heads
    n0 = start_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = _load_tile(K + off_b * stride_kb + off_kvh.to(tl.int64) * stride_kh, offs_n, offs_d,
                   stride_ks, stride_kd, sk, HEAD_DIM)
    v = _load_tile(V + off_b * stride_vb + off_kvh.to(tl.int64) * stride_vh, offs_n, offs_d,
                   stride_vs, stride_vd, sk, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504  # 1/ln(2)

    if CAUSAL:
        # the first row that sees a key of this tile: i >= n0 - diagonal
        lo = tl.maximum(n0 - diagonal, 0) // BLOCK_M * BLOCK_M
        # rows from `band` on see every key of the tile (i >= n0 + BLOCK_N - 1 - diagonal):
        # off-band; the query tiles in [lo, band) are on-band
        band = tl.maximum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diagonal, 0), BLOCK_M) * BLOCK_M, lo)
    for g in range(group):  # the query heads that share this K/V head
        off_h = (off_kvh * group + g).to(tl.int64)
        Qh = Q + off_b * stride_qb + off_h * stride_qh
        DOh = DO + off_b * stride_dob + off_h * stride_doh
        Lseh = Lse + off_b * stride_lb + off_h * stride_lh
        Deltah = Delta + off_b * stride_db + off_h * stride_dh
        if CAUSAL:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                          stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                          offs_n, offs_d, lo, tl.minimum(band, sq), sq, sk, diagonal, qk_scale,
                                          HEAD_DIM, BLOCK_M, True, DOT_FP32)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                          stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                          offs_n, offs_d, band, sq, sq, sk, diagonal, qk_scale,
                                          HEAD_DIM, BLOCK_M, False, DOT_FP32)
        else:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                          stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                          offs_n, offs_d, 0, sq, sq, sk, diagonal, qk_scale,
                                          HEAD_DIM, BLOCK_M, False, DOT_FP32)

    dk *= sm_scale
    mask = (offs_n[:, None] < sk) & (offs_d[None, :] < HEAD_DIM)
    DK += off_b * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
    DV += off_b * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
    tl.store(DK + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd, dk, mask=mask)
    tl.store(DV + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd, dv, mask=mask)


# ---------------------------------------------------------------------------------------------
# dQ: one program per (query tile, batch x head), looping over K/V tiles
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                       offs_m, offs_d, lo, hi, sq, sk, diagonal, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ON_BAND: tl.constexpr,
                       DOT_FP32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, offs_n, offs_d, stride_ks, stride_kd, sk, HEAD_DIM)
        v = _load_tile(V, offs_n, offs_d, stride_vs, stride_vd, sk, HEAD_DIM)
        qk = _mm(q, tl.trans(k), DOT_FP32) * qk_scale                   # (BLOCK_M, BLOCK_N)
        visible = (offs_n[None, :] < sk) & (offs_m[:, None] < sq)
        if ON_BAND:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diagonal)
        p = tl.math.exp2(tl.where(visible, qk - lse2[:, None], float("-inf")))  # 0 where masked
        dp = _mm(do, tl.trans(v), DOT_FP32)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds, k, DOT_FP32)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, sm_scale, diagonal,
                 stride_qb, stride_qs, stride_qh, stride_qd,
                 stride_kb, stride_ks, stride_kh, stride_kd,
                 stride_vb, stride_vs, stride_vh, stride_vd,
                 stride_dob, stride_dos, stride_doh, stride_dod,
                 stride_lb, stride_lh, stride_ls,
                 stride_db, stride_dh, stride_ds,
                 stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                 heads, group, sq, sk,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr):
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // heads).to(tl.int64)
    off_h = off_bh % heads
    off_kvh = (off_h // group).to(tl.int64)
    off_h = off_h.to(tl.int64)
    K += off_b * stride_kb + off_kvh * stride_kh
    V += off_b * stride_vb + off_kvh * stride_vh
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_d, stride_dos, stride_dod,
                    sq, HEAD_DIM)
    lse2, delta = _load_row_stats(Lse + off_b * stride_lb + off_h * stride_lh,
                                  Delta + off_b * stride_db + off_h * stride_dh, offs_m, stride_ls, stride_ds, sq)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504  # 1/ln(2)

    if CAUSAL:
        # the same split as the forward kernel
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + diagonal, 0), sk)
        band = tl.minimum(tl.maximum(m0 + diagonal + 1, 0) // BLOCK_N * BLOCK_N, hi)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                offs_m, offs_d, 0, band, sq, sk, diagonal, qk_scale,
                                HEAD_DIM, BLOCK_N, False, DOT_FP32)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                offs_m, offs_d, band, hi, sq, sk, diagonal, qk_scale,
                                HEAD_DIM, BLOCK_N, True, DOT_FP32)
    else:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                offs_m, offs_d, 0, sk, sq, sk, diagonal, qk_scale,
                                HEAD_DIM, BLOCK_N, False, DOT_FP32)

    dq *= sm_scale
    DQ += off_b * stride_dqb + off_h * stride_dqh
    tl.store(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd, dq,
             mask=(offs_m[:, None] < sq) & (offs_d[None, :] < HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------

def bwd_config(head_dim_padded: int, dot_fp32: bool) -> tuple[dict, dict]:
    """(dK/dV config, dQ config): a dK/dV program keeps a tall K/V tile and walks short query
    tiles, a dQ program the reverse (the tutorial's BLOCK_M1/N1, BLOCK_M2/N2). Smaller tiles
    for IEEE float32 dots, as in `triton_fwd.fwd_config`."""
    if is_interpreted():
        return dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=16)
    if dot_fp32:
        if head_dim_padded <= 128:
            return (dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                    dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2))
        return (dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
                dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1))
    if head_dim_padded <= 128:  # no register spills at sm_90 (cuobjdump -res-usage)
        return (dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=4 if head_dim_padded <= 64 else 8, num_stages=2))
    return (dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1),
            dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1))


def attention_row_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) in float32, (batch, heads, seq), from (batch, seq, heads, d)."""
    b, s, h, d = out.shape
    delta = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    block_m = 16 if is_interpreted() else 64
    _attn_bwd_preprocess[(triton.cdiv(s, block_m), b * h)](
        out, dout, delta, *out.stride(), *dout.stride(), *delta.stride(), h, s,
        HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), BLOCK_M=block_m)
    return delta


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                       lse: torch.Tensor, delta: torch.Tensor, *, scale: float, causal: bool,
                       diagonal: int, dot_fp32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (dq, dk, dv) of one block given the merged lse and D (b, h, sq); inputs
    already validated."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if min(b, sq, sk, h) == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    # every element is written by the kernels
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    pad = head_dim_pad(d)
    group = h // kvh
    common = dict(HEAD_DIM=d, HEAD_DIM_PAD=pad, CAUSAL=bool(causal), DOT_FP32=bool(dot_fp32))
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
    dkdv_config, dq_config = bwd_config(pad, dot_fp32)
    _attn_bwd_dkdv[(triton.cdiv(sk, dkdv_config["BLOCK_N"]), b * kvh)](
        q, k, v, dout, lse, delta, dk, dv, float(scale), int(diagonal),
        *strides, *dk.stride(), *dv.stride(), kvh, group, sq, sk, **common, **dkdv_config)
    _attn_bwd_dq[(triton.cdiv(sq, dq_config["BLOCK_M"]), b * h)](
        q, k, v, dout, lse, delta, dq, float(scale), int(diagonal),
        *strides, *dq.stride(), h, group, sq, sk, **common, **dq_config)
    return dq, dk, dv
