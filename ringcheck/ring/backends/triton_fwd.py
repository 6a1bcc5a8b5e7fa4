"""Triton forward kernel of one ring block: out and lse of q against one K/V chunk.

Laid out like Triton's fused-attention tutorial (`python/tutorials/06-fused-attention.py`):
small helpers, the inner loop over K/V tiles, the kernel, then the launcher.

Numerics (the contract of `ringcheck.ring.backends`):

- scores are scaled once into log2 units (`qk_scale = scale / ln 2`) so the softmax uses
  `exp2`; the lse leaves the kernel in natural-log units, float32;
- online softmax over K/V tiles with a float32 running max `m_i`, sum `l_i` and output
  `acc`; a row that sees no key keeps `m_i = -inf` and `l_i = 0` and ends with out 0 and
  lse -inf, never NaN (every `exp2` is taken against a max that is made finite first);
- every `tl.dot` accumulates in float32. With `DOT_FP32` its operands are upcast to float32
  first (and multiplied in IEEE float32, never TF32): exact for float32/bf16/fp16 inputs, and
  required under Triton's interpreter, whose bf16 `tl.dot` is wrong by orders of magnitude.
  Without it (the GPU default for bf16/fp16) the operands stay in the input dtype for the
  tensor cores, and the probabilities are rounded to that dtype before `P @ V`, as in
  flash-attention.

Masks are `constexpr` flags of one kernel, never copies: ``CAUSAL`` (key j is visible to query
i iff ``j <= i + diagonal``; ``diagonal`` is a runtime int, 0 or -1 in the ring) splits the
K/V tiles of a query tile into *off-band* tiles that every row sees whole (no causal mask)
and *on-band* tiles that need it (``ON_BAND`` of the inner loop). Ragged shapes are masked,
not padded in memory: rows past ``sq``, keys past ``sk`` and head-dim columns past
``HEAD_DIM`` (the tile is ``HEAD_DIM_PAD``, the next power of two >= 16) are loaded as 0 and
never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# helpers (shared with triton_bwd.py)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _mm(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in float32. The left operand (a float32 intermediate such as the
    probabilities, or an input tile) is rounded to b's dtype unless DOT_FP32 upcasts both."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        tl.static_assert(b.dtype != tl.float32, "float32 operands need DOT_FP32 (else tl.dot rounds them to TF32)")
        return tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)


@triton.jit
def _load_tile(base, offs_s, offs_d, stride_s, stride_d, s_len, HEAD_DIM: tl.constexpr):
    """The (len(offs_s), len(offs_d)) tile at base[offs_s, offs_d]; 0 outside s_len x HEAD_DIM."""
    mask = (offs_s[:, None] < s_len) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + offs_s[:, None] * stride_s + offs_d[None, :] * stride_d, mask=mask, other=0.0)


# ---------------------------------------------------------------------------------------------
# the inner loop: one query tile against the K/V tiles [lo, hi)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                    offs_m, offs_d, lo, hi, sk, diagonal, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ON_BAND: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, offs_n, offs_d, stride_ks, stride_kd, sk, HEAD_DIM)
        qk = _mm(q, tl.trans(k), DOT_FP32) * qk_scale               # (BLOCK_M, BLOCK_N), log2 units
        visible = offs_n[None, :] < sk
        if ON_BAND:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diagonal)
        qk = tl.where(visible, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        # a row that has seen no key yet keeps m = -inf; exponents are taken against 0 then,
        # so exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V, offs_n, offs_d, stride_vs, stride_vd, sk, HEAD_DIM)
        acc = acc * alpha[:, None] + _mm(p, v, DOT_FP32)
        m_i = m_ij
    return acc, l_i, m_i


# ---------------------------------------------------------------------------------------------
# the kernel: one program per (query tile, batch x head)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, sm_scale, diagonal,
              stride_qb, stride_qs, stride_qh, stride_qd,
              stride_kb, stride_ks, stride_kh, stride_kd,
              stride_vb, stride_vs, stride_vh, stride_vd,
              stride_ob, stride_os, stride_oh, stride_od,
              stride_lb, stride_lh, stride_ls,
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
    off_kvh = (off_h // group).to(tl.int64)  # grouped-query attention: K/V head of this query head
    off_h = off_h.to(tl.int64)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_kvh * stride_kh
    V += off_b * stride_vb + off_kvh * stride_vh
    Out += off_b * stride_ob + off_h * stride_oh
    Lse += off_b * stride_lb + off_h * stride_lh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_tile(Q, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504  # 1/ln(2): softmax in exp2

    if CAUSAL:
        # keys from `hi` on are seen by no row of this tile (the last row sees j <= m0 + BLOCK_M - 1 + diagonal)
        hi = tl.minimum(tl.maximum(start_m * BLOCK_M + BLOCK_M + diagonal, 0), sk)
        # K/V tiles that end at or before the first row's limit m0 + diagonal are seen whole
        # by every row: off-band, no causal mask; the rest up to `hi` are on-band
        band = tl.minimum(tl.maximum(start_m * BLOCK_M + diagonal + 1, 0) // BLOCK_N * BLOCK_N, hi)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                        offs_m, offs_d, 0, band, sk, diagonal, qk_scale,
                                        HEAD_DIM, BLOCK_N, False, DOT_FP32)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                        offs_m, offs_d, band, hi, sk, diagonal, qk_scale,
                                        HEAD_DIM, BLOCK_N, True, DOT_FP32)
    else:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                        offs_m, offs_d, 0, sk, sk, diagonal, qk_scale,
                                        HEAD_DIM, BLOCK_N, False, DOT_FP32)

    # a row that saw no key has l_i = 0: out 0, lse -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # ln(2): back to natural log
    m_ok = offs_m < sq
    tl.store(Out + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, out,
             mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(Lse + offs_m * stride_ls, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------

def is_interpreted() -> bool:
    """True when these kernels run under Triton's interpreter: `@triton.jit` chose the
    interpreter because TRITON_INTERPRET=1 was set when this module was imported."""
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


def head_dim_pad(head_dim: int) -> int:
    """The tile width along the head dimension: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim_padded: int, dot_fp32: bool) -> dict:
    """Tile sizes and launch options. The interpreter runs every program in Python, so it gets
    the smallest tiles tl.dot allows (small test shapes still span several tiles and reach
    every masking path). On the GPU: the tutorial's tiles for tensor-core dots, kept within
    shared memory up to head dim 256; smaller ones for IEEE float32 dots, which run on the
    FMA units (big tiles only cost registers and compile time there)."""
    if is_interpreted():
        return dict(BLOCK_M=16, BLOCK_N=16)
    if dot_fp32:
        if head_dim_padded <= 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim_padded <= 64:  # these two: no register spills at sm_90 (cuobjdump -res-usage)
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim_padded <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      causal: bool, diagonal: int, dot_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out (b, sq, h, d) and lse (b, h, sq), float32, of one block; inputs already validated
    (q (b, sq, h, d), k and v (b, sk, kv_heads, d), one dtype, one device)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, h, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    pad = head_dim_pad(d)
    config = fwd_config(pad, dot_fp32)
    grid = (triton.cdiv(sq, config["BLOCK_M"]), b * h)
    _attn_fwd[grid](
        q, k, v, out, lse, float(scale), int(diagonal),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        h, h // kvh, sq, sk,
        HEAD_DIM=d, HEAD_DIM_PAD=pad, CAUSAL=bool(causal), DOT_FP32=bool(dot_fp32), **config)
    return out, lse
