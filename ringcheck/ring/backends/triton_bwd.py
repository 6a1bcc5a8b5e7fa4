"""Triton backward kernels of one ring block: the row statistic D, then dK/dV, then dQ.

Laid out like the backward half of Triton's fused-attention tutorial: the preprocess kernel,
the dK/dV inner loop and kernel, the dQ inner loop and kernel, then the launchers.

The ring's backward differs from a single-device backward in one way: the softmax
statistics are the *merged* ones of the whole ring. A block's probabilities are
``P = exp(S - lse)`` (S = scale q k^T, or softcap tanh(scale q k^T / softcap) under ``SOFTCAP``)
with ``lse`` the merged log-sum-exp of the query row over every K/V chunk, and
``dS = P (dP - D)`` with ``D = rowsum(dO * O)`` of the merged output (minus any gradient flowing
into lse, which the ring folds into D). So these kernels take lse and D as inputs and
recompute nothing of the forward but the block's scores.

    dV = P^T dO        dP = dO V^T        dS = P (dP - D)  [x (1 - tanh^2) under a softcap]
    dQ = scale dS K    dK = scale dS^T Q

dO and dV are as wide as V (``HEAD_DIM_V``), dQ and dK as q and k (``HEAD_DIM``).

Rows with lse = -inf (no visible key anywhere in the ring) get P = 0, hence zero gradients.
Grouped-query attention: a dK/dV program owns one K/V head and loops over the query heads of
its group, so dK and dV are summed in registers, without atomics, in a fixed order (the
result does not depend on scheduling). Masks (``CAUSAL``, ``BAND``; `_query_tiles` is the
dK/dV twin of the forward's `key_tiles`: query tiles outside the band are skipped), padding
and the `DOT_FP32` switch are those of `triton_fwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fwd import (
    head_dim_pad,
    head_dims,
    is_interpreted,
    key_tiles,
    load_tile,
    tile_mm,
    tile_offsets,
    tile_tanh,
    tile_visible,
)

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
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh, offs_m, offs_d, stride_os, stride_od,
                   seq, HEAD_DIM).to(tl.float32)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_d, stride_dos, stride_dod,
                    seq, HEAD_DIM).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(Delta + off_b * stride_db + off_h * stride_dh + offs_m.to(tl.int64) * stride_ds, delta, mask=offs_m < seq)


@triton.jit
def _load_row_stats(Lse, Delta, offs_m, stride_ls, stride_ds, sq):
    """lse in log2 units (0 for rows that see no key, so that exp2 gives 0, not NaN) and D."""
    m_ok = offs_m < sq
    lse = tl.load(Lse + offs_m.to(tl.int64) * stride_ls, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.44269504)  # 1/ln(2): exp(x) = exp2(x / ln 2)
    delta = tl.load(Delta + offs_m.to(tl.int64) * stride_ds, mask=m_ok, other=0.0)
    return lse2, delta


# ---------------------------------------------------------------------------------------------
# dK, dV: one program per (K/V tile, batch x K/V head), looping over query tiles
# ---------------------------------------------------------------------------------------------

@triton.jit
def _query_tiles(n0, sq, diagonal, lower, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, BAND: tl.constexpr):
    """For the K/V tile [n0, n0 + BLOCK_N): the rows in [lo, hi) are all that see one of its
    keys (tiles from lo, which is tile-aligned); the query tiles in [full_lo, full_hi) see every
    key of it (no mask), those in [lo, full_lo) and [full_hi, hi) need the mask."""
    lo = 0
    hi = sq
    full_lo = 0
    full_hi = sq
    if CAUSAL:
        # row i sees key n0 from i >= n0 - diagonal on, the whole tile from i >= n0 + BLOCK_N - 1 - diagonal
        lo = tl.maximum(n0 - diagonal, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diagonal, 0), BLOCK_M) * BLOCK_M
    if BAND:
        # row i sees the last key n0 + BLOCK_N - 1 up to i <= n0 + BLOCK_N - 1 - lower, the whole tile up to n0 - lower
        hi = tl.minimum(tl.maximum(n0 + BLOCK_N - lower, 0), sq)
        full_hi = tl.maximum(n0 - lower + 1, 0) // BLOCK_M * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, Lse, Delta,
                         stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                         offs_n, offs_d, offs_dv, lo, hi, sq, sk, diagonal, lower, sm_scale, softcap,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr, BAND: tl.constexpr,
                         SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(Q, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
        do = load_tile(DO, offs_m, offs_dv, stride_dos, stride_dod, sq, HEAD_DIM_V)
        lse2, delta = _load_row_stats(Lse, Delta, offs_m, stride_ls, stride_ds, sq)
        # transposed scores: keys along rows, queries along columns, log2 units
        qkT = tile_mm(k, tl.trans(q), DOT_FP32)                             # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            tT = tile_tanh(qkT * (sm_scale / softcap))
            sT = tT * (softcap * 1.4426950408889634)
        else:
            sT = qkT * (sm_scale * 1.4426950408889634)
        visible = tile_visible(offs_m[None, :], offs_n[:, None], sq, sk, diagonal, lower, MASKED, CAUSAL, BAND)
        pT = tl.math.exp2(tl.where(visible, sT - lse2[None, :], float("-inf")))  # 0 where masked
        dv += tile_mm(pT, do, DOT_FP32)
        dpT = tile_mm(v, tl.trans(do), DOT_FP32)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)                                 # tanh': d s / d (scale q.k)
        dk += tile_mm(dsT, q, DOT_FP32)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, sm_scale, softcap, diagonal, lower,
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
                   HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, BAND: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD and HEAD_DIM_V <= HEAD_DIM_V_PAD)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    start_n = tl.program_id(0)
    off_bkv = tl.program_id(1)
    off_b = (off_bkv // kv_heads).to(tl.int64)
    off_kvh = off_bkv % kv_heads
    n0 = start_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    k = load_tile(K + off_b * stride_kb + off_kvh.to(tl.int64) * stride_kh, offs_n, offs_d,
                   stride_ks, stride_kd, sk, HEAD_DIM)
    v = load_tile(V + off_b * stride_vb + off_kvh.to(tl.int64) * stride_vh, offs_n, offs_dv,
                   stride_vs, stride_vd, sk, HEAD_DIM_V)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _query_tiles(n0, sq, diagonal, lower, BLOCK_M, BLOCK_N, CAUSAL, BAND)
    for g in range(group):  # the query heads that share this K/V head
        off_h = (off_kvh * group + g).to(tl.int64)
        Qh = Q + off_b * stride_qb + off_h * stride_qh
        DOh = DO + off_b * stride_dob + off_h * stride_doh
        Lseh = Lse + off_b * stride_lb + off_h * stride_lh
        Deltah = Delta + off_b * stride_db + off_h * stride_dh
        if CAUSAL or BAND:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                          stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                          offs_n, offs_d, offs_dv, lo, full_lo, sq, sk, diagonal, lower,
                                          sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                                          True, CAUSAL, BAND, SOFTCAP, DOT_FP32)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                      stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                      offs_n, offs_d, offs_dv, full_lo, full_hi, sq, sk, diagonal, lower,
                                      sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                                      False, CAUSAL, BAND, SOFTCAP, DOT_FP32)
        if CAUSAL or BAND:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah,
                                          stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, stride_ds,
                                          offs_n, offs_d, offs_dv, full_hi, hi, sq, sk, diagonal, lower,
                                          sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                                          True, CAUSAL, BAND, SOFTCAP, DOT_FP32)

    dk *= sm_scale
    DK += off_b * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
    DV += off_b * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
    tl.store(DK + tile_offsets(offs_n, offs_d, stride_dks, stride_dkd), dk,
             mask=(offs_n[:, None] < sk) & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + tile_offsets(offs_n, offs_dv, stride_dvs, stride_dvd), dv,
             mask=(offs_n[:, None] < sk) & (offs_dv[None, :] < HEAD_DIM_V))


# ---------------------------------------------------------------------------------------------
# dQ: one program per (query tile, batch x head), looping over K/V tiles
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                       offs_m, offs_d, offs_dv, lo, hi, sq, sk, diagonal, lower, sm_scale, softcap,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, BAND: tl.constexpr,
                       SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(K, offs_n, offs_d, stride_ks, stride_kd, sk, HEAD_DIM)
        v = load_tile(V, offs_n, offs_dv, stride_vs, stride_vd, sk, HEAD_DIM_V)
        qk = tile_mm(q, tl.trans(k), DOT_FP32)                              # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            t = tile_tanh(qk * (sm_scale / softcap))
            s = t * (softcap * 1.4426950408889634)
        else:
            s = qk * (sm_scale * 1.4426950408889634)
        visible = tile_visible(offs_m[:, None], offs_n[None, :], sq, sk, diagonal, lower, MASKED, CAUSAL, BAND)
        p = tl.math.exp2(tl.where(visible, s - lse2[:, None], float("-inf")))  # 0 where masked
        dp = tile_mm(do, tl.trans(v), DOT_FP32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tile_mm(ds, k, DOT_FP32)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, sm_scale, softcap, diagonal, lower,
                 stride_qb, stride_qs, stride_qh, stride_qd,
                 stride_kb, stride_ks, stride_kh, stride_kd,
                 stride_vb, stride_vs, stride_vh, stride_vd,
                 stride_dob, stride_dos, stride_doh, stride_dod,
                 stride_lb, stride_lh, stride_ls,
                 stride_db, stride_dh, stride_ds,
                 stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                 heads, group, sq, sk,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, BAND: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD and HEAD_DIM_V <= HEAD_DIM_V_PAD)
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
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    q = load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_dv, stride_dos, stride_dod,
                    sq, HEAD_DIM_V)
    lse2, delta = _load_row_stats(Lse + off_b * stride_lb + off_h * stride_lh,
                                  Delta + off_b * stride_db + off_h * stride_dh, offs_m, stride_ls, stride_ds, sq)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # the same split as the forward kernel
    lo, full_lo, full_hi, hi = key_tiles(m0, sk, diagonal, lower, BLOCK_M, BLOCK_N, CAUSAL, BAND)
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                            offs_m, offs_d, offs_dv, full_lo, full_hi, sq, sk, diagonal, lower, sm_scale, softcap,
                            HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, CAUSAL, BAND, SOFTCAP, DOT_FP32)
    if CAUSAL or BAND:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                offs_m, offs_d, offs_dv, lo, full_lo, sq, sk, diagonal, lower, sm_scale, softcap,
                                HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, BAND, SOFTCAP, DOT_FP32)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                offs_m, offs_d, offs_dv, full_hi, hi, sq, sk, diagonal, lower, sm_scale, softcap,
                                HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, CAUSAL, BAND, SOFTCAP, DOT_FP32)

    dq *= sm_scale
    DQ += off_b * stride_dqb + off_h * stride_dqh
    tl.store(DQ + tile_offsets(offs_m, offs_d, stride_dqs, stride_dqd), dq,
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
                       lse: torch.Tensor, delta: torch.Tensor, *, scale: float, causal: bool, band: bool,
                       diagonal: int, lower: int, softcap: float | None,
                       dot_fp32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (dq, dk, dv) of one block given the merged lse and D (b, h, sq); inputs
    already validated (dout (b, sq, h, dv) like the output). The mask flags and `softcap` are
    those of `triton_fwd.attention_forward`."""
    b, sq, h, _ = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if min(b, sq, sk, h) == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    # every element is written by the kernels
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    dims = head_dims(q, v)
    group = h // kvh
    common = dict(**dims, CAUSAL=bool(causal), BAND=bool(band), SOFTCAP=softcap is not None,
                  DOT_FP32=bool(dot_fp32))
    runtime = (float(scale), 1.0 if softcap is None else float(softcap), int(diagonal), int(lower))
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
    dkdv_config, dq_config = bwd_config(max(dims["HEAD_DIM_PAD"], dims["HEAD_DIM_V_PAD"]), dot_fp32)
    _attn_bwd_dkdv[(triton.cdiv(sk, dkdv_config["BLOCK_N"]), b * kvh)](
        q, k, v, dout, lse, delta, dk, dv, *runtime,
        *strides, *dk.stride(), *dv.stride(), kvh, group, sq, sk, **common, **dkdv_config)
    _attn_bwd_dq[(triton.cdiv(sq, dq_config["BLOCK_M"]), b * h)](
        q, k, v, dout, lse, delta, dq, *runtime,
        *strides, *dq.stride(), h, group, sq, sk, **common, **dq_config)
    return dq, dk, dv
